"""Stage files: a GGUF holding only what one layer range needs.

llama.cpp has no "run blocks [a, b)" switch, so each stage loads a GGUF of its
own: blocks ``a..b-1`` renumbered from 0, ``{arch}.block_count = b - a``, every
other metadata field copied (per-layer arrays sliced to ``[a:b]``), the global
tensors llama.cpp insists on (``token_embd``, ``output_norm``, ...), and
``output.weight`` only in the last stage. Quantized tensor bytes are streamed
unchanged from the memory-mapped source. What an architecture derives from a
block's index or the block count is pinned or refused by
:mod:`ggufpipe_agent.arch` (``check_split``, ``stage_metadata_overrides``).

Stage files live in a cache on the host that runs the stage, keyed by the
source file's identity (path, size, mtime, inode) and the range. A file is
written under a temporary name and renamed into place, so a crash while writing
never leaves an entry that a later load would trust.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ggufpipe_agent.arch import Overrides, check_split, stage_metadata_overrides
from ggufpipe_agent.errors import ModelError, RangeError
from ggufpipe_agent.model import open_reader, read_gguf_header

#: Bump when the stage file layout changes, so stale cache entries are not reused.
STAGE_FORMAT = 3  # 3: gemma3 stage files carry their slice of the sliding-window pattern
_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.(.*)$")

Progress = Callable[[float], None]


def default_cache_dir() -> Path:
    explicit = os.environ.get("GGUFPIPE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ggufpipe" / "stages"


def check_range(start: int, end: int, block_count: int, where: str) -> None:
    span = f"layers [{start}, {end})"
    if start < 0 or end < 0:
        raise RangeError(f"{where}: {span} has a negative bound")
    if start > end:
        raise RangeError(f"{where}: {span} is reversed")
    if start == end:
        raise RangeError(f"{where}: {span} is empty")
    if end > block_count:
        raise RangeError(f"{where}: {span} is out of bounds (the model has {block_count} blocks)")


def cache_key(source: Path, start: int, end: int) -> str:
    stat = source.stat()
    identity = f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ino}"
    return hashlib.sha256(f"{identity}|{start}|{end}|{STAGE_FORMAT}".encode()).hexdigest()[:20]


def ensure_stage_file(
    source: str | os.PathLike[str],
    start: int,
    end: int,
    cache_dir: Path | None = None,
    progress: Progress | None = None,
) -> Path:
    """The path of a GGUF that runs blocks ``[start, end)`` of ``source``.

    The whole-model range is the source file itself. Otherwise the cached
    stage file, written now if the cache has none.
    """
    header = read_gguf_header(source)
    path = header.path
    arch = header.architecture
    block_count = int(header.get(f"{arch}.block_count", 0))
    check_range(start, end, block_count, str(path))
    check_split(arch, header.get, start, end, str(path))
    if start == 0 and end == block_count:
        return path
    directory = cache_dir or default_cache_dir()
    target = directory / f"{path.stem}.blk{start}-{end}of{block_count}.{cache_key(path, start, end)}.gguf"
    if target.exists():
        return target  # cached: nothing to write, nothing to report
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ModelError(f"cannot create stage cache {directory}: {error.strerror}") from None
    _remove_orphans(directory, target.name)
    temporary = directory / f".{target.name}.{os.getpid()}.tmp"
    overrides = stage_metadata_overrides(arch, header.get, start, end)
    reader = open_reader(path)
    try:
        _write_stage_file(reader, arch, block_count, start, end, overrides, temporary, progress)
        os.replace(temporary, target)
    except OSError as error:
        raise ModelError(f"cannot write stage file {target}: {error}") from None
    finally:
        temporary.unlink(missing_ok=True)
    return target


def _write_stage_file(
    reader: Any,
    arch: str,
    block_count: int,
    start: int,
    end: int,
    overrides: Overrides,
    destination: Path,
    progress: Progress | None,
) -> None:
    import gguf

    last = end == block_count
    writer = gguf.GGUFWriter(destination, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        name = field.name
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        if name in overrides:
            continue
        value = field.contents()
        if name == f"{arch}.block_count":
            value = end - start
        elif (
            name.startswith(f"{arch}.")
            and value_type == gguf.GGUFValueType.ARRAY
            and len(field.data) == block_count
        ):
            value = value[start:end]
        elif name == "general.alignment":
            writer.data_alignment = int(value)
        writer.add_key_value(name, value, value_type, sub_type=sub_type)
    for name, (value, value_type, sub_type) in overrides.items():
        writer.add_key_value(name, value, value_type, sub_type=sub_type)

    chosen = []
    for tensor in reader.tensors:
        match = _BLOCK_TENSOR.match(tensor.name)
        if match:
            index = int(match.group(1))
            if not start <= index < end:
                continue
            name = f"blk.{index - start}.{match.group(2)}"
        elif tensor.name == "output.weight" and not last:
            continue  # only the last stage projects to the vocabulary
        else:
            name = tensor.name
        chosen.append((name, tensor))
        writer.add_tensor_info(
            name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type
        )

    total = sum(int(tensor.n_bytes) for _, tensor in chosen) or 1
    written = 0
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, tensor in chosen:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
        written += int(tensor.n_bytes)
        if progress:
            progress(written / total)
    assert writer.fout is not None
    for handle in writer.fout:
        handle.flush()
        os.fsync(handle.fileno())
    writer.close()


def _remove_orphans(directory: Path, name: str) -> None:
    """Temporary files of this entry left by writers that died (a killed
    agent, a StopRun during the first load): never trusted, so only space."""
    for leftover in directory.glob(f".{name}.*.tmp"):
        pid = leftover.name.rsplit(".", 2)[-2]
        if pid.isdigit() and not _alive(int(pid)):
            leftover.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
