"""The whole-state checkpoint store (pure): exact keys, the longest usable match, the budget."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.checkpoints import ENTRY_OVERHEAD, CheckpointStore

pytestmark = pytest.mark.unit


def toks(*ids: int) -> np.ndarray:
    return np.asarray(ids, dtype=np.int32)


def test_match_is_the_longest_checkpoint_that_starts_the_prompt_and_leaves_a_token() -> None:
    store = CheckpointStore(1 << 20)
    store.add("", "c", toks(1, 2), b"a")
    store.add("", "c", toks(1, 2, 3, 4), b"b")
    store.add("", "c", toks(1, 2, 9), b"x")  # parts from the prompt at its last token
    prompt = toks(1, 2, 3, 4, 5)
    got = store.match("", "c", prompt)
    assert got is not None and got.data == b"b"
    # The whole prompt is no match: the server needs one token to compute.
    assert store.match("", "c", toks(1, 2, 3, 4)) is not None
    assert store.match("", "c", toks(1, 2, 3, 4)).data == b"a"  # type: ignore[union-attr]
    assert store.match("", "c", toks(1, 2)) is None
    assert store.match("", "c", prompt, min_tokens=5) is None


@pytest.mark.parametrize(("ns", "compat"), [("other", "c"), ("", "other")])
def test_another_namespace_or_server_kind_never_matches(ns: str, compat: str) -> None:
    store = CheckpointStore(1 << 20)
    store.add("", "c", toks(1, 2, 3), b"a")
    assert store.match(ns, compat, toks(1, 2, 3, 4)) is None


def test_same_tokens_replace_and_the_budget_evicts_least_recently_used() -> None:
    held: list[int] = []
    size = 10 + 4 * 2 + ENTRY_OVERHEAD  # data, two int32 tokens, bookkeeping
    store = CheckpointStore(2 * size, on_hold=held.append, on_free=lambda n: held.append(-n))
    a = store.add("", "c", toks(1, 1), b"0123456789")
    store.add("", "c", toks(2, 2), b"0123456789")
    assert a is not None
    store.touch(a)  # (1, 1) is now the most recently used
    store.add("", "c", toks(3, 3), b"0123456789")
    kept = sorted(tuple(cp.tokens) for cp in store.entries)
    assert kept == [(1, 1), (3, 3)]
    assert store.held_bytes == 2 * size == sum(held)
    store.add("", "c", toks(3, 3), b"9876543210")  # replaced, not doubled
    assert len(store.entries) == 2 and store.find("", "c", toks(3, 3)).data == b"9876543210"  # type: ignore[union-attr]
    assert store.add("", "c", toks(4), b"x" * (3 * size)) is None  # alone over the budget
    store.clear()
    assert store.entries == [] and store.held_bytes == 0 == sum(held)


def test_entry_count_is_bounded() -> None:
    store = CheckpointStore(1 << 30, max_entries=3)
    for i in range(5):
        store.add("", "c", toks(i), b"")
    assert len(store.entries) == 3


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), max_size=8),
    st.lists(st.integers(0, 3), min_size=1, max_size=8),
)
def test_match_agrees_with_a_scan_of_every_entry(keys: list[list[int]], prompt: list[int]) -> None:
    store = CheckpointStore(1 << 30)
    for key in keys:
        store.add("", "c", toks(*key), b"")
    got = store.match("", "c", toks(*prompt))
    usable = [k for k in keys if len(k) < len(prompt) and prompt[: len(k)] == k]
    assert (got is None) == (not usable)
    if got is not None:
        assert got.n_tokens == max(len(k) for k in usable)


def test_a_smaller_budget_evicts_the_least_recently_used() -> None:
    store = CheckpointStore(1 << 20)
    for i in range(4):
        store.add("", "c", toks(i, i), b"x" * 100)
    one = store.entries[0].nbytes
    store.set_budget(2 * one)
    assert sorted(tuple(cp.tokens) for cp in store.entries) == [(2, 2), (3, 3)]
    assert store.held_bytes == 2 * one
