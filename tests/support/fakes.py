"""Fake stage handles and edges for fast tests of the run driver, and a fake
pipeline for the runners (session/serving.py, session/parallel.py): what the
driver sends is recorded, and the test plays the agents' part by feeding
their messages back (or an :class:`Autopilot` does). No processes, no
llama.cpp."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from pathlib import Path

from ggufpipe_agent.tasks import TaskOwner
from ggufpipe_agent.wire.protocol import (
    ChatMessage,
    Message,
    PrefixHeld,
    ProvisionStage,
    StageProgress,
    StageReady,
    StageStopped,
    StepCounters,
    StopRun,
)
from ggufpipe_tui.core.events import Event, PromptAssigned, RunResult
from ggufpipe_tui.core.inventory import Inventory, RunOptions, Timeouts, parse_inventory
from ggufpipe_tui.core.plan import GgufModelPlan, RunPlan, build_plan
from ggufpipe_tui.core.reuse import ReuseSource
from ggufpipe_tui.session.driver import RunDriver
from ggufpipe_tui.session.parallel import ParallelRunner
from ggufpipe_tui.session.runs import RunHandle, RunQueue, Turn
from ggufpipe_tui.session.serving import SerialRunner
from ggufpipe_tui.session.stages import PipelineError
from tests.support.model_facts import model_facts

FACTS = model_facts(
    path="/models/m.gguf",
    name="tiny",
    file_size=1 << 20,
    block_count=4,
    hidden_dim=8,
    context_length=64,
    vocab_size=16,
    head_count=2,
    head_count_kv=1,
    key_length=4,
    value_length=4,
    eog_token_ids=(2,),
    block_bytes=(100,) * 4,
    embedding_bytes=64,
    output_bytes=8,
)
PIECES = tuple(f"<{i}>".encode() for i in range(16))


def inventory(
    stages: int = 2,
    max_tokens: int = 4,
    step: float = 30.0,
    feedback: str = "orchestrator",
    heartbeat: float = 30.0,
) -> Inventory:
    text = (
        "model: {path: /models/m.gguf}\nhosts: {a: {local: true}}\nstages:\n"
        + "".join("  - {host: a}\n" for _ in range(stages))
        + f"run: {{max_tokens: {max_tokens}, context: 32, feedback: {feedback}}}\n"
        + f"timeouts: {{step: {step}, ready: 30, teardown: 5, heartbeat: {heartbeat}}}\n"
    )
    return parse_inventory(text, Path("inventory.yaml"))


def plan_for(inv: Inventory, run_id: int = 0x101) -> RunPlan:
    n = len(inv.stages)
    per = FACTS.block_count // n
    ranges = [(i * per, FACTS.block_count if i == n - 1 else (i + 1) * per) for i in range(n)]
    return build_plan(inv, FACTS, ranges, run_id, edge_base=0x100)


class FakeStage:
    """A stage as the driver sees it; ``sent`` records its control messages."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.sent: list[Message] = []
        self.lost: list[str] = []
        self.up = True
        self.fail_sends = False
        self.stalled = False  # an agent that reads nothing: sends never complete

    @property
    def label(self) -> str:
        return f"stage {self.index} on fake (local)"

    def alive(self) -> bool:
        return self.up

    async def send(self, message: Message) -> None:
        if self.fail_sends:
            raise ConnectionResetError("gone")
        if self.stalled:
            await asyncio.Event().wait()
        self.sent.append(message)

    def report_lost(self, symptom: str) -> None:
        self.lost.append(symptom)


class FakeEdges:
    """The data plane as the driver sees it: token-in writes are recorded."""

    def __init__(self) -> None:
        self.opened: list[int] = []
        self.written: list[tuple[int, list[int]]] = []
        self.positions: list[int] = []  # where each written object starts
        self.fail_writes = False
        self.stalled = False  # stage 0 reads nothing: token-in writes never complete

    async def open_edges(self, plan: RunPlan, stage: int) -> None:
        self.opened.append(stage)

    async def write_tokens(
        self, plan: RunPlan, sequence: int, tokens: list[int], position: int, rebuild: bool = False
    ) -> None:
        if self.fail_writes:
            raise BrokenPipeError("token-in gone")
        if self.stalled:
            await asyncio.Event().wait()
        self.written.append((sequence, list(tokens)))
        self.positions.append(position)


class Rig:
    """One driver with fake stages, ready to be played."""

    def __init__(
        self,
        stages: int = 2,
        max_tokens: int = 4,
        step: float = 30.0,
        run_id: int = 0x101,
        emit: Callable[[Event], None] | None = None,
        feedback: str = "orchestrator",
        run: RunOptions | None = None,
        heartbeat: float = 30.0,
        source: ReuseSource | None = None,
    ) -> None:
        self.inventory = inventory(stages, max_tokens, step, feedback, heartbeat)
        if run is not None:  # a prompt's own run options
            self.inventory = replace(self.inventory, run=run)
        self.plan = plan_for(self.inventory, run_id)
        if source is not None:
            self.plan = replace(self.plan, reuse=source.offer())
        self.stages = [FakeStage(i) for i in range(stages)]
        self.edges = FakeEdges()
        self.events: list[Event] = []
        self.failures: list[BaseException] = []
        self.tasks = TaskOwner(lambda name, error: self.failures.append(error), "test")
        timeouts: Timeouts = self.inventory.timeouts

        def record(event: Event) -> None:
            self.events.append(event)
            if emit is not None:
                emit(event)

        self.driver = RunDriver(
            self.plan, self.stages, self.edges, timeouts, self.tasks, record, PIECES, source=source
        )

    def start(self, problem: str = "") -> asyncio.Task[None]:
        return self.tasks.spawn(self.driver.drive(problem), "drive")

    def agent_says(self, stage: int, message: Message) -> None:
        self.driver.on_stage_message(stage, message)

    def provisioned(self, stage: int) -> ProvisionStage:
        sent = [m for m in self.stages[stage].sent if isinstance(m, ProvisionStage)]
        assert sent, f"stage {stage} was not provisioned"
        return sent[-1]

    def make_ready(self, held: list[PrefixHeld] | None = None) -> None:
        """Every stage takes its provision and is ready, holding ``held[i]``
        of the offered run."""
        run_id = self.plan.run_id
        for index in range(len(self.stages)):
            self.agent_says(index, StageProgress(run_id, index, "Preparing", "", -1.0))
            self.agent_says(index, StageReady(run_id, index, "a", held[index] if held else PrefixHeld()))

    async def ready(self, held: list[PrefixHeld] | None = None) -> None:
        """Started, every stage ready (holding ``held``), and settled: the run
        waits for its prompt."""
        self.start()
        self.make_ready(held)
        await settle()

    async def prompted(self, prompt: list[int] | None = None, held: list[PrefixHeld] | None = None) -> None:
        """Started, every stage ready (holding ``held``), ``prompt`` given
        (token 5 alone unless said), and settled."""
        self.start()
        self.make_ready(held)
        self.driver.give_prompt([5] if prompt is None else prompt)
        await settle()

    async def tokens(self, *tokens: int) -> None:
        """The last stage's ``tokens``, sequence 0 on, each settled."""
        for sequence, token in enumerate(tokens):
            self.driver.on_token(sequence, [token])
            await settle()

    async def timed_out(self) -> None:
        """Until the run has faulted (a timeout fired)."""
        while self.driver.run.phase.value not in ("Faulted", "TearingDown", "Done"):
            await asyncio.sleep(0.02)

    def answer_stops(self) -> None:
        """Every stage that got StopRun says it stopped."""
        for stage in self.stages:
            if any(isinstance(m, StopRun) for m in stage.sent):
                self.agent_says(stage.index, StageStopped(self.plan.run_id, stage.index, "a", StepCounters()))


async def settle(rounds: int = 20) -> None:
    """Let the driver's loop work through what it was fed."""
    for _ in range(rounds):
        await asyncio.sleep(0)


class Autopilot:
    """Plays every agent of a rig by itself: a provision is answered with
    Preparing and Ready, each token-in object with the next token (token ids
    count up from 9), StopRun with StageStopped. In a token-ring run the
    prompt is answered with every token the last stage's provision allows, as
    that stage would feed them round itself. ``fault_at`` makes stage 0
    fault instead of answering that sequence."""

    def __init__(self, rig: Rig, fault_at: int | None = None) -> None:
        self.rig = rig
        self.fault_at = fault_at
        loop = asyncio.get_running_loop()
        for stage in rig.stages:
            original = stage.send

            async def send(message: Message, stage: FakeStage = stage, original=original) -> None:
                await original(message)
                loop.call_soon(self._answer, stage.index, message)

            stage.send = send  # type: ignore[method-assign]
        write = rig.edges.write_tokens

        async def write_tokens(
            plan: RunPlan, sequence: int, tokens: list[int], position: int, rebuild: bool = False
        ) -> None:
            await write(plan, sequence, tokens, position, rebuild)
            loop.call_soon(self._token, sequence)

        rig.edges.write_tokens = write_tokens  # type: ignore[method-assign]

    def _answer(self, index: int, message: Message) -> None:
        run_id = self.rig.plan.run_id
        if isinstance(message, ProvisionStage):
            self.rig.agent_says(index, StageProgress(run_id, index, "Preparing", "", -1.0))
            self.rig.agent_says(index, StageReady(run_id, index, "a"))
        elif isinstance(message, StopRun):
            self.rig.agent_says(index, StageStopped(run_id, index, "a", StepCounters()))

    def _token(self, sequence: int) -> None:
        if sequence == self.fault_at:
            from ggufpipe_agent.wire.protocol import StageFault

            self.rig.agent_says(0, StageFault(self.rig.plan.run_id, 0, "a", f"step {sequence} failed"))
            return
        ring = self.rig.provisioned(len(self.rig.stages) - 1).ring
        if ring is None:
            self.rig.driver.on_token(sequence, [9 + sequence])
            return
        for fed in range(ring.max_tokens):  # the last stage stops where its provision says
            self.rig.driver.on_token(fed, [9 + fed])


class FakePipeline:
    """What the runners need of a pipeline (session/serving.py's Serving),
    with autopiloted fake stages: run i (0 on) faults at sequence
    ``fault_at[i]``. ``slots`` > 0: a ParallelRunner of that many slots
    (else a SerialRunner), each prompt ``delay`` seconds long so that runs
    overlap. No recovery here: tests/e2e/test_recovery.py."""

    def __init__(
        self,
        prepare_ahead: bool = False,
        fault_at: dict[int, int] | None = None,
        feedback: str = "orchestrator",
        slots: int = 0,
        delay: float = 0.0,
    ) -> None:
        self.inventory = inventory(max_tokens=3, feedback=feedback)
        self.broken = ""
        self.events: list[Event] = []
        self.rigs: list[Rig] = []
        self.fault_at = fault_at or {}
        self.delay = delay
        self.handles: dict[int, RunHandle] = {}
        self.slots: list[int] = []  # each prepared run's slot
        self.reused: list[bool] = []  # and whether it may reuse what its slot holds
        self.in_flight = self.most = 0  # runs with their prompt now, and the most at once
        self.queue = RunQueue()
        self.runner: SerialRunner | ParallelRunner = (
            ParallelRunner(self, self.queue, slots, prepare_ahead)
            if slots
            else SerialRunner(self, self.queue, prepare_ahead)
        )

    def model_plan(self) -> GgufModelPlan:
        return plan_for(self.inventory, 1).model

    async def prepare_run(
        self, options: RunOptions | None = None, *, slot: int = 0, reuse: bool = True
    ) -> RunDriver:
        self.slots.append(slot)
        self.reused.append(reuse)
        number = len(self.rigs)
        run_id = 0x100 + number + 1

        def emit(event: Event) -> None:
            self.events.append(event)
            handle = self.handles.get(run_id)
            if handle is not None:
                handle.push(event)

        rig = Rig(max_tokens=3, run_id=run_id, emit=emit, feedback=self.inventory.run.feedback, run=options)
        Autopilot(rig, self.fault_at.get(number))
        self.rigs.append(rig)
        rig.start()
        return rig.driver

    async def tokenize(
        self, text: str, chat: bool, messages: Sequence[ChatMessage] = (), tools: str = "", template: str = ""
    ) -> tuple[list[int], str]:
        if text == "unreadable":
            raise PipelineError("tokenizing on a: the chat template failed")
        return [len(text)] * (40 if text == "long" else 1), text

    async def run(self, driver: RunDriver, turn: Turn) -> RunResult:
        handle = turn.handle
        handle.driver, handle.run_id = driver, driver.plan.run_id
        self.handles[driver.plan.run_id] = handle
        driver.emit(PromptAssigned(driver.plan.run_id, handle.prompt.text, handle.ticket))
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            if self.delay:
                await asyncio.sleep(self.delay)  # the other runs overlap this one
            driver.give_prompt(turn.tokens, handle.prompt.submitted, turn.limit)
            await driver.done.wait()
        finally:
            self.in_flight -= 1
        assert driver.result is not None
        handle.finish(driver.result)
        return driver.result

    async def repaired(self, driver: RunDriver) -> bool:
        return False


@contextlib.asynccontextmanager
async def served(pipeline: FakePipeline) -> AsyncIterator[asyncio.Future[None]]:
    """The pipeline's runner serving its queue; after: stopped ("done") and ended."""
    serving = asyncio.ensure_future(pipeline.runner.serve())
    yield serving
    pipeline.queue.stop("done")
    await asyncio.wait_for(serving, 5)
