"""GGUF vocabulary reading and the ``tokenizers.Tokenizer`` built from it (see the package docstring)."""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from proxy.tokenizer.errors import UnsupportedTokenizerError
from proxy.tokenizer.unicode_ranges import translate_regex

__all__ = [
    "SPECIAL_CANDIDATE_TEXTS",
    "GGUFVocab",
    "UnsupportedTokenizerError",
    "build_hf_tokenizer",
    "build_pre_tokenizer",
    "gguf_cache_key",
    "load_tokenizer",
    "read_gguf_vocab",
    "supported_pre_types",
    "translate_regex",
]

# Bump when the build logic changes: old cache entries then stop matching.
_BUILD_VERSION = 2


# Pre-tokenizer families (src/llama-vocab.cpp: llama_vocab::impl::load and llm_tokenizer_bpe).
# --------------------------------------------------------------------------------------------------
_RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_RE_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreFamily:
    name: str
    regexes: tuple[str, ...]
    ignore_merges: bool = False
    default_add_bos: bool = False


# The GPT-2 regex: llama.cpp uses its hand-written splitter, which also does the regex's missing
# trailing "|\s+" (a lone whitespace not followed by whitespace); adding it here changes nothing
# else because Split(..., "isolated") keeps unmatched text as its own piece anyway.
_FAM_GPT2 = _PreFamily("gpt2", (_RE_GPT2 + r"|\s+",))
_FAM_STARCODER = _PreFamily("starcoder", (r"\p{N}", _RE_GPT2 + r"|\s+"))
_FAM_LLAMA3 = _PreFamily("llama3", (_RE_LLAMA3,), ignore_merges=True, default_add_bos=True)
_FAM_DBRX = _PreFamily("dbrx", (_RE_LLAMA3,))
_FAM_QWEN2 = _PreFamily("qwen2", (_RE_QWEN2,))

_PRE_FAMILIES: dict[str, _PreFamily] = {}
for _names, _fam in (
    (
        (
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "jina-v1-en",
            "jina-v2-code",
            "roberta-bpe",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
            "exaone4",
        ),
        _FAM_GPT2,
    ),
    (
        ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
        _FAM_STARCODER,
    ),
    (
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        ),
        _FAM_LLAMA3,
    ),
    (("dbrx", "smaug-bpe"), _FAM_DBRX),
    (
        ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"),
        _FAM_QWEN2,
    ),
):
    for _n in _names:
        _PRE_FAMILIES[_n] = _fam


def supported_pre_types() -> list[str]:
    """``tokenizer.ggml.pre`` values :func:`build_hf_tokenizer` can reproduce exactly."""
    return sorted(_PRE_FAMILIES)


# --------------------------------------------------------------------------------------------------
# Token attributes as llama.cpp derives them (token_type + text-based overrides).
# --------------------------------------------------------------------------------------------------
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_USER_DEFINED, _TT_UNUSED, _TT_BYTE = 1, 2, 3, 4, 5, 6

# Texts llama.cpp marks CONTROL when found (EOT/EOM/FIM auto-detection and the EOG list).
_EOT_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
)
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_PRE_TEXTS = (
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
)
_FIM_SUF_TEXTS = (
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
)
_FIM_MID_TEXTS = (
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
)
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>",)
_EOG_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
)
_GPT_OSS_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")
# (GGUF key of the id, candidate texts): auto-detection only runs when the key is absent.
_AUTODETECT = (
    ("tokenizer.ggml.eot_token_id", _EOT_TEXTS),
    ("tokenizer.ggml.eom_token_id", _EOM_TEXTS),
    ("tokenizer.ggml.fim_pre_token_id", _FIM_PRE_TEXTS),
    ("tokenizer.ggml.fim_suf_token_id", _FIM_SUF_TEXTS),
    ("tokenizer.ggml.fim_mid_token_id", _FIM_MID_TEXTS),
    ("tokenizer.ggml.fim_pad_token_id", _FIM_PAD_TEXTS),
    ("tokenizer.ggml.fim_rep_token_id", _FIM_REP_TEXTS),
    ("tokenizer.ggml.fim_sep_token_id", _FIM_SEP_TEXTS),
)
_AUTODETECT_DEPRECATED = {
    "tokenizer.ggml.fim_pre_token_id": "tokenizer.ggml.prefix_token_id",
    "tokenizer.ggml.fim_suf_token_id": "tokenizer.ggml.suffix_token_id",
    "tokenizer.ggml.fim_mid_token_id": "tokenizer.ggml.middle_token_id",
}

#: Every text llama.cpp may promote to a special token by its text; probed by :func:`check_parity`.
SPECIAL_CANDIDATE_TEXTS: tuple[str, ...] = tuple(
    dict.fromkeys(
        _EOT_TEXTS
        + _EOM_TEXTS
        + _FIM_PRE_TEXTS
        + _FIM_SUF_TEXTS
        + _FIM_MID_TEXTS
        + _FIM_PAD_TEXTS
        + _FIM_REP_TEXTS
        + _FIM_SEP_TEXTS
        + _EOG_TEXTS
        + _GPT_OSS_USER_DEFINED
    )
)


@dataclass
class _Special:
    id: int
    text: str
    control: bool  # CONTROL / UNKNOWN (vs USER_DEFINED)
    lstrip: bool = False
    rstrip: bool = False


@dataclass
class GGUFVocab:
    """The tokenizer part of a GGUF, as llama.cpp interprets it."""

    model: str
    pre: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    add_eos: bool
    general_name: str = ""
    specials: list[_Special] = field(default_factory=list)


def _field_value(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return None
    return f.contents()


def read_gguf_vocab(gguf_path: str | os.PathLike[str]) -> GGUFVocab:
    """Read the vocabulary of a GGUF with ``gguf.GGUFReader`` (no network)."""
    from gguf import GGUFReader  # imported lazily: it pulls in numpy and is slow to import

    try:
        return _read_gguf_vocab(GGUFReader(os.fspath(gguf_path), "r"))
    except (ValueError, KeyError, IndexError, TypeError, UnicodeDecodeError) as e:
        raise UnsupportedTokenizerError(f"cannot read the GGUF vocabulary: {type(e).__name__}: {e}") from e


def _read_gguf_vocab(reader: Any) -> GGUFVocab:
    model = _field_value(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise UnsupportedTokenizerError(f"tokenizer.ggml.model={model!r}: only 'gpt2' (BPE) is supported")
    pre = _field_value(reader, "tokenizer.ggml.pre") or ""
    if pre not in _PRE_FAMILIES:
        raise UnsupportedTokenizerError(
            f"tokenizer.ggml.pre={pre!r} is not supported (supported: {', '.join(supported_pre_types())})"
        )
    fam = _PRE_FAMILIES[pre]
    tokens = _field_value(reader, "tokenizer.ggml.tokens")
    merges = _field_value(reader, "tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise UnsupportedTokenizerError("GGUF has no tokenizer.ggml.tokens / tokenizer.ggml.merges")
    types = _field_value(reader, "tokenizer.ggml.token_type")
    n = len(tokens)
    token_types = [int(t) for t in types] if types is not None else [_TT_NORMAL] * n
    if len(token_types) < n:
        raise UnsupportedTokenizerError("tokenizer.ggml.token_type shorter than the vocab")
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]

    def _id(key: str, default: int | None) -> int | None:
        v = _field_value(reader, key)
        if v is None:
            return default
        return int(v) if 0 <= int(v) < n else default

    bos_id = _id("tokenizer.ggml.bos_token_id", 11 if n > 11 else None)
    eos_id = _id("tokenizer.ggml.eos_token_id", 11 if n > 11 else None)
    add_bos = fam.default_add_bos
    add_eos = False
    v = _field_value(reader, "tokenizer.ggml.add_bos_token")
    if v is not None:
        add_bos = bool(v)
    v = _field_value(reader, "tokenizer.ggml.add_eos_token")
    if v is not None:
        add_eos = bool(v)
    if (add_bos and bos_id is None) or (add_eos and eos_id is None):
        raise UnsupportedTokenizerError("vocab adds BOS/EOS but has no such token")
    name = _field_value(reader, "general.name") or ""
    vocab = GGUFVocab(
        model=model,
        pre=pre,
        tokens=list(tokens),
        token_types=token_types[:n],
        merges=list(merges),
        bos_id=bos_id,
        eos_id=eos_id,
        add_bos=add_bos,
        add_eos=add_eos,
        general_name=str(name),
    )
    present_keys = {k for k in reader.fields if k.startswith("tokenizer.ggml.")}
    vocab.specials = _llama_specials(vocab, present_keys)
    return vocab


def _llama_specials(vocab: GGUFVocab, present_keys: set[str]) -> list[_Special]:
    """The tokens ``tokenizer_st_partition`` cuts out (parse_special=true), in llama.cpp's order."""
    text_to_id: dict[str, int] = {}
    for i, t in enumerate(vocab.tokens):
        text_to_id[t] = i  # later duplicates win, like llama.cpp's token_to_id[word] = i
    kind: dict[int, str] = {}  # "control" | "user" for special ids
    for i, tt in enumerate(vocab.token_types):
        if tt in (_TT_CONTROL, _TT_UNKNOWN):
            kind[i] = "control"
        elif tt == _TT_USER_DEFINED:
            kind[i] = "user"

    def _promote(text: str) -> None:
        tid = text_to_id.get(text)
        if tid is not None:
            kind[tid] = "control"  # attr |= CONTROL

    for key, texts in _AUTODETECT:
        dep = _AUTODETECT_DEPRECATED.get(key)
        if key in present_keys or (dep is not None and dep in present_keys):
            continue
        for text in texts:  # llama.cpp promotes only the first found (hash order): we take all
            _promote(text)
    eog_texts = [t for t in _EOG_TEXTS if t in text_to_id]
    for text in eog_texts:
        _promote(text)
    for text in _GPT_OSS_USER_DEFINED:
        tid = text_to_id.get(text)
        if tid is not None:
            kind[tid] = "user"
    if "</s>" in eog_texts and ("<|tool_response>" in eog_texts or "<|plamo:eos|>" in text_to_id):
        kind.pop(text_to_id["</s>"], None)  # "</s> is a normal token here"

    specials = [_Special(i, vocab.tokens[i], kind[i] == "control") for i in sorted(kind)]
    name = vocab.general_name.lower()
    if "phi-3" in name or "phi3" in name:
        for s in specials:
            s.rstrip = s.text not in ("<unk>", "<s>", "<|endoftext|>")
    if vocab.pre in ("jina-v2-de", "jina-v2-es", "jina-v2-code"):
        for s in specials:
            s.lstrip = s.text == "<mask>"
    if "modern-bert" in name:
        for s in specials:
            s.lstrip = s.text == "[MASK]"
    specials.sort(key=lambda s: (-len(s.text.encode("utf-8")), s.id))
    return specials


# --------------------------------------------------------------------------------------------------
# Building the tokenizers.Tokenizer
# --------------------------------------------------------------------------------------------------
def _hf_from_vocab(vocab: GGUFVocab) -> Tokenizer:
    fam = _PRE_FAMILIES[vocab.pre]
    token_to_id: dict[str, int] = {}
    for i, t in enumerate(vocab.tokens):
        token_to_id[t] = i
    merges: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for m in vocab.merges:
        pos = m.find(" ", 1)
        pair = (m[:pos], m[pos + 1 :]) if pos >= 0 else ("", "")
        if pair in seen or not pair[0] or not pair[1]:
            continue  # bpe_ranks.emplace keeps the first rank; malformed lines never match
        seen.add(pair)
        if pair[0] not in token_to_id or pair[1] not in token_to_id or pair[0] + pair[1] not in token_to_id:
            # llama.cpp would merge and then fall back to bytes; tokenizers cannot express that
            raise UnsupportedTokenizerError(f"merge {m!r} refers to tokens outside the vocab")
        merges.append(pair)
    # llama.cpp keeps a byte-level symbol that is not in the vocab (SmolLM2 lacks 21 of the 256, e.g.
    # the bytes 0x04, 0xF1) as a BPE symbol that nothing merges with, then drops it (its byte fallback
    # finds no token). tokenizers drops unknown symbols *before* merging, letting their neighbours
    # merge across the gap. So such symbols become an "unk" token here, a special token that is in no
    # merge (a barrier, like in llama.cpp); PromptTokenizer removes it from the output.
    unk: str | None = None
    missing = [c for c in pre_tokenizers.ByteLevel.alphabet() if c not in token_to_id]
    if missing:
        in_merges = {t for pair in merges for t in pair}
        unk = next(
            (
                s.text
                for s in sorted(vocab.specials, key=lambda s: s.id)
                if s.text not in in_merges and token_to_id.get(s.text) == s.id
            ),
            None,
        )
        if unk is None:
            raise UnsupportedTokenizerError(
                f"vocab lacks {len(missing)} byte symbols and has no special token to stand in for them"
            )
    try:
        bpe = models.BPE(
            vocab=token_to_id,
            merges=merges,
            ignore_merges=fam.ignore_merges,
            fuse_unk=False,
            byte_fallback=False,
            unk_token=unk,
        )
    except Exception as e:  # tokenizers raises plain Exception subclasses
        raise UnsupportedTokenizerError(f"cannot build BPE model: {e}") from e
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = build_pre_tokenizer(vocab.pre)
    tok.decoder = decoders.ByteLevel()
    added = [
        AddedToken(
            s.text, single_word=False, lstrip=s.lstrip, rstrip=s.rstrip, normalized=False, special=s.control
        )
        for s in sorted(vocab.specials, key=lambda s: s.id)
    ]
    if added:
        tok.add_tokens(added)
    single: list[str] = []
    special_tokens: list[tuple[str, int]] = []
    if vocab.add_bos and vocab.bos_id is not None:
        single.append(vocab.tokens[vocab.bos_id])
        special_tokens.append((vocab.tokens[vocab.bos_id], vocab.bos_id))
    single.append("$A")
    if vocab.add_eos and vocab.eos_id is not None:
        single.append(vocab.tokens[vocab.eos_id])
        special_tokens.append((vocab.tokens[vocab.eos_id], vocab.eos_id))
    if special_tokens:
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(single), special_tokens=list(dict.fromkeys(special_tokens))
        )
    # check every id round-trips (duplicated texts in the vocab would break id parity)
    if tok.get_vocab_size(with_added_tokens=True) != len(vocab.tokens):
        raise UnsupportedTokenizerError("vocab has duplicate token texts")
    return tok


def build_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """llama.cpp's pre-tokenizer for ``tokenizer.ggml.pre`` = ``pre``: its regex list in order, each
    as an isolating split (like ``unicode_regex_split``), then GPT-2 byte-level encoding."""
    fam = _PRE_FAMILIES.get(pre)
    if fam is None:
        raise UnsupportedTokenizerError(f"tokenizer.ggml.pre={pre!r} is not supported")
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(translate_regex(r)), behavior="isolated") for r in fam.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
    )


def build_hf_tokenizer(gguf_path: str | os.PathLike[str]) -> Tokenizer:
    """Build a ``tokenizers.Tokenizer`` equivalent to llama.cpp's for this GGUF.

    The pre-tokenizer is llama.cpp's regex list for ``tokenizer.ggml.pre`` (with llama.cpp's Unicode
    classes), the model is byte-level BPE from ``tokenizer.ggml.tokens`` / ``merges``, llama.cpp's
    special tokens (CONTROL / USER_DEFINED / UNKNOWN, plus text-detected EOG/FIM ones) are added
    tokens, and a post-processor adds BOS / EOS when the vocab does (``add_special_tokens=True``).
    Raises :class:`UnsupportedTokenizerError` for anything it cannot reproduce exactly.
    """
    return _hf_from_vocab(read_gguf_vocab(gguf_path))


# --------------------------------------------------------------------------------------------------
# Disk cache
# --------------------------------------------------------------------------------------------------
_GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_metadata_end(buf: mmap.mmap | bytes) -> int:
    """Byte offset where a (little-endian, v2+) GGUF's key/value section ends."""
    if buf[:4] != b"GGUF":
        raise ValueError("not a GGUF file")
    (version,) = struct.unpack_from("<I", buf, 4)
    if version < 2 or version > 0xFFFF:
        raise ValueError(f"unsupported GGUF version {version}")
    (n_kv,) = struct.unpack_from("<Q", buf, 16)
    off = 24
    u64 = struct.Struct("<Q")
    u32 = struct.Struct("<I")

    def skip_value(off: int, vtype: int) -> int:
        if vtype == _GGUF_STRING:
            return off + 8 + int(u64.unpack_from(buf, off)[0])
        if vtype == _GGUF_ARRAY:
            (itype,) = u32.unpack_from(buf, off)
            (count,) = u64.unpack_from(buf, off + 4)
            off += 12
            if itype == _GGUF_STRING:
                for _ in range(count):
                    off += 8 + u64.unpack_from(buf, off)[0]
                return off
            if itype in _GGUF_SCALAR_SIZES:
                return off + int(count) * _GGUF_SCALAR_SIZES[itype]
            for _ in range(count):
                off = skip_value(off, itype)
            return off
        return off + _GGUF_SCALAR_SIZES[vtype]

    for _ in range(n_kv):
        off += 8 + u64.unpack_from(buf, off)[0]  # key
        (vtype,) = u32.unpack_from(buf, off)
        off = skip_value(off + 4, vtype)
        if off > len(buf):
            raise ValueError("truncated GGUF metadata")
    return off


def gguf_cache_key(gguf_path: str | os.PathLike[str]) -> str:
    """Cheap identity of a GGUF's tokenizer: size, mtime and the sha256 of its metadata section.

    Also covers this module's build version and the ``tokenizers`` version, so a cache entry is
    rebuilt when either changes.
    """
    path = os.fspath(gguf_path)
    st = os.stat(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        try:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                try:
                    end = _gguf_metadata_end(mm)
                except (ValueError, struct.error, KeyError):
                    end = min(len(mm), 64 << 20)
                h.update(memoryview(mm)[:end])
        except ValueError:  # empty file: mmap refuses length 0
            pass
    ident = f"v{_BUILD_VERSION}|tokenizers {tokenizers.__version__}|{st.st_size}|{st.st_mtime_ns}|"
    return hashlib.sha256(ident.encode() + h.digest()).hexdigest()[:32]


def load_tokenizer(gguf_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str]) -> Tokenizer:
    """:func:`build_hf_tokenizer`, cached as ``<cache_dir>/<key>.tokenizer.json`` (see
    :func:`gguf_cache_key`). A damaged cache file is rebuilt; writes are atomic."""
    cache = Path(cache_dir)
    path = cache / f"{gguf_cache_key(gguf_path)}.tokenizer.json"
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception:  # corrupt or foreign file: rebuild it
            pass
    tok = build_hf_tokenizer(gguf_path)
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tokenizer-", suffix=".tmp", dir=cache)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(tok.to_str())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tok
