"""Payload files are made, grown and removed relative to the directory the proxy opened and
checked, never by path (issue 31 item 7): a payload directory renamed and replaced by a link
to another user's directory afterwards is never written through."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from proxy.errors import ConfigError
from proxy.server.dataplane.paydir import private_dir_fd
from proxy.server.dataplane.payfile import PayloadFile


def test_a_directory_replaced_by_a_link_after_it_was_opened_is_not_written_through(tmp_path: Path) -> None:
    ours, victim = tmp_path / "payloads", tmp_path / "victim"
    ours.mkdir(mode=0o700)
    victim.mkdir(mode=0o700)
    (victim / "keep.kv").write_bytes(b"the victim's file")
    fd = private_dir_fd(ours)
    first = PayloadFile.create(fd, "radix-1.kv", 4096)
    # Another user swaps the directory for a link to the victim's.
    moved = tmp_path / "moved"
    ours.rename(moved)
    ours.symlink_to(victim)
    second = PayloadFile.create(fd, "radix-2.kv", 4096)
    second.mm[:5] = b"KV!!!"
    first.grow(8192)
    assert sorted(p.name for p in moved.iterdir()) == ["radix-1.kv", "radix-2.kv"]
    assert (moved / "radix-2.kv").read_bytes()[:5] == b"KV!!!"
    first.close()
    second.close()
    assert list(moved.iterdir()) == []
    assert sorted(p.name for p in victim.iterdir()) == ["keep.kv"]  # nothing made or removed there


def test_a_directory_others_can_write_is_refused_on_its_descriptor(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    with pytest.raises(ConfigError, match="not ours alone"):
        private_dir_fd(loose)
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(OSError):
        private_dir_fd(link)


@pytest.mark.parametrize("mode", ["auto", "shared"])
def test_a_server_holding_another_directory_under_our_name_gets_no_payload_files(
    tmp_path: Path, mode: str
) -> None:
    """caps' dir_id (device:inode of the directory the server holds open) must be the one our
    mover holds: the same name is not enough (it may have been swapped between the two opens)."""
    from proxy.config import parse_backend
    from proxy.server.ops.connect import _payload_dir

    ours = tmp_path / "payloads"
    ours.mkdir(mode=0o700)
    st = os.fstat(private_dir_fd(ours))
    spec = parse_backend(f"http://127.0.0.1:1#{mode}")
    same = asyncio.run(_payload_dir(ours, str(ours), spec, f"{st.st_dev}:{st.st_ino}"))
    assert same == ours
    if mode == "auto":
        assert asyncio.run(_payload_dir(ours, str(ours), spec, f"{st.st_dev}:{st.st_ino + 1}")) is None
    else:
        with pytest.raises(ConfigError, match="#shared"):
            asyncio.run(_payload_dir(ours, str(ours), spec, f"{st.st_dev}:{st.st_ino + 1}"))


def test_a_directory_made_again_at_the_same_path_gets_its_own_descriptor(tmp_path: Path) -> None:
    d = tmp_path / "payloads"
    d.mkdir(mode=0o700)
    first = private_dir_fd(d)
    assert private_dir_fd(d) == first  # the same directory: the same descriptor
    d.rmdir()
    d.mkdir(mode=0o700)
    again = private_dir_fd(d)
    assert again != first and os.fstat(again).st_ino == os.lstat(d).st_ino
