"""One run: the pure run FSM (docs/design.md, "Run state machine") fed by events, its effects done here.

A :class:`RunDriver` knows only what a run needs: the plan, a
:class:`~ggufpipe_tui.session.stages.StagePort` per stage (send a control
message, is it alive, report a broken stream), the run's edges
(:class:`RunEdges`: set up a stage's edge ends, write the token-in edge), the
timeouts, a task owner and where its events go. It never sees the pipeline,
the transports or the views, so tests drive it with fake stages.
"""

from __future__ import annotations

import asyncio
import codecs
import math
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from ggufpipe_agent.errors import TransitionError
from ggufpipe_agent.tasks import TaskOwner
from ggufpipe_agent.wire.objects import read_logprobs
from ggufpipe_agent.wire.protocol import (
    Message,
    PrefixHeld,
    StageFault,
    StageProgress,
    StageReady,
    StageStopped,
    StepCounters,
    StepStats,
    StopRun,
)
from ggufpipe_tui.core import run_fsm as fsm
from ggufpipe_tui.core.events import (
    Emit,
    Notice,
    RunFinished,
    RunPhaseChanged,
    RunResult,
    StageLoadProgress,
    StageStateChanged,
    StageStats,
    Timings,
    TokenStreamed,
)
from ggufpipe_tui.core.inventory import Timeouts
from ggufpipe_tui.core.plan import RunPlan, provision_message
from ggufpipe_tui.core.reuse import (
    RESUME_REFUSED,
    Resume,
    ReuseSource,
    choose_kept,
    rebuild_parts,
    resume_problem,
)
from ggufpipe_tui.session.stages import StagePort

#: How long a StopRun may take to be written to a stage.
STOP_SEND_TIMEOUT = 5.0
#: A stage that reports a broken link to a peer: how long to watch the peer
#: (a dead peer's loss report, with its exit status, is the root cause).
LINK_GRACE_SECONDS = 1.5
LOSS_REPORT_SECONDS = 3.0

#: A stage's StageFault for a step that failed in its engine (stage/job.py:
#: StepFailed's "step N: ..."), not for its links or its setup, nor for what a
#: replay would meet again: a full context, positions or shapes the stages
#: disagree on (ggufpipe_agent/llama/engine.py's refusals) are the run's fault.
ENGINE_FAILURE = re.compile(
    r"step \d+: (?!context full|llama\.cpp found no KV slot|an object at position|activation of shape"
    r"|the prompt starts at position|a batched step takes|a step needs)"
)


def engine_failed(reason: str) -> bool:
    return ENGINE_FAILURE.match(reason) is not None


Send = Callable[[], Awaitable[None]]
#: What a failed send becomes: the event to feed the run (or None).
Failed = Callable[[BaseException], "fsm.RunEvent | None"]


class Lane:
    """One stream's sends for a run, in order and off the run's loop.

    The FSM's loop never waits for a peer: an effect that writes to a stage
    is queued on that stage's lane and written by the lane's task, each
    write within ``deadline`` seconds; what comes of it is fed back to the
    run as an event. So a peer that stops reading (stopped, its network
    gone) delays neither the run's timers nor a stop. Once a write has
    failed the lane is broken and every later send fails at once with the
    same error (a stream cannot skip a frame)."""

    def __init__(
        self, name: str, tasks: TaskOwner, feed: Callable[[fsm.RunEvent], None], deadline: float
    ) -> None:
        self.name, self.tasks, self.feed, self.deadline = name, tasks, feed, deadline
        self.pending: deque[tuple[Send, Failed]] = deque()
        self.broken: BaseException | None = None
        self._task: asyncio.Task[None] | None = None

    def post(self, send: Send, failed: Failed) -> None:
        if self.broken is not None:
            self._answer(failed(self.broken))
            return
        self.pending.append((send, failed))
        if self._task is None or self._task.done():
            self._task = self.tasks.spawn(self._write(), self.name)

    def _answer(self, event: fsm.RunEvent | None) -> None:
        if event is not None:
            self.feed(event)

    async def _write(self) -> None:
        while self.pending:
            send, failed = self.pending.popleft()
            try:
                await asyncio.wait_for(send(), self.deadline)
            except asyncio.TimeoutError:
                self.broken = ConnectionError(f"the peer took nothing for {self.deadline:g}s")
            except (ConnectionError, OSError) as error:
                self.broken = error
            if self.broken is not None:
                self._answer(failed(self.broken))
                while self.pending:
                    self._answer(self.pending.popleft()[1](self.broken))
                return


class RunEdges(Protocol):
    """The part of the data plane a run drives."""

    async def open_edges(self, plan: RunPlan, stage: int) -> None: ...

    async def write_tokens(
        self, plan: RunPlan, sequence: int, tokens: list[int], position: int, rebuild: bool = False
    ) -> None: ...


class Detokenizer:
    """Token ids to text as they stream: piece bytes through an incremental
    UTF-8 decoder, so a character split over two tokens prints once whole.
    Bytes that cannot begin or go on a character become U+FFFD where they
    are; a character the run ends inside (cut by max_tokens or a stop) is
    left out, as llama-server ends the text before it."""

    def __init__(self, pieces: tuple[bytes, ...]) -> None:
        self.pieces = pieces
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        piece = self.pieces[token] if 0 <= token < len(self.pieces) else b""
        return self._decoder.decode(piece)

    def flush(self) -> str:
        """The text's end: nothing more. What the decoder still holds is the
        start of a character the next token would have finished (it passes
        every byte that cannot be one at once, replaced), so it is dropped."""
        self._decoder.reset()
        return ""


class RunDriver:
    def __init__(
        self,
        plan: RunPlan,
        stages: Sequence[StagePort],
        edges: RunEdges,
        timeouts: Timeouts,
        tasks: TaskOwner,
        emit: Emit,
        pieces: tuple[bytes, ...] = (),
        log_path: Callable[[], str] = lambda: "",
        source: ReuseSource | None = None,
        resume: Resume | None = None,
    ) -> None:
        self.plan = plan
        self.stages = stages
        self.edges = edges
        self.timeouts = timeouts
        self.tasks = tasks
        self.emit = emit
        self.log_path = log_path
        eog = frozenset(plan.model.eog_token_ids)
        self.run = fsm.Run(max_tokens=plan.max_tokens, eog=eog, ring=plan.ring is not None)
        self.queue: asyncio.Queue[fsm.RunEvent] = asyncio.Queue()
        self.done = asyncio.Event()
        self.result: RunResult | None = None
        self.prompt: list[int] = []
        self.tokens: list[int] = []
        # Prefix reuse: the run the provision offered (plan.reuse), what each
        # stage holds of it, what this run kept, and what it fed the stages.
        self.source = source
        self.holds: dict[int, PrefixHeld] = {}
        self.kept = 0
        self.fed: list[int] = []
        self.injected = False
        self.text: list[str] = []
        self.detokenizer = Detokenizer(pieces)
        self.counters: dict[int, StepCounters] = {}
        self.stage_states: dict[int, str] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._lanes: dict[str, Lane] = {}
        self.refused: set[int] = set()  # stages that refused their provision: nothing to stop there
        self.lost: set[int] = set()  # stages reported lost: a StopRun there would go unanswered
        self._submitted = 0.0
        self._injected = 0.0
        # Recovery (docs/recovery.md): the tokens an interrupted run streamed,
        # which this run regenerates, checks and does not stream again, and
        # what is called when it has (the injection's and that moment's time).
        self.replay: tuple[int, ...] = ()
        self.logprobs: dict[int, tuple[float, tuple[tuple[int, float], ...]]] = {}
        self.caught_up: Callable[[float, float], None] | None = None
        self._replayed = 0.0
        self._first_token = 0.0
        self._last_token = 0.0
        # Recovery in proportion: the interrupted run this one carries on
        # (its streamed tokens are given, not sampled again), and the length
        # of the prompt without them.
        self.resume = resume
        self._prompt_length = 0
        for token in resume.tokens if resume is not None else ():
            if token not in self.run.eog:
                self.text.append(self.detokenizer.feed(token))

    # --------------------------------------------------------------- input

    def feed(self, event: fsm.RunEvent) -> None:
        self.queue.put_nowait(event)

    def give_prompt(self, tokens: list[int], submitted: float | None = None, max_tokens: int = 0) -> None:
        """The run's prompt; ``max_tokens`` > 0 overrides the plan's limit."""
        self.prompt = list(tokens)
        self._prompt_length = len(tokens)
        if self.resume is not None:  # the tokens it streamed are fed as the prompt's end
            self.prompt += self.resume.tokens
        self._submitted = submitted or time.perf_counter()
        self.feed(fsm.PromptGiven(max_tokens))

    def stop(self, reason: str = "stopped by the user") -> None:
        self.feed(fsm.StopRequested(reason))

    def on_token(self, sequence: int, words: list[int]) -> None:
        """A token object from the token-out edge: the token, and its logprobs
        when the run asked for them (kept until the token is accepted)."""
        if len(words) > 1:
            self.logprobs[sequence] = read_logprobs(words)[1:]
        self.feed(fsm.TokenConsumed(sequence, words[0]))

    def provision_refused(self, stage: int, reason: str) -> None:
        """Stage ``stage`` refused its ProvisionStage: it holds no run, so the
        run faults and its teardown sends that stage nothing."""
        self.refused.add(stage)
        self.feed(fsm.StageFaultEvent(stage, reason))

    def on_stage_message(self, stage: int, message: Message) -> None:
        run_id = self.plan.run_id
        if isinstance(message, StageProgress):
            if message.state == "Preparing" and message.fraction < 0:
                # The agent has taken the provision: set up its edge streams.
                self.tasks.spawn(self._open_edges(stage), f"edge setup of stage {stage}")
            if message.fraction < 0:
                self.stage_states[stage] = message.state
                self.emit(StageStateChanged(run_id, stage, message.state, message.detail))
            else:
                self.emit(StageLoadProgress(run_id, stage, message.detail, message.fraction))
        elif isinstance(message, StageReady):
            self.holds[stage] = message.held
            self.feed(fsm.StageReadyEvent(stage))
        elif isinstance(message, StageFault):
            if 0 <= message.link_peer < len(self.stages):
                self.tasks.spawn(self._link_fault(stage, message), f"link fault of stage {stage}")
            elif engine_failed(message.reason):
                # Its engine failed while its agent lives: the stage is lost, and
                # recovery starts it again with a fresh engine (docs/recovery.md).
                self.stages[stage].report_lost(f"its engine failed ({message.reason})")
            else:
                self.feed(fsm.StageFaultEvent(stage, f"{self.stages[stage].label}: {message.reason}"))
        elif isinstance(message, StageStopped):
            self.counters[stage] = message.counters
            self.emit(StageStats(run_id, stage, message.counters))
            self.feed(fsm.StageStoppedEvent(stage))
        elif isinstance(message, StepStats):
            self.counters[stage] = message.counters
            self.emit(StageStats(run_id, stage, message.counters))

    async def _link_fault(self, stage: int, message: StageFault) -> None:
        """A stage whose direct link to a peer broke: when the peer died, its
        loss report comes first and is the run's one reason."""
        peer = self.stages[message.link_peer]
        for _ in range(int(LINK_GRACE_SECONDS / 0.05)):
            if not peer.alive():
                await asyncio.sleep(LOSS_REPORT_SECONDS)
                break
            await asyncio.sleep(0.05)
        self.feed(fsm.StageFaultEvent(stage, f"{self.stages[stage].label}: {message.reason}"))

    async def _open_edges(self, stage: int) -> None:
        try:
            await asyncio.wait_for(self.edges.open_edges(self.plan, stage), self.timeouts.heartbeat)
        except asyncio.TimeoutError:
            self.stages[stage].report_lost(
                f"cannot set up edge streams (its data stream took nothing for {self.timeouts.heartbeat:g}s)"
            )
        except (ConnectionError, OSError) as error:
            # A broken stream to a stage: report it with its root cause.
            self.stages[stage].report_lost(f"cannot set up edge streams ({error})")

    # --------------------------------------------------------------- loop

    async def drive(self, problem: str = "") -> None:
        """Run the FSM to Done. ``problem``: why the plan cannot run (the
        plan's own check failed, or the pipeline is broken)."""
        if problem:
            self._step(fsm.PlanRejected(problem))
        else:
            self._step(fsm.PlanValidated(len(self.plan.stages)))
        while not self.done.is_set():
            self._step(await self.queue.get())

    def _step(self, event: fsm.RunEvent) -> None:
        """One event through the FSM and its effects. Nothing here awaits:
        writes go to the stages' lanes and come back as events."""
        pending: list[fsm.RunEvent] = [event]
        while pending:
            current = pending.pop(0)
            if isinstance(current, fsm.StageLost):
                self.lost.add(current.stage)
            before = self.run.phase
            try:
                self.run, effects = fsm.transition(self.run, current)
            except TransitionError as error:
                self.emit(Notice("info", f"run {self.plan.run_id:016x}: ignored: {error}"))
                continue
            if self.run.phase is not before:
                detail = self.run.failure if self.run.phase is fsm.RunPhase.FAULTED else self.run.stop_reason
                self.emit(RunPhaseChanged(self.plan.run_id, self.run.phase.value, detail))
            for effect in effects:
                follow = self._perform(effect)
                if follow is not None:
                    pending.append(follow)
            if self.run.phase in (fsm.RunPhase.COMPLETED, fsm.RunPhase.FAULTED):
                pending.insert(0, fsm.Advance())

    def _lane(self, name: str) -> Lane:
        lane = self._lanes.get(name)
        if lane is None:
            lane = self._lanes[name] = Lane(name, self.tasks, self.feed, self.timeouts.heartbeat)
        return lane

    def _perform(self, effect: fsm.RunEffect) -> fsm.RunEvent | None:
        plan = self.plan
        if isinstance(effect, fsm.SendProvision):
            self._send_provision(effect.stage)
            if effect.stage == len(plan.stages) - 1:
                # Handed to the lanes: the readiness timer now bounds the
                # sends too, and a send that fails is a lost stage.
                return fsm.ProvisionsSent()
        elif isinstance(effect, fsm.OpenTokenEndpoints | fsm.CloseTokenEndpoints):
            pass  # the token-in writer and token-out reader belong to the data plane
        elif isinstance(effect, fsm.StartTimer):
            self._start_timer(effect.kind)
        elif isinstance(effect, fsm.CancelTimer):
            timer = self._timers.pop(effect.kind, None)
            if timer is not None:
                timer.cancel()
        elif isinstance(effect, fsm.InjectPrompt):
            self._injected = time.perf_counter()
            self._inject_prompt()
        elif isinstance(effect, fsm.InjectToken):
            # Token k is fed at the position after the prompt and the tokens before it.
            self.fed.append(effect.token)
            self._write_tokens(effect.sequence, [effect.token], len(self.prompt) + effect.sequence - 1)
        elif isinstance(effect, fsm.AcceptToken):
            return self._accept(effect.sequence, effect.token)
        elif isinstance(effect, fsm.FinalizeOutput):
            self.detokenizer.flush()  # a character the run ended inside is left out
        elif isinstance(effect, fsm.RecordFailure):
            self.emit(Notice("error", f"run {plan.run_id:016x} faulted: {effect.reason}"))
        elif isinstance(effect, fsm.SendStopRun):
            return self._send_stop(effect.stage)
        elif isinstance(effect, fsm.Note):
            self.emit(Notice("info", f"run {plan.run_id:016x}: {effect.text}"))
        elif isinstance(effect, fsm.Finish):
            self._finish()
        return None

    def _send_provision(self, index: int) -> None:
        stage = self.stages[index]
        message = provision_message(self.plan, index)

        def failed(error: BaseException) -> fsm.RunEvent:
            # StageLost, not ProvisionFailed: it may come back after
            # ProvisionsSent, and a control stream that took no frame is lost.
            return fsm.StageLost(index, f"{stage.label}: cannot send ProvisionStage ({error})")

        self._lane(f"control of stage {index}").post(lambda: stage.send(message), failed)

    def _send_stop(self, index: int) -> fsm.RunEvent | None:
        stage = self.stages[index]
        if index in self.refused:
            return fsm.StageStoppedEvent(index)  # it took no run: nothing to stop
        if index in self.lost:
            return fsm.StageLost(index, f"{stage.label}: StopRun not sent (the stage is lost)")
        if not stage.alive():
            return fsm.StageLost(index, f"{stage.label}: StopRun not delivered (the agent is gone)")
        message = StopRun(self.plan.run_id, self.run.stop_reason or self.run.outcome)

        def failed(error: BaseException) -> fsm.RunEvent:
            return fsm.StageLost(index, f"{stage.label}: StopRun not delivered ({error})")

        async def send() -> None:
            try:
                await asyncio.wait_for(stage.send(message), STOP_SEND_TIMEOUT)
            except asyncio.TimeoutError:
                raise ConnectionError(f"not written within {STOP_SEND_TIMEOUT:g}s") from None

        self._lane(f"control of stage {index}").post(send, failed)
        return None

    def _start_timer(self, kind: str) -> None:
        timeouts = self.timeouts
        seconds = {"ready": timeouts.ready, "teardown": timeouts.teardown}.get(kind, timeouts.step)
        if kind == "step" and self.run.consumed == 0:
            seconds *= max(1, math.ceil(len(self.prompt) / self.plan.engine.n_ubatch))
        old = self._timers.pop(kind, None)
        if old is not None:
            old.cancel()
        # A plain loop callback: the step timer is restarted once per token.
        loop = asyncio.get_running_loop()
        self._timers[kind] = loop.call_later(seconds, self.feed, fsm.Timeout(kind))

    def _inject_prompt(self) -> None:
        """The prompt object: what the stages do not keep of the last run, at
        the position where the kept prefix ends (every stage keeps as much)."""
        holds = [self.holds.get(index, PrefixHeld()) for index in range(len(self.plan.stages))]
        if self.resume is not None:
            self._inject_resumed(self.resume, holds)
            return
        source = self.source if self.plan.reuse.run_id else None
        reuse = choose_kept(source, self.prompt, holds)
        self.kept, self.fed, self.injected = reuse.kept, list(self.prompt), True
        if source is not None:
            why = f" ({reuse.reason})" if reuse.reason else ""
            self.emit(
                Notice(
                    "info",
                    f"run {self.plan.run_id:016x}: reused {reuse.kept} of {len(self.prompt)} prompt tokens "
                    f"from run {source.run_id:016x}{why}",
                )
            )
        self._write_tokens(0, self.prompt[reuse.kept :], reuse.kept)

    def _inject_resumed(self, resume: Resume, holds: list[PrefixHeld]) -> None:
        """A resumed run's prompt: a rebuilt stage 0's parts first, then the
        interrupted run's last token at the position its stages hold."""
        problem = resume_problem(resume, holds)
        if problem:
            self.feed(fsm.EdgeFault(RESUME_REFUSED + problem))
            return
        self.kept, self.fed, self.injected = resume.kept, list(self.prompt), True
        for tokens, position in rebuild_parts(resume, self.prompt[: self._prompt_length]):
            self._write_tokens(0, tokens, position, rebuild=True)
        rebuilt = f"stage {resume.rebuild} rebuilt" if resume.rebuild >= 0 else "no stage rebuilt"
        self.emit(
            Notice(
                "info",
                f"run {self.plan.run_id:016x} carries run {resume.run_id:016x} on after "
                f"{len(resume.tokens)} tokens: {rebuilt}, {resume.positions} positions kept by the others",
            )
        )
        self._write_tokens(0, self.prompt[resume.positions :], resume.positions)

    def next_source(self) -> ReuseSource | None:
        """What the stages hold once this run is done, for the next run's
        offer: this run's fed tokens; what the run was offered when it never
        wrote to the stages; nothing after a fault."""
        if not self.injected:
            # Nothing written: the stages hold what they held, unless they
            # were offered nothing and emptied their caches.
            return self.source if self.plan.reuse.run_id else None
        if self.run.outcome == "faulted":
            return None
        if self.plan.ring is not None:
            # The last stage fed every token it sampled round the ring, but
            # the one it ended on; the orchestrator read them all, in order.
            # (After a stop it may have fed the last one read too: offering
            # one position fewer than the stages hold is safe.)
            return ReuseSource(self.plan.run_id, (*self.fed, *self.tokens[:-1]))
        return ReuseSource(self.plan.run_id, tuple(self.fed))

    def _write_tokens(self, sequence: int, tokens: list[int], position: int, rebuild: bool = False) -> None:
        def failed(error: BaseException) -> None:
            self.stages[0].report_lost(f"token-in edge: {error}")

        self._lane("token-in edge").post(
            lambda: self.edges.write_tokens(self.plan, sequence, tokens, position, rebuild), failed
        )

    def _accept(self, sequence: int, token: int) -> fsm.RunEvent | None:
        now = time.perf_counter()
        if sequence == 0:
            self._first_token = now
        self._last_token = now
        replaying = sequence < len(self.replay)
        if replaying and token != self.replay[sequence]:
            return fsm.EdgeFault(
                f"the replay diverged at token {sequence}: {token} where the interrupted run "
                f"streamed {self.replay[sequence]}"
            )
        if not replaying and self.caught_up is not None:  # the replay is done (or was empty)
            caught_up, self.caught_up = self.caught_up, None
            # Replayed whole: up to the last token made again; carried on in
            # proportion: up to this token (the rebuilt stage's positions first).
            done = self._replayed if self.replay else now if self.resume is not None else self._injected
            caught_up(self._injected, done)
        self.tokens.append(token)
        if token in self.run.eog:
            return None
        text = self.detokenizer.feed(token)
        self.text.append(text)
        if replaying:
            self._replayed = now  # streamed before the loss: the client has it
            return None
        logprobs = self.logprobs.pop(sequence, None)
        given = len(self.resume.tokens) if self.resume is not None else 0  # streamed by the run carried on
        self.emit(TokenStreamed(self.plan.run_id, given + sequence, token, text, logprobs))
        return None

    def _finish(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        decode_ms = (self._last_token - self._first_token) * 1000.0 if self._first_token else 0.0
        decoded = max(0, len(self.tokens) - 1)
        n = len(self.plan.stages)
        timings = Timings(
            ttft_ms=(self._first_token - self._submitted) * 1000.0 if self._first_token else 0.0,
            prefill_ms=(self._first_token - self._injected) * 1000.0 if self._first_token else 0.0,
            decode_ms=decode_ms,
            decode_tokens_per_s=decoded / (decode_ms / 1000.0) if decode_ms > 0 else 0.0,
            stage_mean_step_ms=tuple(self.counters.get(i, StepCounters()).mean_ms for i in range(n)),
        )
        run = self.run
        self.result = RunResult(
            run_id=self.plan.run_id,
            outcome=run.outcome or "completed",
            stop_reason=run.stop_reason,
            failure=run.failure,
            prompt_tokens=tuple(self.prompt[: self._prompt_length]),
            tokens=(*(self.resume.tokens if self.resume is not None else ()), *self.tokens),
            text="".join(self.text),
            timings=timings,
            architecture=self.plan.model.architecture,
            model=self.plan.model.model_id,
            log_path=self.log_path(),
            notes=run.notes,
            prompt_reused=self.kept,
        )
        self.emit(RunFinished(self.result))
        self.done.set()
