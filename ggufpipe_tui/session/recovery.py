"""A pipeline's recovery of a lost stage (docs/recovery.md), the half of
:class:`~ggufpipe_tui.session.pipeline.Pipeline` that is about it: a loss
reported and the recovery FSM (core/recovery.py) moved, the repair (every
lost stage's agent started again on its host or moved to a spare, the model
checked, stage files delivered, a new data plane), and the replay of what
was in flight (a conversation's earlier runs first, at one run at a time).

:class:`Recovering` is a mixin: :class:`Pipeline` is the only class made of
it, and the attributes and methods it declares without defining are the
pipeline's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace

from ggufpipe_agent.errors import GgufpipeError
from ggufpipe_agent.tasks import TaskOwner
from ggufpipe_agent.wire.protocol import Message, ModelFacts
from ggufpipe_tui.core import recovery as rec
from ggufpipe_tui.core import run_fsm as fsm
from ggufpipe_tui.core.events import (
    Emit,
    Event,
    Notice,
    RunFinished,
    RunRecovered,
    RunReplaying,
    RunResult,
    StageRecovery,
)
from ggufpipe_tui.core.inventory import HostSpec, Inventory, RunOptions
from ggufpipe_tui.core.placement import Placement
from ggufpipe_tui.core.spares import moved_inventory, spare_candidates, spare_placement, spare_problem
from ggufpipe_tui.dataplane import DataPlane
from ggufpipe_tui.session.delivery import Delivered, deliver_stages
from ggufpipe_tui.session.driver import RunDriver
from ggufpipe_tui.session.modelsource import LocalModel, ModelSource
from ggufpipe_tui.session.runs import RunHandle, RunQueue
from ggufpipe_tui.session.stages import PipelineError, StageHandle
from ggufpipe_tui.transports.link import AgentLink, HostUnreachable
from ggufpipe_tui.transports.shared import SharedAgent

#: Runs of a conversation recovery replays at most (beyond: a cold replay).
MAX_HISTORY = 64


class Recovering:
    # The pipeline's, used here.
    inventory: Inventory
    stages: list[StageHandle]
    data: DataPlane | None
    facts: ModelFacts | None
    model: ModelSource | None
    placement: Placement | None
    ranges: list[tuple[int, int]]
    delivered: list[Delivered]
    closing: bool
    serving: bool
    broken: str
    parallel: int
    prefix_reuse: bool
    tasks: TaskOwner
    queue: RunQueue
    policy: rec.Policy
    recovery: rec.Recovery
    recoveries: list[RunRecovered]
    _plane: int
    _repairing: asyncio.Task[None] | None
    _interrupted: dict[int, RunResult]
    _history: list[tuple[list[int], RunOptions, tuple[int, ...]]]
    _loss: tuple[str, float, int]
    _repair_times: tuple[float, float, float, str]
    _how: str
    _handles: dict[int, RunHandle]

    link_factory: Callable[[HostSpec, int, Callable[[str], None]], AgentLink]

    # The pipeline's methods (Pipeline defines each; never called on this class).
    def emit(self, event: Event) -> None:
        raise NotImplementedError

    def live_drivers(self) -> list[RunDriver]:
        raise NotImplementedError

    def _run_emitter(self, run_id: int, final: bool = False) -> Emit:
        raise NotImplementedError

    async def _start_stage(self, stage: StageHandle, timeout: float) -> None:
        raise NotImplementedError

    def _watch_stage(self, stage: StageHandle) -> None:
        raise NotImplementedError

    async def _open_data_plane(self, timeout: float) -> None:
        raise NotImplementedError

    def _log_sink(self, stage: int, host: str) -> Callable[[str], None]:
        raise NotImplementedError

    def _on_message(self, stage: StageHandle, message: Message) -> None:
        raise NotImplementedError

    def _stage_lost(self, stage: StageHandle, symptom: str) -> None:
        raise NotImplementedError

    async def prepare_run(
        self, options: RunOptions | None = None, quiet: bool = False, *, slot: int = 0, reuse: bool = True
    ) -> RunDriver:
        raise NotImplementedError

    async def run_prompt(
        self, driver: RunDriver, tokens: list[int], submitted: float, max_tokens: int = 0
    ) -> RunResult:
        raise NotImplementedError

    async def _report_lost(self, stage: StageHandle, symptom: str) -> None:
        reason = await stage.diagnose(symptom)
        stage.lost = reason
        if self.closing:
            return
        repeated = reason == self.broken  # another stage of a shared process that died
        if not self.broken:
            self.broken = reason
        if not repeated:
            self.emit(Notice("error", reason))
        stage.fail_requests(reason)
        live = self.live_drivers()
        running = bool(live)
        prompted = [driver for driver in live if driver.prompt]  # not a run prepared ahead
        at_token = len(prompted[0].tokens) if prompted else len(live[0].tokens) if live else -1
        now = time.perf_counter()
        before = self.recovery
        if not self.serving:
            # Lost while the pipeline starts: start() fails with the reason
            # (a recovery would race the teardown of what was started).
            self.queue.stop(reason)
            return
        self.recovery = rec.transition(before, rec.Loss(reason, now), self.policy)
        if before.phase is rec.Phase.READY:
            self._loss = (f"{stage.label}", now, at_token)
        self.recovery = rec.transition(self.recovery, rec.Begin(now), self.policy)
        if self.recovery.phase is rec.Phase.BROKEN:
            failure = self.recovery.reason
            if self.policy.attempts > 0:
                self.broken = failure
                self.emit(StageRecovery(stage.index, stage.host.name, "Broken", failure, at_token))
        else:
            failure = reason
            if before.phase is not rec.Phase.RECOVERING:
                self.emit(StageRecovery(stage.index, stage.host.name, "Lost", reason, at_token))
                self.emit(StageRecovery(stage.index, stage.host.name, "Recovering", "", at_token))
        if running:
            for driver in live:  # every run in flight needs the stage
                driver.feed(fsm.StageLost(stage.index, failure))
            # A run with its prompt is repaired and replayed by its queue
            # (RunQueue also repairs when its prepared run is lost); runs that
            # slots only prepared ahead have no one waiting: repaired now.
            if self.parallel == 1 or prompted:
                return
        if self.recovery.phase is rec.Phase.BROKEN:
            # Between runs (no run to fault): the session can serve no more.
            self.queue.stop(failure)
        elif self.recovery.phase is rec.Phase.RECOVERING and self._repairing is None:
            self.tasks.spawn(self._recover_between_runs(), "recovery between runs")

    async def _recover_between_runs(self) -> None:
        # Let a faulting prepared run (the queue's) settle first.
        await asyncio.sleep(0)
        try:
            await self.recover()
        except PipelineError as error:
            self.queue.stop(str(error))

    # ------------------------------------------------------------ recovery

    def remember(self, tokens: list[int], options: RunOptions, result: RunResult) -> None:
        """A run that ended: the runs since the stages' caches were last empty
        (each that kept a prefix built on the one before) are what recovery
        replays before an interrupted run that kept a prefix, so that the new
        stage's cache is computed in the same batches as the others' were."""
        replayable = (
            result.ok
            and result.stop_reason in ("max_tokens", "eos")
            and self.prefix_reuse
            and self.policy.attempts > 0  # else nothing is ever replayed: keep nothing
            # With slots, each slot's runs interleave with the others': an
            # interrupted run is replayed on its slot, cold (docs/recovery.md).
            and self.parallel == 1
        )
        if not replayable or (result.prompt_reused and not self._history):
            self._history = []  # a chain that cannot be replayed exactly
            return
        entry = (list(tokens), replace(options, max_tokens=len(result.tokens)), tuple(result.tokens))
        self._history = [*self._history, entry] if result.prompt_reused else [entry]
        if len(self._history) > MAX_HISTORY:
            self._history = []

    async def replay_history(self, old: RunResult) -> None:
        """Before ``old`` (interrupted) is replayed: where it kept a prefix of
        the run before, every run since the caches were last empty runs again,
        quietly, each with its tokens, reply length and sampling, so that
        every stage's cache is computed in the batches it was (a cold replay
        of ``old`` would compute its prefix in other batches, which kernels
        that are not batch-invariant compute in other bits). Each replayed
        run's tokens are checked against the ones it gave."""
        if not old.prompt_reused or not self._history:
            return
        for index, (tokens, options, recorded) in enumerate(list(self._history)):
            driver = await self.prepare_run(options, quiet=True)
            driver.replay = recorded
            result = await self.run_prompt(driver, tokens, time.monotonic(), options.max_tokens)
            if not result.ok or tuple(result.tokens) != recorded:
                why = result.failure or "other tokens"
                raise PipelineError(
                    f"replaying turn {index + 1} of the conversation before the lost run: {why}"
                )

    def take_interrupted(self, run_id: int) -> RunResult | None:
        """Run ``run_id``'s result when it faulted by a lost stage that
        recovery repairs: it is to be replayed (RunQueue._run), not finished."""
        return self._interrupted.pop(run_id, None)

    @property
    def recovering(self) -> bool:
        return self.recovery.active

    async def recover(self) -> None:
        """Repair the pipeline after a lost stage (every lost stage's agent
        started again, the model checked, its stage file delivered, a new data
        plane); returns when it can carry runs, raises PipelineError with the
        one reason when recovery gives up."""
        while self.recovery.phase is rec.Phase.RECOVERING and not self.closing:
            if self._repairing is None or self._repairing.done():
                self._repairing = self.tasks.spawn(self._repair(), "recovery")
            await asyncio.wait({self._repairing})
        if self.recovery.phase is rec.Phase.BROKEN:
            raise PipelineError(self.recovery.reason)
        if self.closing:
            raise PipelineError("the pipeline closed")
        if self.broken:
            raise PipelineError(self.broken)

    async def _repair(self) -> None:
        started = time.perf_counter()
        left = rec.time_left(self.recovery, self.policy, started)
        try:
            how = await asyncio.wait_for(self._rebuild(), max(left, 1.0))
            again = next((stage for stage in self.stages if stage.lost), None)
            if again is not None:
                raise PipelineError(f"lost while repairing: {again.lost}")
        except (GgufpipeError, OSError, asyncio.TimeoutError) as error:
            why = str(error) or f"it took more than the {left:.0f} s left of recovery.deadline"
            self.recovery = rec.transition(self.recovery, rec.RepairFailed(why), self.policy)
            self.recovery = rec.transition(self.recovery, rec.Begin(time.perf_counter()), self.policy)
            if self.recovery.phase is rec.Phase.BROKEN:
                self.broken = self.recovery.reason
                self.emit(Notice("error", self.recovery.reason))
            return
        self.recovery = rec.transition(self.recovery, rec.Repaired(how), self.policy)
        self.broken = ""
        self._repair_times = (started, time.perf_counter(), self._repair_times[2], self._how)

    async def _rebuild(self) -> str:
        """Every lost stage's agent started again on its host, or, where its
        host does not answer, on a spare host (:meth:`_move`); the model
        checked there and its stage file delivered (from its cache when it has
        it), and a new data plane (new links, new credentials) over all stages."""
        timeout = self.inventory.timeouts.connect
        lost = [stage for stage in self.stages if stage.lost or not stage.alive()]
        for stage in lost:
            if stage.link.share_process or isinstance(stage.link, SharedAgent):
                raise PipelineError(
                    f"{stage.label} runs in a shared agent process (share_process: true), "
                    "which recovery cannot start again yet"
                )
        if self.data is not None:
            self._plane += 1  # the old plane's reports (its streams closing) are ignored
            self.data.close()
            self.data = None
        await asyncio.gather(*(stage.close(1.0) for stage in lost), return_exceptions=True)
        fresh: list[StageHandle] = []
        for old in lost:
            fresh.append(self._handle(old.index, old.host))
            self.stages[old.index] = fresh[-1]
        results = await asyncio.gather(
            *(self._start_stage(stage, timeout) for stage in fresh), return_exceptions=True
        )
        # Stages whose host does not answer, by host: they move together.
        gone: dict[str, tuple[HostUnreachable, list[StageHandle]]] = {}
        failures: list[BaseException] = []
        for stage, result in zip(fresh, results, strict=True):
            if isinstance(result, HostUnreachable):
                gone.setdefault(stage.host.name, (result, []))[1].append(stage)
            elif isinstance(result, BaseException):
                failures.append(result)
            else:
                self._watch_stage(stage)
        if failures:
            first = failures[0]
            raise first if isinstance(first, GgufpipeError) else PipelineError(f"restarting: {first!r}")
        moves: list[tuple[str, str]] = []  # (the stages moved, to which host)
        restarted = [stage for stage in fresh if stage.hello is not None]
        for error, stages in gone.values():
            await asyncio.gather(*(stage.close(1.0) for stage in stages), return_exceptions=True)
            moved = await self._move([stage.index for stage in stages], error, timeout)
            moves.append((", ".join(stage.label for stage in stages), moved[0].host.name))
            fresh = [stage for stage in fresh if stage not in stages] + moved
        assert self.model is not None
        await asyncio.gather(*(self.model.check(stage, max(60.0, timeout)) for stage in restarted))
        if self.delivered and isinstance(self.model, LocalModel) and self.model.files is not None:
            files, timeouts = self.model.files, self.inventory.timeouts
            again = await deliver_stages(fresh, files, self.ranges, self.emit, timeouts)
            by_stage = {done.stage: done for done in again}
            self.delivered = [by_stage.get(done.stage, done) for done in self.delivered]
        await self._open_data_plane(timeout)
        for stage in sorted(fresh, key=lambda stage: stage.index):
            detail = "restarted" if stage in restarted else f"moved to {stage.host.name}"
            self.emit(StageRecovery(stage.index, stage.host.name, "Ready", detail))
        short = ["restarted"] if restarted else []
        if moves:
            short.append("moved to " + ", ".join(dict.fromkeys(to for _, to in moves)))
        self._how = ", ".join(short) or "reopened the data plane"
        how = [f"moved {stages} to {to}" for stages, to in moves]
        if restarted:
            how.insert(0, "restarted " + ", ".join(stage.label for stage in restarted))
        return "; ".join(how) or "reopened the data plane"

    def _handle(self, index: int, host: HostSpec) -> StageHandle:
        link = self.link_factory(host, index, self._log_sink(index, host.name))
        return StageHandle(index, link, self._on_message, self._stage_lost)

    async def _move(self, indexes: list[int], error: HostUnreachable, timeout: float) -> list[StageHandle]:
        """The stages ``indexes`` of a host that does not answer (``error``)
        started on the first spare host no stage uses that can hold them (the
        memory plan's figures, core/spares.py) and whose model is stage 0's,
        with their layer ranges; raises PipelineError naming each spare
        tried, and why not, when none can."""
        assert self.facts is not None and self.model is not None
        what = "stage" + ("s " if len(indexes) > 1 else " ") + ", ".join(map(str, indexes))
        in_use = {stage.host.name for stage in self.stages}
        candidates = spare_candidates(self.inventory, in_use)
        if not candidates:
            raise PipelineError(f"{error}; no spare host (spare: true) to move {what} to")
        refused: list[str] = []
        for name in candidates:
            trial = [self._handle(index, self.inventory.hosts[name]) for index in indexes]
            try:
                problem, placement = await self._try_spare(trial, name, timeout)
            except BaseException:  # cancelled (recovery.deadline): no agent is left behind
                await asyncio.gather(*(stage.close(1.0) for stage in trial), return_exceptions=True)
                raise
            if problem or placement is None:
                refused.append(f"{name}: {problem}")
                await asyncio.gather(*(stage.close(1.0) for stage in trial), return_exceptions=True)
                continue
            for stage in trial:
                self.stages[stage.index] = stage
                stage.start_heartbeat(self.tasks, self.inventory.timeouts.heartbeat)
            self.inventory = moved_inventory(self.inventory, dict.fromkeys(indexes, name))
            self.placement = placement
            return trial
        raise PipelineError(f"{error}; no spare host could take {what}: {'; '.join(refused)}")

    async def _try_spare(
        self, trial: list[StageHandle], name: str, timeout: float
    ) -> tuple[str, Placement | None]:
        """Start ``trial`` (stages on the spare ``name``) and check that it can
        hold them and has stage 0's model: ("", its placement), or why not."""
        assert self.facts is not None and self.model is not None
        try:
            started = await asyncio.gather(
                *(self._start_stage(stage, timeout) for stage in trial), return_exceptions=True
            )
            for result in started:
                if isinstance(result, GgufpipeError | OSError):
                    return str(result), None
                if isinstance(result, BaseException):
                    raise result
            for stage in trial:  # its replies (the model check); heartbeats once it is taken
                self.tasks.spawn(stage.read_control(), f"control reader of stage {stage.index}")
            hellos = [stage.hello for stage in self.stages]
            indexes = [stage.index for stage in trial]
            placement = spare_placement(
                self.inventory, self.facts, hellos, self.ranges, indexes, name, trial[0].hello
            )
            problem = spare_problem(placement, name)
            if problem:
                return problem, None
            await asyncio.gather(*(self.model.check(stage, max(60.0, timeout)) for stage in trial))
        except (GgufpipeError, OSError) as failure:
            return str(failure), None
        return "", placement

    def replaying(self, replay: RunDriver, old: RunResult) -> None:
        """``replay`` carries the interrupted run's prompt on (``old``: its
        result): it regenerates the tokens already streamed (checked, not
        streamed again) and goes on."""
        self._handles.pop(old.run_id, None)
        replay.replay = old.tokens
        prepared = time.perf_counter()
        who, lost_at, at_token = self._loss
        start, end, torn_down, how = self._repair_times
        prompt_tokens = len(old.prompt_tokens)

        def caught_up(injected: float, done: float) -> None:
            event = RunRecovered(
                run_id=replay.plan.run_id,
                interrupted=old.run_id,
                stages=who,
                how=how or "restarted",
                at_token=len(old.tokens),
                replayed=prompt_tokens + len(old.tokens),
                lost_at=lost_at,
                teardown_s=max(0.0, (torn_down or start) - lost_at),
                restart_s=max(0.0, end - start),
                load_s=max(0.0, injected - prepared),
                replay_s=max(0.0, done - injected),
            )
            self.recoveries.append(event)
            replay.emit(event)

        replay.caught_up = caught_up
        replay.emit(RunReplaying(replay.plan.run_id, old.run_id, len(old.tokens)))

    def give_up(self, old: RunResult, reason: str) -> RunResult:
        """An interrupted run that recovery could not carry on (``old``: its
        result): it ends now, faulted with ``reason``."""
        result = replace(old, failure=reason)
        self._run_emitter(old.run_id, final=True)(RunFinished(result))
        return result
