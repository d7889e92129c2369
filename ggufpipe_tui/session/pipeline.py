"""The orchestrator: agents, the data plane, and the run FSM's effects.

A :class:`Pipeline` is one session: it starts an agent per stage (in
parallel), reads the model's facts and vocabulary from where the model lives,
opens a data stream to each agent and relays activation objects between
stages without decoding them. Each prompt is a run with its own run id and
plan, driven by a :class:`RunDriver` that performs the effects of the pure
run FSM (:mod:`ggufpipe_tui.core.run_fsm`). Agents keep their loaded stage between
runs, so a second prompt reloads nothing.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import itertools
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from ggufpipe_agent import objects
from ggufpipe_agent.arch import check_architecture, check_plan
from ggufpipe_agent.errors import GgufpipeError, ProtocolError, TransitionError
from ggufpipe_agent.protocol import (
    Inspect,
    Message,
    ModelFacts,
    ModelInfo,
    OpenEdge,
    Refused,
    RequestFailed,
    Shutdown,
    StageFault,
    StageProgress,
    StageReady,
    StageStopped,
    StepCounters,
    StepStats,
    StopRun,
    Tokenize,
    Tokenized,
    encode_message,
)
from ggufpipe_tui.core import run_fsm as fsm
from ggufpipe_tui.core.events import (
    AgentConnected,
    AgentLog,
    Emit,
    Event,
    ModelInspected,
    Notice,
    PlanMade,
    RunFinished,
    RunPhaseChanged,
    RunResult,
    StageLoadProgress,
    StageStateChanged,
    StageStats,
    Timings,
    TokenStreamed,
)
from ggufpipe_tui.core.inventory import HostSpec, Inventory
from ggufpipe_tui.core.placement import place_stages
from ggufpipe_tui.core.plan import (
    PlanError,
    RunPlan,
    build_plan,
    new_run_id,
    provision_message,
    validate_plan,
)
from ggufpipe_tui.session.runlog import RunLog
from ggufpipe_tui.transports.link import AgentLink, LocalAgent, TransportError

log = logging.getLogger("ggufpipe.orchestrator")

LinkFactory = Callable[[HostSpec, int, Callable[[str], None]], AgentLink]
RELAY_CHUNK = 1 << 18


class PipelineError(GgufpipeError):
    """The pipeline could not be set up (agents, model, plan)."""


def default_link_factory(host: HostSpec, stage: int, on_log: Callable[[str], None]) -> AgentLink:
    if host.local:
        return LocalAgent(host, stage, on_log)
    from ggufpipe_tui.transports.ssh import SshAgent

    return SshAgent(host, stage, on_log)


class Detokenizer:
    """Token ids to text as they stream: piece bytes through an incremental
    UTF-8 decoder, so a character split over two tokens prints once whole."""

    def __init__(self, pieces: tuple[bytes, ...]) -> None:
        self.pieces = pieces
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        piece = self.pieces[token] if 0 <= token < len(self.pieces) else b""
        return self._decoder.decode(piece)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class Pipeline:
    def __init__(
        self,
        inventory: Inventory,
        emit: Emit,
        link_factory: LinkFactory = default_link_factory,
        log_dir: Any = None,
    ) -> None:
        self.inventory = inventory
        self._emit_view = emit
        self.link_factory = link_factory
        self.links: list[AgentLink] = []
        self.data: list[tuple[Any, Any]] = []
        #: One writer per data stream at a time: relays, edge setup, token-in.
        self.write_locks: list[asyncio.Lock] = []
        self.facts: ModelFacts | None = None
        self.pieces: tuple[bytes, ...] = ()
        self.ranges: list[tuple[int, int]] = []
        self.driver: RunDriver | None = None
        self.broken = ""  # why the data plane cannot carry another run
        self.closing = False
        self.runlog = RunLog(log_dir)
        self._requests: dict[int, tuple[AgentLink, asyncio.Future[Message]]] = {}
        self._request_ids = itertools.count(1)
        self._lost_stages: set[int] = set()
        self._tasks: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------- events

    def emit(self, event: Event) -> None:
        try:
            self.runlog.write(event)
        except OSError as error:  # a full disk must not stop the run
            self.runlog.disable(f"{error.strerror or error}")
            self._emit_view(Notice("warning", f"run log disabled: cannot write {self.runlog.path} ({error})"))
        try:
            self._emit_view(event)
        except Exception:  # noqa: BLE001 - a view's bug must not break the run
            log.exception("event consumer failed")

    def _spawn(self, coroutine: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        """A pipeline task that dies of a bug must not leave a run waiting
        forever: the failure becomes the run's fault."""
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        error = task.exception()
        log.error("pipeline task failed", exc_info=error)
        reason = f"internal error in the orchestrator: {type(error).__name__}: {error}"
        if not self.broken:
            self.broken = reason
        if self.driver is not None:
            self.driver.feed(fsm.EdgeFault(reason))

    # -------------------------------------------------------------- start

    async def start(self) -> None:
        """Start every stage's agent, read the model, open the data plane."""
        inventory = self.inventory
        timeout = inventory.timeouts.connect
        links = []
        for index, stage in enumerate(inventory.stages):
            host = inventory.hosts[stage.host]
            links.append(self.link_factory(host, index, self._log_sink(index, host.name)))
        self.links = links
        results = await asyncio.gather(
            *(self._start_link(link, timeout) for link in links), return_exceptions=True
        )
        failures = [result for result in results if isinstance(result, BaseException)]
        if failures:
            await self.close()
            first = failures[0]
            if isinstance(first, GgufpipeError):
                raise first
            raise PipelineError(f"starting the agents failed: {first!r}") from first
        for link in links:
            self._spawn(self._control_reader(link))
        try:
            await self._inspect()
            self.data = list(await asyncio.gather(*(self._open_data(link, timeout) for link in links)))
            self.write_locks = [asyncio.Lock() for _ in links]
        except BaseException:
            await self.close()
            raise
        for index in range(len(links) - 1):
            self._spawn(self._relay(index))
        self._spawn(self._token_out())

    def _log_sink(self, stage: int, host: str) -> Callable[[str], None]:
        return lambda line: self.emit(AgentLog(stage, host, line))

    async def _start_link(self, link: AgentLink, timeout: float) -> None:
        try:
            hello = await asyncio.wait_for(link.start(timeout), timeout + 5)
        except asyncio.TimeoutError:
            raise TransportError(f"{link.label}: no answer within {timeout:g}s") from None
        self.emit(AgentConnected(link.stage, link.host.name, link.host.where, hello))

    async def _open_data(self, link: AgentLink, timeout: float) -> tuple[Any, Any]:
        try:
            return await asyncio.wait_for(link.open_data(), timeout)
        except asyncio.TimeoutError:
            raise TransportError(f"{link.label}: the data channel did not open within {timeout:g}s") from None

    async def request(self, link: AgentLink, make: Callable[[int], Message], timeout: float) -> Message:
        request_id = next(self._request_ids)
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._requests[request_id] = (link, future)
        try:
            await link.send(make(request_id))
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise PipelineError(f"{link.label}: no answer to a request within {timeout:g}s") from None
        except (ConnectionError, OSError) as error:
            raise PipelineError(f"{link.label}: the control stream broke ({error})") from None
        finally:
            self._requests.pop(request_id, None)

    async def _inspect(self) -> None:
        link = self.links[0]
        path = self.inventory.model_path_for(link.host)
        reply = await self.request(
            link, lambda rid: Inspect(rid, path, True), max(60.0, self.inventory.timeouts.connect)
        )
        if isinstance(reply, RequestFailed):
            where = self.inventory.where(self.inventory.model_line)
            raise PipelineError(f"model on {link.host.name}: {reply.reason} (model.path at {where})")
        assert isinstance(reply, ModelInfo)
        facts = reply.facts
        where = f"{facts.path} on {link.host.name}"
        check_architecture(facts.architecture, where)
        # Ranges and memory from what each host has; refuses a plan that does not fit.
        self.placement = place_stages(self.inventory, facts, [link.hello for link in self.links])
        self.ranges = list(self.placement.ranges)
        check_plan(facts, self.ranges, where)
        self.facts, self.pieces = facts, reply.pieces
        self.emit(ModelInspected(facts))

    async def tokenize(self, text: str, chat: bool) -> tuple[list[int], str]:
        link = self.links[0]
        path = self.inventory.model_path_for(link.host)
        reply = await self.request(link, lambda rid: Tokenize(rid, path, text, chat), 60.0)
        if isinstance(reply, RequestFailed):
            raise PipelineError(f"tokenizing on {link.host.name}: {reply.reason}")
        assert isinstance(reply, Tokenized)
        return list(reply.tokens), reply.rendered

    # --------------------------------------------------------------- runs

    def make_plan(self) -> RunPlan:
        assert self.facts is not None
        return build_plan(self.inventory, self.facts, self.ranges, new_run_id())

    async def prepare_run(self) -> RunDriver:
        """Plan, provision and load a run that waits for its prompt."""
        if self.driver is not None and not self.driver.done.is_set():
            raise PipelineError("a run is already active")
        plan = self.make_plan()
        driver = RunDriver(self, plan)
        self.driver = driver
        try:
            self.runlog.open(plan.run_id)
        except OSError as error:
            self.emit(Notice("warning", f"run log disabled: cannot write {self.runlog.path} ({error})"))
        self.emit(PlanMade(plan, tuple(stage.host for stage in self.inventory.stages)))
        self._spawn(driver.drive())
        return driver

    async def generate(self, text: str, chat: bool | None = None) -> RunResult:
        """One whole run: provision, tokenize the prompt meanwhile, run it."""
        submitted = time.perf_counter()
        driver = await self.prepare_run()
        try:
            tokens, _ = await self.tokenize(text, self.inventory.run.chat if chat is None else chat)
        except GgufpipeError as error:
            driver.stop(f"no prompt: {error}")
            await driver.done.wait()
            raise
        return await self.run_prompt(driver, tokens, submitted)

    async def generate_tokens(self, tokens: list[int]) -> RunResult:
        """One whole run of a prompt given as token ids."""
        submitted = time.perf_counter()
        return await self.run_prompt(await self.prepare_run(), tokens, submitted)

    async def run_prompt(self, driver: RunDriver, tokens: list[int], submitted: float) -> RunResult:
        """Give a prepared run its prompt and wait for its end."""
        limit = driver.plan.model.max_seq_len
        if len(tokens) >= limit:
            driver.stop("prompt too long")
            await driver.done.wait()
            raise PipelineError(
                f"the prompt is {len(tokens)} tokens, the context holds {limit} "
                "(raise run.context or --context)"
            )
        driver.give_prompt(tokens, submitted)
        await driver.done.wait()
        assert driver.result is not None
        return driver.result

    # ------------------------------------------------------- control plane

    async def _control_reader(self, link: AgentLink) -> None:
        reason = ""
        try:
            while True:
                message = await link.receive()
                if message is None:
                    break
                self._on_message(link, message)
        except ProtocolError as error:
            reason = f"corrupt control stream ({error})"
        except (ConnectionError, OSError) as error:
            reason = f"control stream broke ({error})"
        self.lost(link.stage, reason or "the control stream ended")

    def lost(self, stage: int, symptom: str) -> None:
        """A stage's stream broke or ended. Reported once per stage, with the
        root cause when there is one (the agent exited, and how)."""
        if self.closing or stage in self._lost_stages:
            return
        self._lost_stages.add(stage)
        self._spawn(self._report_lost(stage, symptom))

    async def _report_lost(self, stage: int, symptom: str) -> None:
        link = self.links[stage]
        for _ in range(20):  # the exit status and last stderr lines may lag a moment
            if not link.alive():
                break
            await asyncio.sleep(0.05)
        if link.alive():
            reason = f"{link.label}: {symptom}{link.exit_detail()}"
        else:
            reason = f"{link.label}: {link.gone_reason()}"
        if not self.broken:
            self.broken = reason
        self.emit(Notice("error", reason))
        for owner, future in self._requests.values():
            if owner.stage == stage and not future.done():
                future.set_exception(PipelineError(reason))
        if self.driver is not None:
            self.driver.feed(fsm.StageLost(stage, reason))

    def _on_message(self, link: AgentLink, message: Message) -> None:
        if isinstance(message, ModelInfo | Tokenized | RequestFailed):
            pending = self._requests.get(message.request_id)
            if pending is not None and not pending[1].done():
                pending[1].set_result(message)
            return
        if isinstance(message, Refused):
            self.emit(AgentLog(link.stage, link.host.name, f"refused {message.what}: {message.reason}"))
            driver = self.driver
            setting_up = (fsm.RunPhase.PROVISIONING, fsm.RunPhase.WAITING_READY)
            if (
                driver is not None
                and driver.run.phase in setting_up
                and message.what in ("ProvisionStage", "OpenEdge")
            ):
                # The stage will never become ready: say why now, not at the readiness timeout.
                reason = f"{link.label} refused {message.what}: {message.reason}"
                driver.feed(fsm.StageFaultEvent(link.stage, reason))
            return
        run_id = getattr(message, "run_id", None)
        driver = self.driver
        if driver is None or run_id != driver.plan.run_id:
            self.emit(AgentLog(link.stage, link.host.name, f"ignored {message.tag} for an old run"))
            return
        driver.on_stage_message(link.stage, message)

    # ---------------------------------------------------------- data plane

    async def _relay(self, index: int) -> None:
        """Stage i's outbound objects to stage i+1, header checked, payload
        untouched and streamed in chunks (memory bounded, backpressure kept:
        nothing more is read until the consumer has drained). The consumer's
        stream lock is held for a whole object, so edge setup for the next
        run never lands inside one."""
        reader, _ = self.data[index]
        _, writer = self.data[index + 1]
        lock = self.write_locks[index + 1]
        while True:
            try:
                head = await reader.readexactly(objects.HEADER_SIZE)
            except asyncio.IncompleteReadError as error:
                self.lost(index, "data stream ended" + (" inside a header" if error.partial else ""))
                return
            except (ConnectionError, OSError) as error:
                self.lost(index, f"data stream broke ({error})")
                return
            try:
                header, edge = self._check_object(index, head, self.driver)
            except ProtocolError as error:
                self._edge_fault(f"stage {index} sent a bad object: {error}")
                return
            async with lock:
                try:
                    if edge is not None:
                        writer.write(head)
                    remaining = header.nbytes
                    while remaining:
                        try:
                            chunk = await reader.read(min(remaining, RELAY_CHUNK))
                        except (ConnectionError, OSError) as error:
                            self.lost(index, f"data stream broke ({error})")
                            return
                        if not chunk:
                            self.lost(index, "data stream ended inside an object")
                            return
                        remaining -= len(chunk)
                        if edge is not None:
                            writer.write(chunk)
                            await writer.drain()
                except (ConnectionError, OSError) as error:
                    self.lost(index + 1, f"data stream broke ({error})")
                    return

    def _check_object(
        self, index: int, head: bytes, driver: RunDriver | None
    ) -> tuple[objects.ObjectHeader, Any]:
        """The header of an object stage ``index`` produced; edge is None when
        the object belongs to an old run and is to be dropped."""
        if driver is None:
            header = objects.unpack_header(head, objects.ABSOLUTE_MAX_PAYLOAD)
            return header, None
        plan = driver.plan
        edge = plan.edge(plan.stages[index].outbound_edge)
        header = objects.unpack_header(head, edge.object_spec.max_extent)
        if header.run_id != plan.run_id:
            self.emit(
                AgentLog(index, self.links[index].host.name, f"dropped {header.describe()} of an old run")
            )
            return header, None
        if header.edge_id != edge.edge_id:
            raise ProtocolError(f"{header.describe()}: expected edge {edge.edge_id}")
        objects.check_spec(header, edge.object_spec)
        return header, edge

    async def _token_out(self) -> None:
        index = len(self.links) - 1
        reader, _ = self.data[index]
        while True:
            try:
                head = await reader.readexactly(objects.HEADER_SIZE)
                driver = self.driver
                header, edge = self._check_object(index, head, driver)
                payload = await reader.readexactly(header.nbytes)
            except asyncio.IncompleteReadError:
                self.lost(index, "data stream ended")
                return
            except (ConnectionError, OSError) as error:
                self.lost(index, f"data stream broke ({error})")
                return
            except ProtocolError as error:
                self._edge_fault(f"stage {index} sent a bad token object: {error}")
                return
            if edge is None or driver is None:
                continue
            tokens = objects.decode_tokens(header, payload)
            driver.feed(fsm.TokenConsumed(header.sequence, tokens[0]))

    def _edge_fault(self, reason: str) -> None:
        if not self.broken:
            self.broken = reason
        if self.driver is not None:
            self.driver.feed(fsm.EdgeFault(reason))

    # ------------------------------------------------------------ closing

    async def close(self) -> None:
        """Tear down the active run, then end every agent."""
        driver = self.driver
        if driver is not None and not driver.done.is_set():
            driver.stop("the orchestrator is closing")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(driver.done.wait(), self.inventory.timeouts.teardown + 5)
        self.closing = True
        for link in self.links:
            if link.writer is not None and link.alive():
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(link.send(Shutdown("orchestrator closing")), 2)
        for _, writer in self.data:
            with contextlib.suppress(Exception):
                writer.close()
        await asyncio.gather(*(link.close(3.0) for link in self.links), return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        self.runlog.close()


class RunDriver:
    """One run: the §5 FSM fed by agents, relays and timers, its effects done here."""

    def __init__(self, pipeline: Pipeline, plan: RunPlan) -> None:
        self.pipeline = pipeline
        self.plan = plan
        eog = frozenset(plan.model.eog_token_ids)
        self.run = fsm.Run(max_tokens=plan.max_tokens, eog=eog)
        self.queue: asyncio.Queue[fsm.RunEvent] = asyncio.Queue()
        self.done = asyncio.Event()
        self.result: RunResult | None = None
        self.prompt: list[int] = []
        self.tokens: list[int] = []
        self.text: list[str] = []
        self.detokenizer = Detokenizer(pipeline.pieces)
        self.counters: dict[int, StepCounters] = {}
        self.stage_states: dict[int, str] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._submitted = 0.0
        self._injected = 0.0
        self._first_token = 0.0
        self._last_token = 0.0

    # --------------------------------------------------------------- input

    def feed(self, event: fsm.RunEvent) -> None:
        self.queue.put_nowait(event)

    def give_prompt(self, tokens: list[int], submitted: float | None = None) -> None:
        self.prompt = list(tokens)
        self._submitted = submitted or time.perf_counter()
        self.feed(fsm.PromptGiven())

    def stop(self, reason: str = "stopped by the user") -> None:
        self.feed(fsm.StopRequested(reason))

    def on_stage_message(self, stage: int, message: Message) -> None:
        emit = self.pipeline.emit
        run_id = self.plan.run_id
        if isinstance(message, StageProgress):
            if message.state == "Preparing" and message.fraction < 0:
                # The agent has taken the provision: set up its edge streams.
                self.pipeline._spawn(self._open_edges(stage))
            if message.fraction < 0:
                self.stage_states[stage] = message.state
                emit(StageStateChanged(run_id, stage, message.state, message.detail))
            else:
                emit(StageLoadProgress(run_id, stage, message.detail, message.fraction))
        elif isinstance(message, StageReady):
            self.feed(fsm.StageReadyEvent(stage))
        elif isinstance(message, StageFault):
            host = self.pipeline.links[stage].host
            self.feed(
                fsm.StageFaultEvent(stage, f"stage {stage} on {host.name} ({host.where}): {message.reason}")
            )
        elif isinstance(message, StageStopped):
            self.counters[stage] = message.counters
            emit(StageStats(run_id, stage, message.counters))
            self.feed(fsm.StageStoppedEvent(stage))
        elif isinstance(message, StepStats):
            self.counters[stage] = message.counters
            emit(StageStats(run_id, stage, message.counters))

    async def _open_edges(self, stage: int) -> None:
        plan = self.plan.stages[stage]
        try:
            _, writer = self.pipeline.data[stage]
            async with self.pipeline.write_locks[stage]:
                writer.write(encode_message(OpenEdge(self.plan.run_id, plan.inbound_edge, "inbound")))
                writer.write(encode_message(OpenEdge(self.plan.run_id, plan.outbound_edge, "outbound")))
                await writer.drain()
        except (ConnectionError, OSError) as error:
            # A broken stream to a stage: report it with its root cause.
            self.pipeline.lost(stage, f"cannot set up edge streams ({error})")

    # --------------------------------------------------------------- loop

    async def drive(self) -> None:
        try:
            validate_plan(self.plan)
            if self.pipeline.broken:
                raise PlanError(f"the pipeline is broken: {self.pipeline.broken}")
        except PlanError as error:
            await self._step(fsm.PlanRejected(str(error)))
        else:
            await self._step(fsm.PlanValidated(len(self.plan.stages)))
        while not self.done.is_set():
            await self._step(await self.queue.get())

    async def _step(self, event: fsm.RunEvent) -> None:
        pending: list[fsm.RunEvent] = [event]
        while pending:
            current = pending.pop(0)
            before = self.run.phase
            try:
                self.run, effects = fsm.transition(self.run, current)
            except TransitionError as error:
                self.pipeline.emit(Notice("info", f"run {self.plan.run_id:016x}: ignored: {error}"))
                continue
            if self.run.phase is not before:
                detail = self.run.failure if self.run.phase is fsm.RunPhase.FAULTED else self.run.stop_reason
                self.pipeline.emit(RunPhaseChanged(self.plan.run_id, self.run.phase.value, detail))
            for effect in effects:
                follow = await self._perform(effect)
                if follow is not None:
                    pending.append(follow)
            if self.run.phase in (fsm.RunPhase.COMPLETED, fsm.RunPhase.FAULTED):
                pending.insert(0, fsm.Advance())

    async def _perform(self, effect: fsm.RunEffect) -> fsm.RunEvent | None:
        plan = self.plan
        pipeline = self.pipeline
        if isinstance(effect, fsm.SendProvision):
            link = pipeline.links[effect.stage]
            message = provision_message(plan, effect.stage)
            try:
                await link.send(message)
            except (ConnectionError, OSError) as error:
                return fsm.ProvisionFailed(
                    effect.stage, f"{link.label}: cannot send ProvisionStage ({error})"
                )
            if effect.stage == len(plan.stages) - 1:
                return fsm.ProvisionsSent()
        elif isinstance(effect, fsm.OpenTokenEndpoints):
            pass  # the token-in writer and token-out reader are the pipeline's data streams
        elif isinstance(effect, fsm.StartTimer):
            self._start_timer(effect.kind)
        elif isinstance(effect, fsm.CancelTimer):
            timer = self._timers.pop(effect.kind, None)
            if timer is not None:
                timer.cancel()
        elif isinstance(effect, fsm.InjectPrompt):
            self._injected = time.perf_counter()
            await self._write_tokens(0, self.prompt)
        elif isinstance(effect, fsm.InjectToken):
            await self._write_tokens(effect.sequence, [effect.token])
        elif isinstance(effect, fsm.AcceptToken):
            self._accept(effect.sequence, effect.token)
        elif isinstance(effect, fsm.FinalizeOutput):
            tail = self.detokenizer.flush()
            if tail:
                self.text.append(tail)
                pipeline.emit(TokenStreamed(plan.run_id, -1, -1, tail))
        elif isinstance(effect, fsm.RecordFailure):
            pipeline.emit(Notice("error", f"run {plan.run_id:016x} faulted: {effect.reason}"))
        elif isinstance(effect, fsm.SendStopRun):
            link = pipeline.links[effect.stage]
            try:
                if not link.alive():
                    raise ConnectionError("the agent is gone")
                await asyncio.wait_for(
                    link.send(StopRun(plan.run_id, self.run.stop_reason or self.run.outcome)), 5
                )
            except (ConnectionError, OSError, asyncio.TimeoutError) as error:
                return fsm.StageLost(effect.stage, f"{link.label}: StopRun not delivered ({error})")
        elif isinstance(effect, fsm.CloseTokenEndpoints):
            pass
        elif isinstance(effect, fsm.Note):
            pipeline.emit(Notice("info", f"run {plan.run_id:016x}: {effect.text}"))
        elif isinstance(effect, fsm.Finish):
            self._finish()
        return None

    def _start_timer(self, kind: str) -> None:
        timeouts = self.pipeline.inventory.timeouts
        seconds = {"ready": timeouts.ready, "teardown": timeouts.teardown}.get(kind, timeouts.step)
        if kind == "step" and self.run.consumed == 0:
            seconds *= max(1, math.ceil(len(self.prompt) / self.plan.engine.n_ubatch))
        old = self._timers.pop(kind, None)
        if old is not None:
            old.cancel()
        # A plain loop callback: the step timer is restarted once per token.
        loop = asyncio.get_running_loop()
        self._timers[kind] = loop.call_later(seconds, self.feed, fsm.Timeout(kind))

    async def _write_tokens(self, sequence: int, tokens: list[int]) -> None:
        plan = self.plan
        try:
            _, writer = self.pipeline.data[0]
            async with self.pipeline.write_locks[0]:
                record = objects.tokens_record(plan.run_id, plan.stages[0].inbound_edge, sequence, tokens)
                writer.write(record)
                await writer.drain()
        except (ConnectionError, OSError) as error:
            self.pipeline.lost(0, f"token-in edge: {error}")

    def _accept(self, sequence: int, token: int) -> None:
        now = time.perf_counter()
        if sequence == 0:
            self._first_token = now
        self._last_token = now
        self.tokens.append(token)
        if token in self.run.eog:
            return
        text = self.detokenizer.feed(token)
        self.text.append(text)
        self.pipeline.emit(TokenStreamed(self.plan.run_id, sequence, token, text))

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
            prompt_tokens=tuple(self.prompt),
            tokens=tuple(self.tokens),
            text="".join(self.text),
            timings=timings,
            architecture=self.plan.model.architecture,
            model=self.plan.model.model_id,
            log_path="" if self.pipeline.runlog.disabled else str(self.pipeline.runlog.path or ""),
            notes=run.notes,
        )
        self.pipeline.emit(RunFinished(self.result))
        self.pipeline.runlog.close()
        self.done.set()
