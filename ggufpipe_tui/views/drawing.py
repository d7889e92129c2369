"""How session events reach the terminal UI's screen: the app's inbox and
its frames.

:class:`DrawnApp` is the half of :class:`~ggufpipe_tui.views.app.GgufpipeApp`
that draws (the app itself runs the session, the turns and the keys). The
pipeline's events come on the app's loop to :meth:`DrawnApp._received`: every
one goes to the inbox in order, and each is handled by the app's ``_handle``
(the view state's reducer and the session's bookkeeping). Tokens, a step's
numbers and log lines (:data:`STREAMS`) are drawn at most
:data:`FRAME_SECONDS` apart however fast they come (further apart where the
frames would take more than :data:`FRAME_BUDGET` of a core; while a run
streams, log lines wait for the next change drawn at once, at most
:data:`LOG_SECONDS_MAX`); every other event is drawn at once. While a frame
is due, the streams wait (in the pipeline's thread, then in the inbox) for
that frame instead of waking the app's loop each (:class:`Subscriber`,
views/threaded.py).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import deque

from textual.app import App
from textual.css.query import NoMatches
from textual.message import Message

from ggufpipe_tui.core.events import AgentLog, Event, StageStats, TokenStreamed
from ggufpipe_tui.views.entries import Exchange
from ggufpipe_tui.views.threaded import AppPipeline
from ggufpipe_tui.views.transcript import Transcript
from ggufpipe_tui.views.turns import Turns
from ggufpipe_tui.views.viewstate import ViewState
from ggufpipe_tui.views.widgets import LogPane, StageTable, StatusBar, StatusView

#: Tokens are drawn at most this often: 5 frames a second, a few words a
#: frame at the speeds a reader follows. A frame costs Textual about 5 ms of
#: CPU in a real terminal beside the stages (2-3 ms alone), and on a machine
#: with fewer cores than stages every millisecond the view spends is taken
#: from them: at 10 frames a second the UI took 10-12 % of a core during a
#: decode, at 5 (with the panels below once a second) 6-7 %
#: (docs/performance.md, "The terminal UI").
FRAME_SECONDS = 1 / 5
#: The stage table, the status line and the log's new lines, while a run
#: streams: once a second, in the same frame as text (their numbers change
#: with every step; a frame that draws them besides the text costs twice one
#: that draws text alone, and a log line scrolls the whole log pane). A
#: change of a stage's state is drawn at once.
PANEL_SECONDS = 1.0
#: While a run streams, the log's new lines wait for its end (or any change
#: drawn at once: a notice, a state, a fault), at most this long: a line
#: scrolls the whole log pane and its scrollbar (5-11 ms of CPU, in a screen
#: update of its own after the line is drawn), and the lines a run logs come
#: at its start and its end.
LOG_SECONDS_MAX = 5.0
#: While text streams the UI's thread spends at most this share of one core:
#: a frame that cost more than its share puts the next one off (up to
#: :data:`FRAME_SECONDS_MAX`). Every millisecond a frame takes on a machine
#: whose cores the stages fill is taken from them: on 2 cores the frames were
#: nearly all the CPU the TUI spent beyond headless while a reply streamed
#: (docs/performance.md, "The terminal UI"). From one frame to the
#: next the thread spends 4-11 ms there (a frame that scrolls redraws every
#: line of the transcript and its scrollbar), so the frames come 0.2-0.55 s
#: apart (median 0.3); where they are cheaper (a faster machine, a smaller
#: window) :data:`FRAME_SECONDS` apart.
FRAME_BUDGET = 0.02
#: The longest wait for a frame while text streams, however costly frames are.
FRAME_SECONDS_MAX = 1.0

#: Events that change only what the next frame shows (the streams).
STREAMS = (TokenStreamed, StageStats, AgentLog)


class PipelineEvent(Message):
    """A session event, handled as it comes (the tests and benchmarks post them)."""

    def __init__(self, event: Event, session: int) -> None:
        super().__init__()
        self.event = event
        self.session = session


class PipelineEvents(Message):
    """Session events wait in the app's inbox: handle them."""


class Subscriber:
    """A session's events, to the app (``DrawnApp._received``). A threaded
    pipeline asks ``defer`` on its own thread: the streams of the current
    session that come while a frame is due wait there, without waking the
    app's loop, until the frame fetches them (views/threaded.py)."""

    def __init__(self, app: DrawnApp, session: int) -> None:
        self.app = app
        self.session = session

    def __call__(self, event: Event) -> None:
        self.app._received(event, self.session)

    def defer(self, event: Event) -> bool:
        app = self.app
        return app._fetch_due and isinstance(event, STREAMS) and self.session == app.state.session


class DrawnApp(App[int]):
    """The inbox and the frames of the app (see the module's doc). A
    subclass sets ``state``, ``pipeline`` and ``turns`` and handles one event
    in ``_handle``."""

    state: ViewState
    pipeline: AppPipeline | None
    turns: Turns

    def __init__(self) -> None:
        super().__init__()
        self._widgets: dict[int, Exchange] = {}
        self._frame_due = False
        self._fetch_due = False  # the frame due fetches the pipeline's streams (read by its thread)
        self._panels_at = 0.0
        self._log_since: float | None = None  # when the panels first left a log line waiting
        self._frame_at = (0.0, 0.0)  # when the last frame began: (monotonic, this thread's CPU time)
        # This thread's CPU time between each two of the last frames (0: not streaming).
        self._frame_costs: deque[float] = deque([0.0] * 3, maxlen=3)
        self._drawn_at_once = False  # something was drawn at once since the last frame
        self._inbox: deque[tuple[Event, int, float]] = deque()  # events not handled yet, in order
        self._inbox_posted = False  # a PipelineEvents message is on its way

    def now(self) -> float:
        return time.monotonic()

    def _handle(self, event: Event, session: int, now: float) -> None:
        """One session event (``now``: when it came)."""
        raise NotImplementedError

    # ------------------------------------------------------------- inbox

    def _received(self, event: Event, session: int) -> None:
        """Called by the pipeline on the app's own loop: never touch
        widgets here. Every event goes to the inbox in order; a message
        asks for it to be handled, except that the streams (a token, a
        step's numbers, a log line) wait for the frame already due, which
        handles the inbox first: a Textual message costs a dispatch, and
        tokens come a few milliseconds apart."""
        self._inbox.append((event, session, self.now()))
        if self._inbox_posted or (self._frame_due and isinstance(event, STREAMS)):
            return
        self._inbox_posted = True
        self.post_message(PipelineEvents())

    def on_pipeline_events(self, message: PipelineEvents) -> None:
        self._inbox_posted = False
        self._handle_inbox()

    def on_pipeline_event(self, message: PipelineEvent) -> None:
        self._handle_inbox()
        self._handle(message.event, message.session, self.now())

    def _handle_inbox(self) -> None:
        inbox = self._inbox
        while inbox:
            self._handle(*inbox.popleft())

    # ---------------------------------------------------------- rendering

    def _draw_soon(self) -> None:
        if not self._frame_due:
            self._frame_due = self._fetch_due = True
            self.set_timer(self._frame_delay(), self._draw_frame)

    def _frame_delay(self) -> float:
        """How long the next frame waits: :data:`FRAME_SECONDS`, or longer
        where what a frame costs this thread (from one frame to the next: the
        screen update comes after the frame; the median of the last three,
        so that a one-off such as a layout pass does not count) would be over
        :data:`FRAME_BUDGET` of the time from the last frame to the next."""
        if not FRAME_BUDGET or self._drawn_at_once:  # a run that begins owes nothing
            return FRAME_SECONDS
        cost = statistics.median(self._frame_costs)
        elapsed = time.monotonic() - self._frame_at[0]
        return max(FRAME_SECONDS, min(FRAME_SECONDS_MAX, cost / FRAME_BUDGET) - elapsed)

    def _frame_began(self) -> None:
        wall, cpu = time.monotonic(), time.thread_time()
        last_wall, last_cpu = self._frame_at
        # After a pause in the stream, or a change drawn at once (a run that
        # begins), it is not what the frames cost: no wait for it.
        if wall - last_wall < FRAME_SECONDS_MAX + FRAME_SECONDS and not self._drawn_at_once:
            self._frame_costs.append(cpu - last_cpu)
        else:
            self._frame_costs.extend([0.0] * 3)
        self._drawn_at_once = False
        self._frame_at = (wall, cpu)

    def _draw_frame(self) -> None:
        """A frame of the streams: new text; while a run streams, the stage
        table, the status line and the log only every PANEL_SECONDS."""
        self._frame_began()
        try:
            # The streams that waited in the pipeline's thread, then in the
            # inbox, for this frame (they ask for no other). From here a
            # stream wakes the app again, and asks for the next frame.
            self._fetch_due = False
            fetch = getattr(self.pipeline, "fetch", None)
            if fetch is not None:
                fetch()
            with contextlib.suppress(NoMatches):  # the app is going
                self._handle_inbox()
        finally:
            self._frame_due = False
        with contextlib.suppress(NoMatches):
            self._draw_text()
            if self._panels_due() or not self.state.running:
                self._draw_panels()

    def _draw(self) -> None:
        """Bring the whole screen up to the view state now."""
        self._drawn_at_once = True
        self._draw_text()
        self._draw_panels(at_once=True)

    def _panels_due(self) -> bool:
        return time.monotonic() - self._panels_at >= PANEL_SECONDS

    def _draw_panels(self, at_once: bool = False) -> None:
        """The stage table, the status line and the log's new lines (a line
        scrolls the whole log pane: drawn with the panels, not with each
        frame of text; while a run streams, with a change drawn at once, the
        run's end, or :data:`LOG_SECONDS_MAX` on)."""
        now = self._panels_at = time.monotonic()
        state = self.state
        if state.log:
            if self._log_since is None:
                self._log_since = now
            if at_once or not state.running or now - self._log_since >= LOG_SECONDS_MAX:
                self._log_since = None
                log = self.query_one(LogPane)
                while state.log:
                    stage, line = state.log.popleft()
                    log.add(stage, line)
        if state.dirty:
            state.dirty = False
            self.query_one(StageTable).show(state.rows, state.running)
        self._draw_status()

    def _draw_text(self) -> None:
        state = self.state
        transcript = self.query_one(Transcript)
        for view in state.mount:
            transcript.add(self._widgets.setdefault(id(view), Exchange(view)))
        state.mount.clear()
        for view in state.unmount:  # scrolled out of a long session
            gone = self._widgets.pop(id(view), None)
            if gone is not None:
                transcript.discard(gone)
        state.unmount.clear()
        synced = []
        for view in state.touched.values():
            shown = self._widgets.get(id(view))
            if shown is not None:
                shown.sync()
                synced.append(shown)
        state.touched.clear()
        transcript.update(synced)

    def _title_log(self) -> None:
        only = self.query_one(LogPane).only
        which = "all" if only is None else f"stage {only}"
        self.query_one(LogPane).border_title = f"Log · {which} (ctrl+f)"

    def _tick(self) -> None:
        if self.pipeline is not None:
            self.state.queued = self.turns.waiting()
        busy = self.state.running or self.state.session_phase in ("Connecting", "Closing")
        # While tokens stream the frames draw the panels too: one screen
        # update, not two (each costs milliseconds of compositing).
        if busy and self._panels_due() and not self._frame_due:
            with contextlib.suppress(NoMatches):  # the app is going
                self._draw_panels()

    def _draw_status(self) -> None:
        state = self.state
        now = self.now()
        view = StatusView(
            phase=state.session_phase or state.run_phase or "Connecting",
            run_id=state.run_id,
            model=state.model_line,
            fault=state.fault,
        )
        view.hint = state.hint(now)
        if view.hint == "ready for a prompt" and self.turns.hint():
            view.hint += f" · {self.turns.hint()}"
        stats = state.latest
        if stats is not None:
            view.elapsed = stats.elapsed(now)
            view.tokens_per_s = stats.rate()
            view.tokens = stats.tokens
            view.last_run = stats.ended is not None
        if state.fault and state.session_phase == "Faulted":
            view.fault = f"{state.fault}  (ctrl+r starts again)"
        self.query_one(StatusBar).show(view)
