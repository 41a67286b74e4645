"""/infill's prompt, rebuilt from tokenized pieces as the server's format_prompt_infill builds
it, and the bounded cache of tokenized pieces."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from proxy.core.infill import NO_TOKEN, ExtraChunk, InfillParams, InfillPieces, PieceCache, infill_prompt

pytestmark = pytest.mark.unit

PRE, SUF, MID, REP, SEP, BOS = 900, 901, 902, 903, 904, 1

BASE = InfillParams(
    n_batch=64,
    n_predict=-1,
    n_ctx_slot=512,
    spm_infill=False,
    add_bos=False,
    bos=BOS,
    fim_pre=PRE,
    fim_suf=SUF,
    fim_mid=MID,
    fim_rep=NO_TOKEN,
    fim_sep=NO_TOKEN,
)


def pieces(
    prefix: list[int], suffix: list[int], prompt: tuple[int, ...] | list[int] = (), extra: Any = ()
) -> InfillPieces:
    return InfillPieces(
        prefix=prefix,
        suffix=suffix,
        prompt=prompt,
        extra=[ExtraChunk(filename=f, text=t) for f, t in extra],
        repo=[70, 71],
        file=[80, 81],
        snippet=[60, 61, 62],
    )


CASES: list[tuple[str, InfillParams, InfillPieces, list[int]]] = [
    ("plain", BASE, pieces([10, 11], [20, 21]), [PRE, 10, 11, SUF, 20, 21, MID]),
    ("prompt after the prefix", BASE, pieces([10], [20], [30, 31]), [PRE, 10, 30, 31, SUF, 20, MID]),
    ("bos first", replace(BASE, add_bos=True), pieces([10], [20]), [BOS, PRE, 10, SUF, 20, MID]),
    (
        "spm: suffix first, bos before it",
        replace(BASE, spm_infill=True, add_bos=True),
        pieces([10], [20], [30]),
        [BOS, SUF, 20, PRE, 10, 30, MID],
    ),
    (
        "prefix keeps its tail (3/4 of n_batch)",
        replace(BASE, n_batch=8),
        pieces(list(range(10, 20)), []),
        [PRE, 14, 15, 16, 17, 18, 19, SUF, MID],
    ),
    (
        "suffix keeps its head (1/4 of n_batch less the prompt and 2)",
        replace(BASE, n_batch=24),
        pieces([], list(range(20, 30)), [30]),
        [PRE, 30, SUF, 20, 21, 22, MID],
    ),
    (
        "suffix dropped when the prompt fills its quarter",
        replace(BASE, n_batch=8),
        pieces([], [20, 21], [30]),
        [PRE, 30, SUF, MID],
    ),
    (
        "chunks without FIM_SEP: snippet separator, no repo or file line",
        BASE,
        pieces([10], [20], extra=[([50], [40, 41]), ([51], [42])]),
        [60, 61, 62, 40, 41, 60, 61, 62, 42, PRE, 10, SUF, 20, MID],
    ),
    (
        "repo-level pattern with FIM_REP and FIM_SEP",
        replace(BASE, fim_rep=REP, fim_sep=SEP, add_bos=True),
        pieces([10], [20], extra=[([50], [40])]),
        [REP, 70, 71, SEP, 50, 40, SEP, 80, 81, BOS, PRE, 10, SUF, 20, MID],
    ),
    (
        "FIM_REP alone: repo line, snippet separators",
        replace(BASE, fim_rep=REP),
        pieces([10], [], extra=[([50], [40])]),
        [REP, 70, 71, 60, 61, 62, 40, PRE, 10, SUF, MID],
    ),
    (
        "extra keeps its tail: n_ctx - n_batch - 2 n_predict",
        replace(BASE, fim_rep=REP, fim_sep=SEP, n_ctx_slot=64 + 4 + 2 * 2, n_predict=2),
        pieces([10], [20], extra=[([50], [40, 41, 42])]),
        [42, SEP, 80, 81, PRE, 10, SUF, 20, MID],
    ),
    (
        "no room for extra (n_predict -1 counts as -1, as in the server)",
        replace(BASE, fim_sep=SEP, n_ctx_slot=62),
        pieces([10], [20], extra=[([50], [40])]),
        [PRE, 10, SUF, 20, MID],
    ),
]


@pytest.mark.parametrize(("name", "params", "given", "expected"), CASES, ids=[c[0] for c in CASES])
def test_prompt_as_the_server_builds_it(
    name: str, params: InfillParams, given: InfillPieces, expected: list[int]
) -> None:
    assert infill_prompt(params, given) == expected


CAPS = {
    "n_batch": 2048,
    "n_predict": -1,
    "spm_infill": False,
    "add_bos": False,
    "bos": 1,
    "fim_pre": 8,
    "fim_suf": 9,
    "fim_mid": 10,
    "fim_rep": -1,
    "fim_sep": -1,
}


def test_params_from_caps() -> None:
    params = InfillParams.from_caps({"infill": CAPS}, n_ctx_slot=4096)
    assert params == replace(BASE, n_batch=2048, n_ctx_slot=4096, fim_pre=8, fim_suf=9, fim_mid=10, bos=1)
    assert params.missing() == ""


@pytest.mark.parametrize(
    "caps",
    [{}, {"infill": "yes"}, {"infill": {k: v for k, v in CAPS.items() if k != "fim_mid"}}],
    ids=["before patch 0013", "not an object", "a field missing"],
)
def test_params_not_reported(caps: dict[str, Any]) -> None:
    assert InfillParams.from_caps(caps, n_ctx_slot=4096) is None


def test_missing_tokens_named_as_the_server_names_them() -> None:
    none = replace(BASE, fim_pre=NO_TOKEN, fim_mid=NO_TOKEN)
    assert none.missing() == "prefix token is missing. middle token is missing. "


def test_piece_cache_bounded_least_recent_out() -> None:
    cache = PieceCache(max_entries=2, max_tokens=5)
    cache.put(("", False, "a"), [1, 2])
    cache.put(("", False, "b"), [3])
    assert cache.get(("", False, "a")) == [1, 2]  # now most recent
    cache.put(("", True, "c"), [4])
    assert cache.get(("", False, "b")) is None and len(cache) == 2
    cache.put(("", False, "d"), [5, 6, 7])  # 2 + 1 + 3 tokens > 5: the oldest go
    assert cache.get(("", False, "a")) is None and cache.get(("", False, "d")) == [5, 6, 7]
    assert cache.n_tokens <= 5
    cache.put(("", False, "huge"), list(range(6)))  # larger than the whole cache: not kept
    assert cache.get(("", False, "huge")) is None and cache.n_tokens <= 5


def test_piece_cache_keys_by_namespace_and_special_parsing() -> None:
    cache = PieceCache()
    cache.put(("", True, "<s>"), [1])
    assert cache.get(("", False, "<s>")) is None
    assert cache.get(("tenant-b", True, "<s>")) is None  # another namespace never hits
