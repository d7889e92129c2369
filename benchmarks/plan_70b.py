"""The worked example of docs/planning.md: Llama 3.1 70B Q4_K_M over three
hosts with one 24 GiB GPU each, planned by ggufpipe's own placement code.

No 70B file is needed: the tensor table is built from the published
architecture (hidden 8192, 80 blocks, 64 heads over 8 KV heads of 128, FFN
28672, vocabulary 128256) and llama.cpp's Q4_K_M recipe
(``llama_tensor_get_type`` in src/llama-quant.cpp):

* every 2-D weight Q4_K (token_embd too: Q4_K_M leaves it at the default);
* ``output.weight`` Q6_K;
* ``ffn_down`` and ``attn_v`` Q6_K in the blocks where ``use_more_bits(i, 80)``
  holds (``i < 10 or i >= 70 or (i - 10) % 3 == 2``: 40 blocks), and for a
  70B model the other blocks' ``attn_v`` Q5_K instead of Q4_K;
* norms and ``rope_freqs`` (Llama 3.1's RoPE factors, 64 values) F32.

Bytes per tensor are ``elements / block * type_size`` with the block sizes of
``gguf.GGML_QUANT_SIZES``.

    .venv/bin/python benchmarks/plan_70b.py             # prints the example's tables
    .venv/bin/python benchmarks/plan_70b.py --docs      # and writes them into docs/planning.md
"""

from __future__ import annotations

import sys
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.planning_doc import main, markers  # noqa: E402
from ggufpipe_agent.gguf.memory import GIB, MIB, format_size  # noqa: E402
from ggufpipe_agent.wire.protocol import Device, Hello, MemoryFacts, ModelFacts  # noqa: E402
from ggufpipe_tui.core.inventory import parse_inventory  # noqa: E402
from ggufpipe_tui.core.placement import MARGIN, Placement, PlacementError, evaluate  # noqa: E402
from ggufpipe_tui.core.refusal import place_stages  # noqa: E402

HIDDEN, BLOCKS, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 8192, 80, 64, 8, 128, 28672, 128256
Q4_K, Q5_K, Q6_K, F32 = (GGMLQuantizationType[name] for name in ("Q4_K", "Q5_K", "Q6_K", "F32"))
#: A 24 GiB card (RTX 3090/4090 class) after the agent's CUDA context: an
#: assumption, stated; the agent reports the real free figure.
GPU_TOTAL, GPU_FREE = 24 * GIB, 23 * GIB + 512 * MIB
RAM = 64 * GIB


def nbytes(kind: GGMLQuantizationType, *shape: int) -> int:
    block, size = GGML_QUANT_SIZES[kind]
    elements = 1
    for dim in shape:
        elements *= dim
    assert elements % block == 0
    return elements // block * size


def use_more_bits(layer: int, layers: int) -> bool:
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_table() -> list[tuple[str, GGMLQuantizationType, tuple[int, ...], int]]:
    """(name, type, shape, bytes) of every tensor, in GGUF order."""
    kv = KV_HEADS * HEAD_DIM
    table = [
        ("token_embd.weight", Q4_K, (HIDDEN, VOCAB)),
        ("rope_freqs.weight", F32, (HEAD_DIM // 2,)),
        ("output_norm.weight", F32, (HIDDEN,)),
        ("output.weight", Q6_K, (HIDDEN, VOCAB)),
    ]
    for i in range(BLOCKS):
        more = use_more_bits(i, BLOCKS)
        table += [
            (f"blk.{i}.attn_norm.weight", F32, (HIDDEN,)),
            (f"blk.{i}.attn_q.weight", Q4_K, (HIDDEN, HEADS * HEAD_DIM)),
            (f"blk.{i}.attn_k.weight", Q4_K, (HIDDEN, kv)),
            (f"blk.{i}.attn_v.weight", Q6_K if more else Q5_K, (HIDDEN, kv)),
            (f"blk.{i}.attn_output.weight", Q4_K, (HEADS * HEAD_DIM, HIDDEN)),
            (f"blk.{i}.ffn_norm.weight", F32, (HIDDEN,)),
            (f"blk.{i}.ffn_gate.weight", Q4_K, (HIDDEN, FFN)),
            (f"blk.{i}.ffn_up.weight", Q4_K, (HIDDEN, FFN)),
            (f"blk.{i}.ffn_down.weight", Q6_K if more else Q4_K, (FFN, HIDDEN)),
        ]
    return [(name, kind, shape, nbytes(kind, *shape)) for name, kind, shape in table]


def facts() -> ModelFacts:
    table = tensor_table()
    size = {name: count for name, _, _, count in table}
    blocks = tuple(
        sum(count for name, _, _, count in table if name.startswith(f"blk.{i}.")) for i in range(BLOCKS)
    )
    memory = MemoryFacts(
        block_bytes=blocks,
        token_embd_bytes=size["token_embd.weight"],
        output_norm_bytes=size["output_norm.weight"],
        output_bytes=size["output.weight"],
        global_bytes=size["rope_freqs.weight"],
        kv_widths=(KV_HEADS * 2 * HEAD_DIM,) * BLOCKS,
        swa_blocks=(False,) * BLOCKS,
        sliding_window=0,
        n_embd=HIDDEN,
        n_vocab=VOCAB,
        n_ff=FFN,
        q_width=HEADS * HEAD_DIM,
    )
    return ModelFacts(
        path="/models/Llama-3.1-70B-Instruct-Q4_K_M.gguf",
        name="Llama 3.1 70B Instruct",
        architecture="llama",
        file_type="Q4_K_M",
        file_size=sum(count for *_, count in table),
        block_count=BLOCKS,
        hidden_dim=HIDDEN,
        context_length=131072,
        vocab_size=VOCAB,
        head_count=HEADS,
        head_count_kv=KV_HEADS,
        key_length=HEAD_DIM,
        value_length=HEAD_DIM,
        bos_token_id=128000,
        eos_token_id=128009,
        eog_token_ids=(128001, 128008, 128009),
        add_bos=True,
        chat_template="",
        block_bytes=blocks,
        embedding_bytes=size["token_embd.weight"],
        output_bytes=size["output_norm.weight"] + size["output.weight"],
        memory=memory,
    )


def hello(index: int) -> Hello:
    gpu = Device("CUDA0", "NVIDIA GeForce RTX 4090", GPU_TOTAL, GPU_FREE)
    return Hello(
        2, "0.1.0", f"gpu-{index}", 1, "3.11", "0.3.36", "cuda", True, (gpu,), RAM, RAM, "unix:/x", "t"
    )


EVERY_HOST = "  - {host: gpu-a}\n  - {host: gpu-b}\n  - {host: gpu-c}\n"


def inventory(context: int, stages: str = EVERY_HOST):
    text = (
        "model: {path: /models/Llama-3.1-70B-Instruct-Q4_K_M.gguf}\n"
        "hosts:\n  gpu-a: {address: 10.0.0.11}\n  gpu-b: {address: 10.0.0.12}\n  gpu-c: {address: 10.0.0.13}\n"
        f"stages:\n{stages}"
        f"run: {{context: {context}}}\n"
    )
    return parse_inventory(text, Path("inventory.yaml"))


def tensor_types_text() -> str:
    table = tensor_table()
    rows = {}
    for name, kind, shape, count in table:
        short = name.split(".", 2)[-1] if name.startswith("blk.") else name
        key = (short, kind.name, "x".join(map(str, shape)))
        rows.setdefault(key, [0, 0])
        rows[key][0] += 1
        rows[key][1] += count
    lines = ["| tensor | type | shape (ne) | count | bytes |", "|---|---|---|---|---|"]
    for (short, kind, shape), (count, total) in rows.items():
        lines.append(f"| {short} | {kind} | {shape} | {count} | {total:,} |")
    every = sum(count for *_, count in table)
    lines.append(f"| **all tensors** | | | {len(table)} | {every:,} ({format_size(every)}) |")
    return "\n".join(lines)


def placement_text(placement: Placement) -> str:
    lines = [
        "| stage | host | layers | GPU: weights + KV + compute = need | RAM: weights + compute + outputs + agent |",
        "|---|---|---|---|---|",
    ]
    for stage in placement.stages:
        gpu = stage.memory.devices[0]
        ram = stage.memory.host
        lines.append(
            f"| {stage.index} | {stage.host} | [{stage.layers[0]}, {stage.layers[1]}) "
            f"| {format_size(gpu.weights)} + {format_size(gpu.kv)} + {format_size(gpu.compute)} "
            f"= **{format_size(gpu.total)}** "
            f"| {format_size(ram.weights)} + {format_size(ram.compute)} + {format_size(ram.outputs)} "
            f"+ {format_size(ram.runtime)} = {format_size(ram.total)} |"
        )
    pools = [pool for pool in placement.pools if pool.place != "RAM"]
    lines.append("")
    lines.append(
        "GPU pools (usable = free less the 512 MiB reserve; a pool fits when need x "
        f"{1 + MARGIN:g} <= usable): "
        + "; ".join(
            f"{pool.host} {format_size(int(pool.needed * (1 + MARGIN)))} of {format_size(pool.usable)}"
            + ("" if pool.fits else " (over)")
            for pool in pools
        )
    )
    return "\n".join(lines)


def example() -> str:
    model = facts()
    parts = [
        "Tensor table (Q4_K_M as llama.cpp's recipe types it):",
        "",
        tensor_types_text(),
        "",
        f"Context 8192 (batch 2048, ubatch 512): `--plan` over gpu-a, gpu-b, gpu-c, each one 24 GiB GPU "
        f"with {format_size(GPU_FREE)} free and {format_size(RAM)} of RAM:",
        "",
        placement_text(evaluate(inventory(8192), model, [hello(i) for i in range(3)])),
        "",
    ]
    for context in (32768, 131072):
        hellos = [hello(i) for i in range(3)]
        try:
            placement = place_stages(inventory(context), model, hellos)
            parts += [f"Context {context} fits:", "", placement_text(placement), ""]
        except PlacementError as error:
            parts += [f"Context {context} (the model's own) is refused before anything loads:", ""]
            parts += [f"> {error}", "", placement_text(error.placement), ""]
    return "\n".join(parts) + "\n"


BEGIN, END = markers("plan_70b.py")


if __name__ == "__main__":
    main("plan_70b.py", example)
