"""Host radix tree: unit cases plus a hypothesis state machine against a reference model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from proxy.core.payload import KvLayout, KvSegment
from proxy.core.radix import NODE_OVERHEAD_BYTES, TOKEN_OVERHEAD_BYTES, HostMatch, RadixTree
from proxy.errors import PayloadError

pytestmark = pytest.mark.unit

LAYOUT = KvLayout(1, (1,), (4,), (1,), False, (4,), (0,), (0,))  # 8 bytes per token
PER_TOKEN = LAYOUT.bytes_per_token + TOKEN_OVERHEAD_BYTES


def kv_rows(tokens: list[int]) -> np.ndarray:
    """Synthetic KV: row i is a hash of tokens[:i+1], as real KV depends on the whole prefix."""
    out = np.empty((len(tokens), 8), np.uint8)
    h = 0
    for i, t in enumerate(tokens):
        h = (h * 1_000_003 + t + 1) % (1 << 64)
        out[i] = np.frombuffer(h.to_bytes(8, "little"), np.uint8)
    return out


def seg_for(tokens: list[int], p0: int = 0) -> KvSegment:
    return KvSegment.from_rows(p0, LAYOUT, kv_rows(tokens)[p0:].copy())


def served(tree: RadixTree, match: HostMatch, start: int = 0, end: int | None = None) -> np.ndarray:
    segs = tree.segments(match, start, end)
    if not segs:
        return np.empty((0, 8), np.uint8)
    for a, b in zip(segs, segs[1:], strict=False):
        assert a.p1 == b.p0
    return np.concatenate([s.rows() for s in segs])


def insert(tree: RadixTree, tokens: list[int]) -> int:
    n = tree.insert(tokens, seg_for(tokens))
    tree.check_invariants()
    return n


def node_cost(n_tokens: int) -> int:
    return n_tokens * PER_TOKEN + NODE_OVERHEAD_BYTES


BIG = 10**9


def test_empty_tree() -> None:
    tree = RadixTree(BIG)
    m = tree.match([1, 2, 3])
    assert m.length == 0 and tree.segments(m) == []
    tree.check_invariants()
    assert tree.stats().nodes == 0


def test_insert_then_match_serves_exact_kv() -> None:
    tree = RadixTree(BIG)
    p = [5, 6, 7, 8, 9]
    assert insert(tree, p) == 5
    m = tree.match(p + [1, 2])
    assert m.length == 5
    assert np.array_equal(served(tree, m), kv_rows(p))
    assert np.array_equal(served(tree, m, 2, 4), kv_rows(p)[2:4])
    assert insert(tree, p) == 0  # already held


def test_common_prefix_stored_once() -> None:
    tree = RadixTree(BIG)
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 9, 9]
    insert(tree, a)
    assert tree.insert(b, seg_for(b, p0=tree.match(b, touch=False).length)) == 3
    tree.check_invariants()
    st_ = tree.stats()
    assert (st_.nodes, st_.leaves, st_.unique_tokens, st_.logical_tokens) == (3, 2, 9, 13)
    assert st_.bytes == 9 * PER_TOKEN + 3 * NODE_OVERHEAD_BYTES
    for p in (a, b):
        m = tree.match(p)
        assert m.length == len(p) and np.array_equal(served(tree, m), kv_rows(p))


def test_split_keeps_views_of_one_buffer() -> None:
    tree = RadixTree(BIG)
    a = [1, 2, 3, 4, 5, 6]
    seg = seg_for(a)
    tree.insert(a, seg)
    tree.insert([1, 2, 9], seg_for([1, 2, 9], p0=2))
    tree.check_invariants()
    for s in tree.segments(tree.match(a)):
        assert s.owner is seg.owner  # stored and split without copies


def test_overlapping_segment_stores_only_the_missing_part() -> None:
    tree = RadixTree(BIG)
    a = list(range(10))
    insert(tree, a[:4])
    full = seg_for(a)  # exported from 0 although the tree holds [0,4)
    assert tree.insert(a, full) == 6
    tree.check_invariants()
    assert tree.stats().unique_tokens == 10
    segs = tree.segments(tree.match(a))
    # The [4,10) view would keep all ten rows alive: the tree copies it instead.
    assert segs[-1].owner is not full.owner
    exact = seg_for(a + [77], p0=10)
    tree.insert(a + [77], exact)
    assert tree.segments(tree.match(a + [77]))[-1].owner is exact.owner


def test_insert_rejects_gaps_and_bad_segments() -> None:
    tree = RadixTree(BIG)
    a = [1, 2, 3, 4]
    insert(tree, a[:2])
    with pytest.raises(ValueError, match="holds only"):
        tree.insert(a, seg_for(a, p0=3))
    with pytest.raises(ValueError, match="ends at"):
        tree.insert(a + [5], seg_for(a, p0=2))
    other = KvLayout(1, (1,), (8,), (1,), False, (8,), (0,), (0,))
    with pytest.raises(PayloadError):
        tree.insert(a, KvSegment.from_rows(0, other, np.zeros((4, 16), np.uint8)))
    tree.check_invariants()


def test_partial_edge_match() -> None:
    tree = RadixTree(BIG)
    insert(tree, [1, 2, 3, 4, 5])
    m = tree.match([1, 2, 3, 9])
    assert m.length == 3
    assert np.array_equal(served(tree, m), kv_rows([1, 2, 3]))
    with pytest.raises(ValueError):
        tree.segments(m, 0, 4)


def test_lru_evicts_least_recently_used_leaf() -> None:
    a, b, c = [1] * 10, [2] * 10, [3] * 10
    tree = RadixTree(3 * node_cost(10))
    for p in (a, b, c):
        insert(tree, p)
    tree.match(a)  # a is now newer than b
    insert(tree, [4] * 10)
    assert tree.match(b, touch=False).length == 0
    assert tree.match(a, touch=False).length == 10
    assert tree.match(c, touch=False).length == 10
    assert tree.stats().evictions == 1 and tree.stats().evicted_tokens == 10


def test_eviction_cascades_but_keeps_prefixes_in_use() -> None:
    shared = [7] * 5
    x, y = shared + [1] * 5, shared + [2] * 5
    tree = RadixTree(BIG)
    insert(tree, x)
    tree.insert(y, seg_for(y, p0=5))
    tree.match(y)
    tree.set_budget(tree.stats().bytes - 1)  # one leaf must go: x (older)
    tree.check_invariants()
    assert tree.match(x, touch=False).length == 5 and tree.match(y, touch=False).length == 10
    tree.set_budget(node_cost(5) + NODE_OVERHEAD_BYTES - 1)  # y's leaf goes, then shared is a leaf
    tree.check_invariants()
    assert tree.stats().nodes <= 1
    tree.set_budget(0)
    tree.check_invariants()
    assert tree.stats().nodes == 0 and tree.stats().bytes == 0


def test_evicting_lower_half_of_split_edge_frees_its_buffer() -> None:
    a = list(range(20))
    tree = RadixTree(BIG)
    seg = seg_for(a)
    tree.insert(a, seg)
    tree.match(a[:10] + [99])  # nothing new
    tree.insert(a[:10] + [99], seg_for(a[:10] + [99], p0=10))
    tree.match(a[:10] + [99])
    tree.set_budget(tree.stats().bytes - 1)  # evicts [10,20) of a, the older leaf
    tree.check_invariants()
    m = tree.match(a)
    assert m.length == 10
    upper = tree.segments(m)[0]
    assert upper.owner is not seg.owner  # copied: the 20-row buffer can go
    assert np.array_equal(upper.rows(), kv_rows(a)[:10])


def test_pins_block_eviction() -> None:
    a, b = [1] * 10, [2] * 10
    tree = RadixTree(BIG)
    insert(tree, a)
    insert(tree, b)
    m = tree.match(a)
    tree.pin(m)
    tree.set_budget(0)
    tree.check_invariants()
    assert tree.match(a, touch=False).length == 10 and tree.match(b, touch=False).length == 0
    assert np.array_equal(served(tree, m), kv_rows(a))
    assert tree.stats().pinned_nodes == 1
    tree.unpin(m)
    tree.evict_to_budget()
    tree.check_invariants()
    assert tree.stats().nodes == 0
    with pytest.raises(ValueError, match="stale"):
        tree.segments(m)
    with pytest.raises(ValueError, match="stale"):
        tree.pin(m)


def test_pin_survives_split_and_unpin_balances() -> None:
    tree = RadixTree(BIG)
    a = list(range(10))
    insert(tree, a)
    m = tree.match(a[:4])  # ends inside the edge
    tree.pin(m)
    tree.insert(a[:4] + [50], seg_for(a[:4] + [50], p0=4))  # splits the pinned edge at 4
    tree.check_invariants()
    assert np.array_equal(served(tree, m), kv_rows(a[:4]))
    tree.unpin(m)
    tree.check_invariants()
    with pytest.raises(ValueError, match="without"):
        tree.unpin(m)


def test_insert_larger_than_budget_stores_what_fits() -> None:
    tree = RadixTree(node_cost(6))
    a = list(range(10))
    assert insert(tree, a) == 6
    assert tree.stats().bytes == node_cost(6)
    assert tree.match(a).length == 6
    assert insert(tree, [50] * 3) == 3  # evicts a, fits
    assert tree.match(a, touch=False).length == 0
    tiny = RadixTree(NODE_OVERHEAD_BYTES + PER_TOKEN - 1)
    assert insert(tiny, a) == 0 and tiny.stats().nodes == 0


def test_insert_does_not_evict_its_own_path() -> None:
    tree = RadixTree(node_cost(8) + 2 * NODE_OVERHEAD_BYTES + 2 * PER_TOKEN)
    a = list(range(8))
    insert(tree, a)
    b = a[:5] + [100, 101, 102]
    stored = tree.insert(b, seg_for(b, p0=5))
    tree.check_invariants()
    assert stored == 2  # the split node and two tokens fit; a's prefix stays
    assert tree.match(b, touch=False).length == 7
    assert tree.stats().bytes <= tree.budget_bytes


def test_stats_loads_top_prefixes_and_clear() -> None:
    tree = RadixTree(BIG)
    a, b = [1, 2, 3, 4], [1, 2, 9]
    insert(tree, a)
    tree.insert(b, seg_for(b, p0=2))
    for _ in range(3):
        tree.match(b)
    tree.match(a)
    tree.record_load(40)
    s = tree.stats()
    assert (s.saves, s.saved_tokens, s.loads, s.loaded_tokens) == (2, 5, 1, 40)
    top = tree.top_prefixes(2)
    assert top[0].length == 2 and top[0].hits == 4 and top[0].head == (1, 2)
    assert top[1].length == 3 and top[1].hits == 3 and top[1].bytes == 3 * LAYOUT.bytes_per_token
    m = tree.match(a)
    tree.pin(m)
    tree.clear()
    tree.check_invariants()
    tree.unpin(m)  # no-op after clear
    assert tree.stats().nodes == 0 and tree.match(a).length == 0 and tree.layout is None


def test_lru_heap_stays_bounded_under_repeated_touches() -> None:
    tree = RadixTree(BIG)
    insert(tree, [1, 2, 3])
    insert(tree, [4, 5])
    for _ in range(500):
        tree.match([1, 2, 3])
    tree.check_invariants()
    assert len(tree._heap) <= 2 * tree.stats().nodes + 65
    tree.set_budget(node_cost(3))  # the older leaf [4, 5] goes despite the heap churn
    assert tree.match([4, 5], touch=False).length == 0 and tree.match([1, 2, 3]).length == 3


def test_foreign_match_rejected() -> None:
    t1, t2 = RadixTree(BIG), RadixTree(BIG)
    insert(t1, [1, 2])
    with pytest.raises(ValueError, match="belong"):
        t2.segments(t1.match([1, 2]))


def test_match_8k_prompt_through_many_branches() -> None:
    # How fast this is belongs in a benchmark, not in a test (shared, noisy machine).
    rng = np.random.default_rng(0)
    base = rng.integers(0, 50_000, 8192).astype(np.int32)
    tree = RadixTree(BIG)
    zero = np.zeros((8192, 8), np.uint8)
    tree.insert(base, KvSegment.from_rows(0, LAYOUT, zero))
    for i in range(40):  # 40 branches along the prompt: 80 nodes on the way down
        q = np.concatenate([base[: 100 + i * 200], [60_000 + i]]).astype(np.int32)
        tree.insert(q, KvSegment.from_rows(len(q) - 1, LAYOUT, zero[:1]))
    tree.check_invariants()
    match = tree.match(base.tolist())
    assert match.length == 8192
    assert sum(s.n for s in tree.segments(match)) == 8192
    for i in (0, 17, 39):
        branch = np.concatenate([base[: 100 + i * 200], [60_000 + i]])
        assert tree.match(branch).length == len(branch)


# ---------------------------------------------------------------- state machine

tokens_st = st.lists(st.integers(0, 3), min_size=1, max_size=14)


class TreeMachine(RuleBasedStateMachine):
    """Random inserts / matches / pins / budgets; every answer checked against a model."""

    def __init__(self) -> None:
        super().__init__()
        self.tree = RadixTree(BIG)
        self.inserted: set[tuple[int, ...]] = set()  # every prompt ever stored (model)
        self.pinned: list[tuple[list[int], HostMatch]] = []

    def best_model_lcp(self, q: list[int]) -> int:
        best = 0
        for p in self.inserted:
            n = 0
            while n < min(len(p), len(q)) and p[n] == q[n]:
                n += 1
            best = max(best, n)
        return best

    @rule(q=tokens_st, extend=st.booleans(), p0_frac=st.floats(0, 1))
    def insert(self, q: list[int], extend: bool, p0_frac: float) -> None:
        if extend and self.inserted:  # grow a stored prompt: long shared prefixes
            q = list(sorted(self.inserted)[len(q) % len(self.inserted)]) + q
        have = self.tree.match(q, touch=False).length
        p0 = int(have * p0_frac)
        before = self.tree.stats().bytes
        stored = self.tree.insert(q, seg_for(q, p0))
        assert 0 <= stored <= len(q) - have
        after = self.tree.stats()
        assert after.bytes <= max(self.tree.budget_bytes, before)
        if stored:
            self.inserted.add(tuple(q[: have + stored]))
        if self.tree.budget_bytes == BIG:
            assert self.tree.match(q, touch=False).length == len(q)

    @rule(q=tokens_st, touch=st.booleans())
    def match(self, q: list[int], touch: bool) -> None:
        m = self.tree.match(q, touch=touch)
        bound = self.best_model_lcp(q)
        assert m.length <= bound
        if self.tree.stats().evictions == 0:
            assert m.length == bound
        assert np.array_equal(served(self.tree, m), kv_rows(q)[: m.length])

    @rule(q=tokens_st)
    def pin(self, q: list[int]) -> None:
        m = self.tree.match(q)
        self.tree.pin(m)
        self.pinned.append((q, m))

    @rule(i=st.integers(0, 100))
    def unpin(self, i: int) -> None:
        if not self.pinned:
            return
        _, m = self.pinned.pop(i % len(self.pinned))
        self.tree.unpin(m)

    @rule(budget=st.sampled_from([BIG, 9000, 6000, 4000, 2500, 1200, 600, 0]))
    def set_budget(self, budget: int) -> None:
        self.tree.set_budget(budget)

    @invariant()
    def consistent(self) -> None:
        self.tree.check_invariants()
        s = self.tree.stats()
        event(f"evictions>0: {s.evictions > 0}, pinned: {bool(self.pinned)}, nodes>3: {s.nodes > 3}")
        for q, m in self.pinned:  # pinned KV never goes away and stays correct
            assert self.tree.match(q, touch=False).length >= m.length
            assert np.array_equal(served(self.tree, m), kv_rows(q)[: m.length])


TreeMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_tree_machine = TreeMachine.TestCase


# ---------------------------------------------------------------- namespaces (cache isolation)


def test_namespaces_never_share_a_prefix() -> None:
    tree = RadixTree(BIG)
    tokens = [1, 2, 3, 4, 5, 6]
    assert tree.insert(tokens, seg_for(tokens), ns="tenant-a") == 6
    tree.check_invariants()
    assert tree.match(tokens, ns="tenant-a").length == 6
    assert tree.match(tokens).length == 0
    assert tree.match(tokens, ns="tenant-b").length == 0
    # The same prompt in another namespace is stored again, not deduplicated across keys.
    assert tree.insert(tokens, seg_for(tokens)) == 6
    assert tree.stats().unique_tokens == 12
    tree.check_invariants()


def test_an_emptied_namespace_leaves_nothing_behind() -> None:
    tree = RadixTree(node_cost(4) + 8)
    insert_ns = [10, 11, 12, 13]
    tree.insert(insert_ns, seg_for(insert_ns), ns="salt")
    tree.check_invariants()
    other = [20, 21, 22, 23]
    tree.insert(other, seg_for(other))  # evicts the namespaced leaf (budget for one leaf)
    tree.check_invariants()
    assert tree.match(insert_ns, ns="salt").length == 0
    assert tree.match(other).length == 4
    assert tree.stats().nodes == 1


def test_a_pinned_namespaced_match_survives_eviction() -> None:
    tree = RadixTree(node_cost(4) + 8)
    tokens = [10, 11, 12, 13]
    tree.insert(tokens, seg_for(tokens), ns="salt")
    held = tree.match(tokens, ns="salt")
    tree.pin(held)
    assert tree.insert([20, 21, 22, 23], seg_for([20, 21, 22, 23])) == 0  # no room: the pinned leaf stays
    tree.check_invariants()
    assert served(tree, held).shape == (4, 8)
    tree.unpin(held)
    tree.clear()
    tree.check_invariants()
    assert tree.match(tokens, ns="salt").length == 0


def test_each_namespace_keeps_its_own_layout() -> None:
    """Several models behind one proxy: each compat key in its own namespace, never mixed."""
    other = KvLayout(1, (1,), (8,), (1,), False, (8,), (0,), (0,))  # 16 bytes per token
    tree = RadixTree(1 << 20)
    a = list(range(10))
    tree.insert(a, seg_for(a), ns="m:a")
    rows16 = np.repeat(kv_rows(a), 2, axis=1)
    tree.insert(a, KvSegment.from_rows(0, other, rows16), ns="m:b")
    assert tree.match(a, ns="m:a").length == 10 and tree.match(a, ns="m:b").length == 10
    (got,) = tree.segments(tree.match(a, ns="m:b"), 0, 10)
    assert got.layout == other and np.array_equal(got.rows(), rows16)
    with pytest.raises(PayloadError):
        tree.insert(
            a + [99], KvSegment.from_rows(0, other, np.repeat(kv_rows(a + [99]), 2, axis=1)), ns="m:a"
        )
    tree.check_invariants()
    strict = RadixTree(1 << 20, LAYOUT)  # a layout given: every namespace must use it
    with pytest.raises(PayloadError):
        strict.insert(a, KvSegment.from_rows(0, other, rows16), ns="m:b")
