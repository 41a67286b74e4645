"""The disk tier's I/O on real files (proxy/server/tiers/disk.py), with a real host tree: demotion
on eviction, the copy at shutdown, the scan at start, checked promotion, atomic writes."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from proxy.core.diskindex import SUFFIX
from proxy.core.payload import KvLayout, KvSegment
from proxy.core.radix import RadixTree, Spill
from proxy.server.metrics import DiskMetrics
from proxy.server.tiers.disk import DiskTier
from proxy.server.tiers.disk_files import default_key_file, load_secret, write_entry

LAYOUT = KvLayout(1, (1,), (8,), (1,), False, (8,), (0,), (0,))
KEY = b"q" * 32


def seg(p0: int, n: int, seed: int) -> KvSegment:
    data = np.random.default_rng(seed).integers(0, 256, (n, 16), dtype=np.uint8)
    return KvSegment.from_rows(p0, LAYOUT, data)


def toks(first: int, n: int) -> np.ndarray:
    return np.arange(first, first + n, dtype=np.int32)


async def opened(
    directory: Path,
    budget: int = 1 << 30,
    key: bytes = KEY,
    key_file: Path | None = None,
    layout: KvLayout = LAYOUT,
    **arena: Any,
) -> DiskTier:
    """An opened tier; ``arena``: DiskTier's arena, chunk_tokens and on_arena_full."""
    tier = DiskTier(
        directory,
        budget,
        key,
        layout,
        DiskMetrics(CollectorRegistry()),
        min_tokens=4,
        queue_bytes=1 << 20,
        timeout_s=10,
        key_file=key_file,
        **arena,
    )
    await tier.open()
    return tier


async def written(tier: DiskTier) -> None:
    while tier._queue or tier._queued:
        await asyncio.sleep(0.01)


def test_evicted_kv_comes_back_from_disk_in_a_new_process_byte_for_byte(tmp_path: Path) -> None:
    async def main() -> None:
        tier = await opened(tmp_path / "tier")
        tree = RadixTree(budget_bytes=40 * 20 + 600, layout=LAYOUT)  # one 40-token prompt
        tree.on_evict = tier.demote
        a, b = toks(100, 40), toks(900, 40)
        sa = seg(0, 40, 1)
        tree.insert(a, sa)
        tree.insert(b, seg(0, 40, 2))  # evicts a: demoted
        await written(tier)
        assert tier.index.stats().entries == 1
        await tier.close(tree, 10)  # b is copied at shutdown
        files = sorted(p for p in (tmp_path / "tier").iterdir())
        assert len(files) == 2 and all(p.name.endswith(SUFFIX) for p in files)
        assert all(p.stat().st_mode & 0o777 == 0o600 for p in files)
        assert (tmp_path / "tier").stat().st_mode & 0o777 == 0o700

        again = await opened(tmp_path / "tier")
        fresh = RadixTree(budget_bytes=1 << 20, layout=LAYOUT)
        query = np.concatenate([a, toks(5000, 3)])
        assert await again.promote(fresh, query, "", floor=0) == 40
        match = fresh.match(query)
        assert match.length == 40
        assert KvSegment.concat(fresh.segments(match)) == sa
        assert await again.promote(fresh, query, "", floor=0) == 0  # now in RAM: nothing to do
        assert await again.promote(fresh, toks(900, 40), "other-namespace") == 0
        fresh.check_invariants()
        again.index.check_invariants()
        await again.close(None, 10)

    asyncio.run(main())


def test_a_shared_prefix_is_written_once(tmp_path: Path) -> None:
    async def main() -> None:
        tier = await opened(tmp_path / "tier")
        tree = RadixTree(budget_bytes=1 << 20, layout=LAYOUT)
        a = toks(100, 40)
        b = np.concatenate([a[:30], toks(700, 10)])
        tree.insert(a, seg(0, 40, 1))
        tree.insert(b, seg(30, 10, 2))
        await tier.close(tree, 10)  # nodes [0,30), [30,40) of a and [30,40) of b
        again = await opened(tmp_path / "tier")
        st = again.index.stats()
        assert (st.entries, st.tokens) == (3, 50)
        again.index.check_invariants()
        await again.close(None, 10)

    asyncio.run(main())


def test_a_damaged_entry_is_dropped_when_promoted_and_nothing_is_inserted(tmp_path: Path) -> None:
    async def main() -> None:
        tier = await opened(tmp_path / "tier")
        tree = RadixTree(budget_bytes=1 << 20, layout=LAYOUT)
        a = toks(100, 40)
        tree.insert(a, seg(0, 40, 1))
        await tier.close(tree, 10)
        (path,) = (tmp_path / "tier").iterdir()
        raw = bytearray(path.read_bytes())
        raw[-3] ^= 0xFF
        path.write_bytes(bytes(raw))
        again = await opened(tmp_path / "tier")
        fresh = RadixTree(budget_bytes=1 << 20, layout=LAYOUT)
        assert await again.promote(fresh, a, "") == 0
        assert fresh.match(a).length == 0
        assert again.metrics.dropped.labels("checksum")._value.get() == 1
        assert not path.exists() and again.index.stats().entries == 0
        fresh.check_invariants()
        again.index.check_invariants()
        await again.close(None, 10)

    asyncio.run(main())


def test_temporary_and_foreign_files_at_start(tmp_path: Path) -> None:
    async def main() -> None:
        d = tmp_path / "tier"
        d.mkdir(mode=0o700)
        write_entry(
            d, b"z" * 32, load_secret(default_key_file(d)), Spill("", toks(0, 20), seg(0, 20, 3))
        )  # another model's
        (d / ".abc.kv.1234.tmp").write_bytes(b"half a segment")  # a writer killed mid-write
        tier = await opened(d)
        assert tier.index.stats().entries == 0
        assert tier.metrics.dropped.labels("foreign_key")._value.get() == 1
        assert tier.metrics.dropped.labels("partial")._value.get() == 1
        assert [p.name.endswith(SUFFIX) for p in d.iterdir()] == [True]  # the foreign one is kept
        await tier.close(None, 10)

    asyncio.run(main())


def test_a_write_error_is_counted_and_serving_state_is_unchanged(tmp_path: Path) -> None:
    async def main() -> None:
        tier = await opened(tmp_path / "tier")
        (tmp_path / "tier").rename(tmp_path / "gone")  # every write now fails (ENOENT)
        tree = RadixTree(budget_bytes=40 * 20 + 600, layout=LAYOUT)
        tree.on_evict = tier.demote
        tree.insert(toks(100, 40), seg(0, 40, 1))
        tree.insert(toks(900, 40), seg(0, 40, 2))  # evicts the first: its demotion fails
        await written(tier)
        assert tier.metrics.demotion_failures.labels("io_error")._value.get() == 1
        assert tier.metrics.demotions._value.get() == 0 and tier.index.stats().entries == 0
        assert tree.match(toks(900, 40)).length == 40
        tree.check_invariants()
        tier.index.check_invariants()
        await tier.close(None, 10)

    asyncio.run(main())


def test_a_directory_that_cannot_be_made_leaves_the_tier_unusable(tmp_path: Path) -> None:
    async def main() -> None:
        (tmp_path / "file").write_text("not a directory")
        tier = await opened(tmp_path / "file" / "tier")
        assert not tier.usable
        tree = RadixTree(budget_bytes=1 << 20, layout=LAYOUT)
        assert await tier.promote(tree, toks(0, 40), "") == 0
        await tier.close(tree, 10)

    asyncio.run(main())


def test_a_directory_others_can_write_or_a_link_leaves_the_tier_unusable(tmp_path: Path) -> None:
    # Entry sums are not keyed: in a directory another user can write, they could be forged
    # (two entries' KV swapped gave one prompt the other's answer). Before: a warning only.
    async def main() -> None:
        loose = tmp_path / "loose"
        loose.mkdir()
        loose.chmod(0o777)
        victim = tmp_path / "victim"
        victim.mkdir(mode=0o700)
        link = tmp_path / "link"
        link.symlink_to(victim)
        for directory in (loose, link):
            tier = await opened(directory)
            assert not tier.usable, directory
            await tier.close(None, 10)

    asyncio.run(main())


def test_entries_that_are_links_or_others_are_neither_used_nor_deleted(tmp_path: Path) -> None:
    async def main() -> None:
        d, elsewhere = tmp_path / "tier", tmp_path / "elsewhere"
        d.mkdir(mode=0o700)
        elsewhere.mkdir(mode=0o700)
        secret = load_secret(default_key_file(d))
        real = write_entry(elsewhere, KEY, secret, Spill("", toks(0, 20), seg(0, 20, 3)))
        (d / real.name).symlink_to(elsewhere / real.name)  # a valid entry, but through a link
        loose = write_entry(d, KEY, secret, Spill("", toks(500, 20), seg(0, 20, 4)))
        (d / loose.name).chmod(0o666)  # one anybody could have rewritten
        tier = await opened(d)
        assert tier.index.stats().entries == 0
        assert tier.metrics.dropped.labels("untrusted")._value.get() == 2
        assert sorted(p.name for p in d.iterdir()) == sorted([real.name, loose.name])
        assert (elsewhere / real.name).exists()
        await tier.close(None, 10)

    asyncio.run(main())


def test_the_mac_key_is_made_once_outside_the_directory_and_kept(tmp_path: Path) -> None:
    async def main() -> None:
        d = tmp_path / "tier"
        tier = await opened(d)
        key_file = tmp_path / "tier.key"
        assert tier.usable and key_file.is_file() and (key_file.stat().st_mode & 0o777) == 0o600
        assert len(key_file.read_bytes()) == 32 and not any(p.name.endswith(".key") for p in d.iterdir())
        write_entry(d, KEY, tier.secret, Spill("", toks(0, 20), seg(0, 20, 3)))
        await tier.close(None, 10)
        again = await opened(d)  # the same key: the entry is used
        assert again.secret == tier.secret and again.index.stats().entries == 1
        await again.close(None, 10)

    asyncio.run(main())


def test_entries_signed_with_another_key_are_dropped(tmp_path: Path) -> None:
    async def main() -> None:
        d = tmp_path / "tier"
        d.mkdir(mode=0o700)
        write_entry(d, KEY, b"not our secret, 32 bytes long...", Spill("", toks(0, 20), seg(0, 20, 3)))
        tier = await opened(d)
        assert tier.usable and tier.index.stats().entries == 0
        assert tier.metrics.dropped.labels("header")._value.get() == 1
        assert not any(p.name.endswith(SUFFIX) for p in d.iterdir())  # deleted: it cannot be ours
        await tier.close(None, 10)

    asyncio.run(main())


def test_a_key_file_that_is_a_link_or_readable_by_others_leaves_the_tier_unusable(tmp_path: Path) -> None:
    async def main() -> None:
        loose, linked = tmp_path / "loose", tmp_path / "linked"
        key = tmp_path / "loose.key"
        key.write_bytes(b"k" * 32)
        key.chmod(0o644)
        (tmp_path / "elsewhere.key").write_bytes(b"k" * 32)
        (tmp_path / "linked.key").symlink_to(tmp_path / "elsewhere.key")
        short = tmp_path / "short.key"
        short.write_bytes(b"k" * 8)
        short.chmod(0o600)
        for directory, key_file in ((loose, None), (linked, None), (tmp_path / "short", short)):
            tier = await opened(directory, key_file=key_file)
            assert not tier.usable, directory
            await tier.close(None, 10)

    asyncio.run(main())
