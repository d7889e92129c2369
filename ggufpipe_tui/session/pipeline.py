"""The session: one pipeline of agents, the model they hold, and its runs.

A :class:`Pipeline` starts an agent per stage (in parallel), reads the model's
facts and vocabulary from where the model lives, opens the data plane and then
serves prompts: :meth:`Pipeline.submit` queues a :class:`~.runs.Prompt` and
returns its :class:`~.runs.RunHandle`; a runner turns prompts into runs one
at a time (:class:`~.serving.SerialRunner`; with ``run.parallel`` K > 1, the
:class:`~.parallel.ParallelRunner` up to K at once, each on its own slot of
every stage), each with its own run id and plan, driven by a
:class:`~.driver.RunDriver`. Agents keep their loaded stage between runs, so
a second prompt reloads nothing. Events go out through session/fanout.py.

It owns a :class:`~.stages.StageHandle` per stage, a data plane
(:mod:`ggufpipe_tui.dataplane`), the recovery of a lost stage
(:class:`~.recovery.Recovery`; the repair in session/rebuild.py), and one
:class:`~ggufpipe_agent.tasks.TaskOwner` for every background task: a task
that fails is a fault of the run, never silence.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from ggufpipe_agent.errors import GgufpipeError
from ggufpipe_agent.gguf.architectures import check_architecture, check_plan
from ggufpipe_agent.ids import FIRST_SLOT, RunId, SlotId
from ggufpipe_agent.tasks import TaskOwner
from ggufpipe_agent.wire.protocol import (
    ChatMessage,
    Message,
    ModelFacts,
    Shutdown,
    StageFileRef,
)
from ggufpipe_tui.core import recovery as rec
from ggufpipe_tui.core import run_fsm as fsm
from ggufpipe_tui.core.events import (
    AgentConnected,
    AgentLog,
    Emit,
    Event,
    ModelInspected,
    PlanMade,
    PromptAssigned,
    RunFinished,
    RunRecovered,
    RunResult,
)
from ggufpipe_tui.core.inventory import HostSpec, Inventory, RunOptions
from ggufpipe_tui.core.placement import Placement
from ggufpipe_tui.core.plan import GgufModelPlan, PlanError, RunPlan, build_plan, new_run_id, validate_plan
from ggufpipe_tui.core.refusal import place_stages
from ggufpipe_tui.core.reuse import Resume
from ggufpipe_tui.dataplane import DataPlane, DataPlaneEvents
from ggufpipe_tui.dataplane.direct import DirectPlane
from ggufpipe_tui.session.control import to_run
from ggufpipe_tui.session.delivery import Delivered, deliver_stages, with_stage_files
from ggufpipe_tui.session.driver import LOSS_REPORT_SECONDS, RunDriver
from ggufpipe_tui.session.fanout import Fanout
from ggufpipe_tui.session.modelsource import LocalModel, ModelSource, TokenizeRefused, model_source
from ggufpipe_tui.session.parallel import ParallelRunner
from ggufpipe_tui.session.rebuild import rebuild
from ggufpipe_tui.session.recovery import Recovery
from ggufpipe_tui.session.runlog import RunLog
from ggufpipe_tui.session.runs import Prompt, RunHandle, RunQueue, Turn
from ggufpipe_tui.session.serving import SerialRunner, pipeline_error
from ggufpipe_tui.session.stages import PipelineError, StageHandle, agent_set_up
from ggufpipe_tui.transports.connection import AgentConnection
from ggufpipe_tui.transports.shared import ProcessSharing, SharedAgent

ConnectionFactory = Callable[[HostSpec, int, Callable[[str], None]], AgentConnection]
DataPlaneFactory = Callable[[Sequence[StageHandle], TaskOwner, DataPlaneEvents], DataPlane]
__all__ = ["Pipeline", "PipelineError", "Prompt", "RunHandle"]


def default_connection_factory(host: HostSpec, stage: int, on_log: Callable[[str], None]) -> AgentConnection:
    if host.local:
        from ggufpipe_tui.transports.local import LocalAgent

        return LocalAgent(host, stage, on_log)
    from ggufpipe_tui.transports.ssh import SshAgent

    return SshAgent(host, stage, on_log)


class Pipeline:
    def __init__(
        self,
        inventory: Inventory,
        emit: Emit | None = None,
        connection_factory: ConnectionFactory = default_connection_factory,
        log_dir: Any = None,
        *,
        prepare_ahead: bool = False,
        data_plane: DataPlaneFactory = DirectPlane,
        deliver: bool = True,
        prefix_reuse: bool = True,
    ) -> None:
        self.inventory = inventory
        self.connection_factory = connection_factory
        self.data_plane_factory = data_plane
        self.stages: list[StageHandle] = []
        self.data: DataPlane | None = None
        self.facts: ModelFacts | None = None
        self.pieces: tuple[bytes, ...] = ()
        self.special_pieces: dict[int, bytes] = {}  # control tokens' text
        self.ranges: list[tuple[int, int]] = []
        self.placement: Placement | None = None  # what each stage needs and each host has
        self.model: ModelSource | None = None  # where the model is read and prompts tokenized
        self.delivered: list[Delivered] = []  # model send: true: each stage's file, sent or found
        self.deliver = deliver  # False (--plan): send no stage file, even with send: true
        # Runs in flight at once (run.parallel, --serve's --parallel): each
        # on its own slot of every stage; the runs not done yet, by run id,
        # and the last run of each slot (what its caches hold).
        self.parallel = max(1, inventory.run.parallel)
        self.drivers: dict[int, RunDriver] = {}
        self.on_slot: list[RunDriver | None] = [None] * self.parallel
        self._model_plan: GgufModelPlan | None = None
        self.broken = ""  # why the pipeline cannot carry another run
        self.closing = False
        self.serving = False  # start() has finished: the queue serves runs
        self.runlog = RunLog(log_dir)
        self.events = Fanout(self.runlog, emit)
        self.tasks = TaskOwner(self._task_failed, "pipeline")
        self.queue = RunQueue()
        self.runner = (
            SerialRunner(self, self.queue, prepare_ahead)
            if self.parallel == 1
            else ParallelRunner(self, self.queue, self.parallel, prepare_ahead)
        )
        # Each stage keeps its KV cache between runs; a run keeps the prefix
        # it shares with the one before (core/reuse.py). False: every run
        # starts from an empty cache (a cold run, for comparisons).
        self.prefix_reuse = prefix_reuse
        # Recovery of a lost stage (docs/recovery.md, core/recovery.py).
        policy = rec.Policy(inventory.recovery.attempts, inventory.recovery.deadline)
        self.recovery = Recovery(self, policy, self.tasks)
        self._plane = 0  # the data plane's generation: a replaced one's reports are ignored
        self._relink: set[int] = set()  # producers whose direct link broke: the repair tries them again

    @property
    def links(self) -> list[AgentConnection]:
        return [stage.link for stage in self.stages]

    @property
    def recovering(self) -> bool:
        return self.recovery.active

    @property
    def recoveries(self) -> list[RunRecovered]:
        return self.recovery.recoveries

    # ------------------------------------------------------------- events

    def subscribe(self, callback: Emit) -> Callable[[], None]:
        """``callback(event)`` for every event of the session; returns the unsubscribe."""
        return self.events.subscribe(callback)

    def emit(self, event: Event) -> None:
        self.events.emit(event)

    def _run_emitter(self, run_id: RunId, final: bool = False) -> Emit:
        """``final``: a RunFinished ends the run even while recovering (give_up)."""
        return self.events.run_emitter(run_id, lambda result: self.recovery.ended(result, final))

    def _task_failed(self, name: str, error: BaseException) -> None:
        """A pipeline task that dies of a bug must not leave a run waiting
        forever: the failure becomes the run's fault."""
        reason = f"internal error in the orchestrator ({name}): {type(error).__name__}: {error}"
        self._edge_fault(reason)

    # -------------------------------------------------------------- start

    async def start(self) -> None:
        """Start every stage's agent, read the model, open the data plane, serve prompts."""
        inventory = self.inventory
        timeout = inventory.timeouts.connect
        sharing = ProcessSharing(self.connection_factory)  # share_process: true hosts
        for index, spec in enumerate(inventory.stages):
            host = inventory.hosts[spec.host]
            link = sharing.link(host, index, self._log_sink(index, host.name))
            self.stages.append(StageHandle(index, link, self._on_message, self._stage_lost))
        starting = (self.start_stage(stage, timeout) for stage in self.stages)
        results = await asyncio.gather(*starting, return_exceptions=True)
        failures = [result for result in results if isinstance(result, BaseException)]
        if failures:
            await self.close()
            first = failures[0]
            if isinstance(first, GgufpipeError):
                raise first
            raise PipelineError(f"starting the agents failed: {first!r}") from first
        for stage in self.stages:
            self.watch_stage(stage)
        try:
            await self._inspect()
            await self._deliver()
            await self.open_data_plane(timeout)
        except BaseException:
            await self.close()
            raise
        self.serving = True  # from now on a lost stage is recovered (before: start() fails)
        self.tasks.spawn(self.runner.serve(), "run queue")

    def watch_stage(self, stage: StageHandle) -> None:
        stage.start_heartbeat(self.tasks, self.inventory.timeouts.heartbeat)
        self.tasks.spawn(stage.read_control(), f"control reader of stage {stage.index}")

    def new_stage(self, index: int, host: HostSpec, shares: AgentConnection | None = None) -> StageHandle:
        sink = self._log_sink(index, host.name)
        link: AgentConnection
        if shares is not None:  # attached to the agent process of ``shares`` (transports/shared.py)
            if index not in shares.sharers:
                shares.sharers.append(index)
            link = SharedAgent(host, index, sink, shares)
        else:
            link = self.connection_factory(host, index, sink)
            link.share_process = host.share_process  # a first stage: it starts the shared process
        return StageHandle(index, link, self._on_message, self._stage_lost)

    def close_data_plane(self) -> None:
        if self.data is not None:
            self._plane += 1  # the old plane's reports (its streams closing) are ignored
            self.data.close()
            self.data = None

    async def rebuild(self) -> tuple[str, str]:
        return await rebuild(self)

    async def open_data_plane(self, timeout: float) -> None:
        """A data plane over the current stages; whatever an older one still
        reports (its streams closed by a repair) is ignored."""
        self._plane += 1
        plane = self._plane

        def current(report: Callable[..., None]) -> Callable[..., None]:
            def reported(*args: object) -> None:
                if plane == self._plane:
                    report(*args)

            return reported

        events = DataPlaneEvents(
            lost=current(self._lost_at),
            fault=current(self._edge_fault),
            log=self._log_at,
            routed=current(self.emit),
            broken=current(self._link_broken),
        )
        self.data = self.data_plane_factory(self.stages, self.tasks, events)
        again, self._relink = self._relink, set()
        await self.data.open(timeout, again)

    def _log_sink(self, stage: int, host: str) -> Callable[[str], None]:
        return lambda line: self.emit(AgentLog(stage, host, line))

    def _log_at(self, stage: int, line: str) -> None:
        self.emit(AgentLog(stage, self.stages[stage].host.name, line))

    async def start_stage(self, stage: StageHandle, timeout: float) -> None:
        hello = await stage.start(timeout, agent_set_up(self.inventory.timeouts, self.emit))
        self.emit(AgentConnected(stage.index, stage.host.name, stage.host.where, hello))

    async def _inspect(self) -> None:
        # Through the hosts' copies (every copy checked to be stage 0's model),
        # or on this machine with model send: true (session/modelsource.py).
        self.model = model_source(self.inventory, self.stages)
        model = await self.model.read(max(60.0, self.inventory.timeouts.connect))
        facts, where = model.facts, model.where
        check_architecture(facts.architecture, where)
        # Ranges and memory from what each host has; refuses a plan that does not fit.
        self.placement = place_stages(self.inventory, facts, [link.hello for link in self.links])
        self.ranges = list(self.placement.ranges)
        check_plan(facts, self.ranges, where)
        self.facts, self.pieces = facts, model.pieces
        self.special_pieces = dict(model.special)
        self.emit(ModelInspected(facts))

    async def _deliver(self) -> None:
        """model send: true: each host gets its stage file now, once the ranges
        are known and before any run (docs/architecture.md, "Model delivery")."""
        if self.deliver and isinstance(self.model, LocalModel) and self.model.files is not None:
            self.delivered = await deliver_stages(
                self.stages, self.model.files, self.ranges, self.emit, self.inventory.timeouts
            )

    async def tokenize(
        self, text: str, chat: bool, messages: Sequence[ChatMessage] = (), tools: str = "", template: str = ""
    ) -> tuple[list[int], str]:
        """A prompt's tokens and the text they came from: ``text`` (through the
        chat template when ``chat``) or a whole conversation (``messages``,
        through the chat template); by stage 0's agent, or here with
        ``send: true`` (session/modelsource.py)."""
        for attempt in (1, 2):
            if self.recovery.active and not self.closing:
                await self.recovery.recover()  # stage 0 lost: repaired first (raises when it cannot be)
            if self.model is None or self.closing:
                raise PipelineError("the pipeline is not running")
            try:
                return await self.model.tokenize(text, chat, tuple(messages), tools, template)
            except TokenizeRefused:
                raise  # the text's fault
            except PipelineError:
                # Stage 0 lost while it tokenized (its agent, or the stream to
                # it): once its loss is reported and repaired, once more.
                if attempt == 2 or not await self._loss_reported():
                    raise
        raise AssertionError("unreachable")

    async def _loss_reported(self, within: float = LOSS_REPORT_SECONDS) -> bool:
        """Whether stage 0's loss is (or, within ``within`` s, comes to be) reported."""
        deadline = time.monotonic() + within
        while not (self.recovery.active or self.stages[0].lost):
            if time.monotonic() > deadline or self.closing:
                return False
            await asyncio.sleep(0.05)
        return True

    # --------------------------------------------------------------- runs

    def submit(self, prompt: Prompt, stream: bool = False) -> RunHandle:
        """Queue ``prompt``; runs go in order, one at a time (up to
        ``run.parallel`` at once with slots). ``stream``: the handle also
        yields the run's events (:meth:`RunHandle.events`)."""
        return self.queue.submit(prompt, stream)

    async def generate(self, text: str, chat: bool | None = None) -> RunResult:
        """One whole run of ``text``."""
        return await self.submit(Prompt(text=text, chat=chat)).result()

    async def generate_tokens(self, tokens: list[int]) -> RunResult:
        """One whole run of a prompt given as token ids."""
        return await self.submit(Prompt(tokens=tuple(tokens))).result()

    async def wait_stopped(self) -> str:
        """Until the session serves no more prompts; returns why (a fault)."""
        return await self.queue.wait_stopped()

    def make_plan(self, options: RunOptions | None = None) -> RunPlan:
        """A new run's plan; ``options``: run options other than the inventory's."""
        assert self.facts is not None
        inventory = self.inventory if options is None else replace(self.inventory, run=options)
        plan = build_plan(inventory, self.facts, self.ranges, new_run_id(), placement=self.placement)
        files: dict[int, StageFileRef] = {done.stage: done.ref for done in self.delivered}
        return with_stage_files(plan, files)

    def model_plan(self) -> GgufModelPlan:
        """The model as every run's plan has it (vocabulary, context)."""
        if self._model_plan is None:
            self._model_plan = self.make_plan().model
        return self._model_plan

    async def prepare_run(
        self,
        options: RunOptions | None = None,
        quiet: bool = False,
        *,
        slot: SlotId = FIRST_SLOT,
        reuse: bool = True,
        resume: Resume | None = None,
    ) -> RunDriver:
        """Plan, provision and load a run that waits for its prompt, on
        ``slot`` of every stage (it offers what the slot's last run left
        there, unless ``reuse`` is False: llama-server's cache_prompt).
        ``quiet``: its events go nowhere (a run of the history replayed by
        recovery, :meth:`Recovery.replay_history <.recovery.Recovery.replay_history>`).
        ``resume``: the run carries an interrupted one on in proportion
        (session/recovery.py): offered its positions, one stage rebuilt."""
        if self.recovery.active and not self.closing:
            await self.recovery.recover()  # a stage lost between runs: repaired first
        if self.closing or self.data is None:
            raise PipelineError("the pipeline is not running")
        if not 0 <= slot < self.parallel:
            raise PipelineError(f"slot {slot} does not exist: the stages have {self.parallel}")
        previous = self.on_slot[slot]
        if previous is not None and not previous.done.is_set():
            raise PipelineError(f"a run is already active on slot {slot}")
        use = previous is not None and self.prefix_reuse and reuse
        source = previous.next_source() if use and previous is not None else None
        plan = replace(self.make_plan(options), slot=slot)
        if resume is not None:
            source = None
            plan = replace(plan, reuse=resume.offer(), rebuild=resume.rebuild)
        elif source is not None:
            plan = replace(plan, reuse=source.offer())
        driver = RunDriver(
            plan,
            self.stages,
            self.data,
            self.inventory.timeouts,
            self.tasks,
            (lambda event: None) if quiet else self._run_emitter(plan.run_id),
            self.pieces,
            log_path=lambda: self.events.log_path(plan.run_id),
            source=source,
            resume=resume,
        )
        self.on_slot[slot] = self.drivers[plan.run_id] = driver
        if not quiet:
            self.events.open_log(plan.run_id)
            self.emit(PlanMade(plan, tuple(stage.host for stage in self.inventory.stages)))
        self.data.bind(plan, driver.on_token)
        try:
            validate_plan(plan)
            problem = f"the pipeline is broken: {self.broken}" if self.broken else ""
        except PlanError as error:
            problem = str(error)
        self.tasks.spawn(self._drive(driver, problem), f"run {plan.run_id:016x}")
        return driver

    async def _drive(self, driver: RunDriver, problem: str) -> None:
        try:
            await driver.drive(problem)
        finally:
            self.drivers.pop(driver.plan.run_id, None)
            if self.data is not None:
                self.data.unbind(driver.plan.run_id)

    def live_drivers(self) -> list[RunDriver]:
        """The runs in flight (not done)."""
        return [driver for driver in self.drivers.values() if not driver.done.is_set()]

    def assign(self, handle: RunHandle, driver: RunDriver, replaces: int = 0) -> None:
        self.events.assign(handle, driver, replaces)

    async def run(self, driver: RunDriver, turn: Turn) -> RunResult:
        """Run ``turn``'s prompt on ``driver`` to its end, replayed after a
        lost stage is repaired (Recovery.carry_on), and finish its handle."""
        handle, prompt = turn.handle, turn.handle.prompt
        self.assign(handle, driver)
        driver.emit(PromptAssigned(driver.plan.run_id, prompt.text, handle.ticket))
        try:
            result = await self.run_prompt(driver, turn.tokens, prompt.submitted, turn.limit)
            result = await self.recovery.carry_on(turn, driver, result)
        except GgufpipeError as error:  # refused at the last moment: the run is torn down
            driver = handle.driver or driver
            if not driver.done.is_set():
                driver.stop(f"no prompt: {error}")
            await driver.done.wait()
            assert driver.result is not None
            handle.fail(pipeline_error(error))
            return driver.result
        handle.finish(result)
        self.recovery.remember(turn.tokens, turn.options, result)
        return result

    async def repaired(self, driver: RunDriver) -> bool:
        """``driver`` ended before its prompt: True when a lost stage ended it
        and the pipeline is repaired now (raises when recovery gives up)."""
        if self.recovery.take_interrupted(driver.plan.run_id) is None:
            return False
        await self.recovery.recover()
        return True

    def end_run(self, result: RunResult) -> None:
        self._run_emitter(result.run_id, final=True)(RunFinished(result))

    def stop_serving(self, reason: str) -> None:
        self.queue.stop(reason)

    async def run_prompt(
        self, driver: RunDriver, tokens: list[int], submitted: float, max_tokens: int = 0
    ) -> RunResult:
        """Give a prepared run its prompt and wait for its end; ``max_tokens``
        > 0: this prompt's limit instead of the plan's."""
        limit = driver.plan.model.max_seq_len
        if len(tokens) >= limit:
            driver.stop("prompt too long")
            await driver.done.wait()
            raise PipelineError(
                f"the prompt is {len(tokens)} tokens, the context holds {limit} "
                "(raise run.context or --context)"
            )
        driver.give_prompt(tokens, submitted, max_tokens)
        await driver.done.wait()
        assert driver.result is not None
        return driver.result

    # ------------------------------------------------------- control plane

    def _on_message(self, stage: StageHandle, message: Message) -> None:
        if self.stages[stage.index] is not stage:
            return  # an agent replaced by recovery
        driver = self.drivers.get(getattr(message, "run_id", 0) or 0)
        if self.data is not None and self.data.on_message(stage.index, message):
            return
        to_run(stage, message, driver, self.emit)

    def _lost_at(self, stage: int, symptom: str) -> None:
        self._stage_lost(self.stages[stage], symptom)

    def _stage_lost(self, stage: StageHandle, symptom: str) -> None:
        """A stage's stream broke or ended. Reported once per stage, with the
        root cause when there is one (the agent exited, and how)."""
        if self.closing or stage.lost or self.stages[stage.index] is not stage:
            return
        stage.lost = symptom
        self.tasks.spawn(self.recovery.report_lost(stage, symptom), f"loss report of stage {stage.index}")

    def _link_broken(self, producer: int, reason: str) -> None:
        """A direct link between two live stages broke: repaired as a loss
        with no stage lost (a new data plane, the link tried again)."""
        if self.closing:
            return
        self._relink.add(producer)
        link = f"the direct link from stage {producer} to stage {(producer + 1) % len(self.stages)}"
        self.tasks.spawn(self.recovery.report_link(link, reason), f"report of {link}")

    def _edge_fault(self, reason: str) -> None:
        if not self.broken:
            self.broken = reason
        for driver in self.live_drivers():
            driver.feed(fsm.EdgeFault(reason))

    # ------------------------------------------------------------ closing

    async def close(self) -> None:
        """Tear down the active run, then end every agent and every task."""
        self.queue.stop("the pipeline closed")
        live = self.live_drivers()
        for driver in live:
            driver.stop("the orchestrator is closing")
        if live:
            with contextlib.suppress(asyncio.TimeoutError):
                done = asyncio.gather(*(driver.done.wait() for driver in live))
                await asyncio.wait_for(done, self.inventory.timeouts.teardown + 5)
        self.closing = True
        for stage in self.stages:
            if stage.link.control is not None and stage.alive():
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(stage.send(Shutdown("orchestrator closing")), 2)
        if self.data is not None:
            self.data.close()
        # Stages attached to a shared process end their sessions before the
        # process's own stage ends it.
        for attached in (True, False):
            closing = (stage for stage in self.stages if isinstance(stage.link, SharedAgent) is attached)
            await asyncio.gather(*(stage.close(3.0) for stage in closing), return_exceptions=True)
        await self.tasks.close()
        self.runlog.close()
