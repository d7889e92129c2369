"""A pipeline's recovery of a lost stage (docs/recovery.md): a loss
(or a direct link broken between two live stages: :meth:`Recovery.report_link`)
reported and the recovery FSM (core/recovery.py) moved, the repair (the
pipeline's :meth:`~Recoverable.rebuild`, session/rebuild.py) begun and
bounded, and the replay of what was in flight: a run that a lost stage
interrupted is replayed on a new run once the pipeline is repaired, a
conversation's earlier runs first (at one run at a time).

:class:`Recovery` is an object the pipeline owns and calls; what it needs of
the pipeline is :class:`Recoverable`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Protocol

from ggufpipe_agent.errors import GgufpipeError
from ggufpipe_agent.ids import FIRST_SLOT, RunId, SlotId
from ggufpipe_agent.tasks import TaskOwner
from ggufpipe_tui.core import recovery as rec
from ggufpipe_tui.core import run_fsm as fsm
from ggufpipe_tui.core.events import (
    Event,
    Notice,
    RunInterrupted,
    RunRecovered,
    RunReplaying,
    RunResult,
    StageRecovery,
)
from ggufpipe_tui.core.inventory import RunOptions
from ggufpipe_tui.core.plan import sampling_params
from ggufpipe_tui.core.reuse import RESUME_REFUSED, Resume
from ggufpipe_tui.session.driver import RunDriver
from ggufpipe_tui.session.runs import RunHandle, Turn, with_history
from ggufpipe_tui.session.stages import PipelineError, StageHandle

#: Runs of a conversation recovery replays at most (beyond: a cold replay).
MAX_HISTORY = 64


class Recoverable(Protocol):
    """What recovery needs of the pipeline (session/pipeline.py's Pipeline)."""

    broken: str  # why the pipeline cannot carry another run ("" when it can)

    @property
    def closing(self) -> bool: ...

    @property
    def serving(self) -> bool:
        """start() has finished (before: a loss fails the start)."""
        ...

    @property
    def parallel(self) -> int: ...

    @property
    def prefix_reuse(self) -> bool: ...

    def emit(self, event: Event) -> None: ...

    def live_drivers(self) -> list[RunDriver]: ...

    def stop_serving(self, reason: str) -> None:
        """No more prompts: every one waiting fails with ``reason``."""
        ...

    def end_run(self, result: RunResult) -> None:
        """The run of ``result`` ends now, with it (its RunFinished)."""
        ...

    async def prepare_run(
        self,
        options: RunOptions | None = None,
        quiet: bool = False,
        *,
        slot: SlotId = FIRST_SLOT,
        reuse: bool = True,
        resume: Resume | None = None,
    ) -> RunDriver: ...

    async def run_prompt(
        self, driver: RunDriver, tokens: list[int], submitted: float, max_tokens: int = 0
    ) -> RunResult: ...

    def assign(self, handle: RunHandle, driver: RunDriver, replaces: int = 0) -> None:
        """``driver`` runs ``handle``'s prompt, instead of run ``replaces``."""
        ...

    async def rebuild(self) -> tuple[str, str]:
        """Every lost stage started again (or moved) and a new data plane:
        how, in a sentence and in a few words; raises when it cannot."""
        ...


class Recovery:
    def __init__(self, pipeline: Recoverable, policy: rec.Policy, tasks: TaskOwner) -> None:
        self.pipeline = pipeline
        self.policy = policy
        self.tasks = tasks
        self.state = rec.Recovery()
        # Counted apart (GET /health, /metrics): stages lost, repairs done
        # (a repair restarts every stage lost meanwhile), and the runs that
        # were replayed after one (each run in flight at the loss: RunRecovered).
        self.stages_lost = 0
        self.repairs = 0
        self.recoveries: list[RunRecovered] = []
        self._repairing: asyncio.Task[None] | None = None
        self._interrupted: dict[int, RunResult] = {}  # faulted runs to be replayed
        # The runs since the caches were last empty: (prompt, options, tokens).
        self._history: list[tuple[list[int], RunOptions, tuple[int, ...]]] = []
        self._loss: tuple[str, float, int] = ("", 0.0, -1)  # who was lost first, when, at which token
        self._repair_times = (0.0, 0.0, 0.0, "")  # repair start, end, teardown done, how
        self._how = ""  # the last repair in a few words: "restarted", "moved to gpu-c"
        # The stages lost since the pipeline was last whole (none: a link
        # re-made): one lost alone is rebuilt in proportion (docs/recovery.md).
        self._lost: set[int] = set()

    @property
    def active(self) -> bool:
        """A stage is lost and recovery has not given up or repaired it yet."""
        return self.state.active

    @property
    def counts(self) -> rec.Counts:
        """Stages lost, repairs and runs replayed so far."""
        return rec.Counts(self.stages_lost, self.repairs, len(self.recoveries))

    def _step(self, event: rec.RecoveryEvent) -> None:
        self.state = rec.transition(self.state, event, self.policy)

    def ended(self, result: RunResult, final: bool = False) -> RunInterrupted | None:
        """A run that ended with ``result``: when a lost stage that recovery
        repairs faulted it (and it is not ``final``: given up), it is kept to
        be replayed (its replay's RunFinished ends it) and this is what to say
        instead; else None, and a completed run gives the next loss
        recovery's whole budget."""
        refused = result.failure.startswith(RESUME_REFUSED)  # replayed whole instead
        if (
            not final
            and result.outcome == "faulted"
            and (self.state.phase is rec.Phase.RECOVERING or refused)
            and not self.pipeline.closing
        ):
            self._interrupted[result.run_id] = result
            if not refused:  # a refused resume comes after its repair: that repair's times and how stand
                self._repair_times = (0.0, 0.0, time.perf_counter(), "")
            return RunInterrupted(result.run_id, result.failure, len(result.tokens))
        if result.ok:
            self._step(rec.Settled())
        return None

    async def report_lost(self, stage: StageHandle, symptom: str) -> None:
        """``stage`` is lost (``symptom``): said once, with its root cause; the
        runs in flight fault, and the repair begins (or the session stops)."""
        reason = await stage.diagnose(symptom)
        pipeline = self.pipeline
        if stage.retired:  # a repair replaced it meanwhile (a shared process started again)
            return
        stage.lost = reason
        if pipeline.closing:
            return
        repeated = reason == pipeline.broken  # another stage of a shared process that died
        if not pipeline.broken:
            pipeline.broken = reason
        if not repeated:
            pipeline.emit(Notice("error", reason))
        stage.fail_requests(reason)
        live = pipeline.live_drivers()
        if repeated and self.state.phase is rec.Phase.RECOVERING:
            self._lost.add(stage.index)
            for driver in live:  # one loss: the repair under way restarts the whole process
                driver.feed(fsm.StageLost(stage.index, reason))
            return
        running = bool(live)
        prompted = [driver for driver in live if driver.prompt]  # not a run prepared ahead
        at_token = len(prompted[0].tokens) if prompted else len(live[0].tokens) if live else -1
        now = time.perf_counter()
        before = self.state
        if not pipeline.serving:
            # Lost while the pipeline starts: start() fails with the reason
            # (a recovery would race the teardown of what was started).
            pipeline.stop_serving(reason)
            return
        self.stages_lost += 1
        self._lost = {stage.index} if before.phase is rec.Phase.READY else {*self._lost, stage.index}
        self._step(rec.Loss(reason, now))
        if before.phase is rec.Phase.READY:
            # A shared process that died: its stages, named once.
            who = stage.label if stage.link.alive() else stage.link.process_label
            self._loss = (who, now, at_token)
        self._step(rec.Begin(now))
        if self.state.phase is rec.Phase.BROKEN:
            failure = self.state.reason
            if self.policy.attempts > 0:
                pipeline.broken = failure
                pipeline.emit(StageRecovery(stage.index, stage.host.name, "Broken", failure, at_token))
        else:
            failure = reason
            if before.phase is not rec.Phase.RECOVERING:
                pipeline.emit(StageRecovery(stage.index, stage.host.name, "Lost", reason, at_token))
                pipeline.emit(StageRecovery(stage.index, stage.host.name, "Recovering", "", at_token))
        if running:
            for driver in live:  # every run in flight needs the stage
                driver.feed(fsm.StageLost(stage.index, failure))
            # A run with its prompt is repaired and replayed (Pipeline.run;
            # Pipeline.repaired when a runner's prepared run is lost); runs
            # that slots only prepared ahead have no one waiting: repaired now.
            if pipeline.parallel == 1 or prompted:
                return
        if self.state.phase is rec.Phase.BROKEN:
            # Between runs (no run to fault): the session can serve no more.
            pipeline.stop_serving(failure)
        elif self.state.phase is rec.Phase.RECOVERING and self._repairing is None:
            self.tasks.spawn(self._recover_between_runs(), "recovery between runs")

    async def report_link(self, link: str, reason: str) -> None:
        """``link``, a direct link between two live stages, broke (``reason``):
        a loss with no stage lost. The runs in flight fault (an edge fault:
        every stage still stops its run) and are replayed once the repair
        (:meth:`Recoverable.rebuild`: nothing to restart, a new data plane
        that makes the link again) is done; bounded like any loss."""
        pipeline = self.pipeline
        if pipeline.closing:
            return
        if not pipeline.broken:
            pipeline.broken = reason
        live = pipeline.live_drivers()
        prompted = [driver for driver in live if driver.prompt]
        at_token = len(prompted[0].tokens) if prompted else len(live[0].tokens) if live else -1
        if not pipeline.serving:
            pipeline.stop_serving(reason)
            return
        now, before = time.perf_counter(), self.state
        if before.phase is rec.Phase.READY:
            self._lost = set()
        self._step(rec.Loss(reason, now))
        if before.phase is rec.Phase.READY:
            self._loss = (link, now, at_token)
        self._step(rec.Begin(now))
        broken = self.state.phase is rec.Phase.BROKEN
        failure = self.state.reason if broken else reason
        if broken and self.policy.attempts > 0:
            pipeline.broken = failure
        if broken:
            pipeline.emit(Notice("error", failure))
        else:
            pipeline.emit(Notice("warning", f"{reason}; re-making it"))
        for driver in live:
            driver.feed(fsm.EdgeFault(failure))
        if live and (pipeline.parallel == 1 or prompted):
            return  # each run is repaired and replayed by its carry_on
        if broken:
            pipeline.stop_serving(failure)
        elif self.state.phase is rec.Phase.RECOVERING and self._repairing is None:
            self.tasks.spawn(self._recover_between_runs(), "recovery between runs")

    async def _recover_between_runs(self) -> None:
        # Let a faulting prepared run (a runner's) settle first.
        await asyncio.sleep(0)
        try:
            await self.recover()
        except PipelineError as error:
            self.pipeline.stop_serving(str(error))

    # ------------------------------------------------------------ replay

    def remember(self, tokens: list[int], options: RunOptions, result: RunResult) -> None:
        """A run that ended: the runs since the stages' caches were last empty
        (each that kept a prefix built on the one before) are what recovery
        replays before an interrupted run that kept a prefix, so that the new
        stage's cache is computed in the same batches as the others' were."""
        replayable = (
            result.ok
            and result.stop_reason in ("max_tokens", "eos")
            and self.pipeline.prefix_reuse
            and self.policy.attempts > 0  # else nothing is ever replayed: keep nothing
            # With slots, each slot's runs interleave with the others': an
            # interrupted run is replayed on its slot, cold (docs/recovery.md).
            and self.pipeline.parallel == 1
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
            driver = await self.pipeline.prepare_run(options, quiet=True)
            driver.replay = recorded
            result = await self.pipeline.run_prompt(driver, tokens, time.monotonic(), options.max_tokens)
            if not result.ok or tuple(result.tokens) != recorded:
                why = result.failure or "other tokens"
                raise PipelineError(
                    f"replaying turn {index + 1} of the conversation before the lost run: {why}"
                )

    async def carry_on(self, turn: Turn, driver: RunDriver, result: RunResult) -> RunResult:
        """``driver``'s run of ``turn``'s prompt ended with ``result``. A
        stage lost mid-run: once the pipeline is repaired, the prompt runs
        again with the same sampling (and seed), cold, on the turn's slot, and
        the tokens already streamed are regenerated, checked and not streamed
        again (docs/recovery.md). Bounded by recovery.attempts."""
        handle = turn.handle
        while (old := self.take_interrupted(driver.plan.run_id)) is not None:
            try:
                if handle.done:
                    raise PipelineError("the prompt was withdrawn")
                await self.recover()
                resume = self.resume_of(old, turn)
                options, limit = turn.options, turn.limit
                if resume is None:
                    await self.replay_history(old)
                else:
                    limit = (turn.limit or turn.options.max_tokens) - len(old.tokens)
                    options = replace(
                        with_history(turn.options, (*turn.tokens, *old.tokens)), max_tokens=limit
                    )
                    options = replace(options, extra=(*options.extra, ("skip_draws", len(old.tokens))))
                driver = await self.pipeline.prepare_run(options, slot=turn.slot, resume=resume)
            except GgufpipeError as error:
                return self.give_up(old, str(error))
            self.replaying(driver, old)
            self.pipeline.assign(handle, driver, replaces=old.run_id)
            result = await self.pipeline.run_prompt(driver, turn.tokens, handle.prompt.submitted, limit)
        return result

    def resume_of(self, old: RunResult, turn: Turn) -> Resume | None:
        """How ``old`` (interrupted) is carried on in proportion, or None
        where it is replayed whole: more than one stage lost (a shared
        process), nothing streamed yet, a sampler that cannot be brought
        forward from the tokens (SamplingParams.resumable), a stage 0 to
        rebuild after a kept prefix (its earlier runs' parts are not kept),
        no token left to make, or a resume that its stages refused."""
        lost = sorted(self._lost)
        limit = turn.limit or turn.options.max_tokens
        if (
            len(lost) > 1
            or not old.tokens
            or old.failure.startswith(RESUME_REFUSED)
            or not sampling_params(turn.options).resumable
            or (lost == [0] and old.prompt_reused)
            or limit - len(old.tokens) <= 0
        ):
            return None
        positions = len(old.prompt_tokens) + len(old.tokens) - 1
        return Resume(old.run_id, old.tokens, positions, lost[0] if lost else -1, old.prompt_reused)

    def take_interrupted(self, run_id: RunId) -> RunResult | None:
        """Run ``run_id``'s result when it faulted by a lost stage that
        recovery repairs: it is to be replayed (:meth:`carry_on`), not finished."""
        return self._interrupted.pop(run_id, None)

    async def recover(self) -> None:
        """Repair the pipeline after a lost stage (every lost stage's agent
        started again, the model checked, its stage file delivered, a new data
        plane); returns when it can carry runs, raises PipelineError with the
        one reason when recovery gives up."""
        while self.state.phase is rec.Phase.RECOVERING and not self.pipeline.closing:
            if self._repairing is None or self._repairing.done():
                self._repairing = self.tasks.spawn(self._repair(), "recovery")
            await asyncio.wait({self._repairing})
        if self.state.phase is rec.Phase.BROKEN:
            raise PipelineError(self.state.reason)
        if self.pipeline.closing:
            raise PipelineError("the pipeline closed")
        if self.pipeline.broken:
            raise PipelineError(self.pipeline.broken)

    async def _repair(self) -> None:
        started = time.perf_counter()
        left = rec.time_left(self.state, self.policy, started)
        try:
            how, self._how = await asyncio.wait_for(self.pipeline.rebuild(), max(left, 1.0))
        except (GgufpipeError, OSError, asyncio.TimeoutError) as error:
            why = str(error) or f"it took more than the {left:.0f} s left of recovery.deadline"
            self._step(rec.RepairFailed(why))
            self._step(rec.Begin(time.perf_counter()))
            if self.state.phase is rec.Phase.BROKEN:
                self.pipeline.broken = self.state.reason
                self.pipeline.emit(Notice("error", self.state.reason))
            return
        self._step(rec.Repaired(how))
        self.repairs += 1
        self.pipeline.broken = ""
        self._repair_times = (started, time.perf_counter(), self._repair_times[2], self._how)

    def replaying(self, replay: RunDriver, old: RunResult) -> None:
        """``replay`` carries the interrupted run's prompt on (``old``: its
        result): it regenerates the tokens already streamed (checked, not
        streamed again) and goes on."""
        resume = replay.resume
        # Carried on in proportion: the tokens are given, not made again.
        replay.replay = old.tokens if resume is None else ()
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
                replayed=prompt_tokens + len(old.tokens) if resume is None else rebuilt(resume),
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
        self.pipeline.end_run(result)
        return result


def rebuilt(resume: Resume) -> int:
    """The positions a resumed run computed again: the rebuilt stage's, and
    the one step every stage takes to go on (RunRecovered.replayed; its
    replay_s is the time to the first new token)."""
    return (resume.positions if resume.rebuild >= 0 else 0) + 1
