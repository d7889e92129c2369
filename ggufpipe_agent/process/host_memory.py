"""What memory this host has for stages: RAM from ``/proc/meminfo``, bounded by
the tightest memory cgroup limit over the agent process (a container's).

The agent process reads it for its Hello (:mod:`ggufpipe_agent.process.hello`);
the orchestrator gets it from there, and sizes stages against it with
:mod:`ggufpipe_agent.gguf.memory`, which reads nothing of the host.
"""

from __future__ import annotations

import contextlib
from pathlib import Path


def _read_int(path: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        text = path.read_text().strip()
        return None if text == "max" else int(text)
    return None


def _stat(path: Path, key: str) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return 0


def _cgroup_dirs(root: Path, controller: str) -> list[Path]:
    """This process's cgroup directory and its ancestors, for cgroup v2
    (``controller`` "") or the v1 hierarchy of ``controller``."""
    paths = []
    with contextlib.suppress(OSError):
        for line in (root / "proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if (not controller and controllers == "") or controller in controllers.split(","):
                paths.append(path.strip("/"))
    base = root / "sys/fs/cgroup" / controller if controller else root / "sys/fs/cgroup"
    found = []
    for path in paths:
        parts = [part for part in path.split("/") if part]
        for depth in range(len(parts), -1, -1):
            found.append(base.joinpath(*parts[:depth]))
    found.append(base)  # a container's own cgroup is mounted at the root
    unique: list[Path] = []
    for directory in found:
        if directory not in unique:
            unique.append(directory)
    return unique


def cgroup_memory(root: Path = Path("/")) -> tuple[int, int] | None:
    """(limit, bytes in use that cannot be reclaimed) of the tightest memory
    cgroup limit over this process, or None when there is none. cgroup v2
    (``memory.max``) first, then v1 (``memory.limit_in_bytes``)."""
    best: tuple[int, int] | None = None
    for directory in _cgroup_dirs(root, ""):
        limit = _read_int(directory / "memory.max")
        if limit is None:
            continue
        used = (_read_int(directory / "memory.current") or 0) - _stat(
            directory / "memory.stat", "inactive_file"
        )
        if best is None or limit < best[0]:
            best = (limit, max(used, 0))
    if best is not None:
        return best
    for directory in _cgroup_dirs(root, "memory"):
        limit = _read_int(directory / "memory.limit_in_bytes")
        if limit is None or limit >= 1 << 62:  # v1 says "no limit" with a huge number
            continue
        usage = _read_int(directory / "memory.usage_in_bytes") or 0
        used = usage - _stat(directory / "memory.stat", "total_inactive_file")
        if best is None or limit < best[0]:
            best = (limit, max(used, 0))
    return best


def system_memory(root: Path = Path("/")) -> tuple[int, int]:
    """(total, available) RAM in bytes: /proc/meminfo, bounded by the memory
    cgroup's limit when the agent runs in a container."""
    total = available = 0
    with contextlib.suppress(OSError, ValueError), (root / "proc/meminfo").open() as handle:
        for line in handle:
            key, _, rest = line.partition(":")
            if key == "MemTotal":
                total = int(rest.split()[0]) * 1024
            elif key == "MemAvailable":
                available = int(rest.split()[0]) * 1024
    limit = cgroup_memory(root)
    if limit is not None:
        cap, used = limit
        if not total or cap < total:
            total = cap
        available = min(available, max(cap - used, 0)) if available else max(cap - used, 0)
    return total, available
