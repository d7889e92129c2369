"""The session policy (ggufpipe_tui.session.runs) with fake stages: prompts
become runs one at a time, in order; a run can be prepared ahead; a withdrawn
prompt never runs; a fault stops the queue and fails what waits."""

from __future__ import annotations

import asyncio

import pytest

from ggufpipe_tui.core.events import Event, PromptAssigned, RunFinished, TokenStreamed
from ggufpipe_tui.session.driver import RunDriver
from ggufpipe_tui.session.runs import Prompt, RunHandle, RunQueue
from ggufpipe_tui.session.stages import PipelineError
from tests.fakes import Autopilot, Rig, inventory


class FakePipeline:
    """What the queue needs of a pipeline, with autopiloted fake stages."""

    def __init__(self, prepare_ahead: bool = False, fault_at: dict[int, int] | None = None) -> None:
        self.inventory = inventory(max_tokens=3)
        self.broken = ""
        self.events: list[Event] = []
        self.rigs: list[Rig] = []
        self.fault_at = fault_at or {}
        self.queue = RunQueue(self, prepare_ahead)
        self.handles: dict[int, RunHandle] = {}

    async def prepare_run(self) -> RunDriver:
        number = len(self.rigs)
        run_id = 0x100 + number + 1

        def emit(event: Event) -> None:
            self.events.append(event)
            handle = self.handles.get(run_id)
            if handle is not None:
                handle.push(event)

        rig = Rig(max_tokens=3, run_id=run_id, emit=emit)
        Autopilot(rig, self.fault_at.get(number))
        self.rigs.append(rig)
        rig.start()
        return rig.driver

    def route(self, driver: RunDriver, handle: RunHandle) -> None:
        self.handles[driver.plan.run_id] = handle

    async def tokenize(self, text: str, chat: bool) -> tuple[list[int], str]:
        if text == "unreadable":
            raise PipelineError("tokenizing on a: the chat template failed")
        return [len(text)] * (40 if text == "long" else 1), text

    async def run_prompt(self, driver: RunDriver, tokens: list[int], submitted: float):
        if len(tokens) >= driver.plan.model.max_seq_len:
            driver.stop("prompt too long")
            await driver.done.wait()
            raise PipelineError("the prompt is too long")
        driver.give_prompt(tokens, submitted)
        await driver.done.wait()
        return driver.result


async def served(pipeline: FakePipeline) -> asyncio.Task[None]:
    return asyncio.ensure_future(pipeline.queue.serve())


async def test_prompts_run_one_at_a_time_in_order():
    pipeline = FakePipeline()
    serving = await served(pipeline)
    handles = [pipeline.queue.submit(Prompt(text=t)) for t in ("one", "two", "three")]
    results = [await asyncio.wait_for(h.result(), 5) for h in handles]
    assert [r.run_id for r in results] == [0x101, 0x102, 0x103]
    assert all(r.ok and r.tokens == (9, 10, 11) for r in results)
    assigned = [(e.run_id, e.text, e.ticket) for e in pipeline.events if isinstance(e, PromptAssigned)]
    assert assigned == [(0x101, "one", 1), (0x102, "two", 2), (0x103, "three", 3)]
    # One at a time: each run was done before the next was planned.
    finished = [i for i, e in enumerate(pipeline.events) if isinstance(e, RunFinished)]
    started = [i for i, e in enumerate(pipeline.events) if isinstance(e, PromptAssigned)]
    assert started[1] > finished[0] and started[2] > finished[1]
    pipeline.queue.stop("done")
    await asyncio.wait_for(serving, 2)


async def test_a_run_is_prepared_ahead_and_again_after_each_run():
    pipeline = FakePipeline(prepare_ahead=True)
    serving = await served(pipeline)
    await asyncio.sleep(0.05)
    assert len(pipeline.rigs) == 1 and not pipeline.rigs[0].driver.done.is_set(), "prepared before any prompt"
    result = await asyncio.wait_for(pipeline.queue.submit(Prompt(text="hi")).result(), 5)
    assert result.run_id == 0x101
    await asyncio.sleep(0.05)
    assert len(pipeline.rigs) == 2, "the next run is prepared at once"
    pipeline.queue.stop("done")
    await asyncio.wait_for(serving, 2)


async def test_a_withdrawn_prompt_never_runs():
    pipeline = FakePipeline()
    first = pipeline.queue.submit(Prompt(text="first"))
    second = pipeline.queue.submit(Prompt(text="second"))
    second.stop("the client went away")
    serving = await served(pipeline)
    assert (await asyncio.wait_for(first.result(), 5)).ok
    with pytest.raises(PipelineError, match="not run: the client went away"):
        await second.result()
    await asyncio.sleep(0.05)
    assert len(pipeline.rigs) == 1
    pipeline.queue.stop("done")
    await asyncio.wait_for(serving, 2)


async def test_a_prompt_that_cannot_run_fails_alone():
    pipeline = FakePipeline()
    serving = await served(pipeline)
    bad = pipeline.queue.submit(Prompt(text="long"))
    unreadable = pipeline.queue.submit(Prompt(text="unreadable"))
    good = pipeline.queue.submit(Prompt(text="fine"))
    with pytest.raises(PipelineError, match="too long"):
        await asyncio.wait_for(bad.result(), 5)
    with pytest.raises(PipelineError, match="chat template"):
        await asyncio.wait_for(unreadable.result(), 5)
    assert (await asyncio.wait_for(good.result(), 5)).ok
    pipeline.queue.stop("done")
    await asyncio.wait_for(serving, 2)


async def test_a_fault_stops_the_queue_and_fails_what_waits():
    pipeline = FakePipeline(fault_at={0: 1})
    serving = await served(pipeline)
    faulty = pipeline.queue.submit(Prompt(text="one"))
    waiting = pipeline.queue.submit(Prompt(text="two"))
    result = await asyncio.wait_for(faulty.result(), 5)
    assert result.outcome == "faulted" and result.tokens == (9,)
    with pytest.raises(PipelineError, match="not run: stage 0 on fake"):
        await asyncio.wait_for(waiting.result(), 5)
    assert (await asyncio.wait_for(pipeline.queue.wait_stopped(), 2)).startswith("stage 0 on fake")
    await asyncio.wait_for(serving, 2)
    late = pipeline.queue.submit(Prompt(text="three"))
    with pytest.raises(PipelineError, match="not run"):
        await late.result()


async def test_a_handle_streams_its_runs_events():
    pipeline = FakePipeline()
    serving = await served(pipeline)
    handle = pipeline.queue.submit(Prompt(text="hi"), stream=True)
    seen = [event async for event in handle.events()]
    assert isinstance(seen[0], PromptAssigned) and isinstance(seen[-1], RunFinished)
    assert [e.text for e in seen if isinstance(e, TokenStreamed)] == ["<9>", "<10>", "<11>"]
    pipeline.queue.stop("done")
    await asyncio.wait_for(serving, 2)
