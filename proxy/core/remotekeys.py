"""The remote tier's keys, entries and pricing (pure): chunks of KV shared through a store.

A remote entry is one chunk of the host tree's KV, positions [a, b) of one token path, where
a and b are multiples of the arena's block size (the chunks an export is cut into). Its value
is a disk-tier entry, byte for byte (``diskindex``: header with the model's compatibility
key, the namespace's digest, the place, the sums of the path before it, of its own token ids
and of its rows, all under an HMAC keyed by the tier's secret), so one scheme checks both
tiers. Its key is

    <prefix>:<40 hex of HMAC-SHA256(secret, "RDXREM1" | compat key | ns digest | sha256(tokens[0:b]))>

i.e. the hash chain of the token blocks up to the chunk's end, bound to the model and the
isolation namespace. Keyed by the secret, so a store's reader without it learns nothing of
which prompts are there (it cannot compute a prompt's key), and a writer without it cannot
make an entry that verifies. A chunk found is used only where its header is exactly the one
the request expects (place, path, tokens): a forged, swapped or stale value is refused.

Pure: numpy, hashlib and hmac only.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from proxy.core.diskindex import (
    DiskEntryError,
    DropCause,
    encode_header,
    make_header,
    ns_digest,
    prefix_digests,
    tokens_digest,
    verify_entry,
)

KEY_TAG = b"RDXREM1"


class RemoteFallback(StrEnum):
    """Why a request did not read what the store may hold (``radix_remote_fallbacks_total``)."""

    TIMEOUT = "timeout"  # a store call ran past its deadline
    CONNECTION = "connection"  # the store refused or dropped the connection
    ERROR = "error"  # any other error of the store (a full store refusing writes, a bad reply)
    DOWN = "down"  # the store failed recently: not asked until its backoff ends
    MISSING = "missing"  # a chunk announced by the lookup was gone when read (evicted, flushed)
    REFUSED = "refused"  # a chunk failed a check (MAC, key, place, tokens, size, sum)
    PRICED_OUT = "priced_out"  # reading would take longer than computing it (measured rates)


class WriteDrop(StrEnum):
    """Why a chunk did not reach the store (``radix_remote_write_dropped_total``)."""

    QUEUE_FULL = "queue_full"  # more bytes waiting than the queue's cap
    TIMEOUT = "timeout"
    CONNECTION = "connection"
    ERROR = "error"
    DOWN = "down"  # the store failed recently: not written until its backoff ends


@dataclass(frozen=True)
class ChunkRef:
    """Positions [a, b) of a request, filed under `key`; `prefix` and `tokens` are what its
    header must say (sha256 of tokens[0:a] and of tokens[a:b])."""

    a: int
    b: int
    key: str
    prefix: bytes
    tokens: bytes


def chunk_spans(start: int, end: int, chunk: int) -> list[tuple[int, int]]:
    """The whole chunks of [0, end) from the one that holds position `start` on."""
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, not {chunk}")
    a = (max(0, start) // chunk) * chunk
    out = []
    while a + chunk <= end:
        out.append((a, a + chunk))
        a += chunk
    return out


def chunk_key(secret: bytes, compat: bytes, ns: str, path_digest: bytes, prefix: str) -> str:
    mac = hmac.new(secret, KEY_TAG + compat + ns_digest(ns) + path_digest, hashlib.sha256)
    return f"{prefix}:{mac.hexdigest()[:40]}"


def chunk_refs(
    tokens: np.ndarray,
    ns: str,
    compat: bytes,
    secret: bytes,
    spans: list[tuple[int, int]],
    prefix: str,
) -> list[ChunkRef]:
    """The keys and expected sums of `spans` of `tokens` (one pass over the tokens)."""
    if not spans:
        return []
    digests = prefix_digests(
        tokens, {p for span in spans for p in span}
    )  # 0 included when a span starts there
    return [
        ChunkRef(
            a,
            b,
            chunk_key(secret, compat, ns, digests[b], prefix),
            digests[a],
            tokens_digest(tokens[a:b]),
        )
        for a, b in spans
    ]


def encode_chunk(compat: bytes, secret: bytes, ns: str, path: np.ndarray, rows: np.ndarray) -> bytes:
    """The stored value of the chunk whose KV rows (uint8 (n, row bytes)) are those of
    path[len(path)-n:]: a disk-tier entry (header, MAC, token ids, rows)."""
    start = len(path) - rows.shape[0]
    header, toks = make_header(compat, ns, path, start, rows)
    return encode_header(header, secret) + toks.tobytes() + np.ascontiguousarray(rows).tobytes()


def verify_chunk(
    raw: bytes | memoryview, ref: ChunkRef, compat: bytes, secret: bytes, ns: str, row_bytes: int
) -> np.ndarray:
    """The chunk's rows (uint8 (n, row_bytes) view of `raw`), once every byte is checked: the
    header's MAC under `secret`, the model's key, the namespace, the place, the path before it
    and its own token ids as the request has them, the row size, the length, the rows' sum.
    DiskEntryError (with its DropCause) otherwise."""
    h, toks, rows = verify_entry(raw, compat, secret)
    if h.ns != ns_digest(ns):
        raise DiskEntryError(DropCause.HEADER, "filed for another namespace")
    if (h.start, h.start + h.n) != (ref.a, ref.b) or h.prefix != ref.prefix:
        raise DiskEntryError(DropCause.HEADER, f"holds [{h.start},{h.start + h.n}), not [{ref.a},{ref.b})")
    if h.tokens != ref.tokens or tokens_digest(toks) != ref.tokens:
        raise DiskEntryError(DropCause.TOKENS, "token ids differ from the request's")
    if h.row_bytes != row_bytes:
        raise DiskEntryError(DropCause.HEADER, f"rows of {h.row_bytes} bytes, the servers' are {row_bytes}")
    return rows


@dataclass
class StoreRate:
    """The store's read rate (bytes/s, an exponentially weighted mean of measured reads) and
    whether a read is worth it: it must be quicker than computing the tokens and end before
    the deadline. Starts from a prior a local network reaches easily."""

    bytes_per_s: float = 200e6
    round_trip_s: float = 0.002
    weight: float = 0.25
    seen: int = 0

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes < (1 << 20) or seconds <= 0:  # small reads are mostly round trips
            return
        self.bytes_per_s += self.weight * (nbytes / seconds - self.bytes_per_s)
        self.seen += 1

    def read_s(self, nbytes: int, round_trips: int = 2) -> float:
        return round_trips * self.round_trip_s + nbytes / self.bytes_per_s

    def worth(self, nbytes: int, tokens: int, prefill_s_per_token: float, deadline_s: float) -> bool:
        cost = self.read_s(nbytes)
        return cost < tokens * prefill_s_per_token and cost < deadline_s
