"""How the TUI keeps up with a fast stream, without agents: a reply of many
short lines is drawn in frozen blocks and a short live tail, all of its text
in order; a burst of tokens is drawn in a few frames, not one per token; the
pipeline thread's events reach the app's loop in order, many per wake-up.
(What this costs in CPU is measured by benchmarks/bench_tui.py, not here.)"""

from __future__ import annotations

import asyncio
import threading

from ggufpipe_tui.core.events import Event, Notice, TokenStreamed
from ggufpipe_tui.views import widgets
from ggufpipe_tui.views.app import FRAME_SECONDS, GgufpipeApp, PipelineEvent
from ggufpipe_tui.views.threaded import ThreadedPipeline
from ggufpipe_tui.views.widgets import Block, Exchange
from tests.test_app_snapshots import REPLY, RUN_ID, inventory, running


def reply_text(exchange: Exchange) -> str:
    """What the exchange's reply blocks show, frozen blocks and tail, joined
    as they were split (each frozen block ends at a line break)."""
    blocks = [str(block.render()) for block in exchange.query(Block).filter(".reply")]
    return "\n".join(blocks)


async def test_a_reply_of_short_lines_is_frozen_in_blocks_and_shown_whole() -> None:
    inv = inventory()
    app = GgufpipeApp(inv, script=running(inv))
    lines = 100
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        draws = 0
        drawn = app._draw_text

        def counted() -> None:
            nonlocal draws
            draws += 1
            drawn()

        app._draw_text = counted  # type: ignore[method-assign]
        for number in range(lines):  # one number a line, as a count would come
            for piece in (f"{number}", "\n"):
                app.post_message(PipelineEvent(TokenStreamed(RUN_ID, 100, 100, piece), app.session))
        await asyncio.sleep(3 * FRAME_SECONDS)
        await pilot.pause()
        exchange = app.query_one(Exchange)
        expected = "".join(REPLY) + "".join(f"{number}\n" for number in range(lines))
        assert exchange.text == expected
        assert reply_text(exchange) == expected
        tail = str(exchange.query(Block).filter(".reply").last().render())
        assert tail.count("\n") < widgets.FREEZE_LINES, "the live tail stays short"
        assert len(exchange.query(Block).filter(".reply")) == 2, "one frozen block a frame"
        assert draws <= 3, f"{2 * lines} tokens drawn in {draws} frames"


async def test_events_cross_from_the_pipeline_thread_in_order_many_per_wake_up() -> None:
    received: list[Event] = []
    pipeline = ThreadedPipeline(inventory(), received.append)
    wake_ups = 0
    deliver = pipeline._deliver

    def counted() -> None:
        nonlocal wake_ups
        wake_ups += 1
        deliver()

    pipeline._deliver = counted  # type: ignore[method-assign]
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
        assert wake_ups < count / 4, f"{count} events took {wake_ups} wake-ups of the app's loop"
    finally:
        await pipeline.close()
