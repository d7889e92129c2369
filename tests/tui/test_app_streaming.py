"""How the TUI keeps up with a fast stream, without agents: a reply of many
short lines is drawn whole and in order, in a few frames, not one per token,
and without a layout pass of the screen; the transcript follows the newest
text unless scrolled up, wraps again on a resize, and its text can be
selected; the pipeline thread's events reach the app's loop in order, many
per wake-up.
(What this costs in CPU is measured by benchmarks/bench_tui.py, not here.)"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator

from textual.pilot import Pilot
from textual.selection import Selection
from textual.widgets import Input

from ggufpipe_agent.wire.protocol import StepCounters
from ggufpipe_tui.core.events import AgentLog, Event, Notice, StageStateChanged, StageStats, TokenStreamed
from ggufpipe_tui.views.app import GgufpipeApp
from ggufpipe_tui.views.drawing import (
    FRAME_BUDGET,
    FRAME_SECONDS,
    FRAME_SECONDS_MAX,
    PANEL_SECONDS,
    PipelineEvent,
    PipelineEvents,
)
from ggufpipe_tui.views.rows import StageRow
from ggufpipe_tui.views.threaded import ThreadedPipeline
from ggufpipe_tui.views.transcript import Transcript
from ggufpipe_tui.views.widgets import LogPane, StageTable
from tests.support.app import REPLY, RUN_ID, inventory, running


def scripted_app() -> GgufpipeApp:
    """The app over a scripted pipeline whose run streams REPLY."""
    inv = inventory()
    return GgufpipeApp(inv, script=running(inv))


@contextlib.asynccontextmanager
async def running_app(size: tuple[int, int]) -> AsyncIterator[tuple[GgufpipeApp, Pilot[int]]]:
    """:func:`scripted_app` started on a screen of ``size``, settled."""
    app = scripted_app()
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        yield app, pilot


async def drawn(app: GgufpipeApp) -> None:
    """Until the frames have drawn what came: a frame comes FRAME_SECONDS
    after the stream, or later where frames cost more than their share of
    the CPU (a loaded machine), never more than FRAME_SECONDS_MAX."""
    await asyncio.sleep(FRAME_SECONDS)
    deadline = time.monotonic() + 2 * FRAME_SECONDS_MAX + 1
    while (app._frame_due or app._inbox) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.01)


def counted_layouts(app: GgufpipeApp) -> list[int]:
    """Count the screen's layout passes from now on: the list's one item."""
    layouts = [0]
    laid_out = app.screen._refresh_layout

    def counted(*args: object, **kwargs: object) -> None:
        layouts[0] += 1
        laid_out(*args, **kwargs)  # type: ignore[arg-type]

    app.screen._refresh_layout = counted  # type: ignore[method-assign]
    return layouts


async def stream(app: GgufpipeApp, seconds: float, step: int = 0) -> int:
    """Tokens 20 ms apart for ``seconds``, as a pipeline sends them; returns the next step."""
    emit = app._subscriber(app.session)
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        emit(TokenStreamed(RUN_ID, 100 + step, 100 + step, " x"))
        step += 1
        await asyncio.sleep(0.02)
    return step


def post(app: GgufpipeApp, *pieces: str, sequence: int = 100) -> int:
    for piece in pieces:
        app.post_message(PipelineEvent(TokenStreamed(RUN_ID, sequence, sequence, piece), app.session))
        sequence += 1
    return sequence


async def test_a_stream_of_short_lines_is_drawn_whole_without_laying_the_screen_out() -> None:
    """A reply of many short lines, as a count would come: every line on
    screen in order, in a few frames, the newest in view, and no layout pass
    of the screen for any of it (the transcript's line API takes new lines),
    nor for the log lines, stage numbers and states that come meanwhile."""
    app = scripted_app()
    lines = 100
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        transcript = app.query_one(Transcript)
        await pilot.pause()
        post(app, *[f"{number}\n" for number in range(40)])  # the scrollbar comes (a layout pass)
        for number in range(40):  # and the log's
            app.post_message(PipelineEvent(AgentLog(0, "gpu-a", f"INFO line {number}"), app.session))
        await drawn(app)
        await pilot.pause()
        draws = 0
        draw_text = app._draw_text

        def counted() -> None:
            nonlocal draws
            draws += 1
            draw_text()

        app._draw_text = counted  # type: ignore[method-assign]
        layouts = counted_layouts(app)
        for number in range(40, lines):
            post(app, f"{number}", "\n", sequence=100 + 2 * number)
            if number % 10 == 0:  # the log and the stage table's numbers go on meanwhile
                stage = number // 10 % 3
                counters = StepCounters(number, 3.1, 3.1 * number, 100 * number, 100 * number)
                for event in (
                    AgentLog(stage, "gpu-a", f"INFO step {number}"),
                    StageStats(RUN_ID, stage, counters),
                ):
                    app.post_message(PipelineEvent(event, app.session))
            if number == 50:  # a stage's state: drawn at once, the table stays as tall
                app.post_message(PipelineEvent(StageStateChanged(RUN_ID, 1, "Executing"), app.session))
        await drawn(app)
        await pilot.pause()
        exchange = transcript.exchanges[0]
        expected = "".join(REPLY) + "".join(f"{number}\n" for number in range(lines))
        assert exchange.text == expected and exchange.shown == expected
        shown = transcript.line_texts
        assert "\n".join(expected.split("\n")) in "\n".join(shown), "every line, in order"
        assert draws <= 4, f"{2 * lines} tokens drawn in {draws} frames (and one state change)"
        assert layouts[0] == 0, f"{layouts[0]} layout passes of the screen for streamed text"
        assert transcript.scroll_y == transcript.max_scroll_y > 0, "the newest text is in view"


async def test_the_streams_wait_in_the_inbox_for_their_frame_in_order() -> None:
    """Events from the pipeline's subscriber: tokens that come while a frame
    is due wait for it (no message each), anything else is handled at once,
    after the tokens before it."""
    async with running_app((120, 40)) as (app, pilot):
        messages = 0
        handled = app.on_pipeline_events

        def counted(message: PipelineEvents) -> None:
            nonlocal messages
            messages += 1
            handled(message)

        app.on_pipeline_events = counted  # type: ignore[method-assign]
        emit = app._subscriber(app.session)
        for number in range(200):
            emit(TokenStreamed(RUN_ID, 100 + number, 100 + number, f" {number}"))
            if number == 100:
                emit(Notice("info", "halfway"))
            await asyncio.sleep(0.002)  # tokens a few milliseconds apart, as a pipeline sends them
        await drawn(app)
        await pilot.pause()
        exchange = app.query_one(Transcript).exchanges[0]
        assert exchange.text == "".join(REPLY) + "".join(f" {number}" for number in range(200))
        assert messages < 40, f"200 tokens took {messages} messages"
        at = exchange.appended_at
        assert at == sorted(at) and at[-1] - at[len(REPLY)] > 0.2, "each token keeps the time it came"
        logged = [line.plain for _, line in app.query_one(LogPane).entries]
        assert any("halfway" in line for line in logged)


async def test_scrolled_up_the_transcript_stays_and_text_can_be_selected() -> None:
    async with running_app((80, 24)) as (app, pilot):
        transcript = app.query_one(Transcript)
        sequence = post(app, *[f"line {number}\n" for number in range(40)])
        await drawn(app)
        await pilot.pause()
        assert transcript.scroll_y == transcript.max_scroll_y > 0
        transcript.scroll_to(y=0, animate=False, immediate=True)
        post(app, *[f"more {number}\n" for number in range(10)], sequence=sequence)
        await drawn(app)
        await pilot.pause()
        assert transcript.scroll_y == 0, "the view followed the stream while scrolled up"
        assert transcript.max_scroll_y > 0
        # Selection: what a mouse drag over the lines selects is the text, line breaks where the text has them.
        text, _ = transcript.get_selection(Selection(None, None)) or ("", "")
        reply = (
            "".join(REPLY)
            + "".join(f"line {n}\n" for n in range(40))
            + "".join(f"more {n}\n" for n in range(10))
        )
        assert f"› Write a haiku about pipelines  run {RUN_ID:016x}\n{reply}" in text
        first = transcript.render_line(0)
        assert "Write a haiku" in first.text
        assert [segment.style.meta.get("offset") for segment in first if segment.text][0] == (0, 0)
        # Back at the bottom, it follows again.
        transcript.scroll_end(animate=False, immediate=True)
        post(app, "last\n", sequence=sequence + 10)
        await drawn(app)
        await pilot.pause()
        assert transcript.scroll_y == transcript.max_scroll_y and transcript.line_texts[-4:] == [
            "last",
            "",
            "",
            "",
        ]


async def test_a_resize_wraps_every_line_again() -> None:
    async with running_app((80, 24)) as (app, pilot):
        transcript = app.query_one(Transcript)
        post(app, " word" * 60)
        await drawn(app)
        await pilot.pause()
        narrow = len(transcript.line_texts)
        assert max(len(line) for line in transcript.line_texts) <= transcript.scrollable_content_region.width
        await pilot.resize_terminal(160, 48)
        await pilot.pause()
        await pilot.pause()
        assert len(transcript.line_texts) < narrow
        assert max(len(line) for line in transcript.line_texts) <= transcript.scrollable_content_region.width


class WakeUps:
    """Counts the wake-ups of the app's loop from the pipeline's thread."""

    def __init__(self, pipeline: ThreadedPipeline) -> None:
        self.count = 0
        deliver = pipeline._deliver

        def counted() -> None:
            self.count += 1
            deliver()

        pipeline._deliver = counted  # type: ignore[method-assign]


async def test_events_cross_from_the_pipeline_thread_in_order_many_per_wake_up() -> None:
    received: list[Event] = []
    pipeline = ThreadedPipeline(inventory(), received.append)
    wake_ups = WakeUps(pipeline)
    try:
        count = 2000

        def post_all() -> None:
            for number in range(count):
                pipeline._post(Notice("info", str(number)))

        thread = threading.Thread(target=post_all)
        thread.start()
        thread.join()
        for _ in range(100):
            if len(received) == count:
                break
            await asyncio.sleep(0.01)
        assert [event.text for event in received if isinstance(event, Notice)] == [
            str(number) for number in range(count)
        ]
        assert wake_ups.count < count / 4, f"{count} events took {wake_ups.count} wake-ups of the app's loop"
    finally:
        await pipeline.close()


async def test_streams_the_subscriber_defers_wait_for_a_fetch_without_waking_the_app() -> None:
    """Events the subscriber lets wait (the streams while a frame is due)
    wake nothing; a fetch delivers them, and an event that cannot wait takes
    them along first, in order."""
    received: list[Event] = []

    class Deferring:
        holding = True

        def __call__(self, event: Event) -> None:
            received.append(event)

        def defer(self, event: Event) -> bool:
            return self.holding and isinstance(event, TokenStreamed)

    subscriber = Deferring()
    pipeline = ThreadedPipeline(inventory(), subscriber)
    wake_ups = WakeUps(pipeline)

    def post(*events: Event) -> None:
        thread = threading.Thread(target=lambda: [pipeline._post(event) for event in events])
        thread.start()
        thread.join()

    def texts() -> list[str]:
        return [event.text if isinstance(event, TokenStreamed | Notice) else "?" for event in received]

    try:
        post(*[TokenStreamed(RUN_ID, n, n, f"t{n}") for n in range(50)])
        await asyncio.sleep(0.1)
        assert received == [] and wake_ups.count == 0, "deferred tokens woke the app's loop"
        pipeline.fetch()
        assert texts() == [f"t{n}" for n in range(50)]
        received.clear()
        wake_ups.count = 0
        post(*[TokenStreamed(RUN_ID, n, n, f"u{n}") for n in range(10)], Notice("info", "end"))
        for _ in range(100):
            if len(received) == 11:
                break
            await asyncio.sleep(0.01)
        assert texts() == [f"u{n}" for n in range(10)] + ["end"]
        assert wake_ups.count == 1
    finally:
        await pipeline.close()


async def test_the_app_defers_the_streams_of_its_session_while_a_frame_is_due() -> None:
    async with running_app((120, 40)) as (app, pilot):
        subscriber = app._subscriber(app.session)
        old = app._subscriber(app.session - 1)
        token = TokenStreamed(RUN_ID, 500, 500, " x")
        assert not subscriber.defer(token), "no frame is due: a token wakes the app"
        subscriber(token)  # asks for a frame, once its message is handled
        for _ in range(50):
            if app._frame_due:
                break
            await asyncio.sleep(0.001)
        assert app._frame_due and subscriber.defer(token)
        assert not subscriber.defer(Notice("info", "at once")) and not old.defer(token)
        await drawn(app)
        await pilot.pause()
        assert not app._frame_due and not subscriber.defer(token), "the frame fetched: streams wake again"
        assert app.query_one(Transcript).exchanges[0].text.endswith(" x")


async def test_the_stage_table_is_drawn_at_most_once_a_second_while_streaming_and_a_state_at_once() -> None:
    """With a frame (a frame that costs more than its share waits longer:
    frames come at most FRAME_SECONDS_MAX apart)."""
    async with running_app((120, 40)) as (app, pilot):
        table = app.query_one(StageTable)
        shows = 0
        shown = table.show

        def counted(rows: list[StageRow], running: bool) -> None:
            nonlocal shows
            shows += 1
            shown(rows, running)

        table.show = counted  # type: ignore[method-assign]
        emit = app._subscriber(app.session)
        started = time.monotonic()
        step = 20
        seconds = PANEL_SECONDS + 2 * FRAME_SECONDS_MAX
        while time.monotonic() - started < seconds:
            emit(TokenStreamed(RUN_ID, 100 + step, 100 + step, " x"))
            emit(StageStats(RUN_ID, step % 3, StepCounters(step, 3.1, 3.1 * step, 100, 100)))
            step += 1
            await asyncio.sleep(0.02)
        assert 1 <= shows <= seconds / PANEL_SECONDS + 1, f"the table was drawn {shows} times in {seconds} s"
        shows = 0
        emit(StageStateChanged(RUN_ID, 1, "Executing"))
        await pilot.pause()
        assert shows == 1 and table.rows[1].state == "Executing", "a state is drawn at once"


async def test_a_mouse_drag_selects_the_text_under_it() -> None:
    async with running_app((80, 24)) as (app, pilot):
        transcript = app.query_one(Transcript)
        # Row 0 is the pane's border, column 0 its padding: from "Write" through the
        # reply's 10th character (the cell under the mouse, as in a Static).
        await pilot.mouse_down(transcript, offset=(3, 1))
        await pilot.hover(transcript, offset=(10, 2))
        await pilot.mouse_up(transcript, offset=(10, 2))
        await pilot.pause()
        selected = app.screen.get_selected_text()
        assert selected == f"Write a haiku about pipelines  run {RUN_ID:016x}\nPipelines "


async def test_the_prompt_cursor_stays_on_while_a_prompt_runs() -> None:
    """A blink is a screen update of its own: none while a reply streams."""
    async with running_app((80, 24)) as (app, pilot):
        prompt = app.query_one("#prompt", Input)
        assert not prompt.cursor_blink, "a screenshot: no blink"
        app.script = None  # as a live session
        app.prompt_active = False
        app.prompt_active = True
        assert not prompt.cursor_blink
        app.prompt_active = False
        assert prompt.cursor_blink


def test_a_frame_that_costs_more_than_its_share_puts_the_next_one_off() -> None:
    """The UI's thread spends at most FRAME_BUDGET of a core on the frames
    while text streams: the next frame waits for the median cost of the last
    three over the budget (a one-off such as a layout pass does not count),
    never longer than FRAME_SECONDS_MAX; after a pause or a change drawn at
    once, nothing is owed."""
    app = scripted_app()
    app._frame_at = (time.monotonic(), 0.0)
    assert app._frame_delay() == FRAME_SECONDS, "nothing spent yet"
    cheap = FRAME_BUDGET * FRAME_SECONDS / 2
    app._frame_costs.extend([cheap] * 3)
    assert app._frame_delay() == FRAME_SECONDS, "cheap frames come FRAME_SECONDS apart"
    app._frame_costs.extend([0.0, 0.0, 0.5])
    assert app._frame_delay() == FRAME_SECONDS, "one costly frame among cheap ones is a one-off"
    costly = FRAME_BUDGET * 0.6  # 0.6 s of its share
    app._frame_costs.extend([costly] * 3)
    assert 0.55 < app._frame_delay() <= 0.6
    app._frame_costs.extend([1.0] * 3)
    assert FRAME_SECONDS_MAX - 0.05 < app._frame_delay() <= FRAME_SECONDS_MAX
    app._drawn_at_once = True  # a state change came: the next frame owes nothing
    assert app._frame_delay() == FRAME_SECONDS
    app._frame_began()
    assert app._frame_delay() == FRAME_SECONDS
    app._frame_costs.extend([1.0] * 3)
    app._frame_at = (time.monotonic() - FRAME_SECONDS_MAX - FRAME_SECONDS, time.thread_time())
    app._frame_began()  # after a pause in the stream
    assert app._frame_delay() == FRAME_SECONDS


async def test_log_lines_wait_while_a_run_streams_and_come_with_a_change_drawn_at_once(monkeypatch) -> None:
    """A log line scrolls the whole log pane: while a run streams the lines
    wait (the frames draw text, the table and the status line), and come
    with the next change drawn at once (a notice, a state, the run's end), or
    once LOG_SECONDS_MAX has gone by."""
    from ggufpipe_tui.views import drawing

    async with running_app((120, 40)) as (app, pilot):
        assert app.state.running
        log = app.query_one(LogPane)
        emit = app._subscriber(app.session)

        def logged() -> list[str]:
            return [line.plain for _, line in log.entries]

        started = time.monotonic()
        step = await stream(app, 0.05)
        emit(AgentLog(0, "gpu-a", "INFO decode begins"))
        step = await stream(app, PANEL_SECONDS + 2 * FRAME_SECONDS_MAX, step)
        await drawn(app)
        assert app._panels_at > started, "the panels were drawn meanwhile"
        assert not any("decode begins" in line for line in logged()), "the line waits while the run streams"
        emit(Notice("info", "a notice"))
        await pilot.pause()
        assert any("decode begins" in line for line in logged()), "a change drawn at once brings it"

        monkeypatch.setattr(drawing, "LOG_SECONDS_MAX", 0.0)
        emit(AgentLog(1, "gpu-b", "INFO later"))
        await stream(app, PANEL_SECONDS + 2 * FRAME_SECONDS_MAX, step)
        await drawn(app)
        assert any("later" in line for line in logged()), "a line waits LOG_SECONDS_MAX at most"


async def test_the_stop_key_is_dimmed_and_lit_without_composing_the_footer_anew() -> None:
    """The stop key turns on when a prompt runs and off when it ends: the
    footer restyles that key (a new footer is a layout pass of the screen,
    which would land in the first frames of every reply)."""
    from textual.widgets._footer import FooterKey

    async with running_app((120, 40)) as (app, pilot):

        def stop_key() -> FooterKey:
            return next(key for key in app.query(FooterKey) if key.action == "stop")

        keys = list(app.query(FooterKey))
        layouts = counted_layouts(app)
        for active in (False, True, False):
            app.prompt_active = active
            await pilot.pause()
            await pilot.pause()
            assert stop_key().has_class("-disabled") is not active
        assert list(app.query(FooterKey)) == keys, "the same keys, restyled"
        assert layouts[0] == 0, f"{layouts[0]} layout passes for the stop key"
