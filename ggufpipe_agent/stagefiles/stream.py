"""The bytes of a stage file, produced straight from the source model's files.

A stage file is a GGUF holding only what one layer range needs: blocks
``a..b-1`` renumbered from 0, ``{arch}.block_count = b - a``, every other
metadata entry copied (per-layer arrays sliced to ``[a:b]``, the ``split.*``
keys of a split set dropped), the overrides an architecture needs
(:func:`ggufpipe_agent.gguf.architectures.stage_metadata_overrides`, appended last), the
global tensors llama.cpp insists on (``token_embd``, ``output_norm``, ...),
and ``output.weight`` only in the last stage. The layout is exactly what
``gguf.GGUFWriter`` writes for that content (version 3, ``general.architecture``
first, tensor data aligned to ``general.alignment``), so stage files are
byte-identical to those of the ``GGUFWriter`` based writer this replaced.

:class:`StageFileStream` describes the file as a list of segments: literal
bytes for what changes (the fixed header, re-encoded entries, the tensor
table), and byte ranges of the source parts for everything copied unchanged
(untouched metadata entries, including a vocabulary of hundreds of thousands
of strings, and every tensor's data). Nothing is parsed into Python objects
beyond the header reader's scalars and nothing is written locally; the total
size is known before the first byte; chunks are read with ``pread`` (not
mapped, so the producer's resident memory stays one chunk whatever the
model's size) from any offset, which is what a resumed transfer needs.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ggufpipe_agent.errors import ModelError, RangeError
from ggufpipe_agent.gguf.architectures import Overrides, check_split, keep_tensors, stage_metadata_overrides
from ggufpipe_agent.gguf.files import ModelFiles
from ggufpipe_agent.gguf.header import ARRAY, DEFAULT_ALIGNMENT, SCALAR_FORMATS, STRING, LongArray, align

#: Bump when the stage file layout changes, so stale cache entries are not reused.
STAGE_FORMAT = 3  # 3: gemma3 stage files carry their slice of the sliding-window pattern
#: The unit of a stream: big enough for the disk and the network, small
#: enough that one in flight per consumer is nothing next to a model.
DEFAULT_CHUNK = 8 << 20
GGUF_VERSION = 3
_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.(.*)$")


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


# ------------------------------------------------------------ encoding


def encode_string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _encode_item(value: Any, value_type: int) -> bytes:
    if value_type in SCALAR_FORMATS:
        return struct.pack(SCALAR_FORMATS[value_type], value)
    if value_type == STRING:
        return encode_string(value)
    raise ModelError(f"cannot encode a GGUF value of type {value_type}")


def encode_entry(key: str, value: Any, value_type: int, sub_type: int | None = None) -> bytes:
    """One metadata entry as GGUFWriter encodes it (key, type, value)."""
    value_type = int(value_type)
    head = encode_string(key) + struct.pack("<I", value_type)
    if value_type != ARRAY:
        return head + _encode_item(value, value_type)
    if sub_type is None:
        raise ModelError(f"{key}: an array needs its element type")
    items = b"".join(_encode_item(item, int(sub_type)) for item in value)
    return head + struct.pack("<IQ", int(sub_type), len(value)) + items


# ------------------------------------------------------------ the layout


@dataclass(frozen=True, slots=True)
class Segment:
    """``length`` bytes at ``start`` of the stage file: ``data`` itself, or
    bytes of source part ``part`` at ``offset`` (``part`` -1 and no data:
    zero padding)."""

    start: int
    length: int
    data: bytes = b""
    part: int = -1
    offset: int = 0


class _Builder:
    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self.size = 0
        self._literal = bytearray()

    def literal(self, data: bytes) -> None:
        self._literal += data

    def _flush(self) -> None:
        if self._literal:
            self.segments.append(Segment(self.size, len(self._literal), bytes(self._literal)))
            self.size += len(self._literal)
            self._literal = bytearray()

    def copy(self, part: int, offset: int, length: int) -> None:
        if length <= 0:
            return
        self._flush()
        self.segments.append(Segment(self.size, length, part=part, offset=offset))
        self.size += length

    def zeros(self, length: int) -> None:
        if length <= 0:
            return
        self._flush()
        self.segments.append(Segment(self.size, length))
        self.size += length

    def position(self) -> int:
        return self.size + len(self._literal)

    def finish(self) -> list[Segment]:
        self._flush()
        return self.segments


@dataclass(frozen=True, slots=True)
class StageLayout:
    """Where every byte of a stage file comes from."""

    segments: tuple[Segment, ...]
    size: int
    tensor_bytes: int  # of the tensor data section, padding included
    tensor_count: int
    kv_count: int


def stage_layout(files: ModelFiles, start: int, end: int, overrides: Overrides | None = None) -> StageLayout:
    """The layout of the stage file for blocks ``[start, end)`` of ``files``;
    checks the range and the architecture's split rules first. ``overrides``
    default to :func:`ggufpipe_agent.gguf.architectures.stage_metadata_overrides`."""
    header = files.header
    arch = header.architecture
    where = str(files.first)
    block_count = int(header.get(f"{arch}.block_count", 0))
    check_range(start, end, block_count, where)
    check_split(arch, header.get, start, end, where)
    if overrides is None:
        overrides = stage_metadata_overrides(arch, header.get, start, end)
    last = end == block_count
    kept = keep_tensors(arch)  # global tensors llama.cpp needs in every stage of this architecture
    alignment = int(header.get("general.alignment", DEFAULT_ALIGNMENT))

    chosen = []
    for located in files.tensors:
        entry = located.entry
        match = _BLOCK_TENSOR.match(entry.name)
        if match:
            index = int(match.group(1))
            if not start <= index < end:
                continue
            name = f"blk.{index - start}.{match.group(2)}"
        elif entry.name == "output.weight" and not last and entry.name not in kept:
            continue  # only the last stage projects to the vocabulary
        else:
            name = entry.name
        chosen.append((name, located))

    kv = _Builder()
    kv_count = 0

    def copy_entry(key: str) -> None:
        span = header.spans[key]
        kv.copy(0, span.start, span.end - span.start)

    copy_entry("general.architecture")  # GGUFWriter writes it first
    kv_count += 1
    for key, value in header.metadata.items():
        if key == "general.architecture" or key.startswith("split.") or key in overrides:
            continue
        kv_count += 1
        value_type = header.value_types[key]
        if key == f"{arch}.block_count":
            kv.literal(encode_entry(key, end - start, value_type))
        elif key.startswith(f"{arch}.") and value_type == ARRAY and len(value) == block_count:
            _sliced_array(kv, header, key, value, start, end)
        else:
            copy_entry(key)
    for key, (value, value_type, sub_type) in overrides.items():
        kv_count += 1
        kv.literal(encode_entry(key, value, value_type, None if sub_type is None else int(sub_type)))

    out = _Builder()
    out.literal(b"GGUF" + struct.pack("<IQQ", GGUF_VERSION, len(chosen), kv_count))
    for segment in kv.finish():
        if segment.data:
            out.literal(segment.data)
        else:
            out.copy(segment.part, segment.offset, segment.length)
    data_offset = 0
    for name, located in chosen:
        entry = located.entry
        out.literal(encode_string(name) + struct.pack("<I", len(entry.shape)))
        out.literal(struct.pack(f"<{len(entry.shape)}Q", *entry.shape))
        out.literal(struct.pack("<IQ", entry.ggml_type, data_offset))
        data_offset += align(entry.nbytes, alignment)
    out.zeros(align(out.position(), alignment) - out.position())
    for _, located in chosen:
        entry = located.entry
        part = files.parts[located.part]
        out.copy(located.part, part.data_offset + entry.offset, entry.nbytes)
        out.zeros(align(entry.nbytes, alignment) - entry.nbytes)
    segments = tuple(out.finish())
    size = segments[-1].start + segments[-1].length if segments else 0
    return StageLayout(segments, size, data_offset, len(chosen), kv_count)


def _sliced_array(kv: _Builder, header: Any, key: str, value: Any, start: int, end: int) -> None:
    """A per-layer array cut to ``[start, end)``: fixed-size items are copied
    as raw bytes; string items (small: one per block) are re-encoded."""
    span = header.spans[key]
    item_type = value.item_type if isinstance(value, LongArray) else None
    if item_type is None:
        # The element type follows the value type; the header keeps short arrays as lists.
        item_type = struct.unpack_from("<I", _read(header.path, span.value + 4, 4))[0]
    count = end - start
    if item_type in SCALAR_FORMATS:
        size = struct.calcsize(SCALAR_FORMATS[item_type])
        kv.literal(encode_string(key) + struct.pack("<IIQ", ARRAY, item_type, count))
        kv.copy(0, span.value + 16 + start * size, count * size)
    elif item_type == STRING and isinstance(value, list):
        kv.literal(encode_entry(key, value[start:end], ARRAY, STRING))
    else:
        raise ModelError(f"{header.path}: cannot slice the per-layer array {key}")


def _read(path: Any, offset: int, length: int) -> bytes:
    with open(path, "rb") as handle:
        handle.seek(offset)
        return handle.read(length)


# ------------------------------------------------------------ the stream


class StageFileStream:
    """The stage file for blocks ``[start, end)`` of ``files``, as bytes read
    on demand from the source parts. Open it as a context manager (it holds
    one descriptor per part); ``size`` is known at once."""

    def __init__(self, files: ModelFiles, start: int, end: int, overrides: Overrides | None = None) -> None:
        self.files = files
        self.start = start
        self.end = end
        self.layout = stage_layout(files, start, end, overrides)
        self.size = self.layout.size
        self._starts = [segment.start for segment in self.layout.segments]
        self._fds: list[int] = []

    def __enter__(self) -> StageFileStream:
        self.open()
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def open(self) -> None:
        if self._fds:
            return
        for source in self.files.sources:
            try:
                fd = os.open(source.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as error:
                self.close()
                raise ModelError(f"{source.path}: cannot read ({error.strerror})") from None
            self._fds.append(fd)
            stat = os.fstat(fd)
            if (stat.st_size, stat.st_mtime_ns, stat.st_ino) != (source.size, source.mtime_ns, source.inode):
                self.close()
                raise ModelError(f"{source.path}: changed since its header was read; read it again")
            with contextlib.suppress(OSError, AttributeError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def close(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)

    def read(self, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)`` of the stage file (fewer at its end)."""
        if not self._fds:
            raise ModelError("the stage file stream is not open")
        end = min(self.size, offset + length)
        if offset < 0 or offset > self.size:
            raise ModelError(f"offset {offset} is outside the stage file ({self.size} bytes)")
        pieces: list[bytes] = []
        index = max(0, bisect.bisect_right(self._starts, offset) - 1)
        position = offset
        segments = self.layout.segments
        while position < end:
            segment = segments[index]
            inner = position - segment.start
            take = min(segment.length - inner, end - position)
            if segment.data:
                pieces.append(segment.data[inner : inner + take])
            elif segment.part < 0:
                pieces.append(bytes(take))
            else:
                data = os.pread(self._fds[segment.part], take, segment.offset + inner)
                if len(data) != take:
                    raise ModelError(f"{self.files.sources[segment.part].path}: shorter than its header says")
                pieces.append(data)
            position += take
            index += 1
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def chunks(self, chunk_size: int = DEFAULT_CHUNK, offset: int = 0) -> Iterator[bytes]:
        """The file from ``offset`` in chunks of ``chunk_size`` bytes (the last
        one shorter); chunk ``i`` starts at ``offset + i * chunk_size``."""
        if chunk_size <= 0:
            raise ValueError("chunk_size must be positive")
        position = offset
        while position < self.size:
            chunk = self.read(position, chunk_size)
            position += len(chunk)
            yield chunk


def open_stage_stream(
    files: ModelFiles, start: int, end: int, overrides: Overrides | None = None
) -> StageFileStream:
    """A :class:`StageFileStream`, checked and opened (use it in ``with``)."""
    stream = StageFileStream(files, start, end, overrides)
    stream.open()
    return stream
