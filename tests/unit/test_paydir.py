"""The payload directory: one no other local user made or can change, checked without
following links; leftovers removed without following links either."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from proxy.cli.serve import _payload_dir
from proxy.errors import ConfigError
from proxy.server.dataplane.paydir import check_private_dir, make_private_dir, remove_payloads

pytestmark = pytest.mark.unit


def test_a_directory_of_ours_passes(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    check_private_dir(mine)


def test_a_link_to_a_victims_directory_is_refused(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    link = tmp_path / "radix-link"
    link.symlink_to(victim)
    with pytest.raises(ConfigError, match="symbolic link"):
        check_private_dir(link)
    with pytest.raises(ConfigError, match="symbolic link"):
        _payload_dir(link, 8080)  # radixctl up --shm-dir


@pytest.mark.parametrize("mode", [0o770, 0o777, 0o720, 0o702])
def test_a_directory_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(mode)
    with pytest.raises(ConfigError, match="writable by group or others"):
        check_private_dir(loose)


def test_a_directory_someone_else_made_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 12345, 12345)
    with pytest.raises(ConfigError, match="owned by uid 12345"):
        check_private_dir(theirs)


def test_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="not a directory"):
        check_private_dir(tmp_path / "f")
    with pytest.raises(ConfigError, match="No such file"):
        check_private_dir(tmp_path / "absent")


def test_ups_default_directory_is_new_unpredictable_and_owner_only(tmp_path: Path) -> None:
    a, b = make_private_dir(tmp_path, "radix-0-8080-"), make_private_dir(tmp_path, "radix-0-8080-")
    assert a != b and a.name.startswith("radix-0-8080-") and len(a.name) > len("radix-0-8080-")
    assert stat.S_IMODE(a.stat().st_mode) == 0o700
    check_private_dir(a)


def test_leftovers_are_removed_without_following_links(tmp_path: Path) -> None:
    mine, victim = tmp_path / "mine", tmp_path / "victim"
    mine.mkdir(mode=0o700)
    victim.mkdir(mode=0o700)
    (mine / "a.kv").write_bytes(b"x")
    (mine / "keep.txt").write_text("x")
    (victim / "theirs.kv").write_bytes(b"secret")
    (mine / "link.kv").symlink_to(victim / "theirs.kv")
    remove_payloads(mine)
    assert sorted(p.name for p in mine.iterdir()) == ["keep.txt", "link.kv"]
    assert (victim / "theirs.kv").read_bytes() == b"secret"
    # A link in the directory's place is not followed into the victim's directory.
    link = tmp_path / "radix-link"
    link.symlink_to(victim)
    remove_payloads(link)
    assert (victim / "theirs.kv").exists()
