"""Stage files: a GGUF holding only what one layer range needs, in the host's cache.

llama.cpp has no "run blocks [a, b)" switch, so each stage loads a GGUF of its
own. What goes into it, and how it is produced straight from the source
files (a single GGUF or every part of a split set) without parsing the
vocabulary, is :mod:`ggufpipe_agent.stagefiles.stream`; what an architecture derives
from a block's index or the block count is pinned or refused by
:mod:`ggufpipe_agent.gguf.architectures`.

:func:`ensure_stage_file` writes a cache entry (:mod:`ggufpipe_agent.stagefiles.cache`)
by consuming that same stream, the one a transfer to another host sends, so
local writes and network delivery share one code path. The entry is named by
the model's identity and the range, hashed while written, and used again only
when its sidecar vouches for it and it was written from the very source
files given now (same real paths, sizes, mtimes, inodes).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ggufpipe_agent.errors import CacheError
from ggufpipe_agent.gguf.architectures import check_split, stage_metadata_overrides
from ggufpipe_agent.gguf.files import ModelFiles, read_model_files
from ggufpipe_agent.gguf.identity import model_identity
from ggufpipe_agent.stagefiles.cache import (
    StageKey,
    default_cache_dir,
    remove_entry,
    sidecar_path,
    touch,
    verify_entry,
    write_stage_entry,
)
from ggufpipe_agent.stagefiles.private_files import private_cache_dir, remove_orphans
from ggufpipe_agent.stagefiles.stream import STAGE_FORMAT, check_range, open_stage_stream

__all__ = ["STAGE_FORMAT", "check_range", "default_cache_dir", "ensure_stage_file", "stage_key"]

Progress = Callable[[float], None]


def stage_key(files: ModelFiles, start: int, end: int) -> StageKey:
    """The cache key of blocks ``[start, end)`` of a model: from its identity,
    so every host names the same stage of the same model alike."""
    identity = model_identity(files)
    arch = files.architecture
    block_count = int(files.get(f"{arch}.block_count", 0))
    return StageKey(identity.digest, identity.name, start, end, block_count, STAGE_FORMAT)


def ensure_stage_file(
    source: str | os.PathLike[str],
    start: int,
    end: int,
    cache_dir: Path | None = None,
    progress: Progress | None = None,
    verify: bool = False,
) -> Path:
    """The path of a GGUF that runs blocks ``[start, end)`` of ``source`` (a
    GGUF, or any part of a split set).

    The whole-model range is the source itself (a set's first part, from
    which llama.cpp loads the set). Otherwise the cached stage file, checked
    against its sidecar (``verify``: re-hash it whatever the stat says), or
    written now when the cache has no trustworthy one.
    """
    files = read_model_files(source)
    arch = files.architecture
    where = str(files.first)
    block_count = int(files.get(f"{arch}.block_count", 0))
    check_range(start, end, block_count, where)
    check_split(arch, files.get, start, end, where)
    if start == 0 and end == block_count:
        return files.first
    key = stage_key(files, start, end)
    directory = private_cache_dir(cache_dir or default_cache_dir())
    target = directory / key.file_name
    sources = files.resolved_sources()
    sidecar = verify_entry(target, full=verify)
    if sidecar is not None and sidecar.key == key and sidecar.sources == sources:
        touch(target)
        return target  # cached: nothing to write, nothing to report
    if sidecar is not None:
        why = "written from other source files" if sidecar.sources else "received, not written here"
        remove_entry(target, why)
    elif os.path.lexists(target) or os.path.lexists(sidecar_path(target)):
        remove_entry(target, "no valid sidecar, or contents that do not match it")
    remove_orphans(directory, target.name)
    overrides = stage_metadata_overrides(arch, files.get, start, end)
    try:
        with open_stage_stream(files, start, end, overrides) as stream:
            return write_stage_entry(directory, key, stream.chunks(), stream.size, sources, progress)
    except OSError as error:
        raise CacheError(f"cannot write stage file {target}: {error.strerror or error}") from None
