"""The payload directory (``--shm-dir``): ours alone, checked without following links.

Payload files hold tenants' KV and the server maps them, so the directory must be one no
other local user can have made or can change: a real directory (not a symbolic link, which
``lstat`` sees and ``stat`` would follow), owned by us, writable by nobody else. Under
``/dev/shm`` (sticky) no one else can then rename, replace or write into it, so the names in
it are ours. ``radixctl up`` creates its default one with an unpredictable name, atomically;
a name another user created first (``radix-<uid>-<port>`` was predictable) or a link to a
victim's directory is refused at startup.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

from proxy.errors import ConfigError

PAYLOAD_SUFFIX = ".kv"


def check_private_dir(path: Path) -> None:
    """ConfigError unless ``path`` is a directory (not a link) owned by us, writable only by us."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise ConfigError(f"payload directory {path}: {exc.strerror}", fix="create it (mode 0700)") from exc
    fix = f"remove {path} and let radixctl create its own, or give a directory of yours (mode 0700)"
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(f"payload directory {path} is a symbolic link", fix=fix)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"payload directory {path} is not a directory", fix=fix)
    if st.st_uid != os.geteuid():
        raise ConfigError(f"payload directory {path} is owned by uid {st.st_uid}, not by us", fix=fix)
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(f"payload directory {path} is writable by group or others", fix=fix)


_DIR_FDS: dict[str, int] = {}  # by path; kept open for the process (a handful at most)


def private_dir_fd(path: Path) -> int:
    """A descriptor of our payload directory, opened without following a link and checked on
    the descriptor itself (owner, mode): every payload file is then made, opened and removed
    relative to it, so a directory renamed or replaced by a link later is never written
    through. Opened once per directory at that path and never closed (a payload file being
    removed after its move must not find the number reused by another directory); a directory
    made again at the same path gets a descriptor of its own."""
    key = str(path)
    fd = _DIR_FDS.get(key)
    if fd is not None and _same_file(os.fstat(fd), path):
        return fd
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        os.close(fd)
        raise ConfigError(
            f"payload directory {path} is not ours alone (uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})",
            fix="give a directory of yours (mode 0700)",
        )
    _DIR_FDS[key] = fd
    return fd


def _same_file(st: os.stat_result, path: Path) -> bool:
    try:
        now = os.lstat(path)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


def make_private_dir(base: Path, prefix: str) -> Path:
    """A new directory under ``base`` with an unpredictable name, mode 0700 (``mkdtemp``: an
    exclusive mkdir, so it can never be one that somebody else created)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def remove_payloads(path: Path) -> None:
    """Remove the payload files left in our directory, by name relative to the directory opened
    without following a link (a link in its place is not followed into another directory)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        for entry in os.scandir(fd):
            if entry.name.endswith(PAYLOAD_SUFFIX) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    os.unlink(entry.name, dir_fd=fd)
    finally:
        os.close(fd)
