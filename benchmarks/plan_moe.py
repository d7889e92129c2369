"""The mixture-of-experts worked examples of docs/planning.md: DeepSeek-V3
671B and Qwen3-235B-A22B, both Q4_K_M, planned over named GPU hosts by
ggufpipe's own code, from header-only GGUF files.

No model file is downloaded (there is no internet here but the package
registries): each GGUF is written with its metadata and its full tensor table
(names, shapes, ggml types) and no tensor data, then extended as a *sparse*
file to the size the data would have (it takes a few MB of disk), so that
ggufpipe reads it exactly as an agent reads the real file
(``read_model_facts``: the header, the tensor table, ``memory_facts``).

The tables are built from the published configurations and llama.cpp's
converter and Q4_K_M recipe at the vendored commit (llama-cpp-python 0.3.36):

* DeepSeek-V3 (``deepseek2``): 61 blocks, hidden 7168, the first 3 dense
  (feed-forward 18432), then 256 routed experts of 2048 (8 used) and one
  shared expert; multi-head latent attention with q_lora_rank 1536,
  kv_lora_rank 512, 128 heads of 128 (no-RoPE) + 64 (RoPE) for K and 128
  for V; vocabulary 129280. The converter (conversion/deepseek.py) writes
  ``kv_b_proj`` as ``attn_k_b`` [128, 512, 128] and ``attn_v_b`` [512, 128,
  128] and sets ``head_count_kv = 1`` (MLA as MQA with 576-wide K).
* Qwen3-235B-A22B (``qwen3moe``): 94 blocks, hidden 4096, 64 query heads
  over 4 KV heads of 128, 128 experts of 1536 (8 used), vocabulary 151936,
  untied output.
* Q4_K_M (``llama_tensor_get_type`` in src/llama-quant.cpp): every 2-D and
  3-D weight Q4_K, except ``output.weight`` Q6_K; ``ffn_down*`` (dense,
  ``_exps`` and ``_shexp`` alike: the layer is parsed from the name) and
  ``attn_v`` Q6_K in the blocks where ``use_more_bits(i, n)`` holds;
  ``attn_k_b`` (rows of 128, not a multiple of Q4_K's 256) falls back to
  Q5_0 (``tensor_type_fallback``); the router ``ffn_gate_inp`` is never
  quantized (F32, as the converter writes it), nor are norms and biases.
  With 128 or 256 experts none of the recipe's 8-expert (Mixtral) rules
  apply.

    .venv/bin/python benchmarks/plan_moe.py            # prints the examples
    .venv/bin/python benchmarks/plan_moe.py --docs     # and writes them into docs/planning.md
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.planning_doc import main, markers  # noqa: E402
from ggufpipe_agent.gguf.architectures import check_plan  # noqa: E402
from ggufpipe_agent.gguf.facts import read_model_facts  # noqa: E402
from ggufpipe_agent.gguf.memory import GIB, MIB, format_size  # noqa: E402
from ggufpipe_agent.wire.protocol import Device, Hello, ModelFacts  # noqa: E402
from ggufpipe_tui.commands.plan import placement_json, placement_text  # noqa: E402
from ggufpipe_tui.core.inventory import Inventory, parse_inventory  # noqa: E402
from ggufpipe_tui.core.placement import PlacementError, evaluate  # noqa: E402
from ggufpipe_tui.core.refusal import place_stages  # noqa: E402
from tests.support.synthetic import add_keys  # noqa: E402

Q4_K, Q5_0, Q6_K, F32 = (GGMLQuantizationType[name] for name in ("Q4_K", "Q5_0", "Q6_K", "F32"))
#: LLAMA_FTYPE_MOSTLY_Q4_K_M, as general.file_type.
FILE_TYPE_Q4_K_M = 15
CONTEXT = 8192

Table = list[tuple[str, GGMLQuantizationType, tuple[int, ...]]]  # name, type, shape (ne order)


def nbytes(kind: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    block, size = GGML_QUANT_SIZES[kind]
    elements = 1
    for dim in shape:
        elements *= dim
    assert shape[0] % block == 0, (kind, shape)
    return elements // block * size


def use_more_bits(layer: int, layers: int) -> bool:
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


@dataclass(frozen=True)
class Model:
    file: str
    name: str
    arch: str
    metadata: dict[str, int | float | bool | str]
    table: Table
    vocab: int
    published: str  # the published file's size, as its listing gives it


def deepseek_v3() -> Model:
    hidden, blocks, dense, vocab = 7168, 61, 3, 129280
    heads, q_rank, kv_rank, nope, rope, v_dim = 128, 1536, 512, 128, 64, 128
    experts, expert_ff, dense_ff = 256, 2048, 18432
    table: Table = [
        ("token_embd.weight", Q4_K, (hidden, vocab)),
        ("output_norm.weight", F32, (hidden,)),
        ("output.weight", Q6_K, (hidden, vocab)),
    ]
    for i in range(blocks):
        down = Q6_K if use_more_bits(i, blocks) else Q4_K
        table += [
            (f"blk.{i}.attn_norm.weight", F32, (hidden,)),
            (f"blk.{i}.attn_q_a_norm.weight", F32, (q_rank,)),
            (f"blk.{i}.attn_kv_a_norm.weight", F32, (kv_rank,)),
            (f"blk.{i}.attn_q_a.weight", Q4_K, (hidden, q_rank)),
            (f"blk.{i}.attn_q_b.weight", Q4_K, (q_rank, heads * (nope + rope))),
            (f"blk.{i}.attn_kv_a_mqa.weight", Q4_K, (hidden, kv_rank + rope)),
            (f"blk.{i}.attn_k_b.weight", Q5_0, (nope, kv_rank, heads)),
            (f"blk.{i}.attn_v_b.weight", Q4_K, (kv_rank, v_dim, heads)),
            (f"blk.{i}.attn_output.weight", Q4_K, (heads * v_dim, hidden)),
            (f"blk.{i}.ffn_norm.weight", F32, (hidden,)),
        ]
        if i < dense:
            table += [
                (f"blk.{i}.ffn_gate.weight", Q4_K, (hidden, dense_ff)),
                (f"blk.{i}.ffn_up.weight", Q4_K, (hidden, dense_ff)),
                (f"blk.{i}.ffn_down.weight", down, (dense_ff, hidden)),
            ]
        else:
            table += [
                (f"blk.{i}.ffn_gate_inp.weight", F32, (hidden, experts)),
                (f"blk.{i}.exp_probs_b.bias", F32, (experts,)),
                (f"blk.{i}.ffn_gate_exps.weight", Q4_K, (hidden, expert_ff, experts)),
                (f"blk.{i}.ffn_up_exps.weight", Q4_K, (hidden, expert_ff, experts)),
                (f"blk.{i}.ffn_down_exps.weight", down, (expert_ff, hidden, experts)),
                (f"blk.{i}.ffn_gate_shexp.weight", Q4_K, (hidden, expert_ff)),
                (f"blk.{i}.ffn_up_shexp.weight", Q4_K, (hidden, expert_ff)),
                (f"blk.{i}.ffn_down_shexp.weight", down, (expert_ff, hidden)),
            ]
    metadata: dict[str, int | float | bool | str] = {
        "context_length": 163840,
        "embedding_length": hidden,
        "block_count": blocks,
        "feed_forward_length": dense_ff,
        "attention.head_count": heads,
        "attention.head_count_kv": 1,
        "attention.key_length": kv_rank + rope,
        "attention.value_length": kv_rank,
        "attention.key_length_mla": nope + rope,
        "attention.value_length_mla": v_dim,
        "attention.q_lora_rank": q_rank,
        "attention.kv_lora_rank": kv_rank,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "rope.freq_base": 10000.0,
        "rope.dimension_count": rope,
        "rope.scaling.type": "yarn",
        "rope.scaling.factor": 40.0,
        "rope.scaling.original_context_length": 4096,
        "rope.scaling.yarn_log_multiplier": 0.1,
        "leading_dense_block_count": dense,
        "vocab_size": vocab,
        "expert_count": experts,
        "expert_used_count": 8,
        "expert_shared_count": 1,
        "expert_feed_forward_length": expert_ff,
        "expert_weights_scale": 2.5,
        "expert_weights_norm": True,
        "expert_gating_func": 2,  # sigmoid
    }
    return Model(
        "DeepSeek-V3-Q4_K_M.gguf", "DeepSeek V3", "deepseek2", metadata, table, vocab, "404 GB (377 GiB)"
    )


def qwen3_235b() -> Model:
    hidden, blocks, vocab = 4096, 94, 151936
    heads, kv_heads, head_dim, experts, expert_ff = 64, 4, 128, 128, 1536
    table: Table = [
        ("token_embd.weight", Q4_K, (hidden, vocab)),
        ("output_norm.weight", F32, (hidden,)),
        ("output.weight", Q6_K, (hidden, vocab)),
    ]
    for i in range(blocks):
        more = Q6_K if use_more_bits(i, blocks) else Q4_K
        table += [
            (f"blk.{i}.attn_norm.weight", F32, (hidden,)),
            (f"blk.{i}.attn_q.weight", Q4_K, (hidden, heads * head_dim)),
            (f"blk.{i}.attn_k.weight", Q4_K, (hidden, kv_heads * head_dim)),
            (f"blk.{i}.attn_v.weight", more, (hidden, kv_heads * head_dim)),
            (f"blk.{i}.attn_output.weight", Q4_K, (heads * head_dim, hidden)),
            (f"blk.{i}.attn_q_norm.weight", F32, (head_dim,)),
            (f"blk.{i}.attn_k_norm.weight", F32, (head_dim,)),
            (f"blk.{i}.ffn_norm.weight", F32, (hidden,)),
            (f"blk.{i}.ffn_gate_inp.weight", F32, (hidden, experts)),
            (f"blk.{i}.ffn_gate_exps.weight", Q4_K, (hidden, expert_ff, experts)),
            (f"blk.{i}.ffn_up_exps.weight", Q4_K, (hidden, expert_ff, experts)),
            (f"blk.{i}.ffn_down_exps.weight", more, (expert_ff, hidden, experts)),
        ]
    metadata: dict[str, int | float | bool | str] = {
        "context_length": 40960,
        "embedding_length": hidden,
        "block_count": blocks,
        "feed_forward_length": 12288,
        "attention.head_count": heads,
        "attention.head_count_kv": kv_heads,
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "rope.freq_base": 1000000.0,
        "expert_count": experts,
        "expert_used_count": 8,
        "expert_feed_forward_length": expert_ff,
    }
    return Model(
        "Qwen3-235B-A22B-Q4_K_M.gguf",
        "Qwen3 235B A22B",
        "qwen3moe",
        metadata,
        table,
        vocab,
        "142 GB (133 GiB)",
    )


@contextmanager
def header_only(model: Model) -> Iterator[Path]:
    """The model as a GGUF with its header and no tensor data: a sparse file
    of the real size (the data's pages are never written)."""
    with tempfile.TemporaryDirectory(prefix="plan-moe-") as directory:
        path = Path(directory) / model.file
        writer = GGUFWriter(path, arch=model.arch)
        writer.add_name(model.name)
        writer.add_file_type(FILE_TYPE_Q4_K_M)
        add_keys(writer, model.arch, model.metadata)
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list([f"<t{i}>" for i in range(model.vocab)])  # the count is what matters
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(1)
        for name, kind, shape in model.table:
            writer.add_tensor_info(
                name, tuple(reversed(shape)), np.dtype(np.float32), nbytes(kind, shape), kind
            )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()
        alignment = 32
        data_offset = -(-path.stat().st_size // alignment) * alignment
        data = sum(-(-nbytes(kind, shape) // alignment) * alignment for _, kind, shape in model.table)
        os.truncate(path, data_offset + data)  # sparse: no data written
        yield path


# ----------------------------------------------------------------- hosts

#: Free memory after the agent's CUDA context, an assumption (the agent
#: reports the real figure): 23.5 GiB of a 24 GiB card, 79 GiB of an 80 GiB one.
GPU_24 = ("NVIDIA GeForce RTX 4090", 24 * GIB, 23 * GIB + 512 * MIB)
GPU_80 = ("NVIDIA H100 80GB HBM3", 80 * GIB, 79 * GIB)


@dataclass(frozen=True)
class Hosts:
    title: str
    names: tuple[str, ...]
    gpu: tuple[str, int, int]
    ram: int  # total; the Hello's available RAM is 2 GiB less (an assumption)


FOUR_SMALL = Hosts(
    "four hosts with one 24 GiB GPU and 128 GiB of RAM each",
    ("gpu-a", "gpu-b", "gpu-c", "gpu-d"),
    GPU_24,
    128 * GIB,
)
TWO_BIG = Hosts(
    "two hosts with one 80 GiB GPU and 256 GiB of RAM each", ("h100-a", "h100-b"), GPU_80, 256 * GIB
)
FOUR_SHORT = Hosts(
    "four hosts with one 24 GiB GPU and 64 GiB of RAM each",
    ("gpu-a", "gpu-b", "gpu-c", "gpu-d"),
    GPU_24,
    64 * GIB,
)


def hellos(hosts: Hosts) -> list[Hello | None]:
    description, total, free = hosts.gpu
    gpu = Device("CUDA0", description, total, free)
    return [
        Hello(
            9,
            "0.1.0",
            name,
            1,
            "3.11",
            "0.3.36",
            "cuda",
            True,
            (gpu,),
            hosts.ram,
            hosts.ram - 2 * GIB,
            "unix:/x",
            "t",
        )
        for name in hosts.names
    ]


def inventory(model: Model, hosts: Hosts) -> Inventory:
    lines = "".join(f"  {name}: {{address: 10.0.0.{11 + i}}}\n" for i, name in enumerate(hosts.names))
    stages = "".join(f"  - {{host: {name}}}\n" for name in hosts.names)
    text = f"model: {{path: /models/{model.file}}}\nhosts:\n{lines}stages:\n{stages}run: {{context: {CONTEXT}}}\n"
    return parse_inventory(text, Path("inventory.yaml"))


# ---------------------------------------------------------------- output


def tensor_types_text(model: Model) -> str:
    rows: dict[tuple[str, str, str], list[int]] = {}
    for name, kind, shape in model.table:
        short = name.split(".", 2)[-1] if name.startswith("blk.") else name
        key = (short, kind.name, "x".join(map(str, shape)))
        rows.setdefault(key, [0, 0])
        rows[key][0] += 1
        rows[key][1] += nbytes(kind, shape)
    lines = ["| tensor | type | shape (ne) | count | bytes |", "|---|---|---|---|---|"]
    for (short, kind, shape), (count, total) in rows.items():
        lines.append(f"| {short} | {kind} | {shape} | {count} | {total:,} |")
    every = sum(nbytes(kind, shape) for _, kind, shape in model.table)
    lines.append(
        f"| **all tensors** | | | {len(model.table)} | {every:,} ({every / 1e9:.1f} GB, {format_size(every)}) |"
    )
    return "\n".join(lines)


def plan_text(model: Model, facts: ModelFacts, hosts: Hosts, show_json: bool) -> str:
    inv = inventory(model, hosts)
    agents = hellos(hosts)
    refusal = ""
    try:
        placement = place_stages(inv, facts, agents)
    except PlacementError as error:
        placement, refusal = error.placement, str(error)
    assert placement == evaluate(inv, facts, agents)
    check_plan(facts, list(placement.ranges), "benchmarks/plan_moe.py")  # the family accepts the cuts
    description, total, free = hosts.gpu
    parts = [
        f"#### {model.name} on {hosts.title}",
        "",
        f"Hosts {', '.join(hosts.names)}: each one {description} ({format_size(free)} free of "
        f"{format_size(total)}), {format_size(hosts.ram)} of RAM ({format_size(hosts.ram - 2 * GIB)} "
        "available), `experts: auto`; context 8192. `--plan` prints:",
        "",
        "```",
        placement_text(placement, inv, facts),
        *([f"ggufpipe: error: {refusal}"] if refusal else []),
        "```",
        "",
    ]
    if show_json:
        report = placement_json(placement, inv, facts, refusal)
        shown = {key: report[key] for key in ("model", "architecture", "blocks", "context", "fits")}
        shown["stages"] = report["stages"][:1]
        parts += [
            "`--plan --json` (its stage 0; every stage has `experts` and `expert_bytes`):",
            "",
            "```json",
            json.dumps(shown, indent=1),
            "```",
            "",
        ]
    return "\n".join(parts)


def example() -> str:
    parts = []
    for model, plans in (
        (qwen3_235b(), ((TWO_BIG, False), (FOUR_SMALL, False))),
        (deepseek_v3(), ((FOUR_SMALL, True), (TWO_BIG, False), (FOUR_SHORT, False))),
    ):
        every = sum(nbytes(kind, shape) for _, kind, shape in model.table)
        with header_only(model) as path:
            facts = read_model_facts(path)
        experts = sum(facts.memory.expert_bytes) if facts.memory else 0
        parts += [
            f"### {model.name} Q4_K_M ({model.arch})",
            "",
            "Tensor table (built from the configuration and llama.cpp's Q4_K_M recipe, not read from a "
            "published file):",
            "",
            tensor_types_text(model),
            "",
            f"Tensors {every:,} bytes ({every / 1e9:.1f} GB, {format_size(every)}); the published "
            f"Q4_K_M is listed at about {model.published}. Routed experts: {format_size(experts)} "
            f"({experts / every:.0%}).",
            "",
        ]
        for hosts, show_json in plans:
            parts.append(plan_text(model, facts, hosts, show_json))
    return "\n".join(parts)


BEGIN, END = markers("plan_moe.py")


if __name__ == "__main__":
    main("plan_moe.py", example)
