"""The disk tier under the host tree: its file format and its in-memory index (pure).

A disk entry is one edge of the host tree demoted to disk: the KV of positions
[start, start+n) of one token path, in one file. The file is

    header   magic "RDXDISK1", u32 format version (2), u32 flags (0), key (32 bytes: sha256 of
             the servers' compatibility key), ns (32: sha256 of the namespace), u64 start,
             u64 n, u64 row bytes, prefix (32: sha256 of tokens[0:start] as int32 LE),
             tokens (32: sha256 of the entry's n token ids), data (32: sha256 of the rows)
    hmac     32 bytes: HMAC-SHA256 of the header above, keyed by the tier's secret (a key
             file outside the directory): the header holds the sums of the rest, so nobody
             without the secret can write an entry that passes, even one who knows the
             model and the prompts
    tokens   n int32 little-endian
    data     n * row bytes, opaque: whatever the tree's segment holds, row by row

so every byte is checked before it is used: the header by its keyed MAC, the token ids and
the rows by theirs, the size by the header, the servers by the key, and the place in the
tree by the prefix hash (the entry is bound to the whole path tokens[0:start+n]). No
namespace text and no token text is needed to find an entry: both are hashed.

The index keeps what the proxy needs to match a request without touching the disk: per
entry its token ids (4 bytes a token, against kilobytes of KV), its prefix hash and its
file size, with LRU order and pins (an entry being read is not evicted). A walk finds,
from where the RAM tree's match ends, the chain of entries that continues the request:
an entry starting at ``p`` applies when the request's tokens[0:p] hash to its prefix and
its tokens go on matching. A prefix shared by many branches is one entry.

Pure: numpy, struct, hashlib and hmac only. Not thread-safe: the proxy calls it from one loop.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from proxy.core.prefix import common_prefix

MAGIC = b"RDXDISK1"
FORMAT_VERSION = 2  # 2: the header's sum is an HMAC (version 1 entries are dropped once)
SUFFIX = ".kv"
_HEAD = struct.Struct("<8sII32s32sQQQ32s32s32s")
HEADER_BYTES = _HEAD.size + 32
_MAX_TOKENS = 1 << 24  # sanity bound on n: a header beyond it is garbage
_MAX_ROW = 1 << 30


class DropCause(StrEnum):
    """Why a disk entry was dropped instead of used (``radix_disk_dropped_total{cause}``)."""

    HEADER = "header"  # bad magic, unknown version, header MAC mismatch (corrupt, forged, another key)
    TRUNCATED = "truncated"  # the file is shorter (or longer) than its header says
    FOREIGN_KEY = "foreign_key"  # written for another model or KV layout (kept on disk, unused)
    TOKENS = "tokens"  # the token ids do not match their checksum or the index
    CHECKSUM = "checksum"  # the KV bytes do not match their checksum
    PARTIAL = "partial"  # a temporary file left by a writer that did not finish
    IO = "io_error"  # the file could not be read
    UNTRUSTED = (
        "untrusted"  # a link, not a regular file, or a file not ours or writable by others (kept, unused)
    )


class DemoteFailure(StrEnum):
    """Why a segment evicted from RAM did not reach the disk (``radix_disk_demotion_failures_total``)."""

    NO_SPACE = "no_space"  # ENOSPC, EDQUOT, EFBIG
    READ_ONLY = "read_only"  # EROFS
    PERMISSION = "permission"  # EACCES, EPERM
    IO = "io_error"  # any other OSError
    TIMEOUT = "timeout"  # the write ran past its deadline
    QUEUE_FULL = "queue_full"  # more bytes waiting to be written than the queue bound
    TOO_LARGE = "too_large"  # the entry alone is bigger than the disk budget


class DiskEntryError(Exception):
    """An entry failed a check; `name` is its file when known."""

    def __init__(self, cause: DropCause, message: str, name: str | None = None) -> None:
        super().__init__(f"{cause}: {message}")
        self.cause = cause
        self.name = name


def sha(data: bytes | memoryview | np.ndarray) -> bytes:
    return hashlib.sha256(data).digest()  # type: ignore[arg-type]  # an ndarray is a buffer


def ns_digest(ns: str) -> bytes:
    return sha(ns.encode())


def tokens_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def tokens_digest(tokens: Sequence[int] | np.ndarray) -> bytes:
    """sha256 of token ids as int32 LE (the same bytes as ``payload.tokens_sha256``)."""
    return sha(tokens_bytes(tokens))


def prefix_digests(tokens: np.ndarray, positions: Iterable[int]) -> dict[int, bytes]:
    """sha256 of tokens[0:p] for each p (ascending, at most len(tokens)), in one pass."""
    h = hashlib.sha256()
    out, last = {}, 0
    for p in sorted(set(positions)):
        h.update(tokens_bytes(tokens[last:p]))
        out[p] = h.copy().digest()
        last = p
    return out


@dataclass(frozen=True)
class EntryHeader:
    key: bytes  # sha256 of the compatibility key
    ns: bytes  # sha256 of the namespace
    start: int
    n: int
    row_bytes: int
    prefix: bytes  # sha256 of tokens[0:start]
    tokens: bytes  # sha256 of the entry's token ids
    data: bytes  # sha256 of the rows

    @property
    def size(self) -> int:
        """The whole file's size in bytes."""
        return HEADER_BYTES + self.n * 4 + self.n * self.row_bytes

    @property
    def name(self) -> str:
        """File name: fixed by what the entry is (key, place, tokens, bytes), so writing the
        same entry twice gives the same file."""
        ident = sha(self.key + self.ns + struct.pack("<QQ", self.start, self.n) + self.prefix + self.tokens)
        return ident.hex()[:40] + SUFFIX


def header_mac(secret: bytes, head: bytes) -> bytes:
    return hmac.new(secret, head, hashlib.sha256).digest()


def encode_header(h: EntryHeader, secret: bytes) -> bytes:
    raw = _HEAD.pack(
        MAGIC, FORMAT_VERSION, 0, h.key, h.ns, h.start, h.n, h.row_bytes, h.prefix, h.tokens, h.data
    )
    return raw + header_mac(secret, raw)


def decode_header(raw: bytes | memoryview, secret: bytes) -> EntryHeader:
    """Parse and check a header (its MAC under ``secret``, magic, version, bounds)."""
    if len(raw) < HEADER_BYTES:
        raise DiskEntryError(DropCause.TRUNCATED, f"{len(raw)} bytes, a header needs {HEADER_BYTES}")
    head = bytes(raw[: _HEAD.size])
    if not hmac.compare_digest(header_mac(secret, head), bytes(raw[_HEAD.size : HEADER_BYTES])):
        raise DiskEntryError(
            DropCause.HEADER, "header MAC mismatch: corrupt, forged or written under another key"
        )
    magic, version, flags, key, ns, start, n, row, prefix, toks, data = _HEAD.unpack(head)
    if magic != MAGIC or version != FORMAT_VERSION or flags != 0:
        raise DiskEntryError(DropCause.HEADER, f"magic {magic!r} version {version} flags {flags}")
    if not 0 < n <= _MAX_TOKENS or not 0 < row <= _MAX_ROW:
        raise DiskEntryError(DropCause.HEADER, f"n {n}, row bytes {row} out of range")
    return EntryHeader(key, ns, start, n, row, prefix, toks, data)


def make_header(
    key: bytes, ns: str, path: np.ndarray, start: int, data: np.ndarray
) -> tuple[EntryHeader, np.ndarray]:
    """The header of the entry for path[start:] whose rows are `data` (uint8 (n, row)); and the
    entry's token ids. Hashes the data: call it off the event loop for big segments."""
    toks = np.ascontiguousarray(path[start:], dtype="<i4")
    if data.ndim != 2 or data.shape[0] != len(toks) or data.dtype != np.uint8:
        raise ValueError(f"data {data.dtype} {data.shape} for {len(toks)} tokens")
    header = EntryHeader(
        key=key,
        ns=ns_digest(ns),
        start=start,
        n=len(toks),
        row_bytes=int(data.shape[1]),
        prefix=tokens_digest(path[:start]),
        tokens=sha(toks.tobytes()),
        data=sha(np.ascontiguousarray(data)),
    )
    return header, toks


def verify_entry(
    raw: bytes | memoryview, key: bytes, secret: bytes, want: EntryHeader | None = None
) -> tuple[EntryHeader, np.ndarray, np.ndarray]:
    """Check a whole file's bytes; return (header, token ids, rows (n, row_bytes) uint8 view).

    With `want` (what the index knows of the entry), the header must be exactly that."""
    h = decode_header(raw, secret)
    if h.key != key:
        raise DiskEntryError(DropCause.FOREIGN_KEY, "written for another model or KV layout")
    if want is not None and h != want:
        raise DiskEntryError(DropCause.HEADER, "the header differs from the one indexed")
    if len(raw) != h.size:
        raise DiskEntryError(DropCause.TRUNCATED, f"{len(raw)} bytes, the header says {h.size}")
    buf = np.frombuffer(raw, dtype=np.uint8)
    toks = buf[HEADER_BYTES : HEADER_BYTES + 4 * h.n]
    if sha(toks) != h.tokens:
        raise DiskEntryError(DropCause.TOKENS, "token ids do not match their checksum")
    data = buf[HEADER_BYTES + 4 * h.n :]
    if sha(data) != h.data:
        raise DiskEntryError(DropCause.CHECKSUM, "KV bytes do not match their checksum")
    return h, toks.view("<i4").astype(np.int32), data.reshape(h.n, h.row_bytes)


# ---------------------------------------------------------------- the index


@dataclass(eq=False)
class DiskEntry:
    header: EntryHeader
    tokens: np.ndarray  # int32 token ids of positions [start, end)
    last_used: int = 0
    pins: int = 0
    alive: bool = True

    @property
    def name(self) -> str:
        return self.header.name

    @property
    def start(self) -> int:
        return self.header.start

    @property
    def end(self) -> int:
        return self.header.start + self.header.n

    @property
    def nbytes(self) -> int:
        return self.header.size


@dataclass(frozen=True)
class DiskPiece:
    """Positions [a, b) of a request served by `entry` (entry.start <= a < b <= entry.end)."""

    entry: DiskEntry
    a: int
    b: int


@dataclass(frozen=True)
class DiskMatch:
    reach: int  # the request's tokens [0, reach) have KV in RAM (up to `start`) or on disk
    start: int  # where the walk began (the RAM tree's match)
    pieces: tuple[DiskPiece, ...] = field(default=())

    @property
    def gain(self) -> int:
        return self.reach - self.start


@dataclass(frozen=True)
class DiskStats:
    entries: int
    bytes: int
    budget_bytes: int
    tokens: int
    pinned: int


_Key = tuple[bytes, int, bytes, int]  # (ns, start, prefix, first token)


class DiskIndex:
    """Entries on disk by place, under a byte budget, least recently used evicted first."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._by_name: dict[str, DiskEntry] = {}
        self._by_key: dict[_Key, list[DiskEntry]] = {}
        self._starts: dict[bytes, dict[int, int]] = {}  # ns -> start -> entries starting there
        self._heap: list[tuple[int, int, DiskEntry]] = []
        self._seq = 0
        self._clock = 0
        self._bytes = 0
        self._tokens = 0

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def get(self, name: str) -> DiskEntry | None:
        return self._by_name.get(name)

    def entries(self) -> list[DiskEntry]:
        return list(self._by_name.values())

    def add(self, entry: DiskEntry) -> bool:
        """File a new entry as the most recently used; False (and a touch) when it is known."""
        known = self._by_name.get(entry.name)
        if known is not None:
            self.touch([known])
            return False
        h = entry.header
        if len(entry.tokens) != h.n or h.n == 0:
            raise ValueError(f"entry has {len(entry.tokens)} tokens, header says {h.n}")
        self._by_name[entry.name] = entry
        self._by_key.setdefault(self._key(entry), []).append(entry)
        starts = self._starts.setdefault(h.ns, {})
        starts[h.start] = starts.get(h.start, 0) + 1
        self._bytes += entry.nbytes
        self._tokens += h.n
        self.touch([entry])
        return True

    def remove(self, entry: DiskEntry) -> None:
        if not entry.alive or self._by_name.get(entry.name) is not entry:
            return
        h = entry.header
        entry.alive = False
        del self._by_name[entry.name]
        key = self._key(entry)
        bucket = self._by_key[key]
        bucket.remove(entry)
        if not bucket:
            del self._by_key[key]
        starts = self._starts[h.ns]
        starts[h.start] -= 1
        if not starts[h.start]:
            del starts[h.start]
            if not starts:
                del self._starts[h.ns]
        self._bytes -= entry.nbytes
        self._tokens -= h.n

    def touch(self, entries: Iterable[DiskEntry]) -> None:
        """Mark entries used now (one clock tick for all: they age together)."""
        self._clock += 1
        for entry in entries:
            if entry.alive:
                entry.last_used = self._clock
                self._push(entry)

    def pin(self, entries: Iterable[DiskEntry]) -> None:
        for entry in entries:
            entry.pins += 1

    def unpin(self, entries: Iterable[DiskEntry]) -> None:
        for entry in entries:
            if entry.pins <= 0:
                raise ValueError("unpin() without a matching pin()")
            entry.pins -= 1
            self._push(entry)

    def evict_for(self, nbytes: int) -> list[DiskEntry]:
        """Remove least recently used unpinned entries until `nbytes` more fit in the budget;
        return them (the caller deletes their files)."""
        out = []
        while self._bytes + nbytes > self.budget_bytes and self._heap:
            last_used, _, entry = heapq.heappop(self._heap)
            if entry.alive and entry.pins == 0 and entry.last_used == last_used:
                self.remove(entry)
                out.append(entry)
        if len(self._heap) > 2 * len(self._by_name) + 64:
            self._rebuild_heap()
        return out

    def walk(self, tokens: np.ndarray, ns: str, start: int) -> DiskMatch:
        """The chain of entries that carries the request's match on from `start` (the RAM
        tree's match), as far as it goes."""
        nsd = ns_digest(ns)
        positions = sorted(p for p in self._starts.get(nsd, {}) if p < len(tokens))
        if start >= len(tokens) or not positions or positions[0] > start:
            return DiskMatch(start, start)
        prefixes = prefix_digests(tokens, positions)
        cur, pieces = start, []
        while cur < len(tokens):
            best: tuple[DiskEntry, int] | None = None
            for p in positions:
                if p > cur:
                    break
                for entry in self._by_key.get((nsd, p, prefixes[p], int(tokens[p])), ()):
                    reach = p + common_prefix(entry.tokens, tokens[p:])
                    if reach > cur and (best is None or reach > best[1]):
                        best = (entry, reach)
            if best is None:
                break
            pieces.append(DiskPiece(best[0], cur, best[1]))
            cur = best[1]
        return DiskMatch(cur, start, tuple(pieces))

    def covers(self, path: np.ndarray, ns: str, start: int) -> DiskMatch:
        """How far the disk already holds path from `start` (a demotion skips what it holds)."""
        return self.walk(path, ns, start)

    def set_budget(self, budget_bytes: int) -> list[DiskEntry]:
        self.budget_bytes = budget_bytes
        return self.evict_for(0)

    def stats(self) -> DiskStats:
        pinned = sum(1 for e in self._by_name.values() if e.pins)
        return DiskStats(len(self._by_name), self._bytes, self.budget_bytes, self._tokens, pinned)

    def _key(self, entry: DiskEntry) -> _Key:
        h = entry.header
        return (h.ns, h.start, h.prefix, int(entry.tokens[0]))

    def _push(self, entry: DiskEntry) -> None:
        if entry.alive and entry.pins == 0:
            self._seq += 1
            heapq.heappush(self._heap, (entry.last_used, self._seq, entry))

    def _rebuild_heap(self) -> None:
        self._heap = []
        for entry in self._by_name.values():
            self._push(entry)

    def check_invariants(self) -> None:
        """Recompute the counters and the lookup tables from the entries."""
        nbytes = sum(e.nbytes for e in self._by_name.values())
        ntok = sum(e.header.n for e in self._by_name.values())
        assert (nbytes, ntok) == (self._bytes, self._tokens), "byte/token counters drifted"
        keyed = sorted(id(e) for bucket in self._by_key.values() for e in bucket)
        assert keyed == sorted(id(e) for e in self._by_name.values()), "key table and names differ"
        for key, bucket in self._by_key.items():
            for entry in bucket:
                assert entry.alive and self._key(entry) == key, f"{entry.name} filed under a wrong key"
                assert len(entry.tokens) == entry.header.n, f"{entry.name} token count"
                assert entry.header.tokens == tokens_digest(entry.tokens), f"{entry.name} tokens hash"
                assert entry.pins >= 0, f"{entry.name} negative pins"
        counts: dict[bytes, dict[int, int]] = {}
        for entry in self._by_name.values():
            per = counts.setdefault(entry.header.ns, {})
            per[entry.start] = per.get(entry.start, 0) + 1
        assert counts == self._starts, "start counts drifted"
        live = {(e.last_used, id(e)) for _, _, e in self._heap if e.alive}
        for entry in self._by_name.values():
            if entry.pins == 0:
                assert (entry.last_used, id(entry)) in live, f"{entry.name} missing from the LRU heap"
        unpinned = any(e.pins == 0 for e in self._by_name.values())
        assert self._bytes <= self.budget_bytes or not unpinned, "over budget with evictable entries"
