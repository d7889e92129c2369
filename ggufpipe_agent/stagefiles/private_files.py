"""Private files in a private directory (:mod:`ggufpipe_agent.private_dirs`):
files created 0600 that never follow a planted link, writes that say when
the disk is full, and the free space left. The stage cache is built on them;
the orchestrator's run logs are held to the same rules."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
from pathlib import Path

from ggufpipe_agent.errors import CacheError, DiskFull
from ggufpipe_agent.private_dirs import private_directory

log = logging.getLogger("ggufpipe.cache")

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


# ------------------------------------------------------------ the directory


def private_cache_dir(path: str | os.PathLike[str]) -> Path:
    """The cache directory, created 0700 if missing; refused (CacheError naming
    it and why) when another user owns it or group or others may write in it."""
    return private_directory(path, "stage cache", "cache_dir")


def create_private(path: Path) -> int:
    """A new file at ``path``, opened for writing, mode 0600; never follows or
    reuses anything already there (a planted symlink is an error)."""
    fd = os.open(path, _CREATE, 0o600)
    os.fchmod(fd, 0o600)  # the umask may have taken bits away; none are added
    return fd


def temporary_path(directory: Path, target_name: str, suffix: str = "") -> Path:
    """A fresh unpredictable temporary name for ``target_name``; the pid in it
    lets a later writer remove it once this process is gone."""
    return directory / f".{target_name}.{os.getpid()}.{secrets.token_hex(8)}{suffix}.tmp"


def remove_orphans(directory: Path, target_name: str) -> None:
    """Temporary files of this entry left by writers that died (a killed
    agent, a StopRun during the first load): never trusted, so only space."""
    prefix = f".{target_name}."
    for leftover in directory.glob(f".{glob_escape(target_name)}.*.tmp"):
        pid = leftover.name[len(prefix) :].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            leftover.unlink(missing_ok=True)


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fsync_directory(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ------------------------------------------------------------ writing


def write_all(fd: int, data: bytes | memoryview, path: Path, total: int) -> None:
    """``os.write`` until all is written; a full disk is one DiskFull naming
    the path and the space the whole file needs."""
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except OSError as error:
            if error.errno in _NO_SPACE:
                raise disk_full(path, total) from None
            raise CacheError(f"cannot write {path}: {error.strerror}") from None
        view = view[written:]


def disk_full(path: Path, needed: int) -> DiskFull:
    available = free_bytes(path.parent)
    return DiskFull(
        f"no space left for {path}: the stage file needs {needed} bytes ({human_bytes(needed)}), "
        f"{available} bytes ({human_bytes(available)}) are free there",
        str(path),
        needed,
        available,
    )


def human_bytes(count: int) -> str:
    if count >= 1 << 30:
        return f"{count / 2**30:.2f} GiB"
    return f"{count / 2**20:.1f} MiB"


def free_bytes(directory: Path) -> int:
    try:
        info = os.statvfs(directory)
    except OSError:
        return 0
    return info.f_bavail * info.f_frsize


def reserve(fd: int, path: Path, offset: int, length: int, total: int) -> None:
    """Reserve the file's space now, so a full disk is known before the bytes
    are read or sent, not after; filesystems without fallocate go on."""
    if length <= 0:
        return
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as error:
        if error.errno in _NO_SPACE:
            raise disk_full(path, total) from None
        if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise CacheError(f"cannot reserve space for {path}: {error.strerror}") from None
