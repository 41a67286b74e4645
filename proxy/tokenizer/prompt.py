"""Special-token partition and :class:`PromptTokenizer` (see the package docstring)."""

from __future__ import annotations

import array
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from tokenizers import Tokenizer

from proxy.tokenizer.vocab import SPECIAL_CANDIDATE_TEXTS, build_hf_tokenizer, load_tokenizer

__all__ = [
    "CHAT_TOKENIZE_FLAGS",
    "CacheStats",
    "PromptTokenizer",
    "SpecialToken",
    "split_special",
]

#: Body flags for ``POST /tokenize`` that reproduce the chat completion path.
CHAT_TOKENIZE_FLAGS: dict[str, bool] = {"add_special": True, "parse_special": True}

# --------------------------------------------------------------------------------------------------
# Special-token partition (port of llama_vocab::impl::tokenizer_st_partition)
# --------------------------------------------------------------------------------------------------
_C_ISSPACE = frozenset(" \t\n\v\f\r")


class SpecialToken(NamedTuple):
    id: int
    text: str
    lstrip: bool = False
    rstrip: bool = False


def split_special(text: str, specials: Sequence[SpecialToken]) -> list[str | int]:
    """Cut ``text`` at special tokens exactly like llama.cpp (``parse_special=true``).

    ``specials`` must be in llama.cpp's order (longest UTF-8 text first). Returns text pieces (never
    empty) and token ids, in order.
    """
    frags: list[tuple[int, int] | int] = [(0, len(text))] if text else []
    for sp in specials:
        tt = sp.text
        if not tt or tt not in text:
            continue
        out: list[tuple[int, int] | int] = []
        for fr in frags:
            if isinstance(fr, int):
                out.append(fr)
                continue
            pos, end = fr
            while True:
                m = text.find(tt, pos, end)
                if m < 0:
                    break
                left = m
                if sp.lstrip:
                    while left > pos and text[left - 1] in _C_ISSPACE:
                        left -= 1
                if left > pos:
                    out.append((pos, left))
                out.append(sp.id)
                pos = m + len(tt)
                if sp.rstrip:
                    while pos < end and text[pos] in _C_ISSPACE:
                        pos += 1
            if pos < end:
                out.append((pos, end))
        frags = out
    return [fr if isinstance(fr, int) else text[fr[0] : fr[1]] for fr in frags]


# --------------------------------------------------------------------------------------------------
# PromptTokenizer
# --------------------------------------------------------------------------------------------------
@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    entries: int = 0
    cached_tokens: int = 0


class _PieceCache:
    """Thread-safe LRU of text piece -> token ids, bounded by the total number of cached tokens."""

    def __init__(self, max_tokens: int, max_entries: int) -> None:
        self.max_tokens = max_tokens
        self.max_entries = max_entries
        self._d: OrderedDict[str, array.array[int]] = OrderedDict()
        self._lock = threading.Lock()
        self._tokens = 0
        self.stats = CacheStats()

    def get(self, key: str) -> array.array[int] | None:
        with self._lock:
            v = self._d.get(key)
            if v is not None:
                self._d.move_to_end(key)
                self.stats.hits += 1
                self.stats.hit_tokens += len(v)
            return v

    def put(self, key: str, ids: array.array[int]) -> None:
        if len(ids) > self.max_tokens // 4 or self.max_entries <= 0:
            return
        with self._lock:
            old = self._d.pop(key, None)
            if old is not None:
                self._tokens -= len(old)
            self._d[key] = ids
            self._tokens += len(ids)
            while self._d and (self._tokens > self.max_tokens or len(self._d) > self.max_entries):
                _, ev = self._d.popitem(last=False)
                self._tokens -= len(ev)

    def count_miss(self, n_tokens: int) -> None:
        with self._lock:
            self.stats.misses += 1
            self.stats.miss_tokens += n_tokens

    def snapshot(self) -> CacheStats:
        with self._lock:
            s = CacheStats(**vars(self.stats))
            s.entries = len(self._d)
            s.cached_tokens = self._tokens
            return s


def _tokenizer_meta(tok: Tokenizer) -> tuple[int | None, int | None, int | None]:
    """(BOS id, EOS id) that the tokenizer's TemplateProcessing adds around ``$A``, and the id of
    the BPE model's unk token (a barrier for byte symbols missing from the vocab), if any."""
    spec = json.loads(tok.to_str())
    unk_text = (spec.get("model") or {}).get("unk_token")
    unk = tok.token_to_id(unk_text) if unk_text else None
    pp = spec.get("post_processor")
    if not pp or pp.get("type") != "TemplateProcessing":
        return None, None, unk
    single = pp.get("single") or []
    sp = pp.get("special_tokens") or {}

    def _id(piece: dict[str, Any]) -> int | None:
        st = piece.get("SpecialToken")
        if st is None:
            return None
        ids = (sp.get(st["id"]) or {}).get("ids") or []
        return int(ids[0]) if len(ids) == 1 else None

    bos = _id(single[0]) if single else None
    eos = _id(single[-1]) if len(single) > 1 else None
    return bos, eos, unk


class PromptTokenizer:
    """Tokenize a rendered chat prompt like llama-server's chat path (add_special, parse_special).

    The text is cut at special tokens (:func:`split_special`); each text piece is BPE-encoded through
    an LRU cache keyed by the piece's content (system prompts, tool schemas and past turns repeat
    between requests), and BOS / EOS are added when the vocab adds them. :meth:`encode` is
    synchronous and thread-safe; run it in an executor thread from asyncio code.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        specials: Sequence[SpecialToken] | None = None,
        bos_id: int | None | Literal["auto"] = "auto",
        eos_id: int | None | Literal["auto"] = "auto",
        cache_max_tokens: int = 4_000_000,
        cache_max_entries: int = 100_000,
    ) -> None:
        """``specials`` (in llama.cpp's order), ``bos_id`` and ``eos_id`` (None: not added) default
        to what :func:`build_hf_tokenizer` put in the tokenizer: its added tokens and its
        post-processor. The piece cache holds at most ``cache_max_tokens`` token ids in
        ``cache_max_entries`` pieces (0 entries disables it)."""
        self.tokenizer = tokenizer
        if specials is None:
            dec = tokenizer.get_added_tokens_decoder()
            specials = sorted(
                (SpecialToken(i, t.content, bool(t.lstrip), bool(t.rstrip)) for i, t in dec.items()),
                key=lambda s: (-len(s.text.encode("utf-8")), s.id),
            )
        self.specials: tuple[SpecialToken, ...] = tuple(specials)
        meta_bos, meta_eos, self.unk_id = _tokenizer_meta(tokenizer)
        self.bos_id: int | None = meta_bos if bos_id == "auto" else bos_id
        self.eos_id: int | None = meta_eos if eos_id == "auto" else eos_id
        self._cache = _PieceCache(cache_max_tokens, cache_max_entries)

    @classmethod
    def from_gguf(
        cls, gguf_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None, **kw: Any
    ) -> PromptTokenizer:
        tok = load_tokenizer(gguf_path, cache_dir) if cache_dir is not None else build_hf_tokenizer(gguf_path)
        return cls(tok, **kw)

    # -- encoding ---------------------------------------------------------------------------------
    def split(self, text: str) -> list[str | int]:
        """Text pieces and special token ids of ``text`` (no BOS/EOS)."""
        return split_special(text, self.specials)

    def encode(self, text: str, *, batch: bool = True) -> list[int]:
        """Token ids of ``text`` exactly as the server's chat path produces them.

        ``batch=False`` (short prompts tokenized on the event loop) encodes the missing pieces one
        by one on the calling thread: the batch call hands them to the tokenizer's worker pool,
        and waking those threads costs more than encoding a few short pieces."""
        parts = self.split(text)
        cache = self._cache
        found: dict[str, array.array[int]] = {}
        todo: dict[str, None] = {}  # ordered set of cache misses
        for p in parts:
            if isinstance(p, str) and p not in found and p not in todo:
                ids = cache.get(p)
                if ids is None:
                    todo[p] = None
                else:
                    found[p] = ids
        if todo:
            missing = list(todo)
            # encode_batch_fast releases the GIL (Tokenizer.encode does not), so the event loop keeps
            # running while an executor thread tokenizes; it also spreads pieces over cores.
            if batch:
                encs = self.tokenizer.encode_batch_fast(missing, add_special_tokens=False)
            else:
                encs = [self.tokenizer.encode(p, add_special_tokens=False) for p in missing]
            for p, enc in zip(missing, encs, strict=True):
                ids = self._piece_ids(enc.ids)
                found[p] = ids
                cache.count_miss(len(ids))
                cache.put(p, ids)
        out: list[int] = []
        if self.bos_id is not None:
            out.append(self.bos_id)
        for p in parts:
            if isinstance(p, int):
                out.append(p)
            else:
                out.extend(found[p])
        if self.eos_id is not None:
            out.append(self.eos_id)
        return out

    def _piece_ids(self, ids: list[int]) -> array.array[int]:
        unk = self.unk_id
        if unk is not None and unk in ids:
            ids = [i for i in ids if i != unk]
        return array.array("i", ids)

    def encode_uncached(self, text: str) -> list[int]:
        """:meth:`encode` without the piece cache, one ``Tokenizer.encode`` per piece (a second code
        path for checks and benchmarks; it holds the GIL while tokenizing)."""
        out: list[int] = [self.bos_id] if self.bos_id is not None else []
        for p in self.split(text):
            if isinstance(p, int):
                out.append(p)
            else:
                out.extend(self._piece_ids(self.tokenizer.encode(p, add_special_tokens=False).ids))
        if self.eos_id is not None:
            out.append(self.eos_id)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    # -- cache --------------------------------------------------------------------------------------
    def cache_stats(self) -> CacheStats:
        return self._cache.snapshot()

    def probe_texts(self) -> list[str]:
        """Texts that exercise every special token and every text llama.cpp may promote to one."""
        texts = [s.text for s in self.specials]
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        texts += [t for t in SPECIAL_CANDIDATE_TEXTS if t in vocab and t not in texts]
        out: list[str] = []
        chunk: list[str] = []
        for t in texts:
            chunk.append(f"a{t} {t}\n{t}{t}x")
            if len(chunk) == 32:
                out.append(" ".join(chunk))
                chunk = []
        if chunk:
            out.append(" ".join(chunk))
        return out
