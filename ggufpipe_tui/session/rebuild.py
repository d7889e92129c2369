"""A lost stage's repair: every lost stage's agent started again on its
host or, where its host does not answer, moved to a spare host; the model
checked there, its stage file delivered, and a new data plane over all
stages (docs/recovery.md). Session/recovery.py decides when; this is how.

What it needs of the pipeline is :class:`Rebuildable`: its stages and what
they were placed by, and the pipeline's own ways of starting a stage and
opening a data plane.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from ggufpipe_agent.errors import GgufpipeError
from ggufpipe_agent.tasks import TaskOwner
from ggufpipe_agent.wire.protocol import ModelFacts
from ggufpipe_tui.core.events import Event, StageRecovery
from ggufpipe_tui.core.inventory import HostSpec, Inventory
from ggufpipe_tui.core.placement import Placement
from ggufpipe_tui.core.spares import moved_inventory, spare_candidates, spare_placement, spare_problem
from ggufpipe_tui.session.delivery import Delivered, deliver_stages
from ggufpipe_tui.session.modelsource import LocalModel, ModelSource
from ggufpipe_tui.session.stages import PipelineError, StageHandle
from ggufpipe_tui.transports.connection import AgentConnection, HostUnreachable
from ggufpipe_tui.transports.shared import SharedAgent, process_owner


class Rebuildable(Protocol):
    """What a repair needs of the pipeline (session/pipeline.py's Pipeline);
    it replaces lost stages in ``stages`` and, when a stage moves, the
    ``inventory`` and ``placement``, and ``delivered`` when it sends files."""

    inventory: Inventory
    placement: Placement | None
    delivered: list[Delivered]
    stages: list[StageHandle]

    @property
    def facts(self) -> ModelFacts | None: ...

    @property
    def model(self) -> ModelSource | None: ...

    @property
    def ranges(self) -> list[tuple[int, int]]: ...

    @property
    def tasks(self) -> TaskOwner: ...

    def emit(self, event: Event) -> None: ...

    def new_stage(self, index: int, host: HostSpec, shares: AgentConnection | None = None) -> StageHandle:
        """A handle for stage ``index`` on ``host``, not started; ``shares``:
        the link of the shared agent process it attaches to."""
        ...

    async def start_stage(self, stage: StageHandle, timeout: float) -> None: ...

    def watch_stage(self, stage: StageHandle) -> None:
        """Its heartbeat and control reader."""
        ...

    def close_data_plane(self) -> None:
        """The data plane closed; whatever it still reports is ignored."""
        ...

    async def open_data_plane(self, timeout: float) -> None: ...


async def rebuild(pipeline: Rebuildable) -> tuple[str, str]:
    """Every lost stage's agent started again on its host, or, where its
    host does not answer, on a spare host (:func:`_move`); the model
    checked there and its stage file delivered (from its cache when it has
    it), and a new data plane (new links, new credentials) over all stages.
    Returns how, in a sentence and in a few words ("moved to gpu-c")."""
    timeout = pipeline.inventory.timeouts.connect
    lost = restart_set(pipeline.stages)
    pipeline.close_data_plane()
    for old in lost:  # what closing them says (their streams ending) is not a new loss
        old.retired = True
        old.lost = old.lost or "started again with its agent process"
    await asyncio.gather(*(stage.close(1.0) for stage in lost), return_exceptions=True)
    fresh = _new_handles(pipeline, lost)
    for stage in fresh:
        pipeline.stages[stage.index] = stage
    results = await asyncio.gather(
        *(pipeline.start_stage(stage, timeout) for stage in fresh), return_exceptions=True
    )
    # A stage attached to a shared process whose host does not answer goes with it.
    unreachable = {
        id(stage.link): result
        for stage, result in zip(fresh, results, strict=True)
        if isinstance(result, HostUnreachable)
    }
    for at, stage in enumerate(fresh):
        if isinstance(stage.link, SharedAgent) and id(stage.link.first) in unreachable:
            results[at] = unreachable[id(stage.link.first)]
    # Stages whose host does not answer, by host: they move together.
    gone: dict[str, tuple[HostUnreachable, list[StageHandle]]] = {}
    failures: list[BaseException] = []
    for stage, result in zip(fresh, results, strict=True):
        if isinstance(result, HostUnreachable):
            gone.setdefault(stage.host.name, (result, []))[1].append(stage)
        elif isinstance(result, BaseException):
            failures.append(result)
        else:
            pipeline.watch_stage(stage)
    if failures:
        first = failures[0]
        raise first if isinstance(first, GgufpipeError) else PipelineError(f"restarting: {first!r}")
    moves: list[tuple[str, str]] = []  # (the stages moved, to which host)
    restarted = [stage for stage in fresh if stage.hello is not None]
    for error, stages in gone.values():
        await asyncio.gather(*(stage.close(1.0) for stage in stages), return_exceptions=True)
        moved = await _move(pipeline, [stage.index for stage in stages], error, timeout)
        moves.append((", ".join(stage.label for stage in stages), moved[0].host.name))
        fresh = [stage for stage in fresh if stage not in stages] + moved
    assert pipeline.model is not None
    await asyncio.gather(*(pipeline.model.check(stage, max(60.0, timeout)) for stage in restarted))
    if pipeline.delivered and isinstance(pipeline.model, LocalModel) and pipeline.model.files is not None:
        files, timeouts = pipeline.model.files, pipeline.inventory.timeouts
        again = await deliver_stages(fresh, files, pipeline.ranges, pipeline.emit, timeouts)
        by_stage = {done.stage: done for done in again}
        pipeline.delivered = [by_stage.get(done.stage, done) for done in pipeline.delivered]
    await pipeline.open_data_plane(timeout)
    for stage in sorted(fresh, key=lambda stage: stage.index):
        detail = "restarted" if stage in restarted else f"moved to {stage.host.name}"
        pipeline.emit(StageRecovery(stage.index, stage.host.name, "Ready", detail))
    short = ["restarted"] if restarted else []
    if moves:
        short.append("moved to " + ", ".join(dict.fromkeys(to for _, to in moves)))
    how = [f"moved {stages} to {to}" for stages, to in moves]
    if restarted:
        how.insert(0, "restarted " + _labels(restarted))
    lost_again = next((stage for stage in pipeline.stages if stage.lost), None)
    if lost_again is not None:
        raise PipelineError(f"lost while repairing: {lost_again.lost}")
    return "; ".join(how) or "reopened the data plane", ", ".join(short) or "reopened the data plane"


def restart_set(stages: list[StageHandle]) -> list[StageHandle]:
    """The stages a repair starts again: every lost one, and every stage of
    a shared agent process (share_process: true) that is lost as a whole:
    it exited or went silent, or its first stage, whose session the process
    lives by, is lost. A further stage lost alone while its process lives
    (its session ended, its engine failed) is attached to it again."""
    lost = [stage for stage in stages if stage.lost or not stage.alive()]
    whole: list[AgentConnection] = []
    for stage in lost:
        owner = process_owner(stage.link)
        if owner is not None and (owner is stage.link or not owner.alive() or stage.silent_for):
            whole.append(owner)
    return [
        stage
        for stage in stages
        if stage in lost or any(process_owner(stage.link) is owner for owner in whole)
    ]


def _new_handles(pipeline: Rebuildable, lost: list[StageHandle]) -> list[StageHandle]:
    """New handles, not started, for ``lost`` (restart_set's): each shared
    process lost whole gets a new first stage and its others attached to it;
    a stage lost alone from a live shared process attaches to that one."""
    restarted_owners: dict[int, AgentConnection] = {}  # id of the old first link: the new one
    fresh: list[StageHandle] = []
    firsts = [stage for stage in lost if process_owner(stage.link) is stage.link]
    for old in firsts + [stage for stage in lost if stage not in firsts]:
        owner = process_owner(old.link)
        if owner is None or owner is old.link:
            fresh.append(pipeline.new_stage(old.index, old.host))
            if owner is not None:
                restarted_owners[id(owner)] = fresh[-1].link
        else:
            first = restarted_owners.get(id(owner), owner)
            fresh.append(pipeline.new_stage(old.index, old.host, shares=first))
    return sorted(fresh, key=lambda stage: stage.index)


def _group(pipeline: Rebuildable, indexes: list[int], host: HostSpec) -> list[StageHandle]:
    """Handles for the stages ``indexes`` on ``host``, not started: with
    share_process, the first starts the process and the others attach."""
    first = pipeline.new_stage(indexes[0], host)
    if not host.share_process:
        return [first, *(pipeline.new_stage(index, host) for index in indexes[1:])]
    return [first, *(pipeline.new_stage(index, host, shares=first.link) for index in indexes[1:])]


def _labels(stages: list[StageHandle]) -> str:
    """The stages, a shared process started again whole named once."""
    indexes = {stage.index for stage in stages}
    named: list[str] = []
    for stage in stages:
        owner = process_owner(stage.link)
        whole = owner is not None and set(owner.sharers) <= indexes
        label = owner.process_label if whole and owner is not None else stage.label
        if label not in named:
            named.append(label)
    return ", ".join(named)


async def _move(
    pipeline: Rebuildable, indexes: list[int], error: HostUnreachable, timeout: float
) -> list[StageHandle]:
    """The stages ``indexes`` of a host that does not answer (``error``)
    started on the first spare host no stage uses that can hold them (the
    memory plan's figures, core/spares.py) and whose model is stage 0's,
    with their layer ranges; raises PipelineError naming each spare
    tried, and why not, when none can."""
    assert pipeline.facts is not None and pipeline.model is not None
    what = "stage" + ("s " if len(indexes) > 1 else " ") + ", ".join(map(str, indexes))
    in_use = {stage.host.name for stage in pipeline.stages}
    candidates = spare_candidates(pipeline.inventory, in_use)
    if not candidates:
        raise PipelineError(f"{error}; no spare host (spare: true) to move {what} to")
    refused: list[str] = []
    for name in candidates:
        trial = _group(pipeline, indexes, pipeline.inventory.hosts[name])
        try:
            problem, placement = await _try_spare(pipeline, trial, name, timeout)
        except BaseException:  # cancelled (recovery.deadline): no agent is left behind
            await asyncio.gather(*(stage.close(1.0) for stage in trial), return_exceptions=True)
            raise
        if problem or placement is None:
            refused.append(f"{name}: {problem}")
            await asyncio.gather(*(stage.close(1.0) for stage in trial), return_exceptions=True)
            continue
        for stage in trial:
            pipeline.stages[stage.index] = stage
            stage.start_heartbeat(pipeline.tasks, pipeline.inventory.timeouts.heartbeat)
        pipeline.inventory = moved_inventory(pipeline.inventory, dict.fromkeys(indexes, name))
        pipeline.placement = placement
        return trial
    raise PipelineError(f"{error}; no spare host could take {what}: {'; '.join(refused)}")


async def _try_spare(
    pipeline: Rebuildable, trial: list[StageHandle], name: str, timeout: float
) -> tuple[str, Placement | None]:
    """Start ``trial`` (stages on the spare ``name``) and check that it can
    hold them and has stage 0's model: ("", its placement), or why not."""
    assert pipeline.facts is not None and pipeline.model is not None
    try:
        started = await asyncio.gather(
            *(pipeline.start_stage(stage, timeout) for stage in trial), return_exceptions=True
        )
        for result in started:
            if isinstance(result, GgufpipeError | OSError):
                return str(result), None
            if isinstance(result, BaseException):
                raise result
        for stage in trial:  # its replies (the model check); heartbeats once it is taken
            pipeline.tasks.spawn(stage.read_control(), f"control reader of stage {stage.index}")
        hellos = [stage.hello for stage in pipeline.stages]
        indexes = [stage.index for stage in trial]
        placement = spare_placement(
            pipeline.inventory, pipeline.facts, hellos, pipeline.ranges, indexes, name, trial[0].hello
        )
        problem = spare_problem(placement, name)
        if problem:
            return problem, None
        await asyncio.gather(*(pipeline.model.check(stage, max(60.0, timeout)) for stage in trial))
    except (GgufpipeError, OSError) as failure:
        return str(failure), None
    return "", placement
