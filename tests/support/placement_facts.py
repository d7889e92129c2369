"""A model of 20 blocks of 100 MiB and the agents' Hellos, for the placement
tests (tests/unit/test_placement.py, test_spares.py): pure, no model file."""

from __future__ import annotations

from ggufpipe_agent.gguf.memory import GIB, MIB
from ggufpipe_agent.wire.protocol import Device, Hello, MemoryFacts
from tests.support.model_facts import model_facts

BLOCKS = 20
MEMORY = MemoryFacts(
    block_bytes=(100 * MIB,) * BLOCKS,
    token_embd_bytes=200 * MIB,
    output_norm_bytes=1 * MIB,
    output_bytes=0,
    global_bytes=0,
    kv_widths=(2048,) * BLOCKS,  # 4 KV heads of 128, K and V
    swa_blocks=(False,) * BLOCKS,
    sliding_window=0,
    n_embd=2048,
    n_vocab=32000,
    n_ff=8192,
    q_width=2048,
)
FACTS = model_facts(
    path="/m.gguf",
    name="test",
    file_type="Q4_K",
    file_size=2200 * MIB,
    block_count=BLOCKS,
    hidden_dim=2048,
    vocab_size=32000,
    head_count=16,
    head_count_kv=4,
    key_length=128,
    value_length=128,
    eog_token_ids=(2,),
    block_bytes=MEMORY.block_bytes,
    embedding_bytes=200 * MIB,
    output_bytes=1 * MIB,
    memory=MEMORY,
)


def hello(ram: int = 64 * GIB, gpus: tuple[tuple[int, int], ...] = ()) -> Hello:
    """An agent's Hello: RAM available, GPUs as (total, free)."""
    return Hello(
        protocol=2,
        version="0.1.0",
        hostname="h",
        pid=1,
        python="3.11",
        llama_cpp="0.3.36",
        backend="cuda" if gpus else "cpu",
        gpu_offload=bool(gpus),
        devices=tuple(Device(f"CUDA{i}", f"GPU {i}", total, free) for i, (total, free) in enumerate(gpus)),
        memory_total=ram,
        memory_available=ram,
        data_endpoint="unix:/x",
        data_token="t",
    )
