"""The longest common prefix of two token arrays: the one implementation every match uses
(the host tree's edge walk, the disk index's walk, resident entries, slots, admission)."""

from __future__ import annotations

import numpy as np


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens ``a`` and ``b`` share.

    One vectorised compare, then the first mismatch by ``argmax`` of the boolean array
    (no index array built, unlike ``flatnonzero``: about twice as fast once the arrays
    differ, the same when they do not)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differs = a[:n] != b[:n]
    first = int(differs.argmax())
    return first if differs[first] else n
