"""A directory only this user writes in: the stage cache is one, and the
orchestrator holds its run logs to the same rule."""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path

from ggufpipe_agent.errors import CacheError

log = logging.getLogger("ggufpipe.cache")


def private_directory(path: str | os.PathLike[str], what: str, setting: str) -> Path:
    """A directory of this user's that only it may write in (``what`` names
    it in errors, ``setting`` is where the user chooses another), created
    0700 if missing; made 0700 if others could read it."""
    directory = Path(path)
    try:
        missing = []
        probe = directory
        while not probe.is_dir() and probe != probe.parent:
            missing.append(probe)
            probe = probe.parent
        for level in reversed(missing):  # what we create is private, ancestors included
            with contextlib.suppress(FileExistsError):
                os.mkdir(level, 0o700)
                os.chmod(level, 0o700)  # mkdir's mode passes through the umask
        info = os.stat(directory)
    except OSError as error:
        raise CacheError(f"cannot create {what} {directory}: {error.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise CacheError(f"{what} {directory} is not a directory")
    if info.st_uid != os.geteuid():
        raise CacheError(
            f"{what} {directory} belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()}); "
            "refusing to trust files another user could have put there "
            f"(set {setting} to a directory of yours)"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022:
        who = {0o020: "its group", 0o002: "others"}.get(mode & 0o022, "its group and others")
        raise CacheError(
            f"{what} {directory} is writable by {who} (mode {mode:04o}); refusing to trust files "
            f"others could have put there (chmod 700 {directory}, or set {setting} to a private directory)"
        )
    if mode & 0o077:
        log.info("%s %s was mode %04o; made private (0700)", what, directory, mode)
        os.chmod(directory, 0o700)
    return directory
