"""The run plan and its guarantees (docs/design.md, "The run plan and its checks"
and "Correctness guarantees"). Pure: no I/O.

The orchestrator owns run ids and edge ids; stage code never derives them.
Edge ``i`` of a run of N stages: edge 0 is TokenIn (orchestrator -> stage 0),
edges 1..N-1 are Activation (stage i-1 -> stage i), edge N is TokenOut
(stage N-1 -> orchestrator). A token-ring run (``run.feedback: ring``) has
one more, edge N+1, TokenRing (stage N-1 -> stage 0): each sampled token as
stage 0's next input (docs/rings.md).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from ggufpipe_agent.errors import GgufpipeError
from ggufpipe_agent.gguf.memory import StageMemory, estimate_stage, memory_facts_of
from ggufpipe_agent.ids import FIRST_SLOT, EdgeId, RunId, SlotId
from ggufpipe_agent.wire import objects
from ggufpipe_agent.wire.objects import HEADER_SIZE
from ggufpipe_agent.wire.protocol import (
    EngineOptions,
    InboundEdgeProvision,
    ModelFacts,
    ObjectSpec,
    OutboundEdgeProvision,
    PrefixOffer,
    ProvisionStage,
    RingSpec,
    SamplingParams,
    StageFileRef,
    StageModelFacts,
    TokenRingProvision,
)
from ggufpipe_tui.core.inventory import Inventory, RunOptions


class PlacedStage(Protocol):
    """One stage as the memory plan placed it (core/placement.py's StagePlacement)."""

    @property
    def layers(self) -> tuple[int, int]: ...

    @property
    def needed(self) -> int: ...

    @property
    def available(self) -> int: ...

    @property
    def memory(self) -> StageMemory: ...

    @property
    def experts_in_ram(self) -> bool: ...


class Placed(Protocol):
    """The memory plan's figures a run plan shows (core/placement.py's Placement)."""

    @property
    def stages(self) -> Sequence[PlacedStage]: ...


ORCHESTRATOR = "orchestrator"
#: Slots per edge ring. The MVP keeps one object in flight per edge, so two
#: slots let the next object land while a step runs (docs/rings.md).
RING_SLOTS = 2


class PlanError(GgufpipeError):
    """A plan that breaks a guarantee (docs/design.md, "Correctness guarantees")."""


@dataclass(frozen=True, slots=True)
class GgufModelPlan:
    model_id: str
    gguf_source: str
    num_layers: int
    hidden_dim: int
    dtype_family: str
    dtype_width_bytes: int
    max_seq_len: int
    eos_token_id: int
    architecture: str
    vocab_size: int
    eog_token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class EdgeEndpoint:
    node_id: str
    stage_index: int | None = None  # None: the orchestrator

    @property
    def is_orchestrator(self) -> bool:
        return self.stage_index is None


@dataclass(frozen=True, slots=True)
class EdgePlan:
    run_id: RunId
    edge_id: EdgeId
    kind: str  # "TokenIn", "Activation", "TokenOut"
    producer: EdgeEndpoint
    consumer: EdgeEndpoint
    object_spec: ObjectSpec
    ring_spec: RingSpec


@dataclass(frozen=True, slots=True)
class StagePlan:
    run_id: RunId
    stage_index: int
    stage_count: int
    node_id: str
    gguf_source: str
    layer_start: int
    layer_end_exclusive: int
    inbound_edge: EdgeId
    outbound_edge: EdgeId
    estimated_bytes: int  # what the stage needs where its layers go (RAM, or its GPUs)
    engine: EngineOptions  # the run's sizes with this stage's host's threads and GPU layers
    available_bytes: int = 0  # what the plan may use there (shared by the host's stages); 0: unknown
    memory: StageMemory | None = None  # the breakdown (docs/planning.md)
    stage_file: StageFileRef | None = None  # delivered to the host (model send: true)


@dataclass(frozen=True, slots=True)
class RunPlan:
    run_id: RunId
    model: GgufModelPlan
    stages: tuple[StagePlan, ...]
    edges: tuple[EdgePlan, ...]
    max_tokens: int
    engine: EngineOptions
    sampling: SamplingParams
    ring: EdgePlan | None = None  # the token ring; None: the orchestrator feeds tokens back
    reuse: PrefixOffer = PrefixOffer()  # what the stages may keep of the slot's previous run
    slot: SlotId = FIRST_SLOT  # each stage's slot (0 .. engine.parallel - 1) the run's KV cache is in
    ignore_eos: bool = False  # the model's end-of-generation tokens do not stop it
    # The stage started again that this run rebuilds (a resumed run's reuse:
    # it is offered nothing, the stage before it resends its rows; -1: none).
    rebuild: int = -1

    def stage_offer(self, index: int) -> PrefixOffer:
        """What stage ``index`` is offered of the slot's previous run."""
        if self.rebuild < 0 or not self.reuse.run_id:
            return self.reuse
        if index == self.rebuild:
            return PrefixOffer()
        return replace(self.reuse, resend=index == self.rebuild - 1)

    def edge(self, edge_id: EdgeId) -> EdgePlan:
        for edge in self.edges:  # the ring has its own field, looked up there
            if edge.edge_id == edge_id:
                return edge
        raise KeyError(edge_id)


def sampling_params(options: RunOptions) -> SamplingParams:
    """The sampling a run's last stage is provisioned with: the inventory's
    four fields and what a request added (llama-server's other fields)."""
    return SamplingParams(
        options.temperature, options.top_k, options.top_p, options.seed, **dict(options.extra)
    )


def new_run_id() -> RunId:
    return RunId(secrets.randbits(63) | 1)


def engine_options(run: RunOptions, facts: ModelFacts) -> EngineOptions:
    """The llama.cpp sizes every stage of a run gets (before a host's own
    threads and GPU layers)."""
    length = min(run.context, facts.context_length or run.context)
    return EngineOptions(
        n_ctx=length,
        n_batch=min(length, 2048),
        n_ubatch=min(run.ubatch, length),
        exact_reuse=run.reuse == "exact",
        parallel=max(1, run.parallel),
        batching=run.batching,
    )


def build_plan(
    inventory: Inventory,
    facts: ModelFacts,
    ranges: list[tuple[int, int]],
    run_id: RunId,
    edge_base: int | None = None,
    placement: Placed | None = None,
) -> RunPlan:
    """The run plan. ``placement`` (:func:`ggufpipe_tui.core.refusal.place_stages`)
    gives each stage its memory figures where its layers go; without it they
    are the CPU estimate and the available figure is unknown."""
    options = inventory.run
    n = len(inventory.stages)
    max_seq_len = min(options.context, facts.context_length or options.context)
    width = 2 if options.activation_dtype == "float16" else 4
    eog = () if options.ignore_eos else facts.eog_token_ids
    model = GgufModelPlan(
        model_id=facts.stem,
        gguf_source=inventory.model_path,
        num_layers=facts.block_count,
        hidden_dim=facts.hidden_dim,
        dtype_family="float",
        dtype_width_bytes=width,
        max_seq_len=max_seq_len,
        eos_token_id=facts.eos_token_id,
        architecture=facts.architecture,
        vocab_size=facts.vocab_size,
        eog_token_ids=tuple(eog),
    )
    base = edge_base if edge_base is not None else secrets.randbits(24) << 8
    tokens_in = ObjectSpec("tokens", "int32", 1, max_seq_len)
    sampling = sampling_params(options)
    tokens_out = ObjectSpec("tokens", "int32", objects.token_out_width(sampling.logprobs), 1)
    activation = ObjectSpec("activation", options.activation_dtype, facts.hidden_dim, max_seq_len)
    node = [inventory.stages[i].host for i in range(n)]

    def ring(spec: ObjectSpec) -> RingSpec:
        return RingSpec(RING_SLOTS, spec.max_extent + HEADER_SIZE)

    edges = [
        EdgePlan(
            run_id,
            EdgeId(base),
            "TokenIn",
            EdgeEndpoint(ORCHESTRATOR),
            EdgeEndpoint(node[0], 0),
            tokens_in,
            ring(tokens_in),
        )
    ]
    for i in range(1, n):
        edges.append(
            EdgePlan(
                run_id,
                EdgeId(base + i),
                "Activation",
                EdgeEndpoint(node[i - 1], i - 1),
                EdgeEndpoint(node[i], i),
                activation,
                ring(activation),
            )
        )
    edges.append(
        EdgePlan(
            run_id,
            EdgeId(base + n),
            "TokenOut",
            EdgeEndpoint(node[n - 1], n - 1),
            EdgeEndpoint(ORCHESTRATOR),
            tokens_out,
            ring(tokens_out),
        )
    )
    engine = engine_options(options, facts)
    memory = memory_facts_of(facts)

    def figures(i: int) -> tuple[int, int, StageMemory, bool]:
        if placement is not None and placement.stages[i].layers == ranges[i]:
            placed = placement.stages[i]
            return placed.needed, placed.available, placed.memory, placed.experts_in_ram
        estimate = estimate_stage(memory, ranges[i][0], ranges[i][1], engine)
        return estimate.total, 0, estimate, inventory.hosts[node[i]].experts == "ram"

    sized = [figures(i) for i in range(n)]
    stages = tuple(
        StagePlan(
            run_id=run_id,
            stage_index=i,
            stage_count=n,
            node_id=node[i],
            gguf_source=inventory.model_path_for(inventory.hosts[node[i]]),
            layer_start=ranges[i][0],
            layer_end_exclusive=ranges[i][1],
            inbound_edge=EdgeId(base + i),
            outbound_edge=EdgeId(base + i + 1),
            estimated_bytes=sized[i][0],
            engine=replace(
                engine,
                threads=inventory.hosts[node[i]].threads,
                gpu_layers=inventory.hosts[node[i]].gpu_layers,
                experts_in_ram=sized[i][3],  # the planner's choice (inventory experts:)
            ),
            available_bytes=sized[i][1],
            memory=sized[i][2],
        )
        for i in range(n)
    )
    token_ring = None
    if options.feedback == "ring":
        one_token = ObjectSpec("tokens", "int32", 1, 1)
        producer, consumer = EdgeEndpoint(node[n - 1], n - 1), EdgeEndpoint(node[0], 0)
        token_ring = EdgePlan(
            run_id, EdgeId(base + n + 1), "TokenRing", producer, consumer, one_token, ring(one_token)
        )
    return RunPlan(
        run_id,
        model,
        stages,
        tuple(edges),
        options.max_tokens,
        engine,
        sampling,
        token_ring,
        ignore_eos=options.ignore_eos,
    )


def validate_plan(plan: RunPlan) -> None:
    """Every guarantee (docs/design.md, "Correctness guarantees") that a plan can break; raises PlanError."""
    stages, edges, n = plan.stages, plan.edges, len(plan.stages)
    if n == 0:
        raise PlanError("a run needs at least one stage")
    if plan.max_tokens < 1:
        raise PlanError("max_tokens must be at least 1")
    # Layer assignment: contiguous, non-overlapping, covering, one range each.
    expected = 0
    for i, stage in enumerate(stages):
        if stage.stage_index != i or stage.stage_count != n:
            raise PlanError(f"stage {i} is numbered {stage.stage_index} of {stage.stage_count}")
        if stage.run_id != plan.run_id:
            raise PlanError(f"stage {i} belongs to run {stage.run_id:016x}")
        if stage.layer_start >= stage.layer_end_exclusive:
            raise PlanError(
                f"stage {i} has the empty range [{stage.layer_start}, {stage.layer_end_exclusive})"
            )
        if stage.layer_start < expected:
            raise PlanError(
                f"stage {i} [{stage.layer_start}, {stage.layer_end_exclusive}) overlaps stage {i - 1}"
            )
        if stage.layer_start > expected:
            raise PlanError(f"stage {i} leaves layers [{expected}, {stage.layer_start}) unassigned")
        expected = stage.layer_end_exclusive
    if expected != plan.model.num_layers:
        raise PlanError(f"the stages cover layers [0, {expected}), the model has {plan.model.num_layers}")
    # Edge assignment.
    ids = [edge.edge_id for edge in edges]
    if len(set(ids)) != len(ids):
        raise PlanError("edge ids are not unique within the run")
    if len(edges) != n + 1:
        raise PlanError(f"{n} stages need {n + 1} edges, the plan has {len(edges)}")
    by_id = {edge.edge_id: edge for edge in edges}
    for edge in edges:
        if edge.run_id != plan.run_id:
            raise PlanError(f"edge {edge.edge_id} belongs to run {edge.run_id:016x}")
    for i, stage in enumerate(stages):
        inbound = by_id.get(stage.inbound_edge)
        outbound = by_id.get(stage.outbound_edge)
        if inbound is None or outbound is None:
            raise PlanError(f"stage {i} names an edge that is not in the plan")
        want_in = "TokenIn" if i == 0 else "Activation"
        want_out = "TokenOut" if i == n - 1 else "Activation"
        if inbound.kind != want_in or outbound.kind != want_out:
            raise PlanError(
                f"stage {i} is wired {inbound.kind} -> {outbound.kind}, must be {want_in} -> {want_out}"
            )
        if inbound.consumer != EdgeEndpoint(stage.node_id, i):
            raise PlanError(f"edge {inbound.edge_id} is not consumed by stage {i}")
        if outbound.producer != EdgeEndpoint(stage.node_id, i):
            raise PlanError(f"edge {outbound.edge_id} is not produced by stage {i}")
        if i == 0 and not inbound.producer.is_orchestrator:
            raise PlanError("token-in must be produced by the orchestrator")
        if i == n - 1 and not outbound.consumer.is_orchestrator:
            raise PlanError("token-out must be consumed by the orchestrator")
        if i > 0 and inbound.producer != EdgeEndpoint(stages[i - 1].node_id, i - 1):
            raise PlanError(f"activation edge {inbound.edge_id} must be produced by stage {i - 1}")
    consumed = [stage.inbound_edge for stage in stages]
    produced = [stage.outbound_edge for stage in stages]
    if len(set(consumed)) != n or len(set(produced)) != n:
        raise PlanError("an edge has more than one producer or consumer")
    # All stages agree on the model facts that size the object specs (docs/design.md, "Object records").
    for edge in edges:
        spec = edge.object_spec
        if spec.kind == "activation" and (
            spec.width != plan.model.hidden_dim
            or spec.max_rows != plan.model.max_seq_len
            or spec.itemsize != plan.model.dtype_width_bytes
        ):
            raise PlanError(f"edge {edge.edge_id} object spec disagrees with the model facts")
    ring = plan.ring
    if ring is not None:
        if ring.edge_id in by_id or ring.kind != "TokenRing" or ring.run_id != plan.run_id:
            raise PlanError(f"token ring edge {ring.edge_id} is not an edge of its own in this run")
        if ring.producer != EdgeEndpoint(stages[-1].node_id, n - 1):
            raise PlanError("the token ring must be produced by the last stage")
        if ring.consumer != EdgeEndpoint(stages[0].node_id, 0):
            raise PlanError("the token ring must be consumed by stage 0")


def provision_message(plan: RunPlan, index: int) -> ProvisionStage:
    stage = plan.stages[index]
    inbound = plan.edge(stage.inbound_edge)
    outbound = plan.edge(stage.outbound_edge)
    model = plan.model
    return ProvisionStage(
        run_id=plan.run_id,
        stage_index=index,
        stage_count=stage.stage_count,
        node_id=stage.node_id,
        gguf_source=stage.gguf_source,
        layer_start=stage.layer_start,
        layer_end_exclusive=stage.layer_end_exclusive,
        inbound=InboundEdgeProvision(inbound.edge_id, inbound.kind, inbound.object_spec, inbound.ring_spec),
        outbound=OutboundEdgeProvision(
            outbound.edge_id,
            outbound.kind,
            outbound.consumer.node_id,
            outbound.object_spec,
            outbound.ring_spec,
        ),
        model=StageModelFacts(
            model_id=model.model_id,
            architecture=model.architecture,
            block_count=model.num_layers,
            hidden_dim=model.hidden_dim,
            vocab_size=model.vocab_size,
            dtype_family=model.dtype_family,
            dtype_width_bytes=model.dtype_width_bytes,
            max_seq_len=model.max_seq_len,
        ),
        engine=stage.engine,
        sampling=plan.sampling,
        ring=_ring_provision(plan, index),
        stage_file=stage.stage_file,
        reuse=plan.stage_offer(index),
        slot=plan.slot,
    )


def _ring_provision(plan: RunPlan, index: int) -> TokenRingProvision | None:
    ring, last = plan.ring, len(plan.stages) - 1
    if ring is None or index not in (0, last):
        return None
    eog = plan.model.eog_token_ids
    return TokenRingProvision(ring.edge_id, index == last, index == 0, ring.object_spec, eog, plan.max_tokens)
