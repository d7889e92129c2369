"""``--plan``: connect the agents, read the model, print the placement, exit.

Nothing is provisioned: no stage file is written or sent (``send: true``)
and no weights are loaded into llama.cpp (the agents read the GGUF header
and the vocabulary only; with ``send: true``, this machine does).
The text goes to stdout; ``--json`` prints one JSON object instead.
"""

from __future__ import annotations

import json
import sys
from typing import IO, Any

from ggufpipe_agent.errors import GgufpipeError
from ggufpipe_agent.gguf.memory import StageMemory, Usage, format_size, memory_facts_of
from ggufpipe_agent.wire.protocol import ModelFacts
from ggufpipe_tui.core.events import AgentConnected, AgentLog, Event
from ggufpipe_tui.core.inventory import Inventory
from ggufpipe_tui.core.placement import MARGIN, RAM, Placement, PlacementError
from ggufpipe_tui.core.refusal import usage_text
from ggufpipe_tui.session.pipeline import Pipeline

EXIT_OK = 0
EXIT_SETUP = 2


def _usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "place": usage.place,
        "blocks": usage.blocks,
        "weights": usage.weights,
        "kv_cache": usage.kv,
        "compute": usage.compute,
        "outputs": usage.outputs,
        "agent": usage.runtime,
        "total": usage.total,
    }


def _memory_json(memory: StageMemory) -> list[dict[str, Any]]:
    return [_usage_json(memory.host), *(_usage_json(device) for device in memory.devices if device.total)]


def placement_json(
    placement: Placement, inventory: Inventory, facts: ModelFacts, refusal: str
) -> dict[str, Any]:
    engine = placement.engine
    memory = memory_facts_of(facts)
    return {
        "model": facts.stem,
        "architecture": facts.architecture,
        "blocks": facts.block_count,
        "context": engine.n_ctx,
        "batch": engine.n_batch,
        "ubatch": engine.n_ubatch,
        "automatic": placement.automatic,
        "fits": placement.fits,
        "refusal": refusal,
        "margin": MARGIN,
        "stages": [
            {
                "stage": stage.index,
                "host": stage.host,
                "where": inventory.hosts[stage.host].where,
                "layers": [stage.layers[0], stage.layers[1]],
                "places": list(stage.places),
                "needed_bytes": stage.needed,
                "available_bytes": stage.available,
                # A mixture of experts' routed experts: "gpu", "ram" (llama.cpp's
                # --cpu-moe), null when the stage offloads no block with experts.
                "experts": stage.experts or None,
                "expert_bytes": sum(memory.expert_bytes[stage.layers[0] : stage.layers[1]]),
                "memory": _memory_json(stage.memory),
            }
            for stage in placement.stages
        ],
        "pools": [
            {
                "host": pool.host,
                "place": pool.place,
                "description": pool.description,
                "total_bytes": pool.total,
                "free_bytes": pool.free,
                "cap_bytes": pool.cap,
                "usable_bytes": pool.usable,
                "needed_bytes": pool.needed,
                "stages": list(pool.stages),
                "fits": pool.fits,
            }
            for pool in placement.pools
        ],
    }


def placement_text(placement: Placement, inventory: Inventory, facts: ModelFacts) -> str:
    engine = placement.engine
    memory = memory_facts_of(facts)
    how = "split by memory" if placement.automatic else "layers from the inventory"
    lines = [
        f"model {facts.stem}: {facts.architecture}, {facts.block_count} blocks, {facts.file_type}, "
        f"{format_size(facts.file_size)}",
        f"context {engine.n_ctx}, batch {engine.n_batch}, ubatch {engine.n_ubatch}"
        + (f", {engine.parallel} slots (a KV cache each)" if engine.parallel > 1 else "")
        + f"; {how}",
        "",
        f"{'stage':>5}  {'host':<16} {'layers':<10} {'where':<12} {'needed':>10} {'available':>10}",
    ]
    for stage in placement.stages:
        available = "?" if stage.available < 0 else format_size(stage.available)
        layers = f"[{stage.layers[0]}, {stage.layers[1]})"
        lines.append(
            f"{stage.index:>5}  {stage.host:<16} {layers:<10} {'+'.join(stage.places):<12} "
            f"{format_size(stage.needed):>10} {available:>10}"
        )
        for usage in (stage.memory.host, *stage.memory.devices):
            if usage.total:
                split = usage.blocks and usage.blocks != stage.layers[1] - stage.layers[0]
                blocks = f" ({usage.blocks} blocks)" if split else ""
                lines.append(f"{'':>7}{usage.place}{blocks}: {usage_text(usage, 'KV')}")
        if stage.experts:
            where = "in RAM" if stage.experts_in_ram else "on GPU"
            size = format_size(sum(memory.expert_bytes[stage.layers[0] : stage.layers[1]]))
            lines.append(f"{'':>7}experts: {where} ({size} of routed experts)")
    lines += [
        "",
        "pools (what the plan may fill: the free memory less a reserve, at most the host's memory:)",
    ]
    for pool in placement.pools:
        if not pool.needed and pool.place != RAM:
            continue
        usable = "unknown" if not pool.known else format_size(pool.usable)
        mark = "ok" if pool.fits else "DOES NOT FIT"
        name = pool.place + (f" {pool.description}" if pool.description else "")
        stages = ", ".join(str(i) for i in pool.stages) or "-"
        cap = f", memory: {format_size(pool.cap)}" if pool.cap else ""
        lines.append(
            f"  {pool.host} {name}: stages {stages} need {format_size(pool.needed)} "
            f"(+{MARGIN:.0%} margin), usable {usable} of {format_size(pool.free)} free{cap}: {mark}"
        )
    if any(stage.memory.offloaded for stage in placement.stages):
        lines.append("GPU figures follow llama.cpp's layer placement; they are computed, not measured.")
    return "\n".join(lines)


async def run_plan(
    inventory: Inventory,
    *,
    as_json: bool = False,
    quiet: bool = False,
    verbose: bool = False,
    log_dir: str | None = None,
    out: IO[str] = sys.stdout,
    err: IO[str] = sys.stderr,
) -> int:
    """Print the plan; 0 when it fits, 2 when it does not or cannot be made."""

    def consume(event: Event) -> None:
        if isinstance(event, AgentConnected) and not quiet:
            print(
                f"ggufpipe: stage {event.stage}: agent on {event.host} ({event.where})", file=err, flush=True
            )
        elif isinstance(event, AgentLog) and verbose:
            print(f"[stage {event.stage} {event.host}] {event.line}", file=err, flush=True)

    pipeline = Pipeline(inventory, consume, log_dir=log_dir, deliver=False)  # sends no stage file
    refusal = ""
    try:
        await pipeline.start()
        placement, model = pipeline.placement, pipeline.facts
    except PlacementError as error:
        placement, model, refusal = error.placement, error.facts, str(error)
    except GgufpipeError as error:
        print(f"ggufpipe: error: {error}", file=err, flush=True)
        return EXIT_SETUP
    finally:
        await pipeline.close()
    assert model is not None and placement is not None
    if as_json:
        print(json.dumps(placement_json(placement, inventory, model, refusal)), file=out, flush=True)
    else:
        print(placement_text(placement, inventory, model), file=out, flush=True)
    if refusal:
        print(f"ggufpipe: error: {refusal}", file=err, flush=True)
        return EXIT_SETUP
    return EXIT_OK
