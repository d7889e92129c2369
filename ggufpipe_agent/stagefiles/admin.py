"""Managing a host's stage cache: list its entries, remove some.

For the coming ``ggufpipe-tui cache`` subcommand (the agent answers for its
host); the layout is described in :mod:`ggufpipe_agent.stagefiles.cache`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ggufpipe_agent.errors import CacheError
from ggufpipe_agent.stagefiles.cache import (
    PARTIAL_SUFFIX,
    SIDECAR_SUFFIX,
    read_private_json,
    read_sidecar,
    sidecar_path,
)
from ggufpipe_agent.wire.delivery_messages import CacheEntry


def list_entries(directory: str | os.PathLike[str]) -> list[CacheEntry]:
    """Every entry of a cache directory, most recently used first; files the
    cache does not know (older formats, stray files) are listed as
    "unverified" so they can be removed too."""
    root = Path(directory)
    if not root.is_dir():
        return []
    entries = []
    for path in sorted(root.iterdir()):
        name = path.name
        if name.startswith(".") or name.endswith(SIDECAR_SUFFIX):
            continue
        try:
            info = path.lstat()
        except FileNotFoundError:
            continue
        if name.endswith(PARTIAL_SUFFIX):
            entries.append(_partial_entry(path, info))
            continue
        sidecar = read_sidecar(path)
        if sidecar is None:
            entries.append(CacheEntry(name, "unverified", "", "", 0, 0, 0, info.st_size, 0, info.st_mtime))
            continue
        key = sidecar.key
        used = _mtime(sidecar_path(path), info.st_mtime)
        entries.append(
            CacheEntry(
                name,
                "complete",
                key.model,
                key.label,
                key.start,
                key.end,
                key.block_count,
                info.st_size,
                sidecar.size,
                used,
            )
        )
    return sorted(entries, key=lambda entry: -entry.last_used)


def _partial_entry(path: Path, info: os.stat_result) -> CacheEntry:
    progress = read_private_json(path.with_name(path.name + SIDECAR_SUFFIX)) or {}
    found = progress.get("key")
    key: dict[str, Any] = found if isinstance(found, dict) else {}
    return CacheEntry(
        path.name,
        "partial",
        str(key.get("model", "")),
        str(key.get("label", "")),
        int(key.get("start", 0)),
        int(key.get("end", 0)),
        int(key.get("block_count", 0)),
        int(progress.get("verified", 0)),
        int(progress.get("size", 0)),
        _mtime(path, info.st_mtime),
    )


def _mtime(path: Path, default: float) -> float:
    try:
        return path.lstat().st_mtime
    except OSError:
        return default


def remove_entries(directory: str | os.PathLike[str], names: Iterable[str]) -> list[str]:
    """Remove the named entries (complete, partial or unverified) with their
    sidecars; returns the names removed. A name is a file name in the cache,
    never a path: anything else is refused."""
    root = Path(directory)
    removed = []
    for name in names:
        if not name or "/" in name or name.startswith(".") or name.endswith(SIDECAR_SUFFIX):
            raise CacheError(f"{name!r} is not an entry of the stage cache {root}")
        path = root / name
        found = False
        for candidate in (path, path.with_name(name + SIDECAR_SUFFIX)):
            with contextlib.suppress(FileNotFoundError):
                candidate.unlink()
                found = True
        if found:
            removed.append(name)
    return removed
