"""One run of a pipeline, start to close: for the tests that check one
result (and the events on the way) rather than the pipeline in between."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ggufpipe_tui.core.events import RunResult
from ggufpipe_tui.core.inventory import Inventory
from ggufpipe_tui.session.pipeline import Pipeline
from tests.support.common import LONG_PROMPT


async def generate_once(
    inventory: Inventory,
    events: list[Any] | None = None,
    prompt: str = LONG_PROMPT,
    started: Callable[[Pipeline], None] | None = None,
) -> RunResult:
    """A pipeline on ``inventory`` started, ``started(pipeline)`` (checks of the
    started pipeline), one run on ``prompt``, the pipeline closed. Its events
    go into ``events``."""
    pipeline = Pipeline(inventory, events.append if events is not None else lambda event: None)
    try:
        await pipeline.start()
        if started is not None:
            started(pipeline)
        return await pipeline.generate(prompt)
    finally:
        await pipeline.close()
