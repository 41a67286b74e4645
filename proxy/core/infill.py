"""The prompt llama-server's ``/infill`` builds, rebuilt from tokenized pieces.

A mirror of ``format_prompt_infill`` (tools/server/server-common.cpp of the pinned source):
the repo-level FIM pattern

    [FIM_REP]myproject\\n [FIM_SEP]file0\\n chunk0 ... [FIM_SEP]filename\\n
    [BOS] [FIM_PRE] prefix prompt [FIM_SUF] suffix [FIM_MID]

(prefix and suffix swapped with ``--spm-infill``), cut to the server's ``n_batch``,
``n_predict`` and per-slot context. The server's parameters come from ``/kvctl/caps``
(patch 0013); the pieces are tokenized by the server itself (``/tokenize`` with the flags the
server uses for each), so the token ids sent to ``/completion`` are the ones ``/infill``
would compute: exact by construction.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Texts the server tokenizes itself (without special tokens): the repo name, the current file's
# name and, for vocabs without FIM_SEP, the chunk separator "\n\n--- snippet ---\n\n".
REPO_TEXT = "myproject\n"
FILE_TEXT = "filename\n"
SNIPPET_TEXT = "\n\n--- snippet ---\n\n"
DEFAULT_FILENAME = "tmp"
NO_TOKEN = -1  # LLAMA_TOKEN_NULL


@dataclass(frozen=True)
class InfillParams:
    """What the server builds an infill prompt from (``caps.infill`` plus the slot context)."""

    n_batch: int
    n_predict: int
    n_ctx_slot: int
    spm_infill: bool
    add_bos: bool
    bos: int
    fim_pre: int
    fim_suf: int
    fim_mid: int
    fim_rep: int
    fim_sep: int

    @classmethod
    def from_caps(cls, caps: dict[str, Any], n_ctx_slot: int) -> InfillParams | None:
        """None when the server does not report them (a patch series before 0013)."""
        info = caps.get("infill")
        if not isinstance(info, dict):
            return None
        try:
            return cls(
                n_batch=int(info["n_batch"]),
                n_predict=int(info["n_predict"]),
                n_ctx_slot=n_ctx_slot,
                spm_infill=bool(info["spm_infill"]),
                add_bos=bool(info["add_bos"]),
                bos=int(info["bos"]),
                fim_pre=int(info["fim_pre"]),
                fim_suf=int(info["fim_suf"]),
                fim_mid=int(info["fim_mid"]),
                fim_rep=int(info["fim_rep"]),
                fim_sep=int(info["fim_sep"]),
            )
        except (KeyError, TypeError, ValueError):
            return None

    def missing(self) -> str:
        """The server's own complaint when the vocab lacks a FIM token ("" when none is missing)."""
        out = ""
        if self.fim_pre == NO_TOKEN:
            out += "prefix token is missing. "
        if self.fim_suf == NO_TOKEN:
            out += "suffix token is missing. "
        if self.fim_mid == NO_TOKEN:
            out += "middle token is missing. "
        return out


@dataclass(frozen=True)
class ExtraChunk:
    """One ``input_extra`` entry, tokenized: its file name line and its text."""

    filename: Sequence[int]  # tokens of filename + "\n" (used only with FIM_SEP)
    text: Sequence[int]


@dataclass(frozen=True)
class InfillPieces:
    """Every piece of one request, tokenized as the server tokenizes it."""

    prefix: Sequence[int]
    suffix: Sequence[int]
    prompt: Sequence[int]
    extra: Sequence[ExtraChunk]
    repo: Sequence[int]  # REPO_TEXT
    file: Sequence[int]  # FILE_TEXT
    snippet: Sequence[int]  # SNIPPET_TEXT


def extra_tokens(p: InfillParams, pieces: InfillPieces) -> list[int]:
    """The repo-level context put before the FIM prefix, before it is cut to size."""
    out: list[int] = []
    if p.fim_rep != NO_TOKEN:
        out += [p.fim_rep, *pieces.repo]
    for chunk in pieces.extra:
        out += [p.fim_sep, *chunk.filename] if p.fim_sep != NO_TOKEN else list(pieces.snippet)
        out += chunk.text
    if p.fim_sep != NO_TOKEN:
        out += [p.fim_sep, *pieces.file]
    return out


def infill_prompt(p: InfillParams, pieces: InfillPieces) -> list[int]:
    """The token ids ``format_prompt_infill`` returns for these pieces."""
    extra = extra_tokens(p, pieces)
    # The FIM context fits in a batch, prefix to suffix 3:1; the rest of the context is extra chunks.
    n_prefix_take = min(len(pieces.prefix), 3 * (p.n_batch // 4))
    n_suffix_take = min(len(pieces.suffix), max(0, p.n_batch // 4 - (2 + len(pieces.prompt))))
    n_extra_take = min(max(0, p.n_ctx_slot - p.n_batch - 2 * p.n_predict), len(extra))
    prefix = [p.fim_pre, *pieces.prefix[len(pieces.prefix) - n_prefix_take :], *pieces.prompt]
    suffix = [p.fim_suf, *pieces.suffix[:n_suffix_take]]
    first, last = (suffix, prefix) if p.spm_infill else (prefix, suffix)
    head = extra[len(extra) - n_extra_take :]
    bos = [p.bos] if p.add_bos else []
    return [*head, *bos, *first, *last, p.fim_mid]


PieceKey = tuple[str, bool, str]  # (isolation namespace, special tokens parsed, text)


class PieceCache:
    """Tokenized pieces of one model, least recently used out first: an editor sends the same
    extra chunks (open files, recent edits) with every request. Bounded in entries and tokens.
    Keyed by the request's isolation namespace too: a piece another tenant sent must not answer
    faster (a timing oracle on what others edit)."""

    def __init__(self, max_entries: int = 4096, max_tokens: int = 1 << 20) -> None:
        self.max_entries, self.max_tokens = max_entries, max_tokens
        self._ids: OrderedDict[PieceKey, list[int]] = OrderedDict()
        self.n_tokens = 0

    def __len__(self) -> int:
        return len(self._ids)

    def get(self, key: PieceKey) -> list[int] | None:
        ids = self._ids.get(key)
        if ids is not None:
            self._ids.move_to_end(key)
        return ids

    def put(self, key: PieceKey, ids: list[int]) -> None:
        if key in self._ids or len(ids) > self.max_tokens:
            return
        self._ids[key] = ids
        self.n_tokens += len(ids)
        while len(self._ids) > self.max_entries or self.n_tokens > self.max_tokens:
            _, old = self._ids.popitem(last=False)
            self.n_tokens -= len(old)
