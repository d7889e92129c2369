"""Placing the stages, or refusing a plan that does not fit in memory with
one message: each pool that overflows, its stages and their needs, what the
pool has, and what would fit (fewer runs in flight, a smaller context, the
experts in RAM, fewer layers on a stage, more memory). The solver is
:mod:`ggufpipe_tui.core.placement`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ggufpipe_agent.gguf.memory import GIB, MIB, StageMemory, Usage, format_size
from ggufpipe_agent.wire.protocol import Hello, ModelFacts
from ggufpipe_tui.core.inventory import Inventory, InventoryError
from ggufpipe_tui.core.placement import (
    GPU_RESERVE,
    MARGIN,
    RAM,
    RAM_RESERVE,
    Placement,
    PlacementError,
    evaluate,
    evaluate_ranges,
    sizing_of,
    usage_by_place,
)
from ggufpipe_tui.core.plan import engine_options

_CONTEXT_STEP = 256  # llama.cpp pads the context to this


def place_stages(inventory: Inventory, facts: ModelFacts, hellos: Sequence[Hello | None]) -> Placement:
    """The stages' layer ranges and memory figures; raises PlacementError when
    the plan does not fit, InventoryError for ranges that do not tile the model."""
    placement = evaluate(inventory, facts, hellos)
    if not placement.fits:
        raise PlacementError(refusal(inventory, facts, hellos, placement), placement, facts)
    return placement


def usage_text(usage: Usage, kv: str = "KV cache") -> str:
    """An estimate in one place part by part (``weights 1.2 GiB, KV cache
    64 MiB, ...``); ``kv`` names the KV cache."""
    parts = [
        ("weights", usage.weights),
        (kv, usage.kv),
        ("compute", usage.compute),
        ("outputs", usage.outputs),
        ("agent", usage.runtime),
    ]
    return ", ".join(f"{name} {format_size(count)}" for name, count in parts if count)


def _parts(memory: StageMemory, place: str) -> str:
    return usage_text(memory.host if place == RAM else next(d for d in memory.devices if d.place == place))


def _largest_context(inventory: Inventory, facts: ModelFacts, hellos: Sequence[Hello | None]) -> int:
    """The largest context (a multiple of 256) at which the plan fits; 0 if none."""
    steps = (engine_options(inventory.run, facts).n_ctx - 1) // _CONTEXT_STEP
    return _most_that_fits(inventory, facts, hellos, "context", steps, _CONTEXT_STEP)


def _most_slots(inventory: Inventory, facts: ModelFacts, hellos: Sequence[Hello | None]) -> int:
    """The most runs in flight (slots) below the inventory's at which the plan fits; 0 if none."""
    return _most_that_fits(inventory, facts, hellos, "parallel", max(1, inventory.run.parallel) - 1)


def _most_that_fits(
    inventory: Inventory,
    facts: ModelFacts,
    hellos: Sequence[Hello | None],
    option: str,
    most: int,
    step: int = 1,
) -> int:
    """The largest ``n * step`` (``n`` from 1 to ``most``) that, as the run
    option ``option``, makes the plan fit; 0 if none. A binary search: the
    plan needs more memory as the option grows."""
    low, high, best = 1, most, 0
    while low <= high:
        middle = (low + high) // 2
        change: dict[str, Any] = {option: middle * step}
        trial = replace(inventory, run=replace(inventory.run, **change))
        try:
            fits = evaluate(trial, facts, hellos).fits
        except InventoryError:
            fits = False
        if fits:
            best, low = middle, middle + 1
        else:
            high = middle - 1
    return best * step


def _most_layers(
    placement: Placement, inventory: Inventory, facts: ModelFacts, hellos: Sequence[Hello | None], stage: int
) -> int:
    """How many blocks from its start stage ``stage`` could run where it is."""
    start, end = placement.stages[stage].layers
    best = 0
    for blocks in range(1, end - start):
        ranges = list(placement.ranges)
        ranges[stage] = (start, start + blocks)
        sizing = sizing_of(inventory, facts, hellos, placement.engine)
        trial = evaluate_ranges(sizing, ranges, placement.automatic)
        host = placement.stages[stage].host
        if all(pool.fits for pool in trial.pools if pool.host == host):
            best = blocks
    return best


def _round_up(count: int) -> str:
    """A size to write in the inventory, rounded up to 64 MiB."""
    step = 64 * MIB
    rounded = -(-count // step) * step
    return f"{rounded // GIB}GiB" if rounded % GIB == 0 else f"{rounded // MIB}MiB"


def refusal(
    inventory: Inventory, facts: ModelFacts, hellos: Sequence[Hello | None], placement: Placement
) -> str:
    """One message: each pool that overflows, its stages and their needs, what
    the pool has, and what would fit."""
    lines = []
    for pool in placement.pools:
        if pool.fits:
            continue
        stages = [placement.stages[i] for i in pool.stages]
        what = "RAM" if pool.place == RAM else f"GPU {pool.place}"
        if pool.description:
            what += f" ({pool.description})"
        needs = [
            f"stage {stage.index} on {pool.host} ({inventory.hosts[pool.host].where}), layers "
            f"[{stage.layers[0]}, {stage.layers[1]}), needs "
            f"{format_size(usage_by_place(stage.memory).get(pool.place, 0))} of {what} "
            f"({_parts(stage.memory, pool.place)})"
            for stage in stages
        ]
        if pool.place == RAM and pool.cap and pool.cap <= pool.free - RAM_RESERVE:
            why = f"memory: {format_size(pool.cap)} in the inventory"
        else:
            reserve = RAM_RESERVE if pool.place == RAM else GPU_RESERVE
            why = f"{format_size(pool.free)} free less {format_size(reserve)} kept free"
        with_margin = format_size(int(pool.needed * (1 + MARGIN)))
        lines.append(
            " and ".join(needs)
            + f"; {'together ' if len(stages) > 1 else ''}{with_margin} with the {MARGIN:.0%} margin, and "
            f"{pool.host} has {format_size(pool.usable)} there for the plan ({why})"
        )
    advice = []
    slots = placement.engine.parallel
    fewer = _most_slots(inventory, facts, hellos) if slots > 1 else 0
    if fewer:  # each slot (a run in flight) holds a KV cache of the whole context
        advice.append(f"fewer runs in flight (--parallel {fewer}; now {slots}, a KV cache each)")
    context = _largest_context(inventory, facts, hellos)
    current = placement.engine.n_ctx
    if context:
        advice.append(f"a context of {context} tokens (--context {context}; now {current})")
    failing = [
        s
        for s in placement.stages
        if any(not p.fits for p in placement.pools if p.host == s.host and s.index in p.stages)
    ]
    for host in sorted({s.host for s in failing if s.experts == "gpu"}):
        # Its experts stayed on its GPUs: pinned there, or its RAM too short.
        hosts = {**inventory.hosts, host: replace(inventory.hosts[host], experts="ram")}
        moved = replace(inventory, hosts=hosts)
        trial = evaluate_ranges(sizing_of(moved, facts, hellos, placement.engine), placement.ranges, True)
        gpus_fit = all(p.fits for p in trial.pools if p.host == host and p.place != RAM)
        ram = trial.pool(host, RAM)
        if inventory.hosts[host].experts == "gpu" and trial.fits:
            advice.append(f"experts: ram on {host} (its stages' routed experts in RAM, not on its GPUs)")
        elif gpus_fit and not ram.fits and ram.known:
            wanted = int(ram.needed * (1 + MARGIN))
            more = (
                f"memory: {_round_up(wanted)} or more on {host}"
                if ram.cap and ram.cap <= ram.free - RAM_RESERVE
                else f"{format_size(wanted + RAM_RESERVE - ram.free)} more free RAM on {host}"
            )
            advice.append(
                f"{more} for its stages' routed experts (they would need {format_size(wanted)} of RAM "
                "with the margin; experts: auto puts them there when the RAM holds them)"
            )
    if not placement.automatic:
        for stage in failing:
            most = _most_layers(placement, inventory, facts, hellos, stage.index)
            if most:
                advice.append(
                    f"at most {most} layers on stage {stage.index} "
                    f"([{stage.layers[0]}, {stage.layers[0] + most}) instead of "
                    f"[{stage.layers[0]}, {stage.layers[1]}))"
                )
    else:
        room = sum(p.usable for p in placement.pools if p.known)
        total = sum(p.needed for p in placement.pools) * (1 + MARGIN)
        if total > room:
            advice.append(
                f"more hosts or memory: the plan needs {format_size(int(total))}, "
                f"the hosts have {format_size(room)} for it"
            )
    for pool in placement.pools:
        if pool.fits:
            continue
        wanted = int(pool.needed * (1 + MARGIN))
        if pool.place == RAM and pool.cap:
            advice.append(
                f"memory: {_round_up(wanted)} or more on {pool.host} (it has {format_size(pool.free)} free)"
            )
        else:
            reserve = RAM_RESERVE if pool.place == RAM else GPU_RESERVE
            what = "RAM" if pool.place == RAM else pool.place
            advice.append(f"{format_size(wanted + reserve - pool.free)} more free {what} on {pool.host}")
    return (
        "the plan does not fit in memory: "
        + "; ".join(lines)
        + ". What would fit: "
        + ", or ".join(advice)
        + "."
    )
