"""Safe tar extraction (proxy.native.archive) with and without tarfile's ``data`` filter.

The filter exists only from Python 3.12 / 3.11.4 / 3.10.12; the fallback branch is forced
here on every Python so both paths run wherever the suite runs.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from proxy.errors import BuildError
from proxy.native.archive import HAS_DATA_FILTER, safe_extract
from proxy.native.fetch import Progress

pytestmark = [
    pytest.mark.unit,
    # Without a filter, Python 3.12 and 3.13 warn that 3.14 will filter by default.
    pytest.mark.filterwarnings("ignore:Python 3.14 will:DeprecationWarning"),
]

BRANCHES = [
    pytest.param(False, id="fallback"),
    pytest.param(
        True,
        id="data-filter",
        marks=pytest.mark.skipif(not HAS_DATA_FILTER, reason="no tarfile data filter here"),
    ),
]


def _file(name: str, data: bytes = b"x", mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.uid, info.gid, info.uname, info.gname = (
        len(data),
        mode,
        4242,
        4242,
        "nobody",
        "nogroup",
    )
    return info, data


def _link(name: str, target: str, kind: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, b""


def _special(name: str, kind: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.devmajor, info.devminor = kind, 1, 3
    return info, b""


def _archive(path: Path, entries: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    with tarfile.open(path, "w:gz") as archive:
        for info, data in entries:
            archive.addfile(info, io.BytesIO(data) if info.isfile() else None)
    return path


def _extract(tmp_path: Path, entries: list[tuple[tarfile.TarInfo, bytes]], use_filter: bool) -> Path:
    dest = tmp_path / "dest"
    dest.mkdir()
    with tarfile.open(_archive(tmp_path / "a.tar.gz", entries)) as archive:
        safe_extract(archive, dest, archive.getmembers(), use_filter=use_filter)
    return dest


GOOD = [
    _file("pkg/src/a.c", b"int a;\n"),
    _file("pkg/run.sh", b"#!/bin/sh\n", mode=0o4777),  # setuid and world-writable in the archive
    _link("pkg/src/b.c", "a.c", tarfile.SYMTYPE),
    _link("pkg/hard.c", "pkg/src/a.c", tarfile.LNKTYPE),
]

UNSAFE = {
    "traversal": [_file("pkg/../../escape.txt")],
    "absolute": [_file("/tmp/radix-absolute.txt")],
    "symlink-outside": [_link("pkg/up", "../../outside", tarfile.SYMTYPE)],
    "symlink-absolute": [_link("pkg/etc", "/etc", tarfile.SYMTYPE)],
    "hardlink-outside": [_link("pkg/passwd", "../etc/passwd", tarfile.LNKTYPE)],
    "hardlink-absolute": [_link("pkg/passwd", "/etc/passwd", tarfile.LNKTYPE)],
    # Each link is harmless alone; together `pkg/a/b` resolves to dest's parent.
    "symlink-chain": [
        _link("pkg/a", ".", tarfile.SYMTYPE),
        _link("pkg/a/b", "../..", tarfile.SYMTYPE),
        _file("pkg/a/b/escape.txt"),
    ],
    "char-device": [_special("pkg/null", tarfile.CHRTYPE)],
    "block-device": [_special("pkg/disk", tarfile.BLKTYPE)],
    "fifo": [_special("pkg/pipe", tarfile.FIFOTYPE)],
}


@pytest.mark.parametrize("use_filter", BRANCHES)
def test_plain_files_and_inside_links_extract_as_data(tmp_path: Path, use_filter: bool) -> None:
    dest = _extract(tmp_path, GOOD, use_filter)
    assert (dest / "pkg/src/a.c").read_bytes() == b"int a;\n"
    assert os.readlink(dest / "pkg/src/b.c") == "a.c" and (dest / "pkg/src/b.c").read_bytes() == b"int a;\n"
    assert (dest / "pkg/hard.c").stat().st_ino == (dest / "pkg/src/a.c").stat().st_ino
    mode = stat.S_IMODE((dest / "pkg/run.sh").stat().st_mode)
    assert mode == 0o755  # no setuid, no group/other write
    assert (dest / "pkg/src/a.c").stat().st_uid == os.getuid()  # archive owner ignored


@pytest.mark.parametrize("use_filter", BRANCHES)
@pytest.mark.parametrize("case", sorted(UNSAFE))
def test_unsafe_members_are_refused_and_nothing_escapes(tmp_path: Path, case: str, use_filter: bool) -> None:
    with pytest.raises(BuildError, match="unsafe archive member"):
        _extract(tmp_path, UNSAFE[case], use_filter)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tar.gz", "dest"]
    assert not Path("/tmp/radix-absolute.txt").exists()
    assert not any(p.is_char_device() or p.is_block_device() or p.is_fifo() for p in tmp_path.rglob("*"))


def test_the_default_branch_matches_the_running_python() -> None:
    assert hasattr(tarfile, "data_filter") == HAS_DATA_FILTER
    assert HAS_DATA_FILTER or "filter" not in tarfile.TarFile.extractall.__code__.co_varnames


def test_progress_reports_bytes_and_rate_after_the_quiet_period(capsys: pytest.CaptureFixture[str]) -> None:
    progress = Progress("download x.tar.gz", total=50_000_000, quiet_s=0.0)
    progress.update(10_000_000)
    progress.update(12_000_000)  # under 10 % more: no line
    progress.update(50_000_000)
    progress.update(50_000_000)  # finished: no repeats
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    assert "download x.tar.gz  20%  10.0 / 50.0 MB" in lines[0] and "MB/s" in lines[0]
    assert "100%  50.0 / 50.0 MB" in lines[1]


def test_progress_is_quiet_for_fast_operations(capsys: pytest.CaptureFixture[str]) -> None:
    progress = Progress("extract", total=10, quiet_s=60.0)
    progress.update(10)
    assert capsys.readouterr().err == ""
