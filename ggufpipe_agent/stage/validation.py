"""Checks of a ProvisionStage before a stage takes it (its run id and stage
assignment: docs/design.md, "Stage state machine" and "Security model"): its
shape (stage index, edge kinds, object specs that match the model facts) and
every number the wire can set, against what its use can carry (a header
field's width, a queue, llama.cpp's parameters).
A provision that fails is refused whole; nothing of it reaches a stage run.
"""

from __future__ import annotations

from ggufpipe_agent.errors import CacheError
from ggufpipe_agent.wire import objects
from ggufpipe_agent.wire.protocol import ProvisionStage
from ggufpipe_agent.wire.records import sampler_problem

#: Bounds on what a provision may ask for: far above any real model, far
#: below what would overflow a wire field or exhaust memory.
MAX_STAGES = 1024
MAX_CONTEXT = 1 << 24
#: Slots a stage may hold (llama.cpp's LLAMA_MAX_SEQ is 256).
MAX_SLOTS = 256
MAX_LAYERS = 1 << 16
MAX_RING_SLOTS = 64
MAX_THREADS = 4096


def fits_bits(value: int, bits: int) -> bool:
    """``value`` is an unsigned integer of ``bits`` bits (a header field)."""
    return 0 <= value < 1 << bits


def _field_problem(p: ProvisionStage) -> str:
    """Every number the wire can set, against what its use can carry."""
    if not fits_bits(p.run_id, 64):
        return f"run id {p.run_id} is not a u64"
    if not 1 <= p.stage_count <= MAX_STAGES:
        return f"stage count {p.stage_count} outside 1..{MAX_STAGES}"
    if not 0 <= p.layer_start < p.layer_end_exclusive <= MAX_LAYERS:
        return f"layers [{p.layer_start}, {p.layer_end_exclusive}) is empty, reversed or out of bounds"
    model = p.model
    for name, value in (
        ("block count", model.block_count),
        ("hidden dim", model.hidden_dim),
        ("vocab size", model.vocab_size),
    ):
        if not 1 <= value < 1 << 31:
            return f"model {name} {value} is out of range"
    if not 1 <= model.max_seq_len <= MAX_CONTEXT:
        return f"max_seq_len {model.max_seq_len} outside 1..{MAX_CONTEXT}"
    if p.layer_end_exclusive > model.block_count:
        return f"layers [{p.layer_start}, {p.layer_end_exclusive}) go past {model.block_count} blocks"
    for side, edge in (("inbound", p.inbound), ("outbound", p.outbound)):
        spec = edge.object_spec
        if not fits_bits(edge.edge_id, 32):
            return f"{side} edge id {edge.edge_id} is not a u32"
        if not 1 <= spec.max_rows <= model.max_seq_len:
            return f"{side} edge max_rows {spec.max_rows} outside 1..{model.max_seq_len}"
        if not 1 <= spec.width < 1 << 31:
            return f"{side} edge width {spec.width} is out of range"
        if spec.dtype in ("int32", "float32", "float16") and spec.max_extent > objects.ABSOLUTE_MAX_PAYLOAD:
            return f"{side} edge objects of {spec.max_extent} bytes exceed {objects.ABSOLUTE_MAX_PAYLOAD}"
        if not 1 <= edge.ring_spec.slots <= MAX_RING_SLOTS:
            return f"{side} ring of {edge.ring_spec.slots} slots outside 1..{MAX_RING_SLOTS}"
    engine = p.engine
    if not 1 <= engine.n_ctx <= MAX_CONTEXT:
        return f"context {engine.n_ctx} outside 1..{MAX_CONTEXT}"
    for name, value in (("batch", engine.n_batch), ("ubatch", engine.n_ubatch)):
        if not 1 <= value <= MAX_CONTEXT:
            return f"{name} {value} outside 1..{MAX_CONTEXT}"
    if not 0 <= engine.threads <= MAX_THREADS:
        return f"threads {engine.threads} outside 0..{MAX_THREADS}"
    if not -1 <= engine.gpu_layers < 1 << 31:
        return f"gpu_layers {engine.gpu_layers} is out of range"
    if not 1 <= engine.parallel <= MAX_SLOTS:
        return f"parallel {engine.parallel} outside 1..{MAX_SLOTS}"
    if not 0 <= p.slot < engine.parallel:
        return f"slot {p.slot} outside 0..{engine.parallel - 1} (parallel {engine.parallel})"
    if engine.n_ctx * engine.parallel > MAX_CONTEXT:
        return f"{engine.parallel} slots of {engine.n_ctx} positions exceed {MAX_CONTEXT}"
    sampling = p.sampling
    field, problem = sampler_problem(sampling, model.vocab_size)
    if field:
        return f"{field} {problem}"
    width = objects.token_out_width(sampling.logprobs)
    if p.stage_index == p.stage_count - 1 and p.outbound.object_spec.width != width:
        return f"the token-out edge carries rows of {p.outbound.object_spec.width} words, not {width}"
    offer = p.reuse
    if not fits_bits(offer.run_id, 64) or not 0 <= offer.positions <= model.max_seq_len:
        return f"a prefix offer of {offer.positions} positions of run {offer.run_id} is out of bounds"
    if p.stage_file is not None:  # model send: true (the entry itself is checked as it loads)
        try:
            p.stage_file.key.check()
        except CacheError as error:
            return str(error)
        if not 0 < p.stage_file.size < 1 << 62:
            return f"stage file size {p.stage_file.size} is out of range"
    return ""


def validate_provision(message: ProvisionStage) -> str:
    """The provision's run id and stage assignment (docs/design.md, "Stage state
    machine"), and every field the wire can set; '' when it is sound."""
    p = message
    problem = _field_problem(p)
    if problem:
        return problem
    if not 0 <= p.stage_index < p.stage_count:
        return f"stage index {p.stage_index} outside a pipeline of {p.stage_count}"
    if p.reuse.run_id and p.reuse.run_id == p.run_id:
        return f"run {p.run_id:016x} is offered a prefix of its own"
    if p.inbound.edge_id == p.outbound.edge_id:
        return f"inbound and outbound edges share id {p.inbound.edge_id}"
    want_in = "TokenIn" if p.stage_index == 0 else "Activation"
    want_out = "TokenOut" if p.stage_index == p.stage_count - 1 else "Activation"
    if p.inbound.kind != want_in:
        return f"stage {p.stage_index} inbound edge must be {want_in}, not {p.inbound.kind}"
    if p.outbound.kind != want_out:
        return f"stage {p.stage_index} outbound edge must be {want_out}, not {p.outbound.kind}"
    for name, spec, edge_kind in (
        ("inbound", p.inbound.object_spec, p.inbound.kind),
        ("outbound", p.outbound.object_spec, p.outbound.kind),
    ):
        if spec.dtype not in ("int32", "float32", "float16"):
            return f"{name} edge dtype {spec.dtype!r} is not supported"
        want_kind = "activation" if edge_kind == "Activation" else "tokens"
        if spec.kind != want_kind:
            return f"{name} {edge_kind} edge carries {want_kind} objects, not {spec.kind!r}"
        # The token-out edge is as wide as the run's logprobs (checked with the sampling).
        width = spec.width if edge_kind == "TokenOut" else 1
        if spec.kind == "tokens" and (spec.dtype != "int32" or spec.width != width):
            return f"{name} edge carries tokens as int32 of width 1, not {spec.dtype} of width {spec.width}"
        if spec.kind == "activation" and (
            spec.width != p.model.hidden_dim or spec.max_rows != p.model.max_seq_len
        ):
            return (
                f"{name} edge carries [{spec.max_rows}, {spec.width}] activations; the model "
                f"facts say [{p.model.max_seq_len}, {p.model.hidden_dim}]"
            )
    if p.engine.n_ctx < p.model.max_seq_len:
        return f"context {p.engine.n_ctx} is shorter than max_seq_len {p.model.max_seq_len}"
    return _ring_problem(p)


def _ring_problem(p: ProvisionStage) -> str:
    """The token ring's end of this stage (docs/rings.md), if it has one."""
    ring = p.ring
    if ring is None:
        return ""
    if not fits_bits(ring.edge_id, 32):
        return f"token ring edge id {ring.edge_id} is not a u32"
    if ring.edge_id in (p.inbound.edge_id, p.outbound.edge_id):
        return f"the token ring shares edge id {ring.edge_id} with another edge"
    if ring.produce != (p.stage_index == p.stage_count - 1) or ring.consume != (p.stage_index == 0):
        return f"stage {p.stage_index} of {p.stage_count} cannot be that end of the token ring"
    spec = ring.object_spec
    if (spec.kind, spec.dtype, spec.width) != ("tokens", "int32", 1) or not 1 <= spec.max_rows <= MAX_CONTEXT:
        return "the token ring carries int32 tokens of width 1"
    if ring.produce:
        if not 1 <= ring.max_tokens <= MAX_CONTEXT:
            return f"token ring max_tokens {ring.max_tokens} outside 1..{MAX_CONTEXT}"
        if any(not 0 <= token < p.model.vocab_size for token in ring.eog_token_ids):
            return f"token ring end-of-generation tokens outside the vocabulary of {p.model.vocab_size}"
    return ""
