"""A model's identity: what two hosts compare to know they hold the same model.

:class:`ModelIdentity` is computed from a model's header alone
(:func:`model_identity`, a few milliseconds even for a 262k-token vocabulary):

* **Metadata**: every key and its value, as the exact bytes of the value's
  type and encoding in the file (vocabularies, merges and scores included,
  hashed straight from the file, never parsed into Python lists). The
  ``split.*`` keys are left out, so a split set and its single file are the
  same model (``GGUF.*`` are not keys in the file: GGUFReader's pseudo-fields,
  never read here).
* **Tensor table**: every tensor's name, shape, ggml type and byte size. Not
  the offsets, which differ between a split set and its single file and
  with the alignment, and not the order of the tensors.

**Tensor data is not hashed.** That would read the whole model (tens of GB)
on every host at every start. A copy that matches in metadata and tensor
table is the same conversion of the same model with the same quantization;
what it cannot tell apart is two files that differ only in weights (a
fine-tune that keeps its base's name and every other key, or bit rot inside a
tensor). The stage-file cache covers the second where it matters for
delivery: every stage file carries a digest of its full contents, checked
before use (:mod:`ggufpipe_agent.stagefiles.cache`).

:func:`describe_difference` says in one sentence what differs between two
identities; the per-key and per-tensor entries exist for that sentence.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable
from typing import Any

from ggufpipe_agent.gguf.files import ModelFiles, read_model_files
from ggufpipe_agent.gguf.header import LongArray
from ggufpipe_agent.wire.records import MetadataDigest, ModelIdentity, TensorSignature

_KEY_DIGEST_HEX = 16  # 64 bits per key: only to say which key differs
_EXCLUDED_PREFIXES = ("split.", "GGUF.")
_PREVIEW = 40


def model_identity(path: str | os.PathLike[str] | ModelFiles) -> ModelIdentity:
    """The identity of a model given its file, any part of its split set, or
    its :class:`ModelFiles`; cached per identity of the files."""
    files = path if isinstance(path, ModelFiles) else read_model_files(path)
    return _identity(files)


@functools.lru_cache(maxsize=16)
def _identity(files: ModelFiles) -> ModelIdentity:
    header = files.header
    keys = sorted(key for key in header.metadata if not key.startswith(_EXCLUDED_PREFIXES))
    digests = {}
    fd = os.open(header.path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for key in keys:
            span = header.spans[key]
            digest = hashlib.sha256()
            position, remaining = span.value, span.end - span.value
            while remaining:  # bounded reads: a vocabulary is megabytes
                data = os.pread(fd, min(remaining, 1 << 22), position)
                if not data:
                    break
                digest.update(data)
                position += len(data)
                remaining -= len(data)
            digests[key] = digest.hexdigest()
    finally:
        os.close(fd)
    metadata_hash = hashlib.sha256()
    entries = []
    for key in keys:
        metadata_hash.update(f"{key}\0{digests[key]}\n".encode())
        preview = _preview(header.metadata[key], header.value_types[key])
        entries.append(MetadataDigest(key, digests[key][:_KEY_DIGEST_HEX], preview))
    signatures = sorted(
        (
            TensorSignature(t.entry.name, t.entry.shape, t.entry.ggml_type, t.entry.nbytes)
            for t in files.tensors
        ),
        key=lambda signature: signature.name,
    )
    tensors_hash = hashlib.sha256()
    for signature in signatures:
        dims = ",".join(map(str, signature.shape))
        tensors_hash.update(f"{signature.name}\0{dims}\0{signature.ggml_type}\0{signature.nbytes}\n".encode())
    metadata_digest = metadata_hash.hexdigest()
    tensors_digest = tensors_hash.hexdigest()
    return ModelIdentity(
        digest=hashlib.sha256(f"{metadata_digest}:{tensors_digest}".encode()).hexdigest(),
        metadata_digest=metadata_digest,
        tensors_digest=tensors_digest,
        name=str(header.get("general.name", "") or ""),
        metadata=tuple(entries),
        tensors=tuple(signatures),
    )


def _preview(value: Any, value_type: int) -> str:
    if isinstance(value, LongArray):
        return f"[{value.length} items]"
    if isinstance(value, list):
        text = repr(value)
        return text if len(text) <= _PREVIEW else f"[{len(value)} items]"
    text = repr(value)
    return text if len(text) <= _PREVIEW else text[: _PREVIEW - 3] + "..."


def type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def describe_difference(a: ModelIdentity, b: ModelIdentity) -> str:
    """One sentence saying what differs from ``a`` to ``b`` ("X vs Y" reads
    a's value first); '' when they are the same model."""
    if a.digest == b.digest:
        return ""
    parts = []
    if a.metadata_digest != b.metadata_digest:
        parts.append(_metadata_difference(a, b))
    if a.tensors_digest != b.tensors_digest:
        parts.append(_tensor_difference(a, b))
    return "; ".join(parts) or "the identities differ"


def _metadata_difference(a: ModelIdentity, b: ModelIdentity) -> str:
    if not a.metadata or not b.metadata:
        return "the metadata differs"

    def differs(x: Any, y: Any) -> str:
        if x.digest == y.digest:
            return ""
        return f" differs ({x.preview} vs {y.preview})" if x.preview != y.preview else " differs"

    left = {entry.key: entry for entry in a.metadata}
    right = {entry.key: entry for entry in b.metadata}
    changed = _changes("metadata", left, right, sorted(set(left) | set(right)), differs)
    return _summarize(changed, "metadata keys differ", "the metadata differs")


def _tensor_difference(a: ModelIdentity, b: ModelIdentity) -> str:
    if not a.tensors or not b.tensors:
        return "the tensor table differs"

    def differs(x: Any, y: Any) -> str:
        if x.ggml_type != y.ggml_type:
            return f": type {type_name(x.ggml_type)} vs {type_name(y.ggml_type)}"
        if x.shape != y.shape:
            return f": shape {list(x.shape)} vs {list(y.shape)}"
        if x.nbytes != y.nbytes:
            return f": {x.nbytes} vs {y.nbytes} bytes"
        return ""

    left = {tensor.name: tensor for tensor in a.tensors}
    right = {tensor.name: tensor for tensor in b.tensors}
    changed = _changes("tensor", left, right, sorted(set(left) | set(right), key=_natural), differs)
    return _summarize(changed, "tensors differ", "the tensor table differs")


def _changes(
    kind: str,
    left: dict[str, Any],
    right: dict[str, Any],
    names: list[str],
    differs: Callable[[Any, Any], str],
) -> list[str]:
    """What differs of each of ``names`` between two tables: only in one of
    them, or ``differs(x, y)`` ('' when alike) after the name."""
    changed = []
    for name in names:
        x, y = left.get(name), right.get(name)
        if x is None:
            changed.append(f"{kind} {name} only in the second")
        elif y is None:
            changed.append(f"{kind} {name} only in the first")
        elif what := differs(x, y):
            changed.append(f"{kind} {name}{what}")
    return changed


def _summarize(changed: list[str], plural: str, fallback: str) -> str:
    if not changed:
        return fallback
    if len(changed) == 1:
        return changed[0]
    return f"{len(changed)} {plural}, first {changed[0]}"


def _natural(name: str) -> list[tuple[int, int, str]]:
    """blk.2 before blk.10: the first difference named is the lowest block."""
    return [(0, int(piece), "") if piece.isdigit() else (1, 0, piece) for piece in name.split(".")]
