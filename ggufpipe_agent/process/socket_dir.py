"""The agent's private directory: where its data socket lives.

Created 0700 (``tempfile.mkdtemp``) under ``$XDG_RUNTIME_DIR`` or the temp
directory and removed when the agent ends. An agent that is SIGKILLed (or
whose host loses power) cannot remove it, so each agent holds an ``flock``
on a file inside its directory for as long as it lives (the kernel drops the
lock with the process, however it ends), and a starting agent removes every
directory of this user's agents whose lock it can take: theirs are dead.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

log = logging.getLogger("ggufpipe.agent")

PREFIX = "ggufpipe-agent-"
LOCK_NAME = "owner.lock"
STARTING_NAME = "owner.lock.new"  # the lock file until it is locked
#: A directory without its lock file yet is an agent still starting, unless
#: it is older than this (its agent died between mkdtemp and the lock).
STARTING_GRACE_S = 60.0


def base_directory() -> str | None:
    base = os.environ.get("XDG_RUNTIME_DIR")
    return base if base and os.access(base, os.W_OK) else None


class PrivateDirectory:
    def __init__(self, base: str | None = None) -> None:
        removed = remove_stale(base)
        if removed:
            log.info("removed %d directory(ies) left by agents that were killed", removed)
        self.path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=base))
        # The lock file appears under its name already locked: locked under
        # another name, then renamed (the lock goes with the inode). Created
        # and then locked in place, another agent starting at the same moment
        # (two stages of one account on one host) could take the lock in
        # between, find the directory abandoned and remove it under us.
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        self._lock = os.open(self.path / STARTING_NAME, flags, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(self.path / STARTING_NAME, self.path / LOCK_NAME)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.close(self._lock)


def remove_stale(base: str | None) -> int:
    """Remove this user's agent directories under ``base`` whose agent is
    gone; returns how many."""
    root = Path(base or tempfile.gettempdir())
    removed = 0
    try:
        entries = list(os.scandir(root))
    except OSError:
        return 0
    for entry in entries:
        if not entry.name.startswith(PREFIX):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue  # another user's, or not a directory we made
        if _abandoned(Path(entry.path), info.st_mtime):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed += 1
    return removed


def _abandoned(directory: Path, modified: float) -> bool:
    try:
        descriptor = os.open(directory / LOCK_NAME, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return time.time() - modified > STARTING_GRACE_S
    except OSError:
        return False
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # its agent holds the lock: alive
    finally:
        os.close(descriptor)  # also drops the lock we may have taken
    return True
