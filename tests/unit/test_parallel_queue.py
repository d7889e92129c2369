"""Several prompts in flight (ggufpipe_tui.session.parallel) with
autopiloted fake stages: up to K runs at once, each on its own slot, the
rest waiting in order; a withdrawn prompt never runs; a fault stops the
queue. Which slot: tests/unit/test_slots.py."""

from __future__ import annotations

import asyncio

from ggufpipe_tui.core.events import PromptAssigned
from ggufpipe_tui.session.parallel import ParallelRunner
from ggufpipe_tui.session.runs import Prompt
from ggufpipe_tui.session.stages import PipelineError
from tests.support.fakes import FakePipeline, served


def parallel(slots: int, **kwargs) -> FakePipeline:
    """A fake pipeline whose ParallelRunner has ``slots``; every run takes a while."""
    return FakePipeline(slots=slots, delay=0.05, **kwargs)


async def test_up_to_k_runs_in_flight_and_the_rest_wait_in_order():
    pipeline = parallel(2)
    async with served(pipeline):
        handles = [pipeline.queue.submit(Prompt(text=text)) for text in ("a", "bb", "ccc", "dddd", "eeeee")]
        results = [await asyncio.wait_for(handle.result(), 5) for handle in handles]
        assert all(result.ok for result in results)
        assert pipeline.most == 2, "two in flight at once, never more"
        assert len(set(pipeline.slots[:2])) == 2, "the first two took both slots"
        assigned = [event.ticket for event in pipeline.events if isinstance(event, PromptAssigned)]
        assert sorted(assigned) == [1, 2, 3, 4, 5]


async def test_cache_prompt_false_offers_nothing():
    pipeline = parallel(2)
    async with served(pipeline):
        await asyncio.wait_for(pipeline.queue.submit(Prompt(text="x", cache_prompt=False)).result(), 5)
        await asyncio.wait_for(pipeline.queue.submit(Prompt(text="x")).result(), 5)
        assert pipeline.reused == [False, True]


async def test_a_prompt_withdrawn_while_it_waits_never_runs():
    pipeline = parallel(1)
    async with served(pipeline):
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


async def test_a_fault_stops_the_queue_and_the_runs_in_flight_finish():
    pipeline = parallel(2, fault_at={0: 1})
    async with served(pipeline) as serving:
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
    pipeline = parallel(2, prepare_ahead=True)
    runner = pipeline.runner
    assert isinstance(runner, ParallelRunner)
    async with served(pipeline):
        while len(runner.prepared) < 2:
            await asyncio.sleep(0.01)
        assert sorted(pipeline.slots) == [0, 1], "one run prepared on each slot before any prompt"
        result = await asyncio.wait_for(pipeline.queue.submit(Prompt(text="x")).result(), 5)
        assert result.ok and result.run_id in (0x101, 0x102), "the prompt took a prepared run"
        while len(runner.prepared) < 2:
            await asyncio.sleep(0.01)
        assert len(pipeline.rigs) == 3, "its slot prepared the next"
        other = await asyncio.wait_for(
            pipeline.queue.submit(Prompt(text="y", cache_prompt=False)).result(), 5
        )
        assert other.ok and other.run_id == 0x104, (
            "cache_prompt false: a run that offers nothing, not the prepared one"
        )
        assert pipeline.reused[3] is False
    assert all(driver.done.is_set() for driver in runner.prepared.values()), "prepared runs stopped"
