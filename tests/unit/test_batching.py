"""How a prompt is cut into chunks, and how decode steps of the runs in flight
are batched (ggufpipe_agent/llama/batches.py, ggufpipe_agent/stage/batching.py)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from ggufpipe_agent.errors import ContextOverflow
from ggufpipe_agent.llama.batches import prefill_chunks
from ggufpipe_agent.stage.batching import INTERLEAVE_MIN_ROWS, Row, StepBatcher


@pytest.mark.parametrize(
    ("start", "rows", "aligned", "counts"),
    [
        (0, 1800, False, [512, 512, 512, 264]),
        (0, 2048, False, [512, 512, 512, 512]),
        (100, 2100, False, [512, 512, 512, 512, 52]),  # a batch of 2048 from 100, then 52
        (100, 2100, True, [512, 512, 512, 412, 152]),  # batches end at 2048 in absolute positions
        (0, 5, False, [5]),
        (2040, 16, True, [8, 8]),
    ],
)
def test_a_prompt_is_cut_where_one_context_cuts_it(start, rows, aligned, counts):
    assert prefill_chunks(start, rows, 2048, 512, aligned) == counts
    assert sum(counts) == rows


class Engine:
    """Slots 0..3; slot 3's context is full."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def row_problem(self, slot: int, inputs: Any) -> Exception | None:
        return ContextOverflow("context full") if slot == 3 else None

    def step_batch(self, rows: list[tuple[int, Any]]) -> list[Any]:
        self.batches.append([slot for slot, _ in rows])
        return [(inputs[0] + 100, None) for _, inputs in rows]


def test_ready_steps_go_in_one_batch_in_slot_order_and_a_full_context_fails_alone():
    async def scenario() -> tuple[list[Any], list[list[int]]]:
        engine = Engine()
        batcher = StepBatcher(ThreadPoolExecutor(1))
        loop = asyncio.get_running_loop()
        settled: list[bool] = []
        rows = [Row(slot, slot, 5, [slot], loop.create_future(), settled.append) for slot in (2, 0, 3, 1)]
        outcomes = await asyncio.gather(*(batcher.step(engine, row) for row in rows), return_exceptions=True)
        assert sorted(settled) == [False, True, True, True]
        return outcomes, engine.batches

    outcomes, batches = asyncio.run(scenario())
    # Every step that waits when the worker is free goes in, in slot order.
    assert batches == [[0, 1, 2]]
    assert [outcome[0] if isinstance(outcome, tuple) else type(outcome) for outcome in outcomes] == [
        (102, None),
        (100, None),
        ContextOverflow,
        (101, None),
    ]


def test_a_prompt_beside_streaming_runs_is_cut_finer():
    batcher = StepBatcher(ThreadPoolExecutor(1))
    assert batcher.prompt_rows(512) == 512, "nothing streams: the whole chunk"
    batcher.waiting.append(object())  # type: ignore[arg-type]
    batcher.batch_ms = 30.0
    assert batcher.prompt_rows(512) == INTERLEAVE_MIN_ROWS, "no row time yet"
    batcher.timed_chunk(4, 12.0)
    assert batcher.prompt_rows(512) == 10, "about one decode batch's time"
    batcher.timed_chunk(1, 100.0)
    assert batcher.prompt_rows(512) == INTERLEAVE_MIN_ROWS
    batcher.timed_chunk(2, 1.0)
    assert batcher.prompt_rows(3) == 3


def test_chunks_cut_to_one_row_grow_to_a_batchs_time():
    """A one-row chunk is timed too: a stage that starts at one row learns
    that it may take more (were only longer chunks timed, every prompt
    beside streams would go a row a step)."""
    batcher = StepBatcher(ThreadPoolExecutor(1))
    batcher.waiting.append(object())  # type: ignore[arg-type]
    batcher.batch_ms = 30.0

    def chunk_ms(rows: int) -> float:  # a CPU row costs less in a longer chunk
        return 8.0 + 4.0 * rows

    sizes = []
    for _ in range(6):
        rows = batcher.prompt_rows(512)
        sizes.append(rows)
        batcher.timed_chunk(rows, chunk_ms(rows))
    assert sizes[0] == INTERLEAVE_MIN_ROWS
    assert sizes[-1] > 3 * INTERLEAVE_MIN_ROWS
    assert abs(chunk_ms(sizes[-1]) - batcher.batch_ms) <= 8.0, sizes


def test_with_two_stages_the_runs_in_flight_form_two_groups_of_neighbouring_slots():
    """A batch takes half the runs decoding: while one stage computes a group,
    the other stage computes the other group. A group is a range of
    neighbouring slots (llama.cpp computes KV streams in one ubatch only where
    their sequence ids follow one another), the range of the row that waits
    longest first, whatever order the rows came in."""

    class Roomy(Engine):
        def row_problem(self, slot: int, inputs: Any) -> Exception | None:
            return None

    async def scenario() -> list[list[int]]:
        engine = Roomy()
        batcher = StepBatcher(ThreadPoolExecutor(1), stages=2)
        loop = asyncio.get_running_loop()
        rows = [Row(slot, slot, 5, [slot], loop.create_future(), lambda done: None) for slot in (3, 1, 0, 2)]
        await asyncio.gather(*(batcher.step(engine, row) for row in rows))
        assert batcher.group_rows() == 2
        assert batcher.groups(2) == {0: 0, 1: 0, 2: 1, 3: 1}
        return engine.batches

    assert asyncio.run(scenario()) == [[2, 3], [0, 1]]


def test_a_run_that_starts_decoding_while_a_batch_gathers_goes_in_the_next():
    """A batch waits a moment for the rest of its group; a run's first decode
    step arriving then (its slot in no group yet) waits for the next batch,
    and every step is computed."""

    class Roomy(Engine):
        def row_problem(self, slot: int, inputs: Any) -> Exception | None:
            return None

    async def scenario() -> list[list[int]]:
        engine = Roomy()
        batcher = StepBatcher(ThreadPoolExecutor(1))
        batcher.batch_ms = 10.0  # a batch gathers for a tenth of that
        loop = asyncio.get_running_loop()
        batcher.recent[1] = (time.monotonic(), 1)  # run 1 decodes too: slots 0 and 1 are a group
        first = asyncio.ensure_future(batcher.step(engine, Row(0, 0, 5, [0], loop.create_future(), bool)))
        await asyncio.sleep(0)  # the batch is gathering
        late = await asyncio.wait_for(batcher.step(engine, Row(5, 5, 5, [5], loop.create_future(), bool)), 5)
        assert late[0] == (105, None)
        assert (await asyncio.wait_for(first, 5))[0] == (100, None)
        return engine.batches

    assert asyncio.run(scenario()) == [[0], [5]]
