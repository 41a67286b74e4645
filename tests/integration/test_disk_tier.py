"""The disk tier (docs/disk-tier.md) on a real patched llama-server with the default model.

A proxy restarted on the same directory restores a returning prompt from disk (route H,
a promotion counted) with the answer a full prefill gives (invariant 5); a corrupted
byte, a truncated file and a foreign compatibility key are each found, counted and never
imported; a writer killed in the middle of a write leaves nothing that is used; a tiny
disk budget keeps the most recently evicted prompts; a full or read-only directory only
costs counted demotion failures. References come from the stock server with
``cache_prompt: false``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.core.diskindex import HEADER_BYTES, SUFFIX, decode_header, encode_header, sha
from proxy.native.launch import ServerProcess
from proxy.server.ops.admin import tiers as tiers_of
from proxy.server.tiers.disk_files import default_key_file
from tests.helpers import ProxyThread, Reply, ServerFactory, assert_same_answer, chat_body, post, proxy_config
from tests.integration.test_proxy import convo, document

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def backend(start_server: ServerFactory, patched_bin: Path) -> ServerProcess:
    return start_server(patched_bin, n_parallel=2)


@pytest.fixture
def disk_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="radix-disk-") as tmp:
        yield Path(tmp) / "tier"  # created by the proxy


def start(backend: ServerProcess, disk: Path, **over: Any) -> ProxyThread:
    return ProxyThread(proxy_config(backend, cache_disk=disk, **over)).start()


def ask(proxy: ProxyThread, messages: list[dict[str, str]], n: int = 12) -> Reply:
    """One request; then its save, and the demotions that made room for it, are done."""
    reply = post(f"{proxy.url}/v1/chat/completions", chat_body(messages, n))
    assert reply.status == 200, reply.body
    proxy.settle()
    assert proxy.run(proxy.runtime.coordinator.disk.drain(120))  # type: ignore[union-attr]
    return reply


def reference(stock: ServerProcess, messages: list[dict[str, str]], n: int = 12) -> Reply:
    reply = post(f"{stock.url}/v1/chat/completions", chat_body(messages, n, cache_prompt=False))
    assert reply.status == 200, reply.body
    return reply


def metric(proxy: ProxyThread, name: str, **labels: str) -> float:
    return proxy.call(lambda rt: rt.metrics.value(name, **labels))


def checked(proxy: ProxyThread) -> None:
    """The RAM tree's and the disk index's invariants hold, and no slot is left busy."""
    proxy.settle()
    proxy.call(lambda rt: rt.coordinator.tree.check_invariants())
    proxy.call(lambda rt: rt.coordinator.disk.index.check_invariants())  # type: ignore[union-attr]
    busy = proxy.call(lambda rt: [s.slot_id for sv in rt.coordinator.servers for s in sv.slots if s.busy])
    assert busy == []


def entries(disk: Path) -> list[Path]:
    return sorted(p for p in disk.iterdir() if p.name.endswith(SUFFIX))


def secret(disk: Path) -> bytes:
    """The tier's MAC key, which the proxy made next to its directory."""
    return default_key_file(disk).read_bytes()


def test_a_restarted_proxy_restores_a_returning_prompt_from_disk(
    backend: ServerProcess, stock_server: ServerProcess, disk_dir: Path
) -> None:
    doc = document(71)
    first = start(backend, disk_dir)
    try:
        ask(first, convo(doc, "Which words appear most often?"))
        checked(first)
    finally:
        first.stop()  # what RAM holds is written at shutdown
    assert oct(disk_dir.stat().st_mode & 0o777) == oct(0o700)
    files = entries(disk_dir)
    assert files and all(p.stat().st_mode & 0o077 == 0 for p in files)

    again = start(backend, disk_dir)
    try:
        assert again.call(lambda rt: rt.coordinator.disk.index.stats().entries) == len(files)  # type: ignore[union-attr]
        messages = convo(doc, "Name two words that are rare.")
        got = ask(again, messages)
        # The slots' old KV is not reused (its namespace is unknown to a new proxy): the
        # prefix came from disk, through the host tree.
        assert got.headers["X-Radix-Route"] == "H", got.headers
        assert got.body["timings"]["cache_n"] > 300, got.body["timings"]
        assert metric(again, "radix_disk_promotions_total") == 1
        assert metric(again, "radix_disk_promoted_tokens_total") > 300
        # Read back into arena blocks, one per chunk: the import read them in place.
        assert again.call(lambda rt: rt.arena is not None)
        assert metric(again, "radix_arena_move_bytes_total", direction="import", path="in_place") > 0
        assert metric(again, "radix_arena_move_bytes_total", direction="import", path="staged") == 0
        assert metric(again, "radix_arena_full_total", direction="promote") == 0
        assert_same_answer(got, reference(stock_server, messages))
        checked(again)
    finally:
        again.stop()


def _children(disk: Path) -> list[Path]:
    """Entries that start past position 0 (each prompt's own part under the shared head)."""
    out = []
    for path in entries(disk):
        header = decode_header(path.read_bytes()[:HEADER_BYTES], secret(disk))
        if header.start > 0 and header.n > 100:
            out.append(path)
    return out


def _asked_once(backend: ServerProcess, disk: Path, docs: list[str]) -> list[Path]:
    """One proxy run asks about each document and writes its tree to disk at shutdown: the
    entries of each document's own part, under the shared head."""
    first = start(backend, disk)
    try:
        for doc in docs:
            ask(first, convo(doc, "Which words appear most often?"))
    finally:
        first.stop()
    return _children(disk)


def test_corrupted_truncated_and_foreign_entries_are_dropped_and_counted(
    backend: ServerProcess, stock_server: ServerProcess, disk_dir: Path
) -> None:
    docs = [document(s) for s in (72, 73, 74)]
    kids = _asked_once(backend, disk_dir, docs)
    assert len(kids) == 3, [p.name for p in entries(disk_dir)]
    flipped, cut, foreign = kids
    raw = bytearray(flipped.read_bytes())
    raw[len(raw) - 1000] ^= 0x40  # one bit of one KV byte
    flipped.write_bytes(bytes(raw))
    with open(cut, "r+b") as f:
        f.truncate(cut.stat().st_size - 7)
    raw = bytearray(foreign.read_bytes())
    header = decode_header(bytes(raw[:HEADER_BYTES]), secret(disk_dir))
    raw[:HEADER_BYTES] = encode_header(dataclasses.replace(header, key=b"\x01" * 32), secret(disk_dir))
    foreign.write_bytes(bytes(raw))

    again = start(backend, disk_dir)
    try:
        # Found at start: the truncated file (deleted) and the foreign one (left alone).
        assert metric(again, "radix_disk_dropped_total", cause="truncated") == 1
        assert metric(again, "radix_disk_dropped_total", cause="foreign_key") == 1
        assert not cut.exists() and foreign.exists()
        for doc in docs:
            messages = convo(doc, "Name two words that are rare.")
            got = ask(again, messages)
            # Only the flipped bit is found by reading: that request is prefilled, like the others
            # (a slot may still give it the chat template's first tokens: route A).
            assert "H" not in got.headers["X-Radix-Route"], got.headers
            assert got.body["timings"]["cache_n"] < 32, got.body["timings"]
            assert_same_answer(got, reference(stock_server, messages))
        assert metric(again, "radix_disk_dropped_total", cause="checksum") == 1
        assert metric(again, "radix_disk_promotions_total") == 0
        assert not flipped.exists()
        checked(again)
    finally:
        again.stop()


def test_an_entry_forged_with_another_prompts_kv_is_refused(
    backend: ServerProcess, stock_server: ServerProcess, disk_dir: Path
) -> None:
    """Issue 31 item 8: one prompt's entry given another prompt's KV, every unkeyed sum
    recomputed as anyone who can write the directory could. With sha256 sums it passed every
    check (the review saw the prompt answer with the other prompt's answer); under the MAC it is dropped (cause
    header) and the prompt is computed, equal to stock from scratch."""
    docs = [document(s) for s in (76, 77)]
    victim, donor = _asked_once(backend, disk_dir, docs)  # each document's own part
    key = secret(disk_dir)
    raw, other = bytearray(victim.read_bytes()), donor.read_bytes()
    header, donor_header = (
        decode_header(bytes(raw[:HEADER_BYTES]), key),
        decode_header(other[:HEADER_BYTES], key),
    )
    n_data = len(raw) - HEADER_BYTES - 4 * header.n
    donor_data = other[HEADER_BYTES + 4 * donor_header.n :]  # whole rows of the same row size
    data = (donor_data * (n_data // len(donor_data) + 1))[:n_data]
    raw[HEADER_BYTES + 4 * header.n :] = data
    # The header with the new data sum, closed by the sum version 1 checked (sha256 of the
    # header): everything the forger can compute without the secret.
    head = encode_header(dataclasses.replace(header, data=sha(data)), key)[: HEADER_BYTES - 32]
    raw[:HEADER_BYTES] = head + sha(head)
    victim.write_bytes(bytes(raw))

    again = start(backend, disk_dir)
    try:
        assert metric(again, "radix_disk_dropped_total", cause="header") == 1
        assert not victim.exists()
        cached = []
        for doc in docs:
            messages = convo(doc, "Name two words that are rare.")
            got = ask(again, messages)
            cached.append(got.body["timings"]["cache_n"])
            assert_same_answer(got, reference(stock_server, messages))
        # The intact document comes back from disk; the forged one only its shared head.
        assert min(cached) < 32 and max(cached) > 300, cached
        checked(again)
    finally:
        again.stop()


_SLOW_WRITER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import numpy as np
    from proxy.core.payload import KvLayout, KvSegment
    from proxy.core.radix import Spill
    from proxy.server.tiers import disk_files

    def stalled_fsync(fd):  # a disk that takes forever: the bytes are written, not yet synced
        print("writing", flush=True)
        time.sleep(120)

    os.fsync = stalled_fsync
    layout = KvLayout(1, (1,), (64,), (1,), False, (64,), (0,), (0,))
    path = np.arange(1000, dtype=np.int32)
    segment = KvSegment.from_rows(0, layout, np.full((1000, 128), 7, dtype=np.uint8))
    secret = bytes.fromhex(sys.argv[3])
    disk_files.write_entry(Path(sys.argv[1]), bytes.fromhex(sys.argv[2]), secret, Spill("", path, segment))
    """
)


def test_a_writer_killed_mid_write_leaves_nothing_that_is_used(
    backend: ServerProcess, stock_server: ServerProcess, disk_dir: Path
) -> None:
    # The key the proxy will use: learnt from a first start on the empty directory.
    first = start(backend, disk_dir)
    try:
        key = first.call(lambda rt: rt.coordinator.disk.key.hex())  # type: ignore[union-attr]
    finally:
        first.stop()
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_WRITER, str(disk_dir), key, secret(disk_dir).hex()],
        stdout=subprocess.PIPE,
        cwd=os.getcwd(),
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"writing"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)
    left = [p for p in disk_dir.iterdir()]
    assert len(left) == 1 and left[0].name.endswith(".tmp"), left  # never renamed into place

    again = start(backend, disk_dir)
    try:
        assert metric(again, "radix_disk_dropped_total", cause="partial") == 1
        assert again.call(lambda rt: rt.coordinator.disk.index.stats().entries) == 0  # type: ignore[union-attr]
        assert list(disk_dir.iterdir()) == []
        messages = convo(document(75), "Which words appear most often?")
        assert_same_answer(ask(again, messages), reference(stock_server, messages))
        checked(again)
    finally:
        again.stop()


def budgets_for(proxy: ProxyThread, first: list[dict[str, str]], prompts: float) -> int:
    """Ask `first`, measure what one prompt takes in the tree, and give RAM (and the disk, when
    there is one) room for `prompts` of them."""
    ask(proxy, first)
    one = proxy.call(lambda rt: rt.coordinator.tree.stats().bytes)
    budget = int(prompts * one)
    proxy.call(lambda rt: rt.coordinator.tree.set_budget(budget))
    return budget


def test_a_tiny_disk_budget_keeps_the_most_recently_evicted(
    backend: ServerProcess, stock_server: ServerProcess, disk_dir: Path
) -> None:
    # RAM and disk each hold two prompts and a half: of A..E, RAM keeps D and E, the disk B
    # and C (A, the least recently used, is dropped from both). C comes back from disk; A
    # is computed again. Arena blocks longer than any prompt: each prompt's own part is one
    # tree edge (with the default 256 it would be a chain of them, demoted one by one).
    proxy = start(backend, disk_dir, kv_arena_chunk=4096)
    try:
        # Each document starts the same way, so every prompt's own part hangs off one shared
        # node and eviction takes whole prompts, least recently used first.
        docs = {
            n: f"Document {n}. " + document(s) for n, s in zip("ABCDE", (81, 82, 83, 84, 85), strict=True)
        }
        budget = budgets_for(proxy, convo(docs["A"], "Which words appear most often?"), 2.5)
        proxy.call(lambda rt: rt.coordinator.disk.index.set_budget(budget))  # type: ignore[union-attr]
        for name in "BCDE":
            ask(proxy, convo(docs[name], "Which words appear most often?"))
        tiers = proxy.call(lambda rt: tiers_of(rt))
        assert tiers["disk"]["demotions"] == 3, tiers  # A, B, C
        assert tiers["disk"]["evictions"] == 1, tiers  # A
        assert tiers["disk"]["bytes"] <= budget, tiers
        messages = convo(docs["C"], "Name two words that are rare.")
        got = ask(proxy, messages)
        assert got.headers["X-Radix-Route"] in ("H", "A+H"), got.headers  # a slot may give the head
        assert got.body["timings"]["cache_n"] > 300, got.body["timings"]
        assert metric(proxy, "radix_disk_promotions_total") == 1
        assert_same_answer(got, reference(stock_server, messages))
        messages = convo(docs["A"], "Name two words that are rare.")
        got = ask(proxy, messages)
        # The oldest: gone from both tiers (a slot may still give it the template's first tokens).
        assert "H" not in got.headers["X-Radix-Route"], got.headers
        assert got.body["timings"]["cache_n"] < 32, got.body["timings"]
        assert metric(proxy, "radix_disk_promotions_total") == 1
        checked(proxy)
    finally:
        proxy.stop()


@contextlib.contextmanager
def _unwritable(kind: str) -> Iterator[Path]:
    """A directory that refuses writes: a 1 MiB tmpfs (full) or a read-only one. Mounting
    needs root; a non-root user gets a chmod 500 directory for the read-only case."""
    with tempfile.TemporaryDirectory(prefix="radix-disk-") as tmp:
        mnt = Path(tmp) / "mnt"
        mnt.mkdir(mode=0o700)
        opts = "size=1m,mode=700" if kind == "full" else "size=64m,mode=700"
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mnt)], capture_output=True)
        if mounted.returncode != 0:
            if kind == "full" or os.geteuid() == 0:
                pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
            mnt.chmod(0o500)
            yield mnt
            mnt.chmod(0o700)
            return
        try:
            if kind == "read-only":
                subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
            yield mnt
        finally:
            subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.parametrize("kind", ["full", "read-only"])
def test_a_full_or_read_only_directory_only_costs_counted_demotions(
    backend: ServerProcess, stock_server: ServerProcess, kind: str
) -> None:
    with _unwritable(kind) as mnt:
        proxy = start(backend, mnt)
        try:
            docs = [f"Document {s}. " + document(s) for s in (91, 92, 93, 94)]
            budgets_for(proxy, convo(docs[0], "Which words appear most often?"), 2.5)
            for doc in docs[1:]:  # C and D evict A and B from RAM: demotions that fail
                messages = convo(doc, "Which words appear most often?")
                assert_same_answer(ask(proxy, messages), reference(stock_server, messages))
            failures = sum(
                metric(proxy, "radix_disk_demotion_failures_total", cause=c)
                for c in ("no_space", "read_only", "permission")
            )
            assert failures >= 2, proxy.call(lambda rt: tiers_of(rt))
            assert metric(proxy, "radix_disk_demotions_total") == 0
            assert [p for p in mnt.iterdir() if p.name.endswith(".tmp")] == []  # nothing half-written left
            checked(proxy)
        finally:
            proxy.stop()
