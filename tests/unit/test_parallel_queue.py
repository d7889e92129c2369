"""Several prompts in flight (issue 29, ggufpipe_tui.session.parallel) with
autopiloted fake stages: up to K runs at once, each on its own slot, the
rest waiting in order; a slot is chosen by the longest prefix its last run
left; a withdrawn prompt never runs; a fault stops the queue."""

from __future__ import annotations

import asyncio

from ggufpipe_tui.core.events import PromptAssigned
from ggufpipe_tui.core.inventory import RunOptions
from ggufpipe_tui.session.driver import RunDriver
from ggufpipe_tui.session.parallel import ParallelQueue, choose_slot
from ggufpipe_tui.session.runs import Prompt
from ggufpipe_tui.session.stages import PipelineError
from tests.unit.test_run_queue import FakePipeline


class ParallelPipeline(FakePipeline):
    def __init__(self, slots: int, prepare_ahead: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.queue = ParallelQueue(self, slots, prepare_ahead)
        self.slots: list[int] = []  # each prepared run's slot
        self.reused: list[bool] = []
        self.in_flight = 0
        self.most = 0

    async def prepare_run(
        self, options: RunOptions | None = None, *, slot: int = 0, reuse: bool = True
    ) -> RunDriver:
        self.slots.append(slot)
        self.reused.append(reuse)
        return await super().prepare_run(options)

    async def run_prompt(self, driver, tokens, submitted, max_tokens=0):
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            await asyncio.sleep(0.05)  # every run takes a while: the others overlap it
            return await super().run_prompt(driver, tokens, submitted, max_tokens)
        finally:
            self.in_flight -= 1


def test_the_slot_with_the_longest_shared_prefix_wins():
    held = [(1, 2, 3), (1, 2, 3, 4, 5), (), (9,)]
    used = [3.0, 2.0, 1.0, 0.0]
    assert choose_slot([0, 1, 2, 3], held, used, [1, 2, 3, 4, 5, 6]) == 1
    assert choose_slot([0, 2, 3], held, used, [1, 2, 3, 4, 5, 6]) == 0, "slot 1 is busy"
    assert choose_slot([0, 1, 2, 3], held, used, [7]) == 3, "none shares: the least recently used"
    assert choose_slot([0, 2], held, used, [7]) == 2


async def test_up_to_k_runs_in_flight_and_the_rest_wait_in_order():
    pipeline = ParallelPipeline(2)
    serving = asyncio.ensure_future(pipeline.queue.serve())
    handles = [pipeline.queue.submit(Prompt(text=text)) for text in ("a", "bb", "ccc", "dddd", "eeeee")]
    results = [await asyncio.wait_for(handle.result(), 5) for handle in handles]
    assert all(result.ok for result in results)
    assert pipeline.most == 2, "two in flight at once, never more"
    assert len(set(pipeline.slots[:2])) == 2, "the first two took both slots"
    assigned = [event.ticket for event in pipeline.events if isinstance(event, PromptAssigned)]
    assert sorted(assigned) == [1, 2, 3, 4, 5]
    pipeline.queue.stop("done")
    await asyncio.wait_for(serving, 5)


async def test_cache_prompt_false_offers_nothing():
    pipeline = ParallelPipeline(2)
    serving = asyncio.ensure_future(pipeline.queue.serve())
    await asyncio.wait_for(pipeline.queue.submit(Prompt(text="x", cache_prompt=False)).result(), 5)
    await asyncio.wait_for(pipeline.queue.submit(Prompt(text="x")).result(), 5)
    assert pipeline.reused == [False, True]
    pipeline.queue.stop("done")
    await asyncio.wait_for(serving, 5)


async def test_a_prompt_withdrawn_while_it_waits_never_runs():
    pipeline = ParallelPipeline(1)
    serving = asyncio.ensure_future(pipeline.queue.serve())
    first = pipeline.queue.submit(Prompt(text="first"))
    second = pipeline.queue.submit(Prompt(text="second"))
    second.stop("changed my mind")
    assert (await asyncio.wait_for(first.result(), 5)).ok
    try:
        await asyncio.wait_for(second.result(), 5)
        raise AssertionError("a withdrawn prompt ran")
    except PipelineError as error:
        assert "changed my mind" in str(error)
    assert len(pipeline.rigs) == 1
    pipeline.queue.stop("done")
    await asyncio.wait_for(serving, 5)


async def test_a_fault_stops_the_queue_and_the_runs_in_flight_finish():
    pipeline = ParallelPipeline(2, fault_at={0: 1})
    serving = asyncio.ensure_future(pipeline.queue.serve())
    faulting = pipeline.queue.submit(Prompt(text="one"))
    other = pipeline.queue.submit(Prompt(text="two"))
    assert (await asyncio.wait_for(faulting.result(), 5)).outcome == "faulted"
    assert (await asyncio.wait_for(other.result(), 5)).ok, "the other run in flight finished"
    await asyncio.wait_for(serving, 5)
    assert pipeline.queue.stopped
    late = pipeline.queue.submit(Prompt(text="late"))
    try:
        await late.result()
        raise AssertionError("a prompt ran after the fault")
    except PipelineError as error:
        assert "not run" in str(error)


async def test_every_free_slot_keeps_a_run_prepared_ahead():
    pipeline = ParallelPipeline(2, prepare_ahead=True)
    serving = asyncio.ensure_future(pipeline.queue.serve())
    while len(pipeline.queue.prepared) < 2:
        await asyncio.sleep(0.01)
    assert sorted(pipeline.slots) == [0, 1], "one run prepared on each slot before any prompt"
    result = await asyncio.wait_for(pipeline.queue.submit(Prompt(text="x")).result(), 5)
    assert result.ok and result.run_id in (0x101, 0x102), "the prompt took a prepared run"
    while len(pipeline.queue.prepared) < 2:
        await asyncio.sleep(0.01)
    assert len(pipeline.rigs) == 3, "its slot prepared the next"
    other = await asyncio.wait_for(pipeline.queue.submit(Prompt(text="y", cache_prompt=False)).result(), 5)
    assert other.ok and other.run_id == 0x104, "cache_prompt false: a run that offers nothing, not the prepared one"
    assert pipeline.reused[3] is False
    pipeline.queue.stop("done")
    await asyncio.wait_for(serving, 5)
    assert all(driver.done.is_set() for driver in pipeline.queue.prepared.values()), "prepared runs stopped"
