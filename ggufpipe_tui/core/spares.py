"""Where recovery moves a lost stage whose host does not answer: a spare host.

Pure (no I/O). A host entry with ``spare: true`` is named by no stage; when
a lost stage's agent cannot be started again because its host does not
answer (session/pipeline.py ``_rebuild``), the stages of that host go, with
the same layer ranges, to the first spare host that no stage uses
(:func:`spare_candidates`, inventory order) and that can hold them by the
memory plan's own figures (:func:`spare_problem`: the placement of the
moved pipeline, core/placement.py ``evaluate``, with the spare's Hello).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

from ggufpipe_agent.gguf.memory import format_size
from ggufpipe_agent.wire.protocol import Hello, ModelFacts
from ggufpipe_tui.core.inventory import Inventory
from ggufpipe_tui.core.placement import MARGIN, RAM, Placement, evaluate


def spare_candidates(inventory: Inventory, in_use: Collection[str]) -> list[str]:
    """The spare hosts no stage runs on (``in_use``: the hosts of the
    pipeline's stages now), in the inventory's order."""
    return [name for name, host in inventory.hosts.items() if host.spare and name not in in_use]


def moved_inventory(inventory: Inventory, moves: Mapping[int, str]) -> Inventory:
    """The inventory with stage ``i`` on host ``moves[i]`` (its layers as given)."""
    stages = tuple(
        replace(stage, host=moves.get(index, stage.host)) for index, stage in enumerate(inventory.stages)
    )
    return replace(inventory, stages=stages)


def spare_placement(
    inventory: Inventory,
    facts: ModelFacts,
    hellos: Sequence[Hello | None],
    ranges: Sequence[tuple[int, int]],
    stages: Collection[int],
    spare: str,
    hello: Hello | None,
) -> Placement:
    """The placement of the pipeline with ``stages`` on ``spare`` (whose
    agent said ``hello``) and every stage keeping its range in ``ranges``;
    ``hellos``: the other stages' agents' (the planner's inputs)."""
    trial = moved_inventory(inventory, dict.fromkeys(stages, spare))
    fixed = tuple(replace(stage, layers=(ranges[i][0], ranges[i][1])) for i, stage in enumerate(trial.stages))
    trial = replace(trial, stages=fixed)
    given = [hello if index in stages else old for index, old in enumerate(hellos)]
    return evaluate(trial, facts, given)


def spare_problem(placement: Placement, spare: str) -> str:
    """Why ``spare`` cannot hold what :func:`spare_placement` put there, in a
    sentence; "" when it can (every pool of the spare fits, margin included)."""
    problems = []
    for pool in placement.pools:
        if pool.host != spare or pool.fits:
            continue
        what = "RAM" if pool.place == RAM else f"GPU {pool.place}"
        several = len(pool.stages) > 1
        stages = ", ".join(str(index) for index in pool.stages)
        problems.append(
            f"stage{'s' if several else ''} {stages} need{'' if several else 's'} "
            f"{format_size(int(pool.needed * (1 + MARGIN)))} of {what} with the {MARGIN:.0%} margin, "
            f"{spare} has {format_size(pool.usable)} there for the plan"
        )
    return "; ".join(problems)
