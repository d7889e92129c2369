"""Decode steps of the runs in flight on one stage, computed together.

Each run in flight on a stage has its own slot (a llama.cpp sequence, its
own KV stream). A run's decode step is one row; the rows of every run whose
step is ready go into one ``llama_decode`` (:meth:`StageEngine.step_batch`),
which costs little more than one row alone (the weights are read once per
batch, not once per row). Batches form of themselves: a step that arrives
while the worker computes a batch waits for the next one, and everything
waiting then goes together (continuous batching: a run joins or leaves at
the next step). With N stages a batch takes at most 1/N of the runs
decoding, the first to arrive, so the runs fall into N groups that keep
every stage at work: while stage 1 computes the rows stage 0 sent, stage 0
computes the next group's.

A batched row is computed with other rows beside it, and llama.cpp's kernels
need not give a row the same bits in a batch of 4 as alone: a run's output
is then what one llama.cpp context computes when fed the same batches, not
what the run computes alone. ``run.batching: off`` keeps every step alone
(docs/worker.md, "Batched decode").

``GGUFPIPE_BATCH_TRACE=DIR`` writes, per stage, the composition of every
``llama_decode`` this process runs (run, slot, position, rows, and stage 0's
tokens) as JSON lines, so that a test can feed one llama.cpp context per
stage the same batches and compare (tests/model/test_batched_decode.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ggufpipe_agent.ids import RunId, SlotId

#: Rows of one batched step at most (the runs in flight on a stage; llama.cpp's
#: n_batch bounds it too).
MAX_ROWS = 256
#: A decode batch this recent means runs are streaming through the stage.
STREAMING_S = 0.5
#: A run that stepped here this recently is one of the runs decoding.
RECENT_S = 1.0
#: A prompt's chunk beside streaming runs: at least this many rows, and about
#: a decode batch's time (at least this many ms), so that the streams and the
#: prompt share the stage about evenly. With at least 4 rows (a CPU row costs as
#: much alone as in a batch of 3) the streams' worst gap was 5.4x their median
#: (quiet 3.6x) and the 2,000-token prompt's first token came after 22 s; with
#: 1, 3.2x (quiet 2.9x) after 56 s (docs/performance.md, "The full pipeline on
#: two cores"): issue 38 asks for the streams' gaps.
INTERLEAVE_MIN_ROWS = 1
INTERLEAVE_MIN_MS = 5.0
#: A batch short of its group waits this long at most (and at most
#: GATHER_FRACTION of a batch's time) for the group's other rows, which the
#: previous stage sent together but which arrive one object at a time.
GATHER_S = 0.002
GATHER_FRACTION = 0.1


@dataclass(slots=True)
class Row:
    """One run's decode step waiting for a batch."""

    run_id: RunId
    slot: SlotId
    position: int
    inputs: Any
    done: asyncio.Future[Any]
    #: Called on the worker thread after the batch, with this row's result
    #: or None where the batch failed (the slot bookkeeping of its run).
    settle: Callable[[bool], None]


@dataclass(slots=True)
class StepBatcher:
    """The batches of one stage engine's decode steps, on its worker thread."""

    worker: Executor
    stage: int = 0
    #: The pipeline's stages: the runs in flight are split into this many groups.
    stages: int = 1
    waiting: list[Row] = field(default_factory=list)
    #: The runs that stepped here lately: run -> (when, monotonic s; its slot).
    recent: dict[int, tuple[float, SlotId]] = field(default_factory=dict)
    running: bool = False
    #: A batch is on the worker (queued or computing); _queued is set as it goes.
    computing: bool = False
    _queued: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set as a step joins :attr:`waiting` (a batch gathering its group waits on it).
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)
    #: The batches computed so far, and their rows.
    batches: int = 0
    rows: int = 0
    #: When the last batch ended (monotonic s), and a batch's ms (a moving mean).
    last_at: float = 0.0
    batch_ms: float = 0.0
    #: A prompt row's ms here, as the last prompt chunk of any run took (0: none
    #: yet); the worker sets it after each chunk (:meth:`timed_chunk`).
    row_ms: float = 0.0

    async def yield_to_batch(self) -> None:
        """A prompt's next chunk lets a decode batch that waits go first: the
        batch is queued for the worker before the chunk is (a batch gathering
        its group waits no longer than the gather)."""
        if not self.waiting or self.computing:
            return
        self._queued.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._queued.wait(), GATHER_S)

    def streaming(self) -> bool:
        """Runs are decoding on this stage: a step waits, or one ran lately."""
        return bool(self.waiting) or self.running or time.monotonic() - self.last_at < STREAMING_S

    def prompt_rows(self, rows: int) -> int:
        """How many of a prompt chunk's ``rows`` to compute next: all of them
        when no run is decoding here; else as many as take about one decode
        batch's time (from :attr:`row_ms`; INTERLEAVE_MIN_ROWS while no chunk
        has been timed), so that the decode steps of the runs streaming go
        between the chunks instead of waiting for the whole chunk
        (docs/worker.md, "A new prompt beside the streams")."""
        if not self.streaming():
            return rows
        if self.row_ms <= 0.0:
            return min(rows, INTERLEAVE_MIN_ROWS)
        wanted = round(max(self.batch_ms, INTERLEAVE_MIN_MS) / self.row_ms)
        return max(1, min(rows, max(INTERLEAVE_MIN_ROWS, wanted)))

    def timed_chunk(self, rows: int, ms: float) -> None:
        """A prompt chunk of ``rows`` rows took ``ms`` (on the worker). Every
        chunk counts, a single row too: were only longer ones timed, a stage
        that cut its chunks to one row would never learn that it may take more.
        A row costs less in a longer chunk, so the sizes grow to where a chunk
        takes about a batch's time."""
        if rows > 0:
            self.row_ms = ms / rows

    def group_rows(self) -> int:
        """The rows of the next batch at most: the runs decoding here split
        into one group per stage, so that while stage k computes one group
        stage k+1 computes another (one group of every run would leave all
        stages but one idle at every moment)."""
        now = time.monotonic()
        for run, (when, _) in list(self.recent.items()):
            if now - when > RECENT_S:
                del self.recent[run]
        live = max(len(self.recent), len(self.waiting))
        return max(1, min(MAX_ROWS, -(-live // max(1, self.stages))))

    def groups(self, size: int) -> dict[SlotId, int]:
        """Each decoding run's group, by slot: the slots in increasing order cut
        into groups of ``size``. llama.cpp computes a batch of several KV
        streams in one ubatch only where their sequence ids follow one another
        (``split_equal`` with ``sequential``): slots 0, 2, 4, 6 are four graphs
        of a row each, 48 ms a step of stage 1 here against 27 ms for slots
        0-3 (docs/performance.md, "The full pipeline on two cores"). So a group
        is a range of neighbouring slots, not the runs that came first."""
        live = sorted({*(slot for _, slot in self.recent.values()), *(row.slot for row in self.waiting)})
        return {slot: index // size for index, slot in enumerate(live)}

    async def step(self, engine: Any, row: Row) -> tuple[Any, float]:
        """Compute ``row`` in the next batch; its result and the batch's ms."""
        self.recent[row.run_id] = (time.monotonic(), row.slot)
        self.waiting.append(row)
        self._arrived.set()
        if not self.running:
            self.running = True
            asyncio.get_running_loop().create_task(self._drain(engine))
        result: tuple[Any, float] = await row.done
        return result

    async def _drain(self, engine: Any) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self.waiting:
                # The group of the row that waits longest, all of it that waits.
                take = self.group_rows()
                group_of = self.groups(take)
                group = group_of[self.waiting[0].slot]
                await self._gather(group_of, group)
                # A run's first decode step that came during the wait has no
                # group yet: it goes in the next batch.
                chosen = [row for row in self.waiting if group_of.get(row.slot) == group]
                taken = {id(row) for row in chosen}  # by identity: a row's inputs are arrays
                self.waiting = [row for row in self.waiting if id(row) not in taken]
                rows = sorted(chosen, key=lambda row: row.slot)
                rows = [row for row in rows if not row.done.done()]  # a stopped run's row
                if not rows:
                    continue
                self.computing = True
                self._queued.set()
                try:
                    results, elapsed = await loop.run_in_executor(
                        self.worker, _compute, engine, rows, self.stage
                    )
                except BaseException as error:  # noqa: BLE001 - each row's run gets the failure
                    for row in rows:
                        if not row.done.done():
                            row.done.set_exception(error)
                    continue
                finally:
                    self.computing = False
                self.batches += 1
                self.rows += len(rows)
                self.last_at = time.monotonic()
                self.batch_ms = elapsed if self.batches == 1 else 0.8 * self.batch_ms + 0.2 * elapsed
                for row, result in zip(rows, results, strict=True):
                    if row.done.done():
                        continue
                    if isinstance(result, BaseException):
                        row.done.set_exception(result)
                    else:
                        row.done.set_result((result, elapsed))
        finally:
            self.running = False

    async def _gather(self, group_of: dict[SlotId, int], group: int) -> None:
        """Wait a moment for the rest of ``group``: the previous stage sent
        its rows together, but each is an object of its own, and a batch
        begun on the first computes one row where it could compute them all
        for little more (a CPU row costs as much alone as in a batch of up to 3)."""
        members = sum(1 for value in group_of.values() if value == group)

        def short() -> bool:
            return sum(1 for row in self.waiting if group_of.get(row.slot) == group) < members

        if members <= 1 or not self.batch_ms or not short():
            return
        deadline = time.monotonic() + min(GATHER_S, GATHER_FRACTION * self.batch_ms / 1000.0)
        while short() and (left := deadline - time.monotonic()) > 0:
            self._arrived.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), left)


def _compute(engine: Any, rows: list[Row], stage: int) -> tuple[list[Any], float]:
    """One batched step on the worker thread. A row that cannot be computed
    (its run's context is full) gets its own error, the others are batched."""
    started = time.perf_counter()
    problems = [engine.row_problem(row.slot, row.inputs) for row in rows]
    if any(problems):
        for row, problem in zip(rows, problems, strict=True):
            if problem is not None:
                row.settle(False)
        sound = [row for row, problem in zip(rows, problems, strict=True) if problem is None]
        results = iter(_compute(engine, sound, stage)[0] if sound else [])
        merged = [problem if problem is not None else next(results) for problem in problems]
        return merged, (time.perf_counter() - started) * 1000.0
    try:
        results = engine.step_batch([(row.slot, row.inputs) for row in rows])
    except BaseException:
        for row in rows:
            row.settle(False)
        raise
    for row in rows:
        row.settle(True)
    composition = [(row.run_id, row.slot, row.position, 1, 0) for row in rows]
    trace(stage, composition, [row.inputs for row in rows], started)
    return results, (time.perf_counter() - started) * 1000.0


_trace_lock = threading.Lock()


def trace(
    stage: int, rows: Sequence[tuple[int, int, int, int, int]], inputs: list[Any], started: float = 0.0
) -> None:
    """One ``llama_decode``'s composition (per run: run, slot, position, rows,
    1 where it samples nothing: a prompt's part that another follows), when it
    ended (monotonic s), how long it took (ms, from ``started``: a
    ``time.perf_counter()``) and stage 0's token ids, to
    ``$GGUFPIPE_BATCH_TRACE/stage-N.jsonl``."""
    where = os.environ.get("GGUFPIPE_BATCH_TRACE", "")
    if not where:
        return
    record: dict[str, Any] = {"t": round(time.monotonic(), 4), "rows": [list(row) for row in rows]}
    if started:
        record["ms"] = round((time.perf_counter() - started) * 1000.0, 3)
    if stage == 0:
        record["tokens"] = [[int(token) for token in values] for values in inputs]
    with _trace_lock, (Path(where) / f"stage-{stage}.jsonl").open("a") as out:
        out.write(json.dumps(record) + "\n")
