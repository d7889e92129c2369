"""A fast reader of a GGUF file's metadata and tensor table.

``gguf.GGUFReader`` builds a Python object per array element, which takes
seconds for a 150k-token vocabulary. Facts, identities, cache look-ups and the
stage-file producer need only the scalars, the array lengths, the tensor table
and where each metadata entry lies in the file, so this reader walks the
header of the memory-mapped file, keeps small arrays only, and records each
entry's byte span: the stage-file producer copies untouched entries as raw
bytes and the model identity hashes them, neither building Python lists.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ggufpipe_agent.errors import ModelError

# GGUF value types
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL = range(8)
_STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(8, 13)
_SCALARS = {
    _UINT8: "<B",
    _INT8: "<b",
    _UINT16: "<H",
    _INT16: "<h",
    _UINT32: "<I",
    _INT32: "<i",
    _FLOAT32: "<f",
    _BOOL: "<?",
    _UINT64: "<Q",
    _INT64: "<q",
    _FLOAT64: "<d",
}
SCALAR_FORMATS = dict(_SCALARS)
STRING, ARRAY = _STRING, _ARRAY
#: Arrays longer than this are kept as their length only (vocabularies, merges).
SMALL_ARRAY = 4096
#: ``general.alignment`` when the file does not set it (GGUF_DEFAULT_ALIGNMENT).
DEFAULT_ALIGNMENT = 32
_U64 = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]  # ggml order (ne[0] first), as the file stores it
    ggml_type: int
    offset: int  # from the start of the file's tensor data section
    nbytes: int


@dataclass(frozen=True, slots=True)
class LongArray:
    """An array too long to keep: its element type and length."""

    item_type: int
    length: int

    def __len__(self) -> int:
        return self.length


@dataclass(frozen=True, slots=True)
class KeyValueSpan:
    """Where one metadata entry lies in the file: ``[start, end)`` is the whole
    entry (key, value type, value) exactly as a GGUF writer encodes it;
    ``value`` is the offset of its value type."""

    start: int
    value: int
    end: int


@dataclass(frozen=True, slots=True)
class GgufHeader:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: tuple[TensorEntry, ...]
    #: Byte span of every metadata entry, in file order (the order of ``metadata``).
    spans: dict[str, KeyValueSpan]
    value_types: dict[str, int]
    alignment: int
    #: Offset of the tensor data section (the end of the tensor table, aligned).
    data_offset: int
    file_size: int

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelError(f"{self.path}: GGUF has no general.architecture")
        return arch


class _Cursor:
    def __init__(self, data: mmap.mmap, where: Path) -> None:
        self.data = data
        self.offset = 0
        self.where = where

    def truncated(self) -> ModelError:
        return ModelError(f"{self.where}: corrupt or truncated GGUF header")

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.offset + size > len(self.data):
            raise self.truncated()
        (value,) = struct.unpack_from(fmt, self.data, self.offset)
        self.offset += size
        return value

    def string(self) -> str:
        length = self.take("<Q")
        end = self.offset + length
        if end > len(self.data):
            raise self.truncated()
        raw = self.data[self.offset : end]
        self.offset = end
        return raw.decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        # The hot loop of a big vocabulary (262k strings for Gemma 3): locals only.
        data, offset, unpack = self.data, self.offset, _U64.unpack_from
        limit = len(data)
        for _ in range(count):
            if offset + 8 > limit:
                raise self.truncated()
            offset += 8 + unpack(data, offset)[0]
        if offset > limit:
            raise self.truncated()
        self.offset = offset

    def value(self, value_type: int) -> Any:
        if value_type in _SCALARS:
            return self.take(_SCALARS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type = self.take("<I")
            length = self.take("<Q")
            if length > SMALL_ARRAY:
                if item_type in _SCALARS:
                    self.offset += struct.calcsize(_SCALARS[item_type]) * length
                    if self.offset > len(self.data):
                        raise self.truncated()
                elif item_type == _STRING:
                    self.skip_strings(length)
                else:
                    raise ModelError(f"{self.where}: nested GGUF arrays are not supported")
                return LongArray(item_type, length)
            if item_type == _ARRAY:
                raise ModelError(f"{self.where}: nested GGUF arrays are not supported")
            return [self.value(item_type) for _ in range(length)]
        raise ModelError(f"{self.where}: unknown GGUF value type {value_type}")


_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.")


def block_of(name: str, block_count: int, where: object) -> int | None:
    """The block a tensor named ``blk.N.*`` belongs to (None for a global
    tensor); a block beyond ``block_count`` is a broken file (``where``)."""
    match = _BLOCK_TENSOR.match(name)
    if not match:
        return None
    index = int(match.group(1))
    if index >= block_count:
        raise ModelError(f"{where}: tensor {name} beyond block_count {block_count}")
    return index


def align(offset: int, alignment: int) -> int:
    return offset + (-offset % alignment)


def read_header(path: Path) -> GgufHeader:
    """Parse a checked GGUF path; raises ModelError on anything malformed."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            cursor = _Cursor(data, path)
            if cursor.take("<4s") != b"GGUF":
                raise ModelError(f"{path}: not a GGUF file")
            version = cursor.take("<I")
            if version not in (2, 3):
                raise ModelError(f"{path}: GGUF version {version} is not supported")
            tensor_count = cursor.take("<Q")
            kv_count = cursor.take("<Q")
            metadata: dict[str, Any] = {}
            spans: dict[str, KeyValueSpan] = {}
            value_types: dict[str, int] = {}
            for _ in range(kv_count):
                start = cursor.offset
                key = cursor.string()
                value_start = cursor.offset
                value_type = cursor.take("<I")
                metadata[key] = cursor.value(value_type)
                spans[key] = KeyValueSpan(start, value_start, cursor.offset)
                value_types[key] = value_type
            entries = []
            for _ in range(tensor_count):
                name = cursor.string()
                n_dims = cursor.take("<I")
                shape = tuple(cursor.take("<Q") for _ in range(n_dims))
                ggml_type = cursor.take("<I")
                offset = cursor.take("<Q")
                try:
                    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
                except (ValueError, KeyError):
                    raise ModelError(f"{path}: tensor {name} has unknown type {ggml_type}") from None
                elements = 1
                for dim in shape:
                    elements *= dim
                entries.append(TensorEntry(name, shape, ggml_type, offset, elements * type_size // block))
            file_size = len(data)
            alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
            if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
                # gguf_init_from_file refuses the same
                raise ModelError(f"{path}: general.alignment {alignment!r} is not a power of two")
            data_offset = align(cursor.offset, alignment)
    except (OSError, ValueError) as error:
        raise ModelError(f"{path}: cannot read GGUF ({error})") from None
    for entry in entries:
        if data_offset + entry.offset + entry.nbytes > file_size:
            raise ModelError(
                f"{path}: corrupt or truncated GGUF (tensor {entry.name} ends at byte "
                f"{data_offset + entry.offset + entry.nbytes}, the file has {file_size} bytes)"
            )
    return GgufHeader(
        path, version, metadata, tuple(entries), spans, value_types, alignment, data_offset, file_size
    )
