"""``ggufpipe-tui INVENTORY``: the terminal UI.

The app is a view of one :class:`~ggufpipe_tui.session.pipeline.Pipeline`: the
pipeline's emit callback posts each event as a Textual message, and the app
turns them into the status line, the stage table, the streamed reply and the
log (the core never imports Textual). A session worker drives the pipeline:
connect, then keep a run prepared (every stage loaded, waiting for its prompt)
so a prompt runs the moment it is typed; after each run, prepare the next.
Prompts typed meanwhile wait their turn. A fault ends the session with its one
reason on screen; ``ctrl+r`` closes the pipeline and starts a fresh one.

For tests and screenshots the app also replays a scripted list of events
instead of starting a pipeline (``script=``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.reactive import var
from textual.widgets import Footer, Input, Static
from textual.worker import Worker, WorkerCancelled, WorkerFailed, WorkerState

from ggufpipe_agent.errors import GgufpipeError
from ggufpipe_tui.core.events import (
    AgentConnected,
    AgentLog,
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
    TokenStreamed,
)
from ggufpipe_tui.core.inventory import Inventory
from ggufpipe_tui.session.pipeline import Pipeline, RunDriver
from ggufpipe_tui.views.widgets import (
    PHASE_STYLES,
    STAGE_STYLES,
    Exchange,
    LogPane,
    StageRow,
    StageTable,
    StatusBar,
    StatusView,
    Transcript,
    format_bytes,
    format_seconds,
)

PipelineFactory = Callable[..., Pipeline]
WELCOME = "Type a prompt below and press Enter. The stages load while you type."


@dataclass(frozen=True, slots=True)
class UserPrompt:
    """The session gave this prompt to run ``run_id`` (also a script item)."""

    run_id: int
    text: str


#: A script item: an event, a prompt, or a float that sets the scripted clock.
ScriptItem = Event | UserPrompt | float


class PipelineEvent(Message):
    """An orchestrator event, posted from the pipeline's emit callback."""

    def __init__(self, event: Event | UserPrompt, session: int) -> None:
        super().__init__()
        self.event = event
        self.session = session


@dataclass
class Pending:
    text: str
    submitted: float  # time.perf_counter(), for the time to first token
    exchange: Exchange
    shown: bool = False  # in the output pane yet


@dataclass
class RunStats:
    """One run as the header shows it: elapsed time and tokens per second."""

    run_id: int
    started: float
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    ended: float | None = None
    result: RunResult | None = None

    def elapsed(self, now: float) -> float:
        return (self.ended if self.ended is not None else now) - self.started

    def rate(self) -> float | None:
        if self.result is not None and self.result.timings.decode_tokens_per_s:
            return self.result.timings.decode_tokens_per_s
        first, last = self.first_token, self.last_token
        if first is not None and last is not None and last > first:
            return (self.tokens - 1) / (last - first)
        return None


class GgufpipeApp(App[int]):
    CSS_PATH = "app.tcss"
    TITLE = "ggufpipe"
    ENABLE_COMMAND_PALETTE = False
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+f", "filter_log", "Log filter"),
        Binding("ctrl+r", "restart", "Restart"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    #: A prompt has been given to the current run (the stop key applies).
    prompt_active: var[bool] = var(False, bindings=True)

    def __init__(
        self,
        inventory: Inventory,
        log_dir: Any = None,
        *,
        pipeline_factory: PipelineFactory = Pipeline,
        script: Sequence[ScriptItem] | None = None,
    ) -> None:
        super().__init__()
        self.inventory = inventory
        self.log_dir = log_dir
        self.pipeline_factory = pipeline_factory
        self.script = list(script) if script is not None else None
        self._script_now = 0.0
        self.pipeline: Pipeline | None = None
        self.driver: RunDriver | None = None
        self.session = 0
        self.session_phase: str | None = "Connecting"  # overrides the run phase when set
        self.session_started = 0.0
        self.run_id: int | None = None
        self.run_phase: str | None = None
        self.model_line = ""
        self.fault = ""
        self.prompts: asyncio.Queue[Pending] = asyncio.Queue()
        self.exchanges: dict[int, Exchange] = {}
        self.runs: dict[int, RunStats] = {}
        self.results: list[RunResult] = []
        self.latest: RunStats | None = None
        self.agent_pids: dict[int, int] = {}
        self.quitting = False
        self._pipeline_closes: set[asyncio.Future[None]] = set()
        hosts = inventory.hosts
        self.rows = [
            StageRow(index, stage.host, hosts[stage.host].where, stage.layers)
            for index, stage in enumerate(inventory.stages)
        ]
        self._load_detail: dict[int, str] = {}

    # ------------------------------------------------------------- layout

    def compose(self) -> ComposeResult:
        yield StatusBar(id="status")
        yield StageTable(self.rows, id="stages")
        with Vertical(id="body"):
            with Transcript(id="transcript"):
                yield Static(WELCOME, classes="welcome")
            yield LogPane(id="log")
        with Horizontal(id="prompt-row"):
            yield Static("›", id="prompt-mark")
            yield Input(placeholder="a prompt; Enter runs it", id="prompt")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#stages").border_title = "Stages"
        self.query_one("#transcript").border_title = "Output"
        self._title_log()
        self.query_one("#prompt", Input).focus()
        self.set_interval(0.25, self._tick)
        self.session_started = self.now()
        if self.script is not None:
            self._play_script()
        else:
            self.start_session()
        self._refresh()

    def now(self) -> float:
        return self._script_now if self.script is not None else time.monotonic()

    def _play_script(self) -> None:
        assert self.script is not None
        for item in self.script:
            if isinstance(item, float | int):
                self._script_now = float(item)
            else:
                self._handle(item)

    # ------------------------------------------------------------ session

    def _emitter(self, session: int) -> Callable[[Event], None]:
        def emit(event: Event) -> None:
            # Called by the pipeline on the app's own loop: post, never touch widgets.
            self.post_message(PipelineEvent(event, session))

        return emit

    def start_session(self) -> None:
        previous = next((w for w in self.workers if w.group == "session" and not w.is_finished), None)
        if previous is not None:
            previous.cancel()
        self.session += 1
        self.session_phase = "Connecting"
        self.session_started = self.now()
        self.fault = ""
        self.run_id, self.run_phase, self.driver = None, None, None
        for row in self.rows:
            row.state, row.connected, row.fault, row.load_fraction = "Unprovisioned", False, "", None
            row.counters, row.activity = None, 0
            row.history.clear()
        self.agent_pids.clear()
        self._refresh()
        self.run_session(self.session, previous)

    @work(exclusive=False, group="session", exit_on_error=False)
    async def run_session(self, session: int, previous: Worker[Any] | None) -> None:
        if previous is not None:
            with contextlib.suppress(WorkerCancelled, WorkerFailed):
                await previous.wait()
        await self._close_pipeline()
        self._note(None, Text(f"session {session}: starting {len(self.rows)} agents", style="bold"))
        pipeline = self.pipeline_factory(self.inventory, self._emitter(session), log_dir=self.log_dir)
        self.pipeline = pipeline
        try:
            await pipeline.start()
        except GgufpipeError as error:
            self._end_session(session, str(error), lost=False)
            return
        while True:
            driver = await pipeline.prepare_run()
            self.driver = driver
            pending = await self._next_prompt(driver)
            if pending is None:  # the run ended before its prompt: it faulted while preparing
                break
            self.prompt_active = True
            self.post_message(PipelineEvent(UserPrompt(driver.plan.run_id, pending.text), session))
            self._show(pending)
            pending.exchange.assign(driver.plan.run_id)
            self.exchanges[driver.plan.run_id] = pending.exchange
            try:
                tokens, _ = await pipeline.tokenize(pending.text, self.inventory.run.chat)
                await pipeline.run_prompt(driver, tokens, pending.submitted)
            except GgufpipeError as error:
                # Not run (tokenizing failed, or too long for the context): the
                # prepared run is torn down and the next one prepared.
                if not driver.done.is_set():
                    driver.stop(f"no prompt: {error}")
                self._note(None, Text(f"the prompt was not run: {error}", style="red"))
            await driver.done.wait()
            self.prompt_active = False
            result = driver.result
            if pipeline.broken or (result is not None and result.outcome == "faulted"):
                break
        reason = (driver.result.failure if driver.result is not None else "") or pipeline.broken
        self._end_session(session, reason or "the run ended unexpectedly")

    async def _next_prompt(self, driver: RunDriver) -> Pending | None:
        get = asyncio.ensure_future(self.prompts.get())
        ended = asyncio.ensure_future(driver.done.wait())
        try:
            await asyncio.wait({get, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
            if not get.done():
                get.cancel()
        if get.done() and not get.cancelled():
            pending = get.result()
            if driver.done.is_set():  # both at once: keep the prompt for the next session
                self.prompts.put_nowait(pending)
                return None
            return pending
        return None

    def _end_session(self, session: int, reason: str, lost: bool = True) -> None:
        if session != self.session:
            return
        self.session_phase = "Faulted"
        self.fault = reason
        self.prompt_active = False
        if lost:
            self._mark_lost()
        self._note(None, Text(f"session {session} stopped: {reason}", style="bold red"))
        self._note(None, Text("ctrl+r closes this pipeline and starts a fresh one", style="red"))
        self._refresh()

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        worker = event.worker
        if worker.group == "session" and event.state is WorkerState.ERROR:
            error = worker.error
            self._end_session(self.session, f"internal error: {type(error).__name__}: {error}")

    async def _close_pipeline(self) -> None:
        """Close the pipeline and wait for every close under way. A close is
        shielded: cancelling the worker that waits on it (a restart, then a
        quit) must not leave agents half torn down."""
        pipeline, self.pipeline, self.driver = self.pipeline, None, None
        if pipeline is not None:
            task = asyncio.ensure_future(pipeline.close())
            self._pipeline_closes.add(task)
            task.add_done_callback(self._pipeline_closes.discard)
        if self._pipeline_closes:
            await asyncio.shield(asyncio.gather(*self._pipeline_closes, return_exceptions=True))

    async def on_unmount(self) -> None:
        # Every way out (ctrl+q, an exception, a test's run_test ending) ends every stage.
        await self._close_pipeline()

    def _mark_lost(self) -> None:
        """Stages whose agent is gone: the agent cannot say so itself."""
        pipeline = self.pipeline
        if pipeline is None:
            return
        for link in pipeline.links:
            row = self.rows[link.stage]
            if row.connected and not link.alive() and row.state != "Lost":
                # The exit status only: the stderr tail is in the log pane already.
                status = link.exit_detail().split("; agent stderr:")[0].strip()
                row.state, row.fault = "Lost", f"agent gone {status}".strip()
                row.history.append("Lost")

    # ------------------------------------------------------------ actions

    def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        event.input.clear()
        pending = Pending(text, time.perf_counter(), Exchange(text))
        # A prompt that runs next shows at once; one queued behind another
        # shows when its turn comes, so each reply streams under its prompt.
        if not self.prompt_active and self.prompts.empty():
            self._show(pending)
        self.prompts.put_nowait(pending)
        if self.session_phase == "Faulted":
            self.notify(
                "The pipeline faulted: ctrl+r starts a fresh one, then this prompt runs.", severity="warning"
            )
        elif not pending.shown:
            self.notify(f"Queued ({self.prompts.qsize()} waiting): it runs when the current prompt is done.")
        self._refresh_status()

    def _show(self, pending: Pending) -> None:
        if not pending.shown:
            pending.shown = True
            self.query_one(Transcript).add(pending.exchange)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop":  # shown dimmed while nothing generates
            return True if self.prompt_active else None
        return True

    def action_stop(self) -> None:
        driver = self.driver
        if driver is None or not self.prompt_active or driver.done.is_set():
            self.notify("Nothing is generating.", timeout=2)
            return
        self._note(None, Text("stop requested by the user", style="bold"))
        driver.stop("stopped by the user")

    def action_filter_log(self) -> None:
        log = self.query_one(LogPane)
        choices: list[int | None] = [None, *range(len(self.rows))]
        log.show_only(choices[(choices.index(log.only) + 1) % len(choices)])
        self._title_log()

    def action_restart(self) -> None:
        if self.quitting or self.script is not None:
            return
        self._note(None, Text("restart: closing the pipeline, starting a fresh one", style="bold"))
        self.start_session()

    async def action_quit(self) -> None:
        if self.quitting:  # a second ctrl+q leaves the screen now; on_unmount still ends the stages
            self.exit(0)
            return
        self.quitting = True
        self.session_phase = "Closing"
        self._refresh()
        self.run_worker(self._close_and_exit(), group="quit", exit_on_error=False)

    async def _close_and_exit(self) -> None:
        for worker in [w for w in self.workers if w.group == "session"]:
            worker.cancel()
            with contextlib.suppress(WorkerCancelled, WorkerFailed):
                await worker.wait()
        await self._close_pipeline()
        self.exit(0)

    # ------------------------------------------------------------- events

    def on_pipeline_event(self, message: PipelineEvent) -> None:
        if message.session != self.session:
            if isinstance(message.event, AgentLog | Notice):  # an old session's last words
                self._handle(message.event)
            return
        self._handle(message.event)

    def _handle(self, event: Event | UserPrompt) -> None:
        now = self.now()
        if isinstance(event, AgentLog):
            self._note(event.stage, Text(event.line))
            return
        if isinstance(event, TokenStreamed):
            self._token(event, now)
            return
        if isinstance(event, AgentConnected):
            row = self.rows[event.stage]
            hello = event.hello
            row.connected, row.where = True, event.where
            row.device = hello.devices[0].description if hello.devices else hello.backend.upper()
            self.agent_pids[event.stage] = hello.pid
            self._note(
                event.stage,
                Text(
                    f"agent on {event.host} ({event.where}), pid {hello.pid}, llama-cpp-python "
                    f"{hello.llama_cpp}, {row.device}",
                    style="bold",
                ),
            )
        elif isinstance(event, ModelInspected):
            f = event.facts
            hosts = len({row.host for row in self.rows})
            self.model_line = (
                f"{f.stem} · {f.architecture} · {f.file_type} · {format_bytes(f.file_size)} · "
                f"{f.block_count} layers · {len(self.rows)} stages on {hosts} host{'s' if hosts > 1 else ''}"
            )
            self._note(None, Text(f"model {self.model_line}", style="bold"))
        elif isinstance(event, PlanMade):
            self.run_id = event.plan.run_id
            self.session_phase = None
            self.run_phase = "Planning"
            self._note(None, Text(f"run {self.run_id:016x}: plan", style="bold"))
            for stage, row in zip(event.plan.stages, self.rows, strict=False):
                row.layers = (stage.layer_start, stage.layer_end_exclusive)
                row.estimated_bytes = stage.estimated_bytes
                row.state, row.fault, row.load_fraction = "Unprovisioned", "", None
                self._note(
                    row.index,
                    Text(
                        f"  stage {row.index}: layers [{stage.layer_start}, {stage.layer_end_exclusive}) on "
                        f"{stage.node_id}, ~{format_bytes(stage.estimated_bytes)}"
                    ),
                )
        elif isinstance(event, RunPhaseChanged):
            self._phase(event, now)
        elif isinstance(event, StageStateChanged):
            row = self.rows[event.stage]
            row.state = event.state
            row.history.append(event.state)
            if event.state == "Preparing":
                row.load_fraction, row.fault = None, ""
                self._load_detail.pop(event.stage, None)
            if event.state == "Faulted":
                row.fault = event.detail
            line = Text(f"stage {event.stage} → ")
            line.append(event.state, style=STAGE_STYLES.get(event.state, ""))
            if event.detail:
                line.append(f": {event.detail}")
            self._note(event.stage, line)
        elif isinstance(event, StageLoadProgress):
            row = self.rows[event.stage]
            row.load_detail, row.load_fraction = event.detail, event.fraction
            if self._load_detail.get(event.stage) != event.detail:
                self._load_detail[event.stage] = event.detail
                self._note(event.stage, Text(f"stage {event.stage}: {event.detail}", style="grey70"))
        elif isinstance(event, StageStats):
            row = self.rows[event.stage]
            row.counters = event.counters
            if self.run_phase == "Running":
                row.activity += 1
        elif isinstance(event, RunFinished):
            self._finished(event.result, now)
        elif isinstance(event, Notice):
            style = {"error": "bold red", "warning": "yellow"}.get(event.level, "grey70")
            self._note(None, Text(f"{event.level}: {event.text}", style=style))
        elif isinstance(event, UserPrompt):
            self.prompt_active = True
            exchange = self.exchanges.get(event.run_id)
            if exchange is None:  # a scripted prompt
                exchange = self.query_one(Transcript).add(Exchange(event.text, event.run_id))
                self.exchanges[event.run_id] = exchange
            self._note(None, Text(f"run {event.run_id:016x}: prompt {event.text!r}", style="bold"))
        self._refresh()

    def _phase(self, event: RunPhaseChanged, now: float) -> None:
        self.run_id, self.run_phase = event.run_id, event.phase
        if event.phase == "Running":
            stats = RunStats(event.run_id, started=now)
            self.runs[event.run_id] = self.latest = stats
            for row in self.rows:
                row.counters, row.activity = None, 0
        line = Text(f"run {event.run_id:016x} → ")
        line.append(f" {event.phase} ", style=PHASE_STYLES.get(event.phase, ""))
        if event.detail:
            line.append(f" {event.detail}")
        self._note(None, line)

    def _token(self, event: TokenStreamed, now: float) -> None:
        exchange = self.exchanges.get(event.run_id)
        if exchange is not None and event.text:
            exchange.append(event.text)
            self.query_one(Transcript).follow()
        stats = self.runs.get(event.run_id)
        if stats is not None and event.sequence >= 0:
            stats.tokens += 1
            if stats.first_token is None:
                stats.first_token = now
            stats.last_token = now
        self._refresh_status()

    def _finished(self, result: RunResult, now: float) -> None:
        self.results.append(result)
        self.prompt_active = False
        stats = self.runs.get(result.run_id)
        if stats is not None:
            stats.ended, stats.result = now, result
        exchange = self.exchanges.get(result.run_id)
        t = result.timings
        if result.outcome == "faulted":
            summary = Text(f"✖ faulted: {result.failure}", style="bold red")
        elif not result.tokens:
            summary = Text(
                f"{result.outcome}: {result.failure or 'stopped before the first token'}", style="grey58"
            )
        else:
            why = {"eos": "end of text", "max_tokens": "max tokens", "stopped": "stopped"}.get(
                result.stop_reason, result.outcome
            )
            summary = Text(
                f"{why} · {len(result.tokens)} tokens · first after {t.ttft_ms:.0f} ms · "
                f"{t.decode_tokens_per_s:.1f} tok/s",
                style="grey58",
            )
        if exchange is not None:
            exchange.finish(summary)
            self.query_one(Transcript).follow()
        line = Text(f"run {result.run_id:016x} {result.outcome}", style=summary.style)
        self._note(None, line + Text(f": {result.failure}" if result.failure else f": {summary.plain}"))
        if result.log_path:
            self._note(None, Text(f"run log {result.log_path}", style="grey58"))
        if result.outcome == "faulted":  # the session stops here; the session loop agrees
            self.session_phase = "Faulted"
            self.fault = result.failure
            self._mark_lost()

    # ---------------------------------------------------------- rendering

    def _note(self, stage: int | None, line: Text) -> None:
        prefix = Text(f"[{stage}] " if stage is not None else "[·] ", style="bold dodger_blue1")
        self.query_one(LogPane).add(stage, prefix + line)

    def _title_log(self) -> None:
        only = self.query_one(LogPane).only
        which = "all" if only is None else f"stage {only}"
        self.query_one(LogPane).border_title = f"Log · {which} (ctrl+f)"

    def _tick(self) -> None:
        if self.run_phase == "Running" or self.session_phase in ("Connecting", "Closing"):
            self._refresh_status()

    def _refresh(self) -> None:
        self._refresh_status()
        self.query_one(StageTable).show(self.rows, self.run_phase == "Running")

    def _refresh_status(self) -> None:
        now = self.now()
        view = StatusView(
            phase=self.session_phase or self.run_phase or "Connecting",
            run_id=self.run_id,
            model=self.model_line,
            fault=self.fault,
        )
        view.hint = self._hint(now)
        stats = self.latest
        if stats is not None:
            view.elapsed = stats.elapsed(now)
            view.tokens_per_s = stats.rate()
            view.tokens = stats.tokens
            view.last_run = stats.ended is not None
        if self.fault and self.session_phase == "Faulted":
            view.fault = f"{self.fault}  (ctrl+r starts again)"
        self.query_one(StatusBar).show(view)

    def _hint(self, now: float) -> str:
        n = len(self.rows)
        if self.session_phase == "Connecting":
            connected = sum(row.connected for row in self.rows)
            return f"{connected}/{n} agents up · {format_seconds(now - self.session_started)}"
        if self.session_phase == "Closing":
            return "stopping every stage…"
        if self.session_phase == "Faulted":
            return "the pipeline stopped"
        ready = sum(row.state == "Ready" for row in self.rows)
        if self.run_phase in ("Planning", "Provisioning", "WaitingReady"):
            if ready < n:
                return f"loading: {ready}/{n} stages ready"
            return "starting…" if self.prompt_active else "ready for a prompt"
        if self.run_phase == "Running":
            queued = self.prompts.qsize()
            return "generating · esc stops" + (f" · {queued} queued" if queued else "")
        return ""


def run_app(inventory: Inventory, log_dir: Any = None) -> int:
    """Run the TUI until the user quits; every stage is torn down on the way out."""

    async def main() -> int:
        app = GgufpipeApp(inventory, log_dir)
        try:
            code = await app.run_async()
        finally:
            await app._close_pipeline()  # a crash or signal must not leave agents behind
        return code if code is not None else 1

    return asyncio.run(main())
