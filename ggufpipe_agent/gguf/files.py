"""A model's files: one GGUF, or every part of a llama.cpp split set.

Big GGUFs are published as split sets written by llama.cpp's ``gguf-split``
(or ``gguf.GGUFWriter(split_max_tensors=...)``): ``PREFIX-00001-of-0000N.gguf``
... ``PREFIX-0000N-of-0000N.gguf``. Every part carries ``split.no`` (0-based,
uint16), ``split.count`` (uint16) and ``split.tensors.count`` (int32, the
tensors of the whole set); the first part carries all other metadata; the
tensors are spread over the parts. llama.cpp (``llama_model_loader``) loads a
set only from its first part, finds the others by name
(``llama_split_prefix`` / ``llama_split_path``: ``"%s-%05d-of-%05d.gguf"``),
and checks each part's ``split.no`` and the total tensor count; it does this
even for a ``vocab_only`` load, so every use needs the whole set.

:func:`read_model_files` accepts any part, finds and checks the whole set
before anything loads, and refuses an incomplete or mixed set with one error
naming the part at fault. A file without ``split.count`` (or with a count of
0 or 1, as ``gguf-split --merge`` leaves it) is a single-file model.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ggufpipe_agent.errors import ModelError
from ggufpipe_agent.gguf.header import GgufHeader, TensorEntry, read_header

GGUF_MAGIC = b"GGUF"
SPLIT_NO = "split.no"
SPLIT_COUNT = "split.count"
SPLIT_TENSORS_COUNT = "split.tensors.count"


def expand_home(path: str | os.PathLike[str]) -> Path:
    """``path`` with a leading ``~/`` made the agent's own home, and nothing
    else expanded. Paths come over the wire (Inspect, Tokenize, ProvisionStage):
    expanding ``$VAR`` would read the agent's environment back to whoever
    asks (in the error text), and ``~name`` would point at another user's
    files, so neither is."""
    text = os.fspath(path)
    if text == "~" or text.startswith("~/"):
        return Path.home() / text[2:]
    if text.startswith("~"):
        raise ModelError(f"{text}: only ~/ of the agent's own user is expanded; give the full path")
    return Path(text)


def check_gguf_path(path: str | os.PathLike[str]) -> Path:
    """The path, after checking that it exists and starts like a GGUF file.
    Errors name the path and never quote the file's bytes."""
    target = expand_home(path)
    if not target.exists():
        raise ModelError(f"{target}: no such file")
    if not target.is_file():
        raise ModelError(f"{target}: not a regular file")
    try:
        with target.open("rb") as handle:
            magic = handle.read(4)
    except OSError as error:
        raise ModelError(f"{target}: cannot read ({error.strerror})") from None
    if magic != GGUF_MAGIC:
        raise ModelError(f"{target}: not a GGUF file")
    return target


def split_path(prefix: str, index: int, count: int) -> str:
    """llama.cpp's ``llama_split_path``: part ``index`` (0-based) of ``count``."""
    return f"{prefix}-{index + 1:05d}-of-{count:05d}.gguf"


def split_prefix(path: str, index: int, count: int) -> str | None:
    """llama.cpp's ``llama_split_prefix``: the prefix of ``path`` if and only if
    it names part ``index`` (0-based) of ``count``; None otherwise."""
    postfix = f"-{index + 1:05d}-of-{count:05d}.gguf"
    if len(path) > len(postfix) and path.endswith(postfix):
        return path[: -len(postfix)]
    return None


@dataclass(frozen=True, slots=True)
class SourceFile:
    """One file's identity on this host: a change of any field is a new file."""

    path: str
    size: int
    mtime_ns: int
    inode: int


@dataclass(frozen=True, slots=True)
class LocatedTensor:
    part: int  # index into ModelFiles.parts
    entry: TensorEntry


@dataclass(frozen=True, slots=True, eq=False)
class ModelFiles:
    """A model as llama.cpp loads it: ``parts[0]`` holds the metadata and is
    the path to give llama.cpp; tensors may lie in any part. Equal (and
    hashed) by the identity of its files, so results derived from it can be
    cached per model."""

    parts: tuple[GgufHeader, ...]
    sources: tuple[SourceFile, ...]
    tensors: tuple[LocatedTensor, ...]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ModelFiles) and self.sources == other.sources

    def __hash__(self) -> int:
        return hash(self.sources)

    @property
    def first(self) -> Path:
        return self.parts[0].path

    @property
    def metadata(self) -> dict[str, Any]:
        return self.parts[0].metadata

    @property
    def header(self) -> GgufHeader:
        return self.parts[0]

    def get(self, key: str, default: Any = None) -> Any:
        return self.parts[0].metadata.get(key, default)

    @property
    def architecture(self) -> str:
        return self.parts[0].architecture

    @property
    def file_size(self) -> int:
        """Bytes of the whole set."""
        return sum(part.file_size for part in self.parts)

    @property
    def is_split(self) -> bool:
        return len(self.parts) > 1

    def resolved_sources(self) -> tuple[SourceFile, ...]:
        """The files' identities with their real paths (however they were named)."""
        return tuple(SourceFile(os.path.realpath(s.path), s.size, s.mtime_ns, s.inode) for s in self.sources)


def _source(path: Path) -> SourceFile:
    stat = path.stat()
    return SourceFile(str(path), stat.st_size, stat.st_mtime_ns, stat.st_ino)


@functools.lru_cache(maxsize=64)
def _header(source: SourceFile) -> GgufHeader:
    return read_header(Path(source.path))


def read_gguf_header(path: str | os.PathLike[str]) -> GgufHeader:
    """The header of one GGUF file, parsed once per file identity."""
    return _header(_source(check_gguf_path(path)))


def read_model_files(path: str | os.PathLike[str]) -> ModelFiles:
    """The model that ``path`` belongs to: the file itself, or the whole split
    set when it is a part of one (any part). Raises ModelError naming the
    missing or foreign part of an incomplete set."""
    target = check_gguf_path(path)
    source = _source(target)
    header = _header(source)
    count = _split_int(header, SPLIT_COUNT, 0)
    if count <= 1:
        return ModelFiles((header,), (source,), tuple(LocatedTensor(0, t) for t in header.tensors))
    index = _split_int(header, SPLIT_NO, -1)
    if not 0 <= index < count:
        raise ModelError(f"{target}: {SPLIT_COUNT} is {count} but {SPLIT_NO} is missing or out of range")
    prefix = split_prefix(str(target), index, count)
    if prefix is None:
        raise ModelError(
            f"{target}: part {index + 1} of a {count}-part split set, but its name does not end in "
            f"-{index + 1:05d}-of-{count:05d}.gguf (llama.cpp finds the other parts by name)"
        )
    names = [split_path(prefix, part, count) for part in range(count)]
    missing = [name for name in names if not os.path.isfile(name)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelError(
            f"{missing[0]}: missing part {names.index(missing[0]) + 1} of {count} of the split set "
            f"of {target}{more}"
        )
    sources = tuple(source if name == str(target) else _source(check_gguf_path(name)) for name in names)
    parts = tuple(header if item == source else _header(item) for item in sources)
    expected = _split_int(parts[0], SPLIT_TENSORS_COUNT, -1)
    seen: dict[str, int] = {}
    located = []
    for number, part in enumerate(parts):
        where = f"{part.path}: part {number + 1} of the {count}-part split set of {parts[0].path}"
        if _split_int(part, SPLIT_COUNT, 0) != count or _split_int(part, SPLIT_NO, -1) != number:
            raise ModelError(
                f"{where} says it is part {_split_int(part, SPLIT_NO, -1) + 1} of "
                f"{_split_int(part, SPLIT_COUNT, 0)} (a part of another set?)"
            )
        if _split_int(part, SPLIT_TENSORS_COUNT, -1) != expected:
            raise ModelError(
                f"{where} says the set has {_split_int(part, SPLIT_TENSORS_COUNT, -1)} tensors, "
                f"the first part says {expected} (a part of another set?)"
            )
        for entry in part.tensors:
            if entry.name in seen:
                raise ModelError(
                    f"{where} holds tensor {entry.name} again (also in part {seen[entry.name] + 1}); "
                    "a part of another set?"
                )
            seen[entry.name] = number
            located.append(LocatedTensor(number, entry))
    if len(located) != expected:
        raise ModelError(
            f"{parts[0].path}: the {count}-part split set holds {len(located)} tensors, its "
            f"{SPLIT_TENSORS_COUNT} says {expected} (a part of another set?)"
        )
    return ModelFiles(parts, sources, tuple(located))


def _split_int(header: GgufHeader, key: str, default: int) -> int:
    value = header.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelError(f"{header.path}: {key} is not an integer")
    return value
