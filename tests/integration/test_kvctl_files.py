"""Payload files of KV moves (issue 14), on a real patched server.

The server maps export files (created, and their pages allocated, before its main loop
writes the KV into them, or the caller's own file written in place) and reads import files
in place; the proxy's mover keeps one file per direction for the next move and removes any
file whose move was not answered.
These tests prove that no file is left behind or reused too early, and that moves through
the files stay byte-exact.
"""

from __future__ import annotations

import asyncio
import base64
import os
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from proxy.core.payload import KvLayout, KvSegment, tokens_sha256
from proxy.errors import FallbackCause, KvMoveError
from proxy.native.launch import ServerProcess
from proxy.server.dataplane.backend import ServerClient
from proxy.server.dataplane.mover import KvMover
from proxy.server.metrics import Metrics
from tests.helpers import ServerFactory, prefill_slot, request

PROMPT = (
    "A lighthouse keeper kept a notebook of every ship that passed his island: its name, its flag, "
    "the hour, the weather and what it carried if he could tell. Over forty years the notebook "
    "grew into eleven volumes, and the harbour office borrowed them whenever a question came up "
    "about an old voyage, a lost cargo or a family looking for a sailor. "
) * 3


@pytest.fixture(scope="module")
def server(start_server: ServerFactory, patched_bin: Path) -> ServerProcess:
    return start_server(patched_bin, threads=1)


def _kv(server: ServerProcess, method: str, path: str, body: object = None) -> tuple[int, object]:
    reply = request(
        server.url + path,
        method,
        body,
        headers={"Authorization": f"Bearer {server.spec.kvctl_key}"},
        timeout=120,
    )
    return reply.status, reply.body


def _prefill(server: ServerProcess, slot: int) -> list[int]:
    return prefill_slot(server, slot, PROMPT)


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _inline_export(server: ServerProcess, slot: int, tokens: list[int]) -> tuple[dict[str, object], bytes]:
    """The reply and payload of an inline export of ``[0, len(tokens))`` of ``slot``."""
    body = {"slot": slot, "p0": 0, "p1": len(tokens), "expect_sha256": tokens_sha256(tokens)}
    status, reply = _kv(server, "POST", "/kvctl/export", body)
    assert status == 200 and isinstance(reply, dict), reply
    return reply, base64.b64decode(reply["data"])


def test_export_files_are_complete_or_absent(server: ServerProcess) -> None:
    """An export that fails after its file was prepared leaves no file, temporary or final;
    one that succeeds leaves exactly its file, equal to the inline payload."""
    directory = server.spec.kvctl_dir
    assert directory is not None
    tokens = _prefill(server, 0)
    n = len(tokens)
    before = _files(directory)

    # 409: the tokens named are not the ones held (checked on the main loop, after the file exists).
    # The file is gone when the answer arrives, not later when the main loop drops its task
    # (a race CI once lost): checked right after each of several answers.
    for _ in range(5):
        status, _ = _kv(
            server,
            "POST",
            "/kvctl/export",
            {"slot": 0, "p0": 0, "p1": n, "expect_sha256": tokens_sha256(tokens[::-1]), "file": "gone.kv"},
        )
        assert status == 409
        assert _files(directory) == before
    # 400: a range the slot does not hold
    status, _ = _kv(
        server,
        "POST",
        "/kvctl/export",
        {"slot": 1, "p0": 0, "p1": n, "expect_sha256": tokens_sha256(tokens), "file": "gone.kv"},
    )
    assert status in (400, 409)
    assert _files(directory) == before

    body = {"slot": 0, "p0": 0, "p1": n, "expect_sha256": tokens_sha256(tokens)}
    status, inline = _kv(server, "POST", "/kvctl/export", body)
    assert status == 200 and isinstance(inline, dict)
    status, res = _kv(server, "POST", "/kvctl/export", {**body, "file": "ok.kv"})
    assert status == 200 and isinstance(res, dict) and res["file"] == "ok.kv"
    assert isinstance(res["t_ms"], float | int) and res["t_ms"] >= 0
    assert _files(directory) == sorted([*before, "ok.kv"])
    assert (directory / "ok.kv").read_bytes() == base64.b64decode(inline["data"])
    (directory / "ok.kv").unlink()


async def _mover_moves(server: ServerProcess, tokens: list[int]) -> None:
    directory = server.spec.kvctl_dir
    assert directory is not None
    async with aiohttp.ClientSession() as session:
        backend = ServerClient(server.url, session, server.spec.kvctl_key)
        caps = await backend.caps()
        compat = dict(caps.compat)
        mover = KvMover(
            backend, KvLayout.from_caps(compat), compat, directory, Metrics(CollectorRegistry(), ("s0",))
        )
        before = set(_files(directory))
        n = len(tokens)
        (segment,) = await mover.export({"slot": 0}, 0, tokens)

        def new_files() -> list[str]:
            return sorted(set(_files(directory)) - before)

        # The export file is kept for the next export (the server writes it in place).
        out = new_files()
        assert len(out) == 1 and out[0].startswith("radix-")
        # A shorter export goes through the same file: what it returns is what the server wrote
        # this time (a stale or misread file would hold the previous [0, n) payload).
        (head,) = await mover.export({"slot": 0}, 0, tokens[: n // 3])
        assert head == segment.slice(0, n // 3)
        assert new_files() == out

        # Two imports (one of two segments) go through one file, kept for the next import.
        await mover.import_(1, 0, tokens, [segment])
        kept = sorted(set(new_files()) - set(out))
        assert len(kept) == 1 and kept[0].startswith("radix-")
        half = n // 2
        await mover.import_(2, 0, tokens, [segment.slice(0, half), segment.slice(half, n)])
        assert new_files() == sorted([*out, *kept])
        # Byte-exact: what the slots hold now re-exports to the very rows that went in.
        for slot in (1, 2):
            (again,) = await mover.export({"slot": slot}, 0, tokens)
            assert isinstance(again, KvSegment) and again == segment
        assert new_files() == sorted([*out, *kept])
        # An export the server refuses (the tokens named are not the ones slot 1 holds): its
        # file is removed, never read or reused.
        with pytest.raises(KvMoveError) as err:
            await mover.export({"slot": 1}, 0, tokens[::-1])
        assert err.value.cause == FallbackCause.CONFLICT
        assert new_files() == kept
        # An import the server refuses (slot 3 does not hold the [0, p0) it builds on): the
        # file it used is removed, never written again.
        with pytest.raises(KvMoveError) as err:
            await mover.import_(3, half, tokens, [segment.slice(half, n)])
        assert err.value.cause == FallbackCause.CONFLICT
        assert new_files() == []
        await mover.import_(3, 0, tokens, [segment])
        assert await mover.export({"slot": 3}, 0, tokens) == [segment]
        files = new_files()
        assert len(files) == 2 and not set(files) & {*out, *kept}
        mover.close()
        assert new_files() == []


def test_export_in_place(server: ServerProcess) -> None:
    """``in_place`` writes the payload into the first bytes of the caller's existing file, in
    place (no new file, the rest untouched), and says so; a file that is missing, too small
    or a symlink is a 400 and nothing is written."""
    directory = server.spec.kvctl_dir
    assert directory is not None
    tokens = _prefill(server, 0)
    n = len(tokens)
    body = {"slot": 0, "p0": 0, "p1": n, "expect_sha256": tokens_sha256(tokens)}
    status, inline = _kv(server, "POST", "/kvctl/export", body)
    assert status == 200 and isinstance(inline, dict)
    payload = base64.b64decode(inline["data"])
    before = _files(directory)

    target = directory / "mine.kv"
    target.write_bytes(b"\xaa" * (len(payload) + 100))
    inode = target.stat().st_ino
    status, res = _kv(server, "POST", "/kvctl/export", {**body, "file": "mine.kv", "in_place": True})
    assert status == 200 and isinstance(res, dict), res
    assert res["in_place"] is True and res["size"] == len(payload) and res["file"] == "mine.kv"
    assert target.stat().st_ino == inode
    assert target.read_bytes() == payload + b"\xaa" * 100

    small = directory / "small.kv"
    small.write_bytes(b"\0" * (len(payload) - 1))
    (directory / "link.kv").symlink_to(target)
    for name in ("missing.kv", "small.kv", "link.kv"):
        status, err = _kv(server, "POST", "/kvctl/export", {**body, "file": name, "in_place": True})
        assert status == 400, (name, err)
    assert small.read_bytes() == b"\0" * (len(payload) - 1)
    assert target.read_bytes() == payload + b"\xaa" * 100
    status, _ = _kv(server, "POST", "/kvctl/export", {**body, "file": "mine.kv", "in_place": 1})
    assert status == 400
    # without in_place the file is replaced by a new one, as before
    status, res = _kv(server, "POST", "/kvctl/export", {**body, "file": "mine.kv"})
    assert status == 200 and isinstance(res, dict) and res["in_place"] is False
    assert target.read_bytes() == payload and target.stat().st_ino != inode
    for name in ("mine.kv", "small.kv", "link.kv"):
        (directory / name).unlink()
    assert _files(directory) == before


def _chunks_of(p0: int, p1: int, c: int) -> list[tuple[int, int]]:
    """[p0, p1) cut at the multiples of ``c``."""
    out = []
    c0 = p0
    while c0 < p1:
        c1 = min(p1, (c0 // c + 1) * c)
        out.append((c0, c1))
        c0 = c1
    return out


def _range_export(server: ServerProcess, slot: int, tokens: list[int], p0: int, p1: int) -> bytes:
    """The payload of an inline export of ``[p0, p1)`` of ``slot``."""
    body = {"slot": slot, "p0": p0, "p1": p1, "expect_sha256": tokens_sha256(tokens[:p1])}
    status, reply = _kv(server, "POST", "/kvctl/export", body)
    assert status == 200 and isinstance(reply, dict), reply
    return base64.b64decode(reply["data"])


def test_export_in_chunks_at_offsets(server: ServerProcess) -> None:
    """Patch 0020: an in-place export with ``chunk`` cuts ``[p0, p1)`` at the multiples of
    ``chunk`` and writes each part as its own payload at its entry of ``offsets`` (any order,
    gaps untouched), equal byte for byte to an export of that part alone; without
    ``offsets`` the parts lie back to back from offset 0."""
    directory = server.spec.kvctl_dir
    assert directory is not None
    tokens = _prefill(server, 0)
    n, p0, c = len(tokens), 5, 64
    assert n > 3 * c, n
    parts = _chunks_of(p0, n, c)
    refs = [_range_export(server, 0, tokens, c0, c1) for c0, c1 in parts]
    before = _files(directory)

    # the parts in reverse order, with gaps between them and around them
    offsets = [0] * len(parts)
    end = 100
    for i in reversed(range(len(parts))):
        offsets[i] = end
        end += len(refs[i]) + 37 * (i + 1)
    target = directory / "chunks.kv"
    target.write_bytes(b"\xaa" * (end + 50))
    inode = target.stat().st_ino
    body = {"slot": 0, "p0": p0, "p1": n, "expect_sha256": tokens_sha256(tokens), "file": "chunks.kv"}
    status, res = _kv(
        server, "POST", "/kvctl/export", {**body, "in_place": True, "chunk": c, "offsets": offsets}
    )
    assert status == 200 and isinstance(res, dict), res
    assert res["in_place"] is True and res["file"] == "chunks.kv"
    assert res["chunks"] == [[c0, c1, o, len(r)] for (c0, c1), o, r in zip(parts, offsets, refs, strict=True)]
    assert res["size"] == sum(len(r) for r in refs) and res["n_cells"] == n - p0
    assert target.stat().st_ino == inode and target.stat().st_size == end + 50
    data = target.read_bytes()
    expect = bytearray(b"\xaa" * (end + 50))
    for o, r in zip(offsets, refs, strict=True):
        expect[o : o + len(r)] = r
    assert data == bytes(expect)

    # without offsets: back to back from 0, the rest untouched
    status, res = _kv(server, "POST", "/kvctl/export", {**body, "in_place": True, "chunk": c})
    assert status == 200 and isinstance(res, dict), res
    packed = b"".join(refs)
    assert target.read_bytes() == packed + bytes(expect[len(packed) :])
    assert [ch[2] for ch in res["chunks"]] == [sum(len(r) for r in refs[:i]) for i in range(len(refs))]

    # a plain in-place export is one chunk at 0, as before; so is a chunk as long as the range
    _, whole = _inline_export(server, 0, tokens)
    for extra, at in (({}, 0), ({"chunk": n}, 0), ({"offsets": [7]}, 7)):
        target.write_bytes(b"\xbb" * (len(whole) + 20))
        status, res = _kv(server, "POST", "/kvctl/export", {**body, "p0": 0, "in_place": True, **extra})
        assert status == 200 and isinstance(res, dict), (extra, res)
        assert res["chunks"] == [[0, n, at, len(whole)]] and res["size"] == len(whole)
        assert target.read_bytes() == b"\xbb" * at + whole + b"\xbb" * (20 - at)
    target.unlink()
    assert _files(directory) == before


def test_chunk_payloads_import_as_segments(server: ServerProcess) -> None:
    """The parts of a chunked export are complete payloads: imported into another slot as
    file segments (at their offsets, in position order) they give back the same KV, byte for
    byte, and the same next token."""
    directory = server.spec.kvctl_dir
    assert directory is not None
    tokens = _prefill(server, 0)
    n, c = len(tokens), 64
    inline, whole = _inline_export(server, 0, tokens)
    parts = _chunks_of(0, n, c)
    sizes = [len(_range_export(server, 0, tokens, c0, c1)) for c0, c1 in parts]
    offsets = [0] * len(parts)
    end = 0
    for i in reversed(range(len(parts))):
        offsets[i] = end
        end += sizes[i] + 11
    target = directory / "parts.kv"
    target.write_bytes(b"\0" * end)
    body = {"slot": 0, "p0": 0, "p1": n, "expect_sha256": tokens_sha256(tokens), "file": "parts.kv"}
    status, res = _kv(
        server, "POST", "/kvctl/export", {**body, "in_place": True, "chunk": c, "offsets": offsets}
    )
    assert status == 200 and isinstance(res, dict), res

    status, erased = _kv(server, "POST", "/kvctl/erase", {"slot": 1})
    assert status == 200, erased
    segments = [{"file": "parts.kv", "offset": o, "size": s} for o, s in zip(offsets, sizes, strict=True)]
    status, res = _kv(
        server,
        "POST",
        "/kvctl/import",
        {"slot": 1, "p0": 0, "p1": n, "tokens": tokens, "compat": inline["compat"], "segments": segments},
    )
    assert status == 200 and isinstance(res, dict), res
    assert res["n_cells"] == n
    assert _inline_export(server, 1, tokens)[1] == whole

    def continuation(slot: int) -> tuple[str, int]:
        reply = request(
            server.url + "/completion",
            "POST",
            {"prompt": PROMPT, "n_predict": 4, "id_slot": slot, "cache_prompt": True, "temperature": 0},
            timeout=300,
        )
        assert reply.status == 200 and isinstance(reply.body, dict), reply.body
        return str(reply.body["content"]), int(reply.body["timings"]["cache_n"])

    imported = continuation(1)
    assert imported == continuation(0) and imported[1] >= n - 1, imported
    target.unlink()


def test_bad_chunks_are_refused_and_leave_the_file(server: ServerProcess) -> None:
    """Wrong ``chunk`` or ``offsets`` are a 400 before anything is written: the caller's file
    keeps its bytes and inode, no file appears."""
    directory = server.spec.kvctl_dir
    assert directory is not None
    tokens = _prefill(server, 0)
    n, c = len(tokens), 64
    status, caps = _kv(server, "GET", "/kvctl/caps")
    assert status == 200 and isinstance(caps, dict)
    n_ctx_slot = int(caps["n_ctx_slot"])
    parts = _chunks_of(0, n, c)
    sizes = [len(_range_export(server, 0, tokens, c0, c1)) for c0, c1 in parts]
    k = len(parts)
    good = [sum(sizes[:i]) for i in range(k)]
    target = directory / "keep.kv"
    content = os.urandom(sum(sizes) + 10)
    target.write_bytes(content)
    inode = target.stat().st_ino
    before = _files(directory)
    body = {"slot": 0, "p0": 0, "p1": n, "expect_sha256": tokens_sha256(tokens), "file": "keep.kv"}
    placed = {**body, "in_place": True, "chunk": c}

    cases: dict[str, tuple[dict[str, object], str]] = {
        "too few offsets": ({**placed, "offsets": good[:-1]}, f"need {k} ("),
        "too many offsets": ({**placed, "offsets": [*good, 0]}, f"need {k} ("),
        "offsets for the whole range": ({**body, "in_place": True, "offsets": good}, "need 1 ("),
        "past the end": ({**placed, "offsets": [*good[:-1], len(content) - sizes[-1] + 1]}, "at least"),
        "far past the end": ({**placed, "offsets": [*good[:-1], 1 << 62]}, "at least"),
        "overlap": ({**placed, "offsets": [good[1] - 1, good[1], *good[2:]]}, "overlap"),
        "same offset": ({**placed, "offsets": [good[1], *good[1:]]}, "overlap"),
        "chunk 0": ({**placed, "chunk": 0}, "'chunk'"),
        "chunk negative": ({**placed, "chunk": -64}, "'chunk'"),
        "chunk past n_ctx_slot": ({**placed, "chunk": n_ctx_slot + 1}, "'chunk'"),
        "chunk float": ({**placed, "chunk": 64.0}, "'chunk'"),
        "chunk string": ({**placed, "chunk": "64"}, "'chunk'"),
        "chunk without in_place": ({**body, "chunk": c}, "in_place"),
        "offsets without in_place": ({**body, "offsets": [0]}, "in_place"),
        "chunk with in_place false": ({**body, "in_place": False, "chunk": c}, "in_place"),
        "chunk inline": ({k2: v for k2, v in body.items() if k2 != "file"} | {"chunk": c}, "in_place"),
        "offset float": ({**placed, "offsets": [0.0, *good[1:]]}, "entry 0"),
        "offset string": ({**placed, "offsets": [*good[:-1], str(good[-1])]}, f"entry {k - 1}"),
        "offset null": ({**placed, "offsets": [*good[:-1], None]}, f"entry {k - 1}"),
        "offset bool": ({**placed, "offsets": [*good[:-1], True]}, f"entry {k - 1}"),
        "offset negative": ({**placed, "offsets": [-1, *good[1:]]}, "entry 0"),
        "offset above int64": ({**placed, "offsets": [*good[:-1], 1 << 63]}, f"entry {k - 1}"),
        "offsets not an array": ({**placed, "offsets": 0}, "'offsets'"),
        "offsets longer than n_ctx_slot": ({**placed, "offsets": [0] * (n_ctx_slot + 1)}, "at most"),
    }
    for name, (req, words) in cases.items():
        status, err = _kv(server, "POST", "/kvctl/export", req)
        assert status == 400, (name, err)
        assert isinstance(err, dict) and words in err["error"]["message"], (name, err)
        assert target.read_bytes() == content and target.stat().st_ino == inode, name
        assert _files(directory) == before, name

    # the same request with the right offsets is fine
    status, res = _kv(server, "POST", "/kvctl/export", {**placed, "offsets": good})
    assert status == 200 and isinstance(res, dict), res
    target.unlink()


def test_mover_reuses_one_import_file_and_drops_unanswered_ones(server: ServerProcess) -> None:
    tokens = _prefill(server, 0)
    asyncio.run(_mover_moves(server, tokens))


def _maps(server: ServerProcess, directory: Path) -> list[tuple[str, int]]:
    """The server's mappings of files of ``directory``: (path, bytes) each (a path ending in
    ``(deleted)`` is a removed file)."""
    assert server.proc is not None
    out = []
    for line in Path(f"/proc/{server.proc.pid}/maps").read_text().splitlines():
        if str(directory) in line:
            fields = line.split(None, 5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out.append((fields[5], end - start))
    return out


def _mapped(server: ServerProcess, directory: Path) -> list[str]:
    return sorted({path for path, _ in _maps(server, directory)})


def test_reused_files_stay_mapped_until_removed(server: ServerProcess) -> None:
    """Patch 0008: the server keeps the mapping of a file it read or wrote in place between
    calls (one mapping per inode, so a new file under an old name is read anew, and a file
    rewritten in place is read as it is now), and lets it go at the next /kvctl request once
    the file is removed, so a removed file's tmpfs pages are not held."""
    directory = server.spec.kvctl_dir
    assert directory is not None
    tokens = _prefill(server, 0)
    n, half = len(tokens), len(tokens) // 2
    inline, payload = _inline_export(server, 0, tokens)
    _, payload_half = _inline_export(server, 0, tokens[:half])

    def import_from(name: str, p1: int, size: int) -> int:
        status, res = _kv(
            server,
            "POST",
            "/kvctl/import",
            {
                "slot": 1,
                "p0": 0,
                "p1": p1,
                "tokens": tokens[:p1],
                "compat": inline["compat"],
                "segments": [{"file": name, "offset": 0, "size": size}],
            },
        )
        assert status in (200, 400), res
        return status

    def held_by_slot1(p1: int) -> bytes:
        return _inline_export(server, 1, tokens[:p1])[1]

    target = directory / "in.kv"
    target.write_bytes(payload)
    assert import_from("in.kv", n, len(payload)) == 200
    assert held_by_slot1(n) == payload
    assert _mapped(server, directory) == [str(target)]  # kept after the call

    # Rewritten in place (same inode): the kept mapping reads what the file holds now.
    with open(target, "r+b") as f:
        f.write(payload_half)
    assert import_from("in.kv", half, len(payload_half)) == 200
    assert held_by_slot1(half) == payload_half

    # A new file under the same name: mapped anew, never the old inode's pages.
    target.unlink()
    target.write_bytes(payload)
    assert import_from("in.kv", n, len(payload)) == 200
    assert held_by_slot1(n) == payload
    assert _mapped(server, directory) == [str(target)]  # the removed inode was dropped

    # Shrunk in place: the range past the new end is refused, not read through the old mapping.
    with open(target, "r+b") as f:
        f.truncate(len(payload_half))
        f.write(payload_half)
    assert import_from("in.kv", n, len(payload)) == 400
    assert import_from("in.kv", half, len(payload_half)) == 200
    page = os.sysconf("SC_PAGE_SIZE")
    # Mapped anew at the new size: the old, longer mapping (past the end of the file) is gone.
    assert _maps(server, directory) == [(str(target), -(-len(payload_half) // page) * page)]

    # Removed: the next /kvctl request lets the mapping go.
    target.unlink()
    status, _ = _kv(server, "GET", "/kvctl/caps")
    assert status == 200
    assert _mapped(server, directory) == []


def test_a_payload_directory_replaced_by_a_link_is_never_written_through(
    start_server: ServerFactory, patched_bin: Path, stock_server: ServerProcess, tmp_path: Path
) -> None:
    """Issue 31 item 7: after the proxy and the server have opened the payload directory,
    another user renames it and puts a link to a victim's directory in its place. Both sides
    keep moving KV through the directory they opened (the proxy's mover and the server open,
    make and remove payload files relative to it), so the moves still work and nothing is made
    in, read from or removed from the victim's directory."""
    from tests.helpers import ProxyThread, assert_same_answer, chat_body, post, proxy_config
    from tests.integration.test_proxy import convo, document

    payloads = tmp_path / "payloads"
    payloads.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    (victim / "keep.kv").write_bytes(b"the victim's file")
    server = start_server(patched_bin, n_parallel=1, ctx_size=2048, kvctl_dir=payloads)
    proxy = ProxyThread(proxy_config(server)).start()
    try:
        messages = convo(document(61, 150), "What is the first word?")
        first = post(f"{proxy.url}/v1/chat/completions", chat_body(messages, 8))
        assert first.status == 200, first.body
        proxy.settle()  # saved to the host tree through an export file, the slot erased
        # (answers are compared with stock from scratch under the near-tie rule: this prompt
        # has a near-tie at its third token)
        payloads.rename(tmp_path / "moved")
        payloads.symlink_to(victim)
        again = post(f"{proxy.url}/v1/chat/completions", chat_body(messages, 8))
        assert again.status == 200 and again.headers["X-Radix-Route"] == "H", again.headers
        reference = post(
            f"{stock_server.url}/v1/chat/completions", chat_body(messages, 8, cache_prompt=False)
        )
        assert_same_answer(first, reference)
        assert_same_answer(again, reference)
        proxy.settle()
        fallbacks = proxy.call(
            lambda rt: sum(
                s.value
                for m in rt.metrics.fallbacks.collect()
                for s in m.samples
                if s.name.endswith("_total")
            )
        )
        assert fallbacks == 0
    finally:
        proxy.stop()
        server.stop()
    assert sorted(p.name for p in victim.iterdir()) == ["keep.kv"]
    assert (victim / "keep.kv").read_bytes() == b"the victim's file"
