"""The resident index: entries, sharers, pins and release order (pure)."""

from __future__ import annotations

import numpy as np
import pytest

from proxy.core.resident import ResidentIndex

pytestmark = pytest.mark.unit


def toks(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


def test_views_report_the_usable_prefix_of_each_entry() -> None:
    index = ResidentIndex(range(4, 8), 0)
    index.add(4, toks(1, 2, 3, 4), source_slot=0, now=1.0)
    index.add(5, toks(1, 2, 9), source_slot=1, now=2.0)
    index.check_invariants()
    views = {v.owner_id: v.lcp for v in index.views(toks(1, 2, 3, 7))}
    assert views == {4: 3, 5: 2}
    assert index.views(toks(8, 8)) == ()
    assert index.has(toks(1, 2, 9)) and not index.has(toks(1, 2))


@pytest.mark.parametrize(
    ("max_entries", "ids", "expected"),
    [
        (0, range(4, 12), 8),  # auto: min(64, owner ids)
        (0, range(4, 100), 64),
        (3, range(4, 12), 3),
        (50, range(4, 6), 2),  # never more than the server offers
    ],
)
def test_entry_limit(max_entries: int, ids: range, expected: int) -> None:
    assert ResidentIndex(ids, max_entries).max_entries == expected


def test_free_owner_respects_the_limit() -> None:
    index = ResidentIndex(range(4, 8), 2)
    assert index.free_owner() == 4
    index.add(4, toks(1), 0, 0.0)
    assert index.free_owner() == 5
    index.add(5, toks(2), 0, 0.0)
    assert index.free_owner() is None
    index.remove(4)
    assert index.free_owner() == 4
    index.check_invariants()


def test_release_order_prefers_entries_that_free_cells_then_lru() -> None:
    index = ResidentIndex(range(4, 8), 0)
    index.add(4, toks(1, 2, 3), source_slot=0, now=1.0)  # slot 0 still shares all of it
    index.add(5, toks(7, 8, 9), source_slot=1, now=3.0)
    index.add(6, toks(5, 5, 5), source_slot=2, now=2.0)
    index.slot_changed(1, toks(7, 0, 0))  # slot 1 now shares one cell
    index.slot_changed(2, toks(0, 0))  # slot 2 shares nothing
    assert index.entries[6].frees_on_release() == 3
    assert index.entries[5].frees_on_release() == 2
    assert index.entries[4].frees_on_release() == 0
    assert index.release_order() == [6, 5, 4]
    index.pin(6)
    assert index.release_order() == [5, 4]
    index.unpin(6)
    index.check_invariants()


def test_attach_records_a_sharer_and_a_hit() -> None:
    index = ResidentIndex(range(4, 8), 0)
    index.add(4, toks(1, 2, 3, 4), 0, 0.0)
    index.attached(4, slot_id=3, m=2, now=5.0)
    assert index.entries[4].sharers == {0: 4, 3: 2}
    assert index.stats().hits == 1 and index.entries[4].last_used == 5.0
    index.check_invariants()


@pytest.mark.parametrize("bad", ["duplicate", "out_of_range", "unpin_without_pin"])
def test_misuse_is_refused(bad: str) -> None:
    index = ResidentIndex(range(4, 8), 0)
    index.add(4, toks(1), 0, 0.0)
    with pytest.raises(ValueError):
        if bad == "duplicate":
            index.add(4, toks(2), 0, 0.0)
        elif bad == "out_of_range":
            index.add(9, toks(2), 0, 0.0)
        else:
            index.unpin(4)


def test_a_reset_index_tolerates_late_callers() -> None:
    index = ResidentIndex(range(4, 8), 0)
    index.add(4, np.arange(10, dtype=np.int32), source_slot=0, now=0.0)
    index.entries.clear()  # the server restarted while an attach and a release were in flight
    index.attached(4, 1, 5, 1.0)
    index.remove(4)
    index.check_invariants()
