"""Model facts read lazily from a GGUF file (no tensor data is loaded).

:mod:`ggufpipe_agent.gguf_header` walks only the memory-mapped header (the
metadata and the tensor table), so this is cheap even for a file of tens of
GB; the results are cached per file identity. ``gguf.GGUFReader`` is used only
where tensors are copied (stage files).
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any

from ggufpipe_agent.errors import ModelError
from ggufpipe_agent.gguf_header import GgufHeader, read_header
from ggufpipe_agent.protocol import ModelFacts

GGUF_MAGIC = b"GGUF"
_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.")


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


def open_reader(path: str | os.PathLike[str]) -> Any:
    """A full ``gguf.GGUFReader`` (slow on big vocabularies: only for copying
    tensors); parse errors become ModelError."""
    import gguf

    target = check_gguf_path(path)
    try:
        return gguf.GGUFReader(target, "r")
    except (ValueError, OSError, IndexError, KeyError) as error:
        raise ModelError(f"{target}: corrupt or truncated GGUF ({error})") from None


def read_gguf_header(path: str | os.PathLike[str]) -> GgufHeader:
    return read_header(check_gguf_path(path))


def _scalar(value: Any) -> int:
    """Per-layer hyperparameters may be arrays; the widest value bounds memory."""
    if isinstance(value, list):
        return int(max(value)) if value else 0
    return int(value)


def read_model_facts(path: str | os.PathLike[str]) -> ModelFacts:
    """The facts of a GGUF file, parsed once per file identity (path, size,
    mtime): every prompt's Tokenize and every run's preparation ask again."""
    target = check_gguf_path(path)
    stat = target.stat()
    return _facts(str(target), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _facts(path: str, _size: int, _mtime_ns: int) -> ModelFacts:
    header = read_header(Path(path))
    source = header.path
    arch = header.architecture

    def need(key: str) -> Any:
        value = header.get(f"{arch}.{key}")
        if value is None:
            raise ModelError(f"{source}: GGUF lacks {arch}.{key}")
        return value

    block_count = int(need("block_count"))
    hidden = int(need("embedding_length"))
    head_count = _scalar(need("attention.head_count"))
    head_count_kv = _scalar(header.get(f"{arch}.attention.head_count_kv", head_count))
    head_dim = hidden // head_count if head_count else 0
    tokens = header.get("tokenizer.ggml.tokens")
    vocab_size = len(tokens) if tokens is not None else int(need("vocab_size"))
    eos = int(header.get("tokenizer.ggml.eos_token_id", -1))
    eog = {eos} if eos >= 0 else set()
    for key in ("eot_token_id", "eom_token_id"):
        value = header.get(f"tokenizer.ggml.{key}")
        if value is not None:
            eog.add(int(value))

    block_bytes = [0] * block_count
    embedding_bytes = 0
    output_bytes = 0
    for tensor in header.tensors:
        match = _BLOCK_TENSOR.match(tensor.name)
        if match:
            index = int(match.group(1))
            if index >= block_count:
                raise ModelError(f"{source}: tensor {tensor.name} beyond block_count {block_count}")
            block_bytes[index] += tensor.nbytes
        elif tensor.name == "token_embd.weight":
            embedding_bytes += tensor.nbytes
        else:
            output_bytes += tensor.nbytes

    return ModelFacts(
        path=str(source),
        name=str(header.get("general.name", "") or ""),
        architecture=arch,
        file_type=_file_type_name(header.get("general.file_type")),
        file_size=source.stat().st_size,
        block_count=block_count,
        hidden_dim=hidden,
        context_length=int(header.get(f"{arch}.context_length", 0) or 0),
        vocab_size=vocab_size,
        head_count=head_count,
        head_count_kv=head_count_kv,
        key_length=int(header.get(f"{arch}.attention.key_length", head_dim)),
        value_length=int(header.get(f"{arch}.attention.value_length", head_dim)),
        bos_token_id=int(header.get("tokenizer.ggml.bos_token_id", -1)),
        eos_token_id=eos,
        eog_token_ids=tuple(sorted(eog)),
        add_bos=bool(header.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=str(header.get("tokenizer.chat_template", "") or ""),
        block_bytes=tuple(block_bytes),
        embedding_bytes=embedding_bytes,
        output_bytes=output_bytes,
    )


def _file_type_name(value: Any) -> str:
    if value is None:
        return "unknown"
    import gguf

    try:
        name = gguf.LlamaFileType(int(value)).name
    except ValueError:
        return f"type {value}"
    return name.removeprefix("MOSTLY_")


def kv_bytes_per_token(facts: ModelFacts, blocks: int) -> int:
    """KV cache bytes per context position for ``blocks`` blocks (f16 K and V)."""
    return blocks * facts.head_count_kv * (facts.key_length + facts.value_length) * 2


def estimate_stage_bytes(facts: ModelFacts, start: int, end: int, n_ctx: int, last: bool) -> int:
    """Rough resident memory of a stage: its weights, embeddings, KV cache."""
    weights = sum(facts.block_bytes[start:end]) + facts.embedding_bytes
    if last:
        weights += facts.output_bytes
    return weights + kv_bytes_per_token(facts, end - start) * n_ctx
