"""common_prefix: the one longest-common-prefix of token arrays every match in the core uses."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.core import admission, diskindex, prefix, radix, resident
from proxy.core.prefix import common_prefix

pytestmark = pytest.mark.unit

tokens = st.lists(st.integers(0, 3), max_size=40).map(lambda xs: np.array(xs, dtype=np.int32))


def naive(a: np.ndarray, b: np.ndarray) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@given(tokens, tokens)
def test_matches_the_token_by_token_count(a: np.ndarray, b: np.ndarray) -> None:
    assert common_prefix(a, b) == naive(a, b) == common_prefix(b, a)
    assert common_prefix(a, np.concatenate([a, b])) == len(a)


def test_edges() -> None:
    empty = np.array([], dtype=np.int32)
    assert common_prefix(empty, empty) == 0 and common_prefix(np.arange(3), empty) == 0
    assert common_prefix(np.arange(5), np.arange(5)) == 5
    assert common_prefix(np.array([7, 1]), np.array([8, 1])) == 0
    assert common_prefix(np.arange(100_000), np.r_[np.arange(99_999), -1]) == 99_999


def test_one_implementation() -> None:
    # The host tree's edge walk, the disk index's walk, the resident index and admission
    # all call this one function (each had its own copy).
    for module in (radix, diskindex, resident, admission):
        assert vars(module)["common_prefix"] is prefix.common_prefix, module.__name__
