"""Llama-shaped GGUFs of a chosen size, for the stage-file cache and delivery.

Only the headers are what the stage-file code reads (names, shapes, offsets);
the tensor data is random, so nothing compresses or dedups, and the file is
no model llama.cpp could run. A stage file cut from one (any block range) is
as big as the chosen tensors make it, which is what the receiver's and the
cache's tests need of a real model's stage file. And a small GGUF's
writer written out at once (write_out).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

COLUMNS = 1024
BLOCK_PARTS = ("attn_q", "attn_k", "ffn_up", "ffn_down", "ffn_gate", "attn_output")


def write_out(writer: Any) -> None:
    """A ``gguf.GGUFWriter`` whose tensors were added whole: its header,
    key-values and tensors written, the file closed."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def big_model(path: Path, blocks: int = 8, mib_per_tensor: float = 8, seed: int = 0) -> Path:
    """A llama-shaped GGUF: ``token_embd`` and each block's six weights of
    ``mib_per_tensor`` MiB of random float32 each (8 blocks of 8 MiB: ~400 MB),
    written a tensor at a time."""
    import gguf

    rng = np.random.default_rng(seed)
    rows = int(mib_per_tensor * (1 << 20)) // 4 // COLUMNS
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_name("big synthetic")
    for key, value in (("block_count", blocks), ("embedding_length", COLUMNS), ("attention.head_count", 8)):
        writer.add_uint32(f"llama.{key}", value)
    names = ["token_embd.weight", "output_norm.weight"] + [
        f"blk.{block}.{part}.weight" for block in range(blocks) for part in BLOCK_PARTS
    ]

    def shape(name: str) -> tuple[int, ...]:
        return (COLUMNS,) if name == "output_norm.weight" else (rows, COLUMNS)

    for name in names:
        writer.add_tensor_info(name, shape(name), np.dtype(np.float32), int(np.prod(shape(name))) * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name in names:
        writer.write_tensor_data(rng.standard_normal(shape(name), dtype=np.float32))
    writer.close()
    return path
