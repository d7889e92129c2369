"""The placement: which blocks each stage runs, chosen from what each host has.

Pure: a function of the inventory, the model's facts and the agents' Hellos
(no I/O). Every stage's need is estimated by :mod:`ggufpipe_agent.gguf.memory`
where llama.cpp will put it: host RAM, or the GPUs of a stage that offloads.
Each host's RAM and each of its GPUs is a *pool*; the stages of a host share
its pools. A pool may hold its stages' estimates plus a margin:

* ``usable = min(memory cap, free) - reserve``: the reserve (512 MiB of RAM,
  512 MiB per GPU) is what the stages do not own: the OS and other
  processes, a local orchestrator, the CUDA context's later growth (cuBLAS
  workspace), none of which llama.cpp's buffers count;
* ``needed * (1 + MARGIN) <= usable``: the 5 % margin covers the estimate's
  error (calibrated within 5 % of what llama.cpp allocates, the allocator's
  fragmentation included: docs/planning.md).

Stages without ``layers`` get contiguous ranges proportional to the room each
has after its fixed parts (embeddings, output layer, compute and output
buffers, the agent); ranges given in the inventory are kept. Either way the
result is checked; :mod:`ggufpipe_tui.core.refusal` places the stages, or
refuses a plan that does not fit with what would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ggufpipe_agent.errors import GgufpipeError
from ggufpipe_agent.gguf.architectures import cut_multiple, plan_metadata
from ggufpipe_agent.gguf.memory import (
    MIB,
    MemoryFacts,
    StageMemory,
    estimate_stage,
    has_experts,
    kv_block_bytes,
    memory_facts_of,
)
from ggufpipe_agent.wire.protocol import EngineOptions, Hello, ModelFacts
from ggufpipe_tui.core.inventory import Inventory, InventoryError
from ggufpipe_tui.core.inventory_policy import assign_layers
from ggufpipe_tui.core.plan import engine_options

#: Margin on every estimate (its calibrated error, rounded up).
MARGIN = 0.05
#: Kept free in a host's RAM and on each GPU: what no stage's buffers count.
RAM_RESERVE = 512 * MIB
GPU_RESERVE = 512 * MIB
RAM = "RAM"


class PlacementError(GgufpipeError):
    """A plan that does not fit; ``placement`` is the one that was tried, for
    the model of ``facts``."""

    def __init__(self, message: str, placement: Placement, facts: ModelFacts) -> None:
        super().__init__(message)
        self.placement = placement
        self.facts = facts


@dataclass(frozen=True, slots=True)
class Pool:
    """One host's RAM, or one of its GPUs, and what the plan puts there."""

    host: str
    place: str  # RAM or a device name (CUDA0)
    description: str
    total: int  # 0: unknown
    free: int  # as the agent reported it (RAM: MemAvailable within its cgroup)
    cap: int  # the inventory's memory: (RAM only); 0: none
    usable: int  # what the plan may fill; -1: unknown (the agent reported nothing)
    needed: int = 0  # the estimates of the stages here
    stages: tuple[int, ...] = ()

    @property
    def known(self) -> bool:
        return self.usable >= 0

    @property
    def fits(self) -> bool:
        return not self.known or self.needed * (1 + MARGIN) <= self.usable

    @property
    def label(self) -> str:
        return f"{self.host} {self.place}"


@dataclass(frozen=True, slots=True)
class StagePlacement:
    index: int
    host: str
    layers: tuple[int, int]
    memory: StageMemory
    places: tuple[str, ...]  # where its blocks are: (RAM,) or its GPUs
    needed: int  # its estimate in those places
    available: int  # those pools' usable bytes (shared with the host's other stages); -1: unknown
    # A mixture of experts' routed experts of its offloaded blocks: "gpu" (with
    # the blocks), "ram" (llama.cpp's --cpu-moe); "" when it offloads no block
    # that has experts.
    experts: str = ""

    @property
    def experts_in_ram(self) -> bool:
        return self.experts == "ram"


@dataclass(frozen=True, slots=True)
class Placement:
    engine: EngineOptions  # the run's llama.cpp sizes
    automatic: bool  # ranges chosen here (False: given in the inventory)
    stages: tuple[StagePlacement, ...]
    pools: tuple[Pool, ...]

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        return tuple(stage.layers for stage in self.stages)

    @property
    def fits(self) -> bool:
        return all(pool.fits for pool in self.pools)

    def pool(self, host: str, place: str) -> Pool:
        return next(p for p in self.pools if p.host == host and p.place == place)


# ----------------------------------------------------------------- inputs


@dataclass(frozen=True, slots=True)
class _Host:
    name: str
    pools: tuple[Pool, ...]  # RAM first, then the GPUs
    devices: tuple[tuple[str, int], ...]  # what the host's stages offload to: (name, free)


def host_pools(inventory: Inventory, hellos: Sequence[Hello | None]) -> dict[str, _Host]:
    hosts: dict[str, _Host] = {}
    for index, stage in enumerate(inventory.stages):
        if stage.host in hosts:
            continue  # the host's first agent speaks for it
        spec = inventory.hosts[stage.host]
        hello = hellos[index] if index < len(hellos) else None
        if hello is None or hello.memory_available <= 0:
            usable = spec.memory if spec.memory else -1
            ram = Pool(stage.host, RAM, "", 0, 0, spec.memory, usable)
        else:
            room = max(hello.memory_available - RAM_RESERVE, 0)
            usable = min(spec.memory, room) if spec.memory else room
            ram = Pool(stage.host, RAM, "", hello.memory_total, hello.memory_available, spec.memory, usable)
        pools = [ram]
        devices: tuple[tuple[str, int], ...] = ()
        if hello is not None and hello.gpu_offload and hello.devices and spec.gpu_layers != 0:
            for device in hello.devices:
                pools.append(
                    Pool(
                        stage.host,
                        device.name,
                        device.description,
                        device.memory_total,
                        device.memory_free,
                        0,
                        max(device.memory_free - GPU_RESERVE, 0),
                    )
                )
            devices = tuple((device.name, device.memory_free) for device in hello.devices)
        hosts[stage.host] = _Host(stage.host, tuple(pools), devices)
    return hosts


@dataclass(frozen=True, slots=True)
class Sizing:
    """What every trial placement of one plan is measured with: the
    inventory, the model's memory facts, the run's llama.cpp sizes and the
    hosts' pools."""

    inventory: Inventory
    memory: MemoryFacts
    options: EngineOptions
    hosts: dict[str, _Host]


def sizing_of(
    inventory: Inventory,
    facts: ModelFacts,
    hellos: Sequence[Hello | None],
    options: EngineOptions | None = None,
) -> Sizing:
    """The sizing of ``inventory``'s plan (``options``: the run's llama.cpp
    sizes, by default what the inventory's run options give)."""
    engine = engine_options(inventory.run, facts) if options is None else options
    return Sizing(inventory, memory_facts_of(facts), engine, host_pools(inventory, hellos))


# -------------------------------------------------------------- evaluating


def usage_by_place(memory: StageMemory) -> dict[str, int]:
    used = {RAM: memory.host.total}
    for device in memory.devices:
        used[device.place] = used.get(device.place, 0) + device.total
    return used


def evaluate_ranges(
    sizing: Sizing,
    ranges: Sequence[tuple[int, int]],
    automatic: bool,
) -> Placement:
    """The placement of ``ranges``, with each stage's experts where its host's
    ``experts:`` says; for ``auto``, a stage's routed experts go to RAM when
    its GPUs cannot hold its share and its host's RAM can hold them (stage by
    stage on a host, until its GPUs fit)."""
    inventory = sizing.inventory
    specs = [inventory.hosts[stage.host] for stage in inventory.stages]
    in_ram = [spec.experts == "ram" for spec in specs]
    placement = _evaluate_experts(sizing, ranges, automatic, in_ram)
    for index, spec in enumerate(specs):
        if spec.experts != "auto" or placement.stages[index].experts != "gpu":
            continue
        host = placement.stages[index].host
        gpus = [p for p in placement.pools if p.host == host and p.place != RAM and index in p.stages]
        if all(pool.fits for pool in gpus):
            continue
        moved = [*in_ram[:index], True, *in_ram[index + 1 :]]
        trial = _evaluate_experts(sizing, ranges, automatic, moved)
        if trial.pool(host, RAM).fits:
            placement, in_ram = trial, moved
    return placement


def _evaluate_experts(
    sizing: Sizing,
    ranges: Sequence[tuple[int, int]],
    automatic: bool,
    in_ram: Sequence[bool],
) -> Placement:
    """The placement of ``ranges`` with stage ``i``'s routed experts in RAM
    where ``in_ram[i]``."""
    inventory, memory, options, hosts = sizing.inventory, sizing.memory, sizing.options, sizing.hosts
    needed: dict[tuple[str, str], int] = {}
    members: dict[tuple[str, str], list[int]] = {}
    stages = []
    for index, (stage, (start, end)) in enumerate(zip(inventory.stages, ranges, strict=True)):
        host = hosts[stage.host]
        experts = ""
        if host.devices and has_experts(memory, start, end):
            experts = "ram" if in_ram[index] else "gpu"
        engine = replace(
            options, gpu_layers=inventory.hosts[stage.host].gpu_layers, experts_in_ram=experts == "ram"
        )
        estimate = estimate_stage(memory, start, end, engine, host.devices)
        for place, count in usage_by_place(estimate).items():
            key = (stage.host, place)
            needed[key] = needed.get(key, 0) + count
            if count:
                members.setdefault(key, []).append(index)
        on_devices = tuple(d.place for d in estimate.devices if d.blocks)
        if not on_devices:
            experts = ""  # no block offloaded (gpu_layers: 1): nothing to move
        in_host = estimate.host.blocks or experts == "ram"
        places = on_devices if on_devices and not in_host else (RAM, *on_devices)
        pools = [p for p in host.pools if p.place in places]
        available = -1 if any(not p.known for p in pools) else sum(p.usable for p in pools)
        in_places = sum(count for place, count in usage_by_place(estimate).items() if place in places)
        stages.append(
            StagePlacement(index, stage.host, (start, end), estimate, places, in_places, available, experts)
        )
    filled = tuple(
        replace(
            pool,
            needed=needed.get((pool.host, pool.place), 0),
            stages=tuple(members.get((pool.host, pool.place), ())),
        )
        for host in hosts.values()
        for pool in host.pools
    )
    return Placement(options, automatic, tuple(stages), filled)


# ------------------------------------------------------------- the split


def _block_cost(memory: MemoryFacts, block: int, options: EngineOptions) -> int:
    return memory.block_bytes[block] + kv_block_bytes(memory, block, options)


def _proportional(
    sizing: Sizing,
    multiple: int = 1,
) -> list[tuple[int, int]]:
    """Contiguous ranges, each proportional to its stage's room after its
    fixed parts. Rooms of unknown size count as the largest known room.
    Every stage starts at a multiple of ``multiple`` (the architecture's
    :func:`~ggufpipe_agent.gguf.architectures.cut_multiple`) and the last one
    has at least ``multiple`` blocks (:func:`_last_start`)."""
    inventory, memory, options, hosts = sizing.inventory, sizing.memory, sizing.options, sizing.hosts
    stages = inventory.stages
    count = len(stages)
    blocks = len(memory.block_bytes)
    # Fixed parts: a one-block stage at the right place, less its block.
    fixed: list[dict[str, int]] = []
    for index, stage in enumerate(stages):
        block = 0 if index == 0 else blocks - 1 if index == count - 1 else min(index, blocks - 2)
        engine = replace(options, gpu_layers=inventory.hosts[stage.host].gpu_layers)
        one = estimate_stage(memory, block, block + 1, engine, hosts[stage.host].devices)
        cost = _block_cost(memory, block, options)
        used = usage_by_place(one)
        where = RAM if one.host.blocks else next(d.place for d in one.devices if d.blocks)
        used[where] -= cost
        fixed.append(used)
    rooms: list[float | None] = []  # None: an agent that reported nothing
    for stage in stages:
        host = hosts[stage.host]
        sharing = [i for i, other in enumerate(stages) if other.host == stage.host]
        one = estimate_stage(
            memory, 0, 1, replace(options, gpu_layers=inventory.hosts[stage.host].gpu_layers), host.devices
        )
        places = [RAM] if one.host.blocks else [d.place for d in one.devices]
        room = 0.0
        unknown = False
        for pool in host.pools:
            if pool.place not in places:
                continue
            if not pool.known:
                unknown = True
                continue
            taken = sum(fixed[i].get(pool.place, 0) for i in sharing) * (1 + MARGIN)
            room += pool.usable - taken
        rooms.append(None if unknown else room / len(sharing) / (1 + MARGIN))
    known = [room for room in rooms if room is not None]
    fallback = max(known) if known else 1.0
    weights = [max(fallback if room is None else room, 0.0) for room in rooms]
    if sum(weights) <= 0:
        weights = [1.0] * count
    costs = [_block_cost(memory, block, options) for block in range(blocks)]
    cumulative = [0]
    for cost in costs:
        cumulative.append(cumulative[-1] + cost)
    total_weight = sum(weights)
    cuts = [0]
    share = 0.0
    last = _last_start(blocks, multiple)
    for index in range(count - 1):
        share += weights[index]
        target = cumulative[-1] * share / total_weight
        low = cuts[-1] + multiple
        high = last - (count - 2 - index) * multiple  # room for the later stages' starts
        cut = min(range(low, high + 1, multiple), key=lambda k: (abs(cumulative[k] - target), k))
        cuts.append(cut)
    cuts.append(blocks)
    return [(cuts[i], cuts[i + 1]) for i in range(count)]


def _repair(
    sizing: Sizing,
    ranges: list[tuple[int, int]],
    multiple: int = 1,
) -> list[tuple[int, int]]:
    """Move boundary blocks off stages whose pools overflow onto neighbours
    with room, ``multiple`` at a time (stages start only at its multiples),
    while that helps."""
    memory = sizing.memory

    def overflow(placement: Placement) -> float:
        return sum(max(pool.needed * (1 + MARGIN) - pool.usable, 0) for pool in placement.pools if pool.known)

    current = evaluate_ranges(sizing, ranges, True)
    for _ in range(len(memory.block_bytes) * len(ranges)):
        if current.fits:
            break
        best: tuple[float, list[tuple[int, int]], Placement] | None = None
        for boundary in range(1, len(ranges)):
            for shift in (-multiple, multiple):
                moved = list(ranges)
                cut = moved[boundary][0] + shift
                if not (moved[boundary - 1][0] < cut and cut + multiple <= moved[boundary][1]):
                    continue
                moved[boundary - 1] = (moved[boundary - 1][0], cut)
                moved[boundary] = (cut, moved[boundary][1])
                candidate = evaluate_ranges(sizing, moved, True)
                score = overflow(candidate)
                if best is None or score < best[0]:
                    best = (score, moved, candidate)
        if best is None or best[0] >= overflow(current):
            break
        _, ranges, current = best
    return ranges


# ----------------------------------------------------------------- placing


def evaluate(inventory: Inventory, facts: ModelFacts, hellos: Sequence[Hello | None]) -> Placement:
    """The placement whether it fits or not."""
    sizing = sizing_of(inventory, facts, hellos)
    if inventory.stages[0].layers is not None:
        ranges = assign_layers(inventory, facts.block_count)  # checks the given ranges
        return evaluate_ranges(sizing, ranges, False)
    if len(inventory.stages) > facts.block_count:
        assign_layers(inventory, facts.block_count)  # its error names the file and line
    multiple = _cut_multiple(facts)
    _check_stage_count(inventory, facts, multiple)
    ranges = _proportional(sizing, multiple)
    ranges = _repair(sizing, ranges, multiple)
    return evaluate_ranges(sizing, ranges, True)


def _cut_multiple(facts: ModelFacts) -> int:
    """Where the model's architecture lets a stage start (every block: 1),
    from what the orchestrator knows of it (the keys ``check_plan`` reads)."""
    return cut_multiple(facts.architecture, plan_metadata(facts))


def _last_start(blocks: int, multiple: int) -> int:
    """The last block an automatic stage may start at: a multiple of
    ``multiple`` that leaves the last stage ``multiple`` blocks or more
    (``blocks - 1`` when stages may start anywhere)."""
    return max((blocks - multiple) // multiple * multiple, 0)


def _check_stage_count(inventory: Inventory, facts: ModelFacts, multiple: int) -> None:
    most = _last_start(facts.block_count, multiple) // multiple + 1
    if multiple > 1 and len(inventory.stages) > most:
        raise InventoryError(
            f"{inventory.where(inventory.stages[0].line)}: stages: {len(inventory.stages)} stages for a "
            f"{facts.architecture} model of {facts.block_count} blocks, whose stages start at multiples "
            f"of {multiple} blocks and have {multiple} or more: at most {most} stages"
        )
