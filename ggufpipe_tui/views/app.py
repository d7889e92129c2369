"""``ggufpipe-tui INVENTORY``: the terminal UI.

The app is a view of one :class:`~ggufpipe_tui.session.pipeline.Pipeline`,
run on an event loop of its own thread (:mod:`ggufpipe_tui.views.threaded`:
objects relayed through the orchestrator never wait for a frame being
drawn): the pipeline's events arrive as Textual messages, :class:`ViewState` (a
reducer, no widgets) turns them into what the screen shows, and the app draws
that: the status line, the stage table, the streamed replies, the log. How
events reach the screen (the inbox, frames at most
:data:`~ggufpipe_tui.views.drawing.FRAME_SECONDS` apart for the streams,
every other event at once) is :class:`~ggufpipe_tui.views.drawing.DrawnApp`'s,
which this app extends with the session, the turns and the keys.

The session policy is the pipeline's (``prepare_ahead``: a run stays
provisioned and loaded so a prompt runs the moment it is typed; prompts wait
their turn; a fault stops the session). The app submits prompts and shows
what happens. A fault ends the session with its one reason on screen;
``ctrl+r`` closes the pipeline and starts a fresh one, and prompts that never
ran are given to it.

Prompts are the turns of a conversation (:mod:`ggufpipe_tui.views.turns`):
each is sent with every kept turn before it, so a typed prompt is submitted
when the one before has ended. ``ctrl+n`` starts a new conversation.

For tests and screenshots the app also replays a scripted list of events
instead of starting a pipeline (``script=``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.reactive import var
from textual.widgets import Input, Static
from textual.worker import Worker, WorkerCancelled, WorkerFailed, WorkerState

from ggufpipe_agent.errors import GgufpipeError
from ggufpipe_tui.core.events import (
    AgentLog,
    Event,
    ModelInspected,
    Notice,
    PlanMade,
    PromptAssigned,
    RunFinished,
    RunResult,
)
from ggufpipe_tui.core.inventory import Inventory
from ggufpipe_tui.session.runs import ContextOverflow
from ggufpipe_tui.session.stages import PipelineError
from ggufpipe_tui.views.drawing import STREAMS, DrawnApp, Subscriber
from ggufpipe_tui.views.priority import lower_ui
from ggufpipe_tui.views.rows import ExchangeView, StageRow
from ggufpipe_tui.views.threaded import AppHandle, AppPipeline, ThreadedPipeline
from ggufpipe_tui.views.transcript import Transcript
from ggufpipe_tui.views.turns import Turn, Turns
from ggufpipe_tui.views.viewstate import ViewState
from ggufpipe_tui.views.widgets import LogPane, StageTable, StatusBar, SteadyFooter

PipelineFactory = Callable[..., AppPipeline]
WELCOME = "Type a prompt below and press Enter. The stages load while you type."
#: A script item: the session gave this prompt to run ``run_id``.
UserPrompt = PromptAssigned
#: A script item: an event, a prompt, or a float that sets the scripted clock.
ScriptItem = Event | float


class GgufpipeApp(DrawnApp):
    CSS_PATH = "app.tcss"
    TITLE = "ggufpipe"
    ENABLE_COMMAND_PALETTE = False
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+n", "new_conversation", "New chat"),
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
        pipeline_factory: PipelineFactory = ThreadedPipeline,
        script: Sequence[ScriptItem] | None = None,
    ) -> None:
        super().__init__()
        self.inventory = inventory
        self.log_dir = log_dir
        self.pipeline_factory = pipeline_factory
        self.script = list(script) if script is not None else None
        self._script_now = 0.0
        self.state = ViewState(inventory)
        self.pipeline = None
        self.active: AppHandle | None = None  # the handle of the run the prompt went to
        self.turns = Turns(raw=not inventory.run.chat)  # typed prompts, as conversation turns
        self.quitting = False
        self._pipeline_closes: set[asyncio.Future[None]] = set()

    # The view state, read by the header, the tests and whoever drives the app.
    @property
    def rows(self) -> list[StageRow]:
        return self.state.rows

    @property
    def run_id(self) -> int | None:
        return self.state.run_id

    @property
    def run_phase(self) -> str | None:
        return self.state.run_phase

    @property
    def session_phase(self) -> str | None:
        return self.state.session_phase

    @property
    def session(self) -> int:
        return self.state.session

    @property
    def fault(self) -> str:
        return self.state.fault

    @property
    def model_line(self) -> str:
        return self.state.model_line

    @property
    def results(self) -> list[RunResult]:
        return list(self.state.results)

    @property
    def agent_pids(self) -> dict[int, int]:
        return self.state.agent_pids

    # ------------------------------------------------------------- layout

    def compose(self) -> ComposeResult:
        yield StatusBar(id="status")
        yield StageTable(self.state.rows, id="stages")
        with Vertical(id="body"):
            yield Transcript(WELCOME, id="transcript")
            yield LogPane(id="log")
        with Horizontal(id="prompt-row"):
            yield Static("›", id="prompt-mark")
            yield Input(placeholder="a prompt; Enter runs it", id="prompt")
        yield SteadyFooter()

    def on_mount(self) -> None:
        self.query_one("#stages").border_title = "Stages"
        self.query_one("#transcript").border_title = "Output"
        self._title_log()
        prompt = self.query_one("#prompt", Input)
        prompt.focus()
        # A scripted app is a screenshot: a blinking cursor would make it
        # depend on the moment it is taken.
        prompt.cursor_blink = self.script is None
        self.set_interval(0.25, self._tick)
        self.state.session_started = self.now()
        if self.script is not None:
            self._play_script()
        else:
            self.start_session()
        self._draw()

    def now(self) -> float:
        return self._script_now if self.script is not None else super().now()

    def _play_script(self) -> None:
        assert self.script is not None
        for item in self.script:
            if isinstance(item, float | int):
                self._script_now = float(item)
            else:
                self.state.apply(item, self.now())
        self.prompt_active = self.state.prompt_active

    # ------------------------------------------------------------ session

    def _subscriber(self, session: int) -> Subscriber:
        return Subscriber(self, session)

    def start_session(self) -> None:
        previous = next((w for w in self.workers if w.group == "session" and not w.is_finished), None)
        if previous is not None:
            previous.cancel()
        cut = self.turns.new_session()
        if cut is not None and not cut.view.finished:
            said = "stopped by the restart: this turn is left out of the conversation"
            self._say(cut.view, Text(said, style="grey58"))
        self.state.tickets.clear()  # the new session gives them new tickets
        self.active = None
        self.state.new_session(self.now())
        self._draw()
        self.run_session(self.state.session, previous)

    @work(exclusive=False, group="session", exit_on_error=False)
    async def run_session(self, session: int, previous: Worker[Any] | None) -> None:
        if previous is not None:
            with contextlib.suppress(WorkerCancelled, WorkerFailed):
                await previous.wait()
        await self._close_pipeline()
        starting = f"session {session}: starting {len(self.state.rows)} agents"
        self.state.note(None, Text(starting, style="bold"))
        pipeline = self.pipeline_factory(
            self.inventory, self._subscriber(session), log_dir=self.log_dir, prepare_ahead=True
        )
        self.pipeline = pipeline
        try:
            await pipeline.start()
        except GgufpipeError as error:
            self._end_session(session, str(error), lost=False)
            return
        self._end_session(session, await pipeline.wait_stopped() or "the run ended unexpectedly")

    def _feed(self) -> None:
        """Submit the next typed prompt if the one before has ended."""
        turn = self.turns.feed(self.pipeline)
        if turn is not None:
            assert turn.handle is not None
            self.state.tickets[turn.handle.ticket] = turn.view
            self.run_worker(self._watch(turn), group="turns", exit_on_error=False)

    async def _watch(self, turn: Turn) -> None:
        """A prompt that fails without a run: refused (it would overflow the
        context, or its template failed) or the session stopped first."""
        assert turn.handle is not None
        try:
            await turn.handle.result()
            return
        except PipelineError as error:
            said = self.turns.failed(turn, error)
            if not turn.started:
                self.state.tickets.pop(turn.handle.ticket, None)
            if said is not None:
                self._say(turn.view, said)
                if isinstance(error, ContextOverflow):
                    self.notify(said.plain.removeprefix("not run: "), severity="warning", timeout=8)
                    prompt = self.query_one("#prompt", Input)
                    if not prompt.value:
                        prompt.value = turn.view.prompt
        self._feed()
        self._draw()

    def _say(self, view: ExchangeView, summary: Text) -> None:
        """End an exchange that got no RunFinished with ``summary``."""
        view.finished, view.summary = True, summary
        self.state.show(view)
        self.state.touched[id(view)] = view

    def _end_session(self, session: int, reason: str, lost: bool = True) -> None:
        if session != self.state.session:
            return
        self.state.end_session(reason)
        self.prompt_active = False
        if lost:
            self._mark_lost()
        self._draw()

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        worker = event.worker
        if worker.group == "session" and event.state is WorkerState.ERROR:
            error = worker.error
            self._end_session(self.state.session, f"internal error: {type(error).__name__}: {error}")

    async def _close_pipeline(self) -> None:
        """Close the pipeline and wait for every close under way. A close is
        shielded: cancelling the worker that waits on it (a restart, then a
        quit) must not leave agents half torn down."""
        pipeline, self.pipeline = self.pipeline, None
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
        if self.pipeline is None:
            return
        for link in self.pipeline.links:
            if not link.alive():
                # The exit status only: the stderr tail is in the log pane already.
                self.state.mark_lost(link.stage, link.exit_detail().split("; agent stderr:")[0].strip())

    # ------------------------------------------------------------ actions

    def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        event.input.clear()
        self.state.queued = self.turns.waiting()
        view = self.state.submitted(text)
        self.turns.add(view)
        self._feed()
        if self.state.session_phase == "Faulted":
            self.notify(
                "The pipeline faulted: ctrl+r starts a fresh one, then this prompt runs.", severity="warning"
            )
        elif not view.shown:
            self.notify(f"Queued ({self.turns.waiting()} waiting): it runs when the current prompt is done.")
        self._draw()

    def watch_prompt_active(self, active: bool) -> None:
        """While a prompt runs, the prompt's cursor stays on instead of
        blinking: each blink is a screen update of its own, two a second,
        which on a machine with few cores is taken from the stages."""
        with contextlib.suppress(NoMatches):
            self.query_one("#prompt", Input).cursor_blink = self.script is None and not active

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop":  # shown dimmed while nothing generates
            return True if self.prompt_active else None
        return True

    def action_stop(self) -> None:
        handle = self.active
        if handle is None or not self.prompt_active or handle.done:
            self.notify("Nothing is generating.", timeout=2)
            return
        self.state.note(None, Text("stop requested by the user", style="bold"))
        self._draw()
        handle.stop("stopped by the user")

    def action_new_conversation(self) -> None:
        conversation = self.turns.new_conversation()
        self._draw()  # what is shown so far stays above the line
        line = f"── new conversation ({conversation.number}): the next prompt starts fresh ──"
        self.query_one(Transcript).divide(Text(line, style="bold grey58"))
        self.state.note(None, Text(f"conversation {conversation.number}: new", style="bold"))
        self._draw()

    def action_filter_log(self) -> None:
        log = self.query_one(LogPane)
        choices: list[int | None] = [None, *range(len(self.state.rows))]
        log.show_only(choices[(choices.index(log.only) + 1) % len(choices)])
        self._title_log()

    def action_restart(self) -> None:
        if self.quitting or self.script is not None:
            return
        self.state.note(None, Text("restart: closing the pipeline, starting a fresh one", style="bold"))
        self.start_session()

    async def action_quit(self) -> None:
        if self.quitting:  # a second ctrl+q leaves the screen now; on_unmount still ends the stages
            self.exit(0)
            return
        self.quitting = True
        self.state.session_phase = "Closing"
        self._draw()
        self.run_worker(self._close_and_exit(), group="quit", exit_on_error=False)

    async def _close_and_exit(self) -> None:
        for worker in [w for w in self.workers if w.group == "session"]:
            worker.cancel()
            with contextlib.suppress(WorkerCancelled, WorkerFailed):
                await worker.wait()
        await self._close_pipeline()
        self.exit(0)

    # ------------------------------------------------------------- events

    def _handle(self, event: Event, session: int, now: float) -> None:
        """One session event (``now``: when it came)."""
        if session != self.state.session:
            if isinstance(event, AgentLog | Notice):  # an old session's last words
                self.state.apply(event, now)
                self._draw_soon()
            return
        turn = self.turns.in_flight
        if isinstance(event, PromptAssigned) and turn is not None and turn.handle is not None:
            if turn.handle.ticket == event.ticket:
                self.active = turn.handle
        elif isinstance(event, PlanMade):
            self.turns.context = event.plan.model.max_seq_len
        self.state.apply(event, now)
        if isinstance(event, RunFinished):
            self.active = None
            said = self.turns.ended(event.result)
            view = self.state.exchanges.get(event.result.run_id)
            if said and view is not None:
                view.summary = (view.summary or Text("")) + Text(f" · {said}", style="grey58 italic")
                self.state.touched[id(view)] = view
            self._feed()
            if event.result.outcome == "faulted":
                self._mark_lost()
        elif isinstance(event, ModelInspected):
            self.turns.facts = event.facts
            if not self.turns.chat:
                self.state.note(None, Text(self.turns.no_chat_reason(), style="yellow"))
            self._feed()
        self.prompt_active = self.state.prompt_active
        if isinstance(event, STREAMS):
            self._draw_soon()  # the streams: coalesced into frames
        else:
            self._draw()


def run_app(inventory: Inventory, log_dir: Any = None) -> int:
    """Run the TUI until the user quits; every stage is torn down on the way out."""

    async def main() -> int:
        # Below the stages (views/priority.py): this thread, and the
        # terminal driver's threads the app starts, not the pipeline's.
        lower_ui()
        app = GgufpipeApp(inventory, log_dir)
        try:
            code = await app.run_async()
        finally:
            await app._close_pipeline()  # a crash or signal must not leave agents behind
        return code if code is not None else 1

    return asyncio.run(main())
