"""Safe tar extraction on every supported Python.

``tarfile``'s ``filter="data"`` exists only from Python 3.12, 3.11.4 and 3.10.12 (Debian 12
ships 3.11.2, Ubuntu 22.04's python3.11 is 3.11.0). Every member is checked here first, on
every version, with the rules of the ``data`` filter: no absolute or ``..`` paths, nothing
that lands outside the destination (also through a symlink extracted earlier), no link
pointing outside, no device files or FIFOs. Where the filter exists it runs as well;
without it the member is rewritten like the filter would (no owner, no setuid/setgid/sticky
or group/other write bits).
"""

from __future__ import annotations

import copy
import os
import tarfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from proxy.errors import BuildError
from proxy.native.fetch import Progress

HAS_DATA_FILTER = hasattr(tarfile, "data_filter")


def safe_extract(
    archive: tarfile.TarFile,
    dest: Path,
    members: Iterable[tarfile.TarInfo],
    *,
    use_filter: bool = HAS_DATA_FILTER,
    what: str = "extract",
) -> int:
    """Extract ``members`` under ``dest``; return the bytes written. Refuses unsafe members."""
    members = list(members)
    progress = Progress(what, total=sum(m.size for m in members if m.isfile()))
    checked = _checked(members, Path(os.path.realpath(dest)), progress, rewrite=not use_filter)
    if use_filter:
        archive.extractall(dest, members=checked, filter="data")
    else:
        archive.extractall(dest, members=checked)
    return progress.done


def _checked(
    members: list[tarfile.TarInfo], root: Path, progress: Progress, rewrite: bool
) -> Iterator[tarfile.TarInfo]:
    # Lazy on purpose: extractall extracts each member before asking for the next, so the
    # realpath checks see the symlinks earlier members created.
    done = 0
    for member in members:
        check_member(member, root)
        yield _as_data(member) if rewrite else member
        done += member.size if member.isfile() else 0
        progress.update(done)


def check_member(member: tarfile.TarInfo, root: Path) -> None:
    """Raise BuildError unless ``member`` is a plain file, directory or link that stays in ``root``."""
    name = member.name
    if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
        _refuse(member, "is a device file, FIFO or other special file")
    if os.path.isabs(name):
        _refuse(member, "has an absolute path")
    if ".." in Path(name).parts:
        _refuse(member, "has a '..' component")
    if not _inside(root / name, root):
        _refuse(member, "would land outside the destination (through a symlink)")
    if member.issym() or member.islnk():
        if os.path.isabs(member.linkname):
            _refuse(member, f"links to the absolute path {member.linkname}")
        base = root / os.path.dirname(name) if member.issym() else root
        if not _inside(base / member.linkname, root):
            _refuse(member, f"links outside the destination ({member.linkname})")


def _inside(path: Path, root: Path) -> bool:
    return os.path.commonpath([os.path.realpath(path), root]) == str(root)


def _as_data(member: tarfile.TarInfo) -> tarfile.TarInfo:
    """What the ``data`` filter does to a member's metadata, for Pythons without it."""
    member = copy.copy(member)
    mode = member.mode & 0o755
    if member.isfile() or member.islnk():
        mode = (mode if mode & 0o100 else mode & ~0o111) | 0o600
    elif member.isdir():
        mode |= 0o700
    member.mode = mode
    # Without a name, tarfile (as root) chowns to these ids: the extracting user's own.
    member.uid, member.gid, member.uname, member.gname = os.getuid(), os.getgid(), "", ""
    return member


def _refuse(member: tarfile.TarInfo, why: str) -> None:
    raise BuildError(
        f"unsafe archive member {member.name!r}: {why}; extraction stopped",
        fix="the archive is damaged or not the pinned file: delete it from the cache's downloads/ and retry",
    )
