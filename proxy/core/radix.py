"""The host radix tree: token prefix -> KV segments in host RAM (route H).

A compressed radix tree keyed by token ids. A node's depth is an absolute position: the
edge into a node covers tokens [start, end) of every prompt through it and owns the
KvSegment of exactly those positions (invariant 2: K is stored after RoPE at its
position, so KV may only go back where it came from). A shared prefix is stored once.

Memory: splitting an edge splits its segment into two numpy VIEWS of one buffer. When
the lower part is evicted, the upper part is copied so the buffer can actually be freed;
so the byte count is always what the tree really keeps alive.

Eviction: unpinned leaves, least recently used first (a clock ticks on every match and
insert and stamps the whole path, so a parent is never older than its children). A
lazy heap holds candidate leaves; stale entries are skipped when popped.

Namespaces: every prefix lives under a namespace (a cache-isolation key, "" by default),
each with its own root. A match never crosses namespaces, so requests with different keys
never reuse each other's KV; eviction and the byte budget are shared by all of them.

Pure: numpy only. Not thread-safe: the proxy calls it from one event loop.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from proxy.core.payload import KvLayout, KvSegment
from proxy.core.prefix import common_prefix
from proxy.errors import PayloadError

# Metadata estimate charged against the budget besides the KV bytes themselves.
NODE_OVERHEAD_BYTES = 512  # the node object, its dict of children, heap entries
TOKEN_OVERHEAD_BYTES = 4  # the int32 edge token

Tokens = Sequence[int] | np.ndarray


@dataclass(frozen=True)
class HostMatch:
    """`length` tokens of the query have KV in the tree, from position 0. `handle` is
    opaque: pass the match back to segments() / pin() / unpin()."""

    length: int
    handle: object = field(repr=False, compare=False)


@dataclass(frozen=True)
class TreeStats:
    nodes: int
    leaves: int
    unique_tokens: int  # tokens stored (each shared prefix once)
    logical_tokens: int  # sum of leaf depths: prompt tokens the tree can serve
    bytes: int  # payload bytes plus metadata estimate
    budget_bytes: int
    pinned_nodes: int
    saves: int
    saved_tokens: int
    loads: int
    loaded_tokens: int
    evictions: int
    evicted_tokens: int


@dataclass(frozen=True)
class Spill:
    """A node's KV leaving RAM (or copied out at shutdown): the KV of path[start:], where
    `path` is every token from position 0 to the node's end, in namespace `ns`."""

    ns: str
    path: np.ndarray
    segment: KvSegment

    @property
    def start(self) -> int:
        return self.segment.p0


@dataclass(frozen=True)
class PrefixInfo:
    """One node for the admin view: the prefix ending at it."""

    length: int  # tokens from position 0 to the end of this node
    hits: int
    bytes: int  # KV bytes of the whole prefix
    head: tuple[int, ...]  # its first tokens, for display


class _Node:
    __slots__ = (
        "uid",
        "parent",
        "tokens",
        "start",
        "segment",
        "children",
        "pins",
        "own_pins",
        "last_used",
        "hits",
        "alive",
        "ns",
    )

    def __init__(
        self,
        uid: int,
        parent: _Node | None,
        tokens: np.ndarray,
        start: int,
        segment: KvSegment | None,
        clock: int,
    ) -> None:
        self.uid = uid
        self.parent = parent
        self.tokens = tokens  # int32 edge tokens, positions [start, end)
        self.start = start
        self.segment = segment  # None only for the root
        self.children: dict[int, _Node] = {}  # keyed by the child's first token
        self.pins = 0  # pins of matches ending at or below this node
        self.own_pins = 0  # pins of matches whose handle is this node
        self.last_used = clock
        self.hits = 0
        self.alive = True
        self.ns = ""  # the namespace, on roots (parent None)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def cost(self) -> int:
        assert self.segment is not None
        return self.segment.nbytes + len(self.tokens) * TOKEN_OVERHEAD_BYTES + NODE_OVERHEAD_BYTES


class _Handle:
    """What a HostMatch carries: the deepest node of the matched path."""

    __slots__ = ("tree", "node")

    def __init__(self, tree: RadixTree, node: _Node) -> None:
        self.tree = tree
        self.node = node


def as_tokens(tokens: Tokens) -> np.ndarray:
    """A 1-D int32 array (no copy when it already is one)."""
    if isinstance(tokens, np.ndarray):
        arr = tokens.astype(np.int32, copy=False)
    else:
        arr = np.fromiter(tokens, dtype=np.int32, count=len(tokens))
    if arr.ndim != 1:
        raise ValueError("tokens must be 1-D")
    return arr


class RadixTree:
    """Token radix tree of KV segments under a byte budget. See the module docstring."""

    def __init__(self, budget_bytes: int, layout: KvLayout | None = None) -> None:
        self.budget_bytes = budget_bytes
        # Given: every namespace must use it. None: each namespace takes the layout of its first
        # insert (several models, each in its own namespace: proxy/server/ops/models.py), and
        # ``layout`` reports the first one seen.
        self.layout = layout
        self._fixed_layout = layout is not None
        self._ns_layouts: dict[str, KvLayout] = {}
        self._uid = 0
        self._clock = 0
        self._roots: dict[str, _Node] = {"": self._new_root("")}
        self._heap: list[tuple[int, int, _Node]] = []  # (last_used, uid, leaf), lazily pruned
        # Counters kept next to the links they count; check_invariants() recomputes them.
        self._nodes = 0
        self._leaves = 0
        self._unique = 0
        self._logical = 0
        self._bytes = 0
        self._in_flight = 0  # bytes of KV held outside the tree by moves in flight (reserve/release)
        self._saves = self._saved_tokens = 0
        self._loads = self._loaded_tokens = 0
        self._evictions = self._evicted_tokens = 0
        # Told of every evicted leaf before its KV is dropped (the disk tier demotes it).
        self.on_evict: Callable[[Spill], None] | None = None
        # Makes the copy of a segment the tree keeps on its own (a slice that would hold a larger
        # buffer alive): with the arena, into a block of its own, so it stays one-copy movable.
        self.copier: Callable[[KvSegment], KvSegment] = KvSegment.copy

    # ------------------------------------------------------------ lookups

    def match(self, tokens: Tokens, touch: bool = True, ns: str = "") -> HostMatch:
        """Longest prefix of `tokens` with KV in the tree, in namespace `ns`. `touch` marks
        the path used (LRU) and counts a hit on each of its nodes; pass False for a mere
        estimate."""
        path, length = self._walk(as_tokens(tokens), ns)
        if touch and path:
            self._touch(path)
            for node in path:
                node.hits += 1
        return HostMatch(length, _Handle(self, path[-1] if path else self._roots[""]))

    def touch(self, match: HostMatch) -> None:
        """Count an estimate from ``match(tokens, touch=False)`` as used after all (LRU, hits)."""
        if match.length == 0:
            return
        path = self._path_to(self._node_of(match))
        self._touch(path)
        for node in path:
            node.hits += 1

    def segments(self, match: HostMatch, start: int = 0, end: int | None = None) -> list[KvSegment]:
        """Views of the KV for positions [start, end) of a match (end defaults to its length).

        Pin the match first if anything may run in between (an insert can evict it)."""
        end = match.length if end is None else end
        if not 0 <= start <= end <= match.length:
            raise ValueError(f"range [{start},{end}) outside the match [0,{match.length})")
        out = []
        for node in self._path_to(self._node_of(match)):
            a, b = max(start, node.start), min(end, node.end)
            if a < b:
                assert node.segment is not None
                out.append(node.segment.slice(a, b))
        return out

    def pin(self, match: HostMatch) -> None:
        """Keep the match's path from eviction until unpin(). Callers unpin in `finally`."""
        node = self._node_of(match)
        node.own_pins += 1
        self._add_pins(node, 1)

    def unpin(self, match: HostMatch) -> None:
        """Undo one pin(). A no-op after clear() dropped the path."""
        handle = self._handle_of(match)
        node = handle.node
        if not node.alive:
            return
        if node.own_pins <= 0:
            raise ValueError("unpin() without a matching pin()")
        node.own_pins -= 1
        self._add_pins(node, -1)
        # The budget may have shrunk while this path was pinned.
        self._evict_until(self.budget_bytes)

    # ------------------------------------------------------------ updates

    def insert(self, tokens: Tokens, segment: KvSegment, ns: str = "") -> int:
        """Store the KV of `tokens` that the tree lacks; return how many tokens were stored.

        `segment` covers [segment.p0, len(tokens)) with segment.p0 <= the current match
        length; the tree keeps views of the part beyond its match (copying it only when
        the view would keep a bigger buffer alive). Other leaves are evicted to make room;
        when the whole remainder does not fit, the longest prefix of it that fits is kept.
        The caller must not modify the segment's data afterwards."""
        q = as_tokens(tokens)
        self._check_layout(segment.layout, ns)
        if segment.p1 != len(q):
            raise ValueError(f"segment ends at {segment.p1}, tokens at {len(q)}")
        path, length = self._walk(q, ns)
        if segment.p0 > length:
            raise ValueError(f"segment starts at {segment.p0} but the tree holds only [0,{length})")
        self._touch(path)
        if length == len(q):
            return 0
        deepest = path[-1] if path else self._roots.get(ns) or self._add_root(ns)
        # Pin the path while making room so eviction cannot take what we extend.
        self._add_pins(deepest, 1)
        try:
            stored = self._store(deepest, length, q, segment)
        finally:
            self._add_pins(deepest, -1)
        if stored:
            self._saves += 1
            self._saved_tokens += stored
        return stored

    def insert_run(self, tokens: Tokens, segments: Sequence[KvSegment], ns: str = "") -> int:
        """``insert`` for adjacent segments (an export's chunks), each as its own edge, in
        order; stops at the first one not stored whole (the next would not start in the tree)."""
        q = as_tokens(tokens)
        stored = 0
        for seg in segments:
            stored += self.insert(q[: seg.p1], seg, ns)
            if self.match(q[: seg.p1], touch=False, ns=ns).length < seg.p1:
                break
        return stored

    def evict_lru_leaf(self) -> int:
        """Evict the least recently used unpinned leaf (the arena needs a free range); the
        bytes it counted, 0 when there is none."""
        while self._heap:
            last_used, _, node = heapq.heappop(self._heap)
            if self._evictable(node) and node.last_used == last_used:
                cost = node.cost()
                self._evict_leaf(node)
                return max(1, cost)
        return 0

    def _store(self, deepest: _Node, length: int, q: np.ndarray, segment: KvSegment) -> int:
        split = deepest.parent is not None and length < deepest.end
        extra = NODE_OVERHEAD_BYTES if split else 0
        per_token = segment.layout.bytes_per_token + TOKEN_OVERHEAD_BYTES
        n_new = len(q) - length
        room = self.budget_bytes - self._in_flight
        self._evict_until(room - extra - NODE_OVERHEAD_BYTES - n_new * per_token)
        free = room - self._bytes - extra - NODE_OVERHEAD_BYTES
        k = min(n_new, free // per_token) if free > 0 else 0
        if k <= 0:
            return 0
        parent = self._split(deepest, length) if split else deepest
        seg = segment.slice(length, length + k)
        if seg.keeps_extra():
            seg = self.copier(seg)
        self._add_leaf(parent, q[length : length + k].copy(), seg)
        return k

    def record_load(self, n_tokens: int) -> None:
        """The executor restored n_tokens from the tree into a slot."""
        self._loads += 1
        self._loaded_tokens += n_tokens

    def reserve(self, nbytes: int) -> int:
        """Count ``nbytes`` of KV the proxy is about to hold outside the tree (a payload being
        exported or imported) against the budget, evicting leaves to make room; returns the
        amount to pass to ``release`` when the bytes are gone or inserted."""
        self._evict_until(self.budget_bytes - self._in_flight - nbytes)
        self._in_flight += nbytes
        return nbytes

    def release(self, nbytes: int) -> None:
        if nbytes > self._in_flight:
            raise ValueError(f"release of {nbytes} bytes, {self._in_flight} reserved")
        self._in_flight -= nbytes

    def set_budget(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.evict_to_budget()

    def evict_to_budget(self) -> int:
        """Evict LRU unpinned leaves until within budget; return the tokens evicted."""
        before = self._evicted_tokens
        self._evict_until(self.budget_bytes)
        return self._evicted_tokens - before

    def clear(self, layout: KvLayout | None = None) -> None:
        """Drop everything (e.g. the model changed). Outstanding handles become stale."""
        self.layout = layout
        self._fixed_layout = layout is not None
        self._ns_layouts = {}
        for node in self._iter_nodes():
            node.alive = False
            node.segment = None  # stale handles must not keep KV alive
        for root in self._roots.values():
            root.alive = False
        self._roots = {"": self._new_root("")}
        self._heap.clear()
        self._nodes = self._leaves = self._unique = self._logical = self._bytes = 0

    # ------------------------------------------------------------ reports

    def stats(self) -> TreeStats:
        pinned = sum(1 for n in self._iter_nodes() if n.pins > 0)
        return TreeStats(
            nodes=self._nodes,
            leaves=self._leaves,
            unique_tokens=self._unique,
            logical_tokens=self._logical,
            bytes=self._bytes,
            budget_bytes=self.budget_bytes,
            pinned_nodes=pinned,
            saves=self._saves,
            saved_tokens=self._saved_tokens,
            loads=self._loads,
            loaded_tokens=self._loaded_tokens,
            evictions=self._evictions,
            evicted_tokens=self._evicted_tokens,
        )

    def top_prefixes(self, k: int, head_tokens: int = 16) -> list[PrefixInfo]:
        """The k most-hit prefixes (ties: longer first)."""
        nodes = sorted(self._iter_nodes(), key=lambda n: (-n.hits, -n.end, n.uid))[:k]
        out = []
        for node in nodes:
            path = self._path_to(node)
            head = np.concatenate([p.tokens for p in path])[:head_tokens]
            nbytes = sum(p.segment.nbytes for p in path if p.segment is not None)
            out.append(PrefixInfo(node.end, node.hits, nbytes, tuple(int(t) for t in head)))
        return out

    def spill_all(self) -> list[Spill]:
        """Every node's KV, least recently used first (a child before its parent, as eviction
        would take them), for a copy to disk at shutdown. Views: use them before the tree
        changes."""
        nodes = sorted(self._iter_nodes(), key=lambda n: (n.last_used, -n.start, n.uid))
        return [self._spill(n) for n in nodes]

    def _spill(self, node: _Node) -> Spill:
        assert node.segment is not None
        path = self._path_to(node)
        cur: _Node = node
        while cur.parent is not None:
            cur = cur.parent
        return Spill(cur.ns, np.concatenate([p.tokens for p in path]), node.segment)

    # ------------------------------------------------------------ internals

    def _new_root(self, ns: str) -> _Node:
        root = self._new_node(None, np.empty(0, np.int32), 0, None)
        root.ns = ns
        return root

    def _add_root(self, ns: str) -> _Node:
        root = self._roots[ns] = self._new_root(ns)
        return root

    def _new_node(
        self, parent: _Node | None, tokens: np.ndarray, start: int, segment: KvSegment | None
    ) -> _Node:
        self._uid += 1
        return _Node(self._uid, parent, tokens, start, segment, self._clock)

    def _walk(self, q: np.ndarray, ns: str = "") -> tuple[list[_Node], int]:
        """Nodes with at least one matched token, and the match length."""
        root = self._roots.get(ns)
        if root is None:
            return [], 0
        node, pos, path = root, 0, []
        while pos < len(q):
            child = node.children.get(int(q[pos]))
            if child is None:
                break
            k = common_prefix(child.tokens, q[pos:])
            path.append(child)
            pos += k
            if k < len(child.tokens):
                break
            node = child
        return path, pos

    def _touch(self, path: list[_Node]) -> None:
        """Stamp the whole path with a new clock so a parent is never older than a child."""
        self._clock += 1
        for node in path:
            node.last_used = self._clock
        if path:
            self._push_if_evictable(path[-1])

    def _handle_of(self, match: HostMatch) -> _Handle:
        handle = match.handle
        if not isinstance(handle, _Handle) or handle.tree is not self:
            raise ValueError("match does not belong to this tree")
        return handle

    def _node_of(self, match: HostMatch) -> _Node:
        node = self._handle_of(match).node
        if not node.alive:
            raise ValueError("stale match: its path was evicted (pin matches you keep)")
        return node

    def _path_to(self, node: _Node) -> list[_Node]:
        """Non-root nodes from the top down to `node`."""
        path = []
        cur: _Node | None = node
        while cur is not None and cur.parent is not None:
            path.append(cur)
            cur = cur.parent
        path.reverse()
        return path

    def _add_pins(self, node: _Node, delta: int) -> None:
        cur: _Node | None = node
        while cur is not None:
            cur.pins += delta
            cur = cur.parent
        if delta < 0:
            self._push_if_evictable(node)

    def _check_layout(self, layout: KvLayout, ns: str) -> None:
        expected = self.layout if self._fixed_layout else self._ns_layouts.get(ns)
        if expected is None:
            self._ns_layouts[ns] = layout
            self.layout = self.layout or layout
        elif layout != expected:
            raise PayloadError("segment layout differs from the namespace's (one compat key per namespace)")

    def _split(self, node: _Node, at: int) -> _Node:
        """Split node's edge at absolute position `at`; return the new upper node.

        Both halves view the same segment buffer (no copy); tokens are copied (small)."""
        assert node.parent is not None and node.segment is not None and node.start < at < node.end
        cut = at - node.start
        upper = self._new_node(
            node.parent, node.tokens[:cut].copy(), node.start, node.segment.slice(node.start, at)
        )
        upper.pins, upper.last_used, upper.hits = node.pins, node.last_used, node.hits
        node.parent.children[int(node.tokens[0])] = upper
        node.segment = node.segment.slice(at, node.end)
        node.tokens = node.tokens[cut:].copy()
        node.start = at
        node.parent = upper
        upper.children[int(node.tokens[0])] = node
        self._nodes += 1
        self._bytes += NODE_OVERHEAD_BYTES
        return upper

    def _add_leaf(self, parent: _Node, tokens: np.ndarray, segment: KvSegment) -> None:
        leaf = self._new_node(parent, tokens, parent.end, segment)
        leaf.last_used = self._clock
        if parent.parent is not None and not parent.children:
            self._logical += leaf.end - parent.end  # parent stops being a leaf
        else:
            self._leaves += 1
            self._logical += leaf.end
        parent.children[int(tokens[0])] = leaf
        self._nodes += 1
        self._unique += len(tokens)
        self._bytes += leaf.cost()
        self._push_if_evictable(leaf)

    def _push_if_evictable(self, node: _Node) -> None:
        if self._evictable(node):
            heapq.heappush(self._heap, (node.last_used, node.uid, node))
            if len(self._heap) > 2 * self._nodes + 64:
                self._rebuild_heap()

    def _evictable(self, node: _Node) -> bool:
        return node.alive and node.parent is not None and not node.children and node.pins == 0

    def _rebuild_heap(self) -> None:
        self._heap = [(n.last_used, n.uid, n) for n in self._iter_nodes() if self._evictable(n)]
        heapq.heapify(self._heap)

    def _evict_until(self, target_bytes: int) -> None:
        while self._bytes > target_bytes and self._heap:
            last_used, _, node = heapq.heappop(self._heap)
            if self._evictable(node) and node.last_used == last_used:
                self._evict_leaf(node)

    def _evict_leaf(self, leaf: _Node) -> None:
        parent = leaf.parent
        assert parent is not None and leaf.segment is not None
        del parent.children[int(leaf.tokens[0])]
        leaf.alive = False
        self._nodes -= 1
        self._unique -= len(leaf.tokens)
        self._bytes -= leaf.cost()
        self._evictions += 1
        self._evicted_tokens += len(leaf.tokens)
        if parent.parent is not None and not parent.children:
            self._logical -= leaf.end - parent.end  # parent becomes a leaf
        else:
            self._leaves -= 1
            self._logical -= leaf.end
        self._release_buffer(leaf)
        if self.on_evict is not None:
            self.on_evict(self._spill(leaf))
        leaf.segment = None  # a stale HostMatch still points here: let the KV go anyway
        self._push_if_evictable(parent)
        if parent.parent is None and not parent.children and parent.pins == 0 and parent.ns:
            del self._roots[parent.ns]  # an emptied namespace leaves nothing behind
            parent.alive = False

    def _release_buffer(self, leaf: _Node) -> None:
        """Ancestors that view the evicted leaf's buffer (one split edge) get their own
        copy, so that buffer is really freed and `bytes` stays true."""
        assert leaf.segment is not None
        owner = leaf.segment.owner
        cur = leaf.parent
        while cur is not None and cur.segment is not None and cur.segment.owner is owner:
            cur.segment = self.copier(cur.segment)
            cur = cur.parent

    def _iter_nodes(self) -> list[_Node]:
        """All non-root nodes."""
        out, stack = [], [c for root in self._roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    # ------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """Recompute everything from the links; raise AssertionError naming what broke."""
        assert "" in self._roots, "the default namespace has no root"
        for ns, root in self._roots.items():
            assert root.alive and root.parent is None and len(root.tokens) == 0 and root.ns == ns, (
                "root malformed"
            )
        heap_keys = {(lu, uid) for lu, uid, _ in self._heap}
        nodes = leaves = unique = logical = nbytes = 0
        stack = [(root, self._layout_of(ns)) for ns, root in self._roots.items()]
        while stack:
            node, layout = stack.pop()
            self._check_node(node, heap_keys, layout)
            if node.parent is not None:
                nodes += 1
                unique += len(node.tokens)
                nbytes += node.cost()
                if not node.children:
                    leaves += 1
                    logical += node.end
            stack.extend((child, layout) for child in node.children.values())
        counted = (self._nodes, self._leaves, self._unique, self._logical, self._bytes)
        actual = (nodes, leaves, unique, logical, nbytes)
        assert counted == actual, f"counters (nodes, leaves, unique, logical, bytes) {counted} != {actual}"
        has_victim = any(self._evictable(n) for n in self._iter_nodes())
        held = nbytes + self._in_flight
        assert held <= self.budget_bytes or not has_victim, (
            f"{held} bytes (moves in flight included) over budget {self.budget_bytes}"
        )
        assert self._in_flight >= 0, "negative in-flight bytes"

    def _layout_of(self, ns: str) -> KvLayout | None:
        return self.layout if self._fixed_layout else self._ns_layouts.get(ns)

    def _check_node(self, node: _Node, heap_keys: set[tuple[int, int]], layout: KvLayout | None) -> None:
        name = f"node {node.uid} [{node.start},{node.end})"
        assert node.alive, f"{name} reachable but dead"
        assert node.own_pins >= 0 and node.pins >= 0, f"{name} negative pins"
        child_pins = sum(c.pins for c in node.children.values())
        assert node.pins == node.own_pins + child_pins, f"{name} pins {node.pins} != own + children"
        assert node.last_used <= self._clock, f"{name} last_used in the future"
        for key, child in node.children.items():
            cname = f"child {child.uid} of {name}"
            assert child.parent is node, f"{cname}: parent link broken"
            assert len(child.tokens) > 0 and int(child.tokens[0]) == key, f"{cname}: key != first token"
            assert child.start == node.end, f"{cname}: starts at {child.start}, parent ends at {node.end}"
            assert node.parent is None or child.last_used <= node.last_used, f"{cname}: newer than its parent"
        if node.parent is None:
            assert node.segment is None, "root holds a segment"
            return
        seg = node.segment
        assert seg is not None, f"{name} has no segment"
        assert seg.p0 == node.start and seg.n == len(node.tokens), f"{name} segment [{seg.p0},{seg.p1})"
        assert seg.layout == layout, f"{name} segment layout differs from its namespace's"
        assert node.tokens.dtype == np.int32 and node.tokens.ndim == 1, f"{name} tokens not int32"
        if self._evictable(node):
            assert (node.last_used, node.uid) in heap_keys, f"{name} evictable leaf missing from the LRU heap"
