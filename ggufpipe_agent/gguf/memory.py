"""What a stage needs in memory, from the GGUF alone.

A stage is one llama.cpp model and context (:mod:`ggufpipe_agent.llama.engine`), so
its memory is what llama.cpp allocates for it, in the places llama.cpp puts it:

* **weights**: the tensor bytes of its blocks (a mixture of experts' 3-D
  ``*_exps`` tensors, its router ``ffn_gate_inp`` and shared experts
  ``*_shexp`` included: every ``blk.N.*`` tensor, sized from its shape and
  ggml type); ``token_embd`` on every stage (stage files always carry it and
  llama.cpp keeps the input layer in host memory); the output norm and
  projection where llama.cpp puts the output layer. A stage file has
  ``output.weight`` only on the last stage, unless the architecture keeps it
  in every stage (``Architecture.keep_tensors``: gpt-oss, minimax-m2); every
  stage without it (and a model with tied embeddings) gets llama.cpp's
  ``TENSOR_DUPLICATED`` copy of ``token_embd`` as its projection: free on the
  CPU (the same mapped bytes), a real copy on a GPU.
* **experts in RAM** (``EngineOptions.experts_in_ram``, llama.cpp's
  ``--cpu-moe``): the routed experts (``EXPERTS_PATTERN``) of the offloaded
  blocks stay in RAM, the rest of those blocks goes to the GPU. A prompt
  ubatch of at least ``OP_OFFLOAD_MIN_BATCH`` tokens still runs the experts
  on the GPU: ggml's scheduler copies each expert tensor there, one at a
  time (a new split per offloaded weight), so that GPU's compute buffer also
  holds the largest one; with smaller ubatches the CPU runs them and its
  compute buffer holds the feed-forward phase.
* **KV cache**: per block ``cells * (K + V widths) * 2`` bytes (f16), where
  ``cells`` is the context padded to 256. Sliding-window blocks (gemma3) get
  the full context too: llama.cpp's default ``swa_full = true`` is what the
  engine runs with.
* **compute buffer**: llama.cpp reserves the worst-case graph, a micro-batch
  of ``n_ubatch`` tokens that are all outputs, so every stage's graph holds
  the logits ``n_ubatch * n_vocab * 4`` even where the engine stops the graph
  before them. Measured (benchmarks/calibrate_memory.py) the peak is the
  largest of three phases (flash attention, as the engine runs):
  logits ``n_ub * (n_vocab + 2 n_embd) * 4``, feed-forward
  ``n_ub * (3 n_ff + 4 n_embd) * 4 + masks`` and attention
  ``n_ub * (2 n_embd + 2 q + kv) * 4 + masks``, a mask being
  ``cells * n_ub * 2`` bytes (two for a sliding-window model).
* **outputs**: llama.cpp's output buffer holds logits for every output row.
  The last stage flags one row; every other stage flags every row (the
  engine needs the whole residual stream), so it holds ``n_batch * n_vocab *
  4`` bytes after a long prefill although nothing is ever written there.
* **runtime**: the agent process and its activation buffers.

GPU placement follows llama.cpp's ``llama_model::load_tensors``: with
``n_gpu_layers = g`` the last ``g`` of the ``n + 1`` slots (``n`` blocks and
the output layer) go to the GPUs, split over several GPUs in proportion to
their free memory. It is computed, not measured: no GPU was at hand.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ggufpipe_agent.gguf.header import block_of
from ggufpipe_agent.wire.protocol import EngineOptions, MemoryFacts, ModelFacts

MIB = 1 << 20
GIB = 1 << 30
#: llama.cpp pads the context (KV cells) to a multiple of 256.
KV_PAD = 256
#: f16 K and V, llama.cpp's default cache type (the engine does not change it).
KV_ELEMENT_BYTES = 2
#: An agent process with llama.cpp, numpy and a vocabulary loaded: 97 MiB
#: resident measured here (Python 3.11, llama-cpp-python 0.3.36), rounded up.
AGENT_BASELINE = 128 * MIB
#: Copies of the largest activation object a stage holds at once: the
#: inbound payload, its decoded rows and the captured outbound rows.
ACTIVATION_COPIES = 3
#: The routed experts' tensors, as llama.cpp's ``--cpu-moe`` names them
#: (``LLM_FFN_EXPS_REGEX``, common/common.h; matched with ``regex_search``):
#: not the router (``ffn_gate_inp``) nor the shared experts (``*_shexp``).
EXPERTS_PATTERN = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
_EXPERTS = re.compile(EXPERTS_PATTERN)
#: A CUDA device runs an op whose weights are in host memory itself (copying
#: them over) from this many rows of a batch (``GGML_OP_OFFLOAD_MIN_BATCH``,
#: ggml-cuda.cu ``get_op_batch_size``: a ``MUL_MAT_ID``'s tokens).
OP_OFFLOAD_MIN_BATCH = 32


# ------------------------------------------------------------ model facts


def _per_block(value: Any, count: int, default: int = 0) -> list[int]:
    if isinstance(value, list):
        values = [int(v) for v in value[:count]]
        return values + [values[-1] if values else default] * (count - len(values))
    return [int(value if value is not None else default)] * count


def _widest(value: Any, default: int = 0) -> int:
    if isinstance(value, list):
        return int(max(value)) if value else default
    return int(value) if value is not None else default


def memory_facts(header: Any, tensors: Any = None) -> MemoryFacts:
    """The memory facts of a parsed GGUF header (:class:`~ggufpipe_agent.gguf.header.GgufHeader`);
    ``tensors``: the tensor table when it spans more files than the header's
    (a split set), else the header's own."""
    from ggufpipe_agent.gguf.architectures import keep_tensors, swa_flags

    arch = header.architecture
    get = header.get
    blocks = int(get(f"{arch}.block_count", 0))
    n_embd = int(get(f"{arch}.embedding_length", 0))
    heads = _per_block(get(f"{arch}.attention.head_count"), blocks)
    kv_heads = _per_block(get(f"{arch}.attention.head_count_kv", get(f"{arch}.attention.head_count")), blocks)
    widest_heads: int = max(heads, default=0)
    head_dim = n_embd // widest_heads if widest_heads else 0
    key_length = int(get(f"{arch}.attention.key_length", head_dim))
    value_length = int(get(f"{arch}.attention.value_length", head_dim))
    experts = int(get(f"{arch}.expert_count", 0) or 0)
    # A per-layer array (which a split refuses, but the whole model may be read): the widest.
    used = _widest(get(f"{arch}.expert_used_count"), 1) or 1
    if experts:
        n_ff = _widest(get(f"{arch}.expert_feed_forward_length", get(f"{arch}.feed_forward_length")))
        n_ff *= used
    else:
        n_ff = _widest(get(f"{arch}.feed_forward_length"), 4 * n_embd)
    tokens = get("tokenizer.ggml.tokens")
    n_vocab = len(tokens) if tokens is not None else int(get(f"{arch}.vocab_size", 0))
    swa: list[bool] = [False] * blocks
    window = 0
    flags = swa_flags(arch, get, 0, blocks)
    if flags is not None:
        swa = flags
        window = int(get(f"{arch}.attention.sliding_window", 0) or 0)

    block_bytes = [0] * blocks
    expert_bytes = [0] * blocks
    expert_tensor = [0] * blocks
    # Feed-forward widths per block, from the tensors' shapes (ne[1] of the
    # up projections): a dense block's, or its experts' and shared experts'.
    dense_ff: dict[int, int] = {}
    expert_ff: dict[int, int] = {}
    shared_ff: dict[int, int] = {}
    named = {"token_embd.weight": 0, "output_norm.weight": 0, "output.weight": 0}
    global_bytes = 0
    for tensor in header.tensors if tensors is None else tensors:
        index = block_of(tensor.name, blocks, header.path)
        if index is not None:
            block_bytes[index] += tensor.nbytes
            if _EXPERTS.search(tensor.name):
                expert_bytes[index] += tensor.nbytes
                expert_tensor[index] = max(expert_tensor[index], tensor.nbytes)
            rest = tensor.name.split(".", 2)[2]  # after "blk.N."
            width = tensor.shape[1] if len(tensor.shape) > 1 else 0
            if rest == "ffn_up.weight":
                dense_ff[index] = width
            elif rest == "ffn_up_exps.weight":
                expert_ff[index] = width
            elif rest == "ffn_up_shexp.weight":
                shared_ff[index] = width
        elif tensor.name in named:
            named[tensor.name] += tensor.nbytes
        else:
            global_bytes += tensor.nbytes
    if expert_ff:
        # A mixture of experts: its widest block is a dense one (DeepSeek's
        # leading dense blocks) or the experts in use plus the shared ones.
        dense = _widest(get(f"{arch}.feed_forward_length"), 4 * n_embd)
        n_ff = max(
            dense_ff.get(block, dense)
            if block not in expert_ff
            else expert_ff[block] * used + shared_ff.get(block, 0)
            for block in range(blocks)
        )
    # Multi-head latent attention (deepseek2 with *_mla head sizes): llama.cpp
    # caches K only (the compressed latent and the rotary part) and reads V
    # as a view of it (llama_kv_cache: has_v = !is_mla).
    mla = bool(get(f"{arch}.attention.key_length_mla")) and bool(get(f"{arch}.attention.value_length_mla"))
    cached = key_length if mla else key_length + value_length
    has_experts = any(expert_bytes)
    return MemoryFacts(
        block_bytes=tuple(block_bytes),
        token_embd_bytes=named["token_embd.weight"],
        output_norm_bytes=named["output_norm.weight"],
        output_bytes=named["output.weight"],
        global_bytes=global_bytes,
        kv_widths=tuple(kv * cached for kv in kv_heads),
        swa_blocks=tuple(swa),
        sliding_window=window,
        n_embd=n_embd,
        n_vocab=n_vocab,
        n_ff=n_ff,
        q_width=widest_heads * key_length,
        expert_bytes=tuple(expert_bytes) if has_experts else (),
        expert_tensor_bytes=tuple(expert_tensor) if has_experts else (),
        output_kept="output.weight" in keep_tensors(arch),
    )


def memory_facts_of(facts: ModelFacts) -> MemoryFacts:
    """``facts.memory``, or a coarser record from the older fields when the
    facts were made by hand (tests): tied output, no sliding window, 4x FFN."""
    if facts.memory is not None:
        return facts.memory
    blocks = facts.block_count
    return MemoryFacts(
        block_bytes=facts.block_bytes,
        token_embd_bytes=facts.embedding_bytes,
        output_norm_bytes=facts.output_bytes,
        output_bytes=0,
        global_bytes=0,
        kv_widths=(facts.head_count_kv * (facts.key_length + facts.value_length),) * blocks,
        swa_blocks=(False,) * blocks,
        sliding_window=0,
        n_embd=facts.hidden_dim,
        n_vocab=facts.vocab_size,
        n_ff=4 * facts.hidden_dim,
        q_width=facts.head_count * facts.key_length,
    )


# ------------------------------------------------------------ the estimate


@dataclass(frozen=True, slots=True)
class Usage:
    """What a stage needs in one place: host RAM or one GPU."""

    place: str  # "RAM" or the device's name ("CUDA0")
    weights: int = 0
    kv: int = 0
    compute: int = 0
    outputs: int = 0
    runtime: int = 0
    blocks: int = 0  # how many of the stage's blocks are here

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute + self.outputs + self.runtime


@dataclass(frozen=True, slots=True)
class StageMemory:
    """A stage's needs: host RAM and each GPU it uses (in the Hello's order)."""

    host: Usage
    devices: tuple[Usage, ...] = ()

    @property
    def total(self) -> int:
        return self.host.total + sum(device.total for device in self.devices)

    @property
    def offloaded(self) -> bool:
        return any(device.total for device in self.devices)


def has_experts(memory: MemoryFacts, start: int, end: int) -> bool:
    """Whether blocks ``[start, end)`` hold routed experts (``*_exps`` tensors)."""
    return any(memory.expert_bytes[start:end])


def kv_cells(n_ctx: int) -> int:
    return -(-n_ctx // KV_PAD) * KV_PAD


def kv_block_bytes(memory: MemoryFacts, block: int, options: EngineOptions, swa_full: bool = True) -> int:
    """KV cache bytes of one block (f16 K and V), for every slot (each its
    own KV stream of n_ctx cells)."""
    cells = kv_cells(options.n_ctx)
    if memory.swa_blocks[block] and not swa_full:
        # llama_kv_cache_iswa: GGML_PAD(min(size, n_swa + n_ubatch), 256)
        cells = min(cells, kv_cells(memory.sliding_window + options.n_ubatch))
    return cells * memory.kv_widths[block] * KV_ELEMENT_BYTES * max(1, options.parallel)


def compute_phases(memory: MemoryFacts, start: int, end: int, options: EngineOptions) -> tuple[int, int, int]:
    """The compute buffer's peaks (logits phase, widest block phase) and the
    KQ masks' bytes (graph inputs, part of the block phase)."""
    ub = min(options.n_ubatch, options.n_ctx)
    masks = 2 if any(memory.swa_blocks[start:end]) else 1
    mask = masks * kv_cells(options.n_ctx) * ub * 2  # f16, [cells, n_ubatch] each
    kv_width = max(memory.kv_widths[start:end], default=0)
    logits = ub * (memory.n_vocab + 2 * memory.n_embd) * 4
    feed_forward = ub * (3 * memory.n_ff + 4 * memory.n_embd) * 4 + mask
    attention = ub * (2 * memory.n_embd + 2 * memory.q_width + kv_width) * 4 + mask
    return logits, max(feed_forward, attention), mask


def _layer_devices(blocks: int, options: EngineOptions, free: Sequence[int]) -> list[int]:
    """llama.cpp's device of each of the ``blocks + 1`` layers (the last one is
    the output layer): -1 for the CPU, else an index into ``free``."""
    if not free:
        return [-1] * (blocks + 1)
    layers = blocks + 1 if options.gpu_layers < 0 else options.gpu_layers
    start = max(blocks + 1 - layers, 0)
    active = min(layers, blocks + 1)
    weights = [float(value) for value in free]
    if not any(weights):
        weights = [1.0] * len(free)
    total = sum(weights)
    splits, running = [], 0.0
    for value in weights:
        running += value
        splits.append(running / total)
    placed = []
    for slot in range(blocks + 1):
        if slot < start or slot - start >= active:
            placed.append(-1)
        else:
            device = bisect.bisect_right(splits, (slot - start) / active)
            placed.append(min(device, len(free) - 1))
    return placed


def estimate_stage(
    memory: MemoryFacts,
    start: int,
    end: int,
    options: EngineOptions,
    devices: Sequence[tuple[str, int]] = (),
    swa_full: bool = True,
) -> StageMemory:
    """What the stage running blocks ``[start, end)`` needs. ``devices`` are
    the host's GPUs as (name, free bytes) when the stage offloads (the engine
    passes ``gpu_layers`` to llama.cpp); empty for a CPU stage. With
    ``options.experts_in_ram`` the routed experts of offloaded blocks count
    in RAM (the module docstring says what else changes)."""
    blocks = end - start
    last = end == len(memory.block_bytes)
    layer_devices = _layer_devices(blocks, options, [free for _, free in devices])
    places = ["RAM", *(name for name, _ in devices)]
    weights = [0] * len(places)
    kv = [0] * len(places)
    counts = [0] * len(places)
    copies = [0] * len(places)  # the largest expert tensor a device copies in for a prompt
    split_experts = options.experts_in_ram and bool(memory.expert_bytes)
    for offset in range(blocks):
        block = start + offset
        where = layer_devices[offset] + 1
        weights[where] += memory.block_bytes[block]
        kv[where] += kv_block_bytes(memory, block, options, swa_full)
        counts[where] += 1
        if split_experts and where:
            weights[where] -= memory.expert_bytes[block]
            weights[0] += memory.expert_bytes[block]
            copies[where] = max(copies[where], memory.expert_tensor_bytes[block])
    # The input layer (token_embd) and the other global tensors stay in RAM.
    weights[0] += memory.token_embd_bytes + memory.global_bytes
    output = layer_devices[blocks] + 1
    has_projection = last or memory.output_kept
    projection = memory.output_bytes if has_projection and memory.output_bytes else 0
    if output != 0 and not projection:
        projection = memory.token_embd_bytes  # TENSOR_DUPLICATED: a copy on the GPU
    weights[output] += memory.output_norm_bytes + projection

    logits, block_phase, mask = compute_phases(memory, start, end, options)
    ub = min(options.n_ubatch, options.n_ctx)
    feed_forward = ub * (3 * memory.n_ff + 4 * memory.n_embd) * 4 + mask
    offloaded_experts = ub >= OP_OFFLOAD_MIN_BATCH  # the GPU runs them, on copies
    compute = [0] * len(places)
    for where in range(1, len(places)):
        if counts[where] or where == output:
            compute[where] = max(logits if where == output else 0, block_phase)
            if copies[where] and offloaded_experts:
                compute[where] = max(compute[where], feed_forward + copies[where])
    if len(places) == 1 or counts[0] or output == 0:
        compute[0] = max(logits if output == 0 else 0, block_phase)
    else:
        # All on GPUs: the host keeps the graph inputs (embedding rows, the
        # masks) for the copy to the device. Not measured.
        compute[0] = ub * memory.n_embd * 4 + mask
        if any(copies) and not offloaded_experts:
            compute[0] = max(compute[0], feed_forward)  # the CPU runs the experts
    rows = 1 if last else min(options.n_batch, options.n_ctx)
    outputs = rows * memory.n_vocab * 4
    activation = options.n_ctx * memory.n_embd * 4 * ACTIVATION_COPIES if start or not last else 0
    usages = [
        Usage(
            place,
            weights[i],
            kv[i],
            compute[i],
            outputs if i == 0 else 0,
            AGENT_BASELINE + activation if i == 0 else 0,
            counts[i],
        )
        for i, place in enumerate(places)
    ]
    return StageMemory(usages[0], tuple(usages[1:]))


def format_size(count: int) -> str:
    """Bytes for a person: MiB below 10 GiB (one decimal below 10 MiB), else GiB."""
    if count < 0:
        return f"-{format_size(-count)}"
    if count >= 10 * GIB:
        return f"{count / GIB:.1f} GiB"
    if count >= GIB:
        return f"{count / GIB:.2f} GiB"
    if count >= 10 * MIB:
        return f"{count / MIB:.0f} MiB"
    return f"{count / MIB:.1f} MiB"
