"""Model facts read lazily from a GGUF model (no tensor data is loaded).

:mod:`ggufpipe_agent.gguf.header` walks only the memory-mapped header (the
metadata and the tensor table), so this is cheap even for tens of GB; a split
set (:mod:`ggufpipe_agent.gguf.files`) is read whole from any of its parts.
The results are cached per identity of every file of the model.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from ggufpipe_agent.errors import ModelError
from ggufpipe_agent.gguf.files import (
    GGUF_MAGIC,
    ModelFiles,
    check_gguf_path,
    read_gguf_header,
    read_model_files,
)
from ggufpipe_agent.gguf.header import block_of
from ggufpipe_agent.gguf.memory import memory_facts
from ggufpipe_agent.wire.protocol import ModelFacts

__all__ = [
    "GGUF_MAGIC",
    "check_gguf_path",
    "read_gguf_header",
    "read_model_facts",
]


def _scalar(value: Any) -> int:
    """Per-layer hyperparameters may be arrays; the widest value bounds memory."""
    if isinstance(value, list):
        return int(max(value)) if value else 0
    return int(value)


def read_model_facts(path: str | os.PathLike[str]) -> ModelFacts:
    """The facts of a GGUF model, given its file or any part of its split set.

    ``path`` in the facts is the file to give llama.cpp (a set's first part);
    ``file_size`` is the whole set's. Parsed once per identity of the model's
    files: every prompt's Tokenize and every run's preparation ask again."""
    files = read_model_files(path)
    return _facts(files)


@functools.lru_cache(maxsize=8)
def _facts(files: ModelFiles) -> ModelFacts:
    header = files.header
    source = files.first
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
    for located in files.tensors:
        tensor = located.entry
        index = block_of(tensor.name, block_count, source)
        if index is not None:
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
        file_size=files.file_size,
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
        memory=memory_facts(header, [located.entry for located in files.tensors]),
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
