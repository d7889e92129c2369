"""Prompts to runs one at a time (ggufpipe_tui.session.serving) with fake
stages: prompts become runs one at a time, in order; a run can be prepared ahead; a withdrawn
prompt never runs; a fault stops the queue and fails what waits."""

from __future__ import annotations

import asyncio

import pytest

from ggufpipe_agent.wire.protocol import ChatMessage
from ggufpipe_tui.core.events import PromptAssigned, RunFinished, TokenStreamed
from ggufpipe_tui.session.runs import REFUSE, SHORTEN, ContextOverflow, Prompt, RunOverrides
from ggufpipe_tui.session.stages import PipelineError
from tests.support.fakes import FakePipeline, served


async def test_prompts_run_one_at_a_time_in_order():
    pipeline = FakePipeline()
    async with served(pipeline):
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


async def test_a_run_is_prepared_ahead_and_again_after_each_run():
    pipeline = FakePipeline(prepare_ahead=True)
    async with served(pipeline):
        await asyncio.sleep(0.05)
        assert len(pipeline.rigs) == 1 and not pipeline.rigs[0].driver.done.is_set(), (
            "prepared before any prompt"
        )
        result = await asyncio.wait_for(pipeline.queue.submit(Prompt(text="hi")).result(), 5)
        assert result.run_id == 0x101
        await asyncio.sleep(0.05)
        assert len(pipeline.rigs) == 2, "the next run is prepared at once"


async def test_a_withdrawn_prompt_never_runs():
    pipeline = FakePipeline()
    first = pipeline.queue.submit(Prompt(text="first"))
    second = pipeline.queue.submit(Prompt(text="second"))
    second.stop("the client went away")
    async with served(pipeline):
        assert (await asyncio.wait_for(first.result(), 5)).ok
        with pytest.raises(PipelineError, match="not run: the client went away"):
            await second.result()
        await asyncio.sleep(0.05)
        assert len(pipeline.rigs) == 1


async def test_a_prompt_that_cannot_run_fails_alone():
    pipeline = FakePipeline()
    async with served(pipeline):
        bad = pipeline.queue.submit(Prompt(text="long"))
        unreadable = pipeline.queue.submit(Prompt(text="unreadable"))
        good = pipeline.queue.submit(Prompt(text="fine"))
        with pytest.raises(PipelineError, match="the prompt is 40 tokens, the context holds 32"):
            await asyncio.wait_for(bad.result(), 5)
        with pytest.raises(PipelineError, match="chat template"):
            await asyncio.wait_for(unreadable.result(), 5)
        assert (await asyncio.wait_for(good.result(), 5)).ok
        assert len(pipeline.rigs) == 1, "the run prepared for a prompt that could not run waits for the next"
        assigned = [e.text for e in pipeline.events if isinstance(e, PromptAssigned)]
        assert assigned == ["fine"], "a prompt that cannot run is never given a run"


async def test_a_fault_stops_the_queue_and_fails_what_waits():
    pipeline = FakePipeline(fault_at={0: 1})
    async with served(pipeline) as serving:
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
    async with served(pipeline):
        handle = pipeline.queue.submit(Prompt(text="hi"), stream=True)
        seen = [event async for event in handle.events()]
        assert isinstance(seen[0], PromptAssigned) and isinstance(seen[-1], RunFinished)
        assert [e.text for e in seen if isinstance(e, TokenStreamed)] == ["<9>", "<10>", "<11>"]


async def test_a_prompt_with_other_sampling_gets_a_run_of_its_own():
    pipeline = FakePipeline(prepare_ahead=True)
    async with served(pipeline):
        await asyncio.sleep(0.05)
        greedy = pipeline.rigs[0]
        hot = pipeline.queue.submit(Prompt(text="hot", options=RunOverrides(temperature=0.7, seed=5)))
        result = await asyncio.wait_for(hot.result(), 5)
        assert result.ok and result.run_id == 0x102
        assert greedy.driver.result is not None and greedy.driver.result.outcome == "torn down"
        assert pipeline.rigs[1].plan.sampling.temperature == 0.7 and pipeline.rigs[1].plan.sampling.seed == 5
        await asyncio.sleep(0.05)
        assert pipeline.rigs[2].plan.sampling.temperature == 0.7, "prepared ahead as the last prompt sampled"
        again = pipeline.queue.submit(Prompt(text="hot", options=RunOverrides(temperature=0.7, seed=5)))
        assert (await asyncio.wait_for(again.result(), 5)).run_id == 0x103, "the prepared run serves it"
        cold = pipeline.queue.submit(Prompt(text="cold"))
        assert (await asyncio.wait_for(cold.result(), 5)).run_id == 0x105, "greedy: prepared anew"
        await asyncio.sleep(0.05)
        # Greedy with other top_p is still greedy: the prepared run serves it.
        same = pipeline.queue.submit(Prompt(text="cold", options=RunOverrides(temperature=0.0, top_p=0.5)))
        assert (await asyncio.wait_for(same.result(), 5)).run_id == 0x106


async def test_a_prompt_sets_its_max_tokens_and_bad_options_fail_alone():
    pipeline = FakePipeline(prepare_ahead=True)
    async with served(pipeline):
        short = pipeline.queue.submit(Prompt(text="a", options=RunOverrides(max_tokens=1)))
        bad = pipeline.queue.submit(Prompt(text="b", options=RunOverrides(temperature=-1.0)))
        after = pipeline.queue.submit(Prompt(text="c"))
        assert (await asyncio.wait_for(short.result(), 5)).tokens == (9,)
        with pytest.raises(PipelineError, match=r"temperature: -1.0 is not a finite number in \[0, 1e\+06\]"):
            await asyncio.wait_for(bad.result(), 5)
        assert (await asyncio.wait_for(after.result(), 5)).tokens == (9, 10, 11)


async def test_text_that_cannot_reach_a_stage_fails_alone():
    pipeline = FakePipeline(prepare_ahead=True)
    async with served(pipeline):
        bad = pipeline.queue.submit(Prompt(text="x \udfff y"))
        message = pipeline.queue.submit(Prompt(messages=(ChatMessage("user", "\ud800"),), chat=True))
        after = pipeline.queue.submit(Prompt(text="c"))
        with pytest.raises(PipelineError, match="the prompt: a lone surrogate U[+]DFFF at character 2"):
            await asyncio.wait_for(bad.result(), 5)
        with pytest.raises(PipelineError, match=r"message 0 \(user\): a lone surrogate"):
            await asyncio.wait_for(message.result(), 5)
        assert (await asyncio.wait_for(after.result(), 5)).tokens


async def test_a_bug_in_the_queue_fails_every_prompt_instead_of_leaving_them_waiting(monkeypatch):
    pipeline = FakePipeline(prepare_ahead=True)

    async def broken(*args, **kwargs):
        raise ValueError("a bug")

    monkeypatch.setattr(pipeline.runner, "_tokens", broken)
    async with served(pipeline) as serving:
        first = pipeline.queue.submit(Prompt(text="a"))
        waiting = pipeline.queue.submit(Prompt(text="b"))
        for handle in (first, waiting):
            with pytest.raises(PipelineError, match="internal error in the run queue: ValueError: a bug"):
                await asyncio.wait_for(handle.result(), 5)
        await asyncio.wait_for(serving, 2)
        assert pipeline.queue.stopped.startswith("internal error")


async def test_a_reply_that_cannot_fit_is_refused_before_or_shortened():
    pipeline = FakePipeline()  # a context of 32, max_tokens 3
    async with served(pipeline):
        refused = pipeline.queue.submit(Prompt(tokens=(1,) * 30, overflow=REFUSE))
        shortened = pipeline.queue.submit(Prompt(tokens=(1,) * 30, overflow=SHORTEN))
        fits = pipeline.queue.submit(Prompt(tokens=(1,) * 29, overflow=REFUSE))
        with pytest.raises(ContextOverflow, match="30 tokens and the reply may take 3 more") as caught:
            await asyncio.wait_for(refused.result(), 5)
        assert (caught.value.prompt_tokens, caught.value.max_tokens, caught.value.context) == (30, 3, 32)
        assert (await asyncio.wait_for(shortened.result(), 5)).tokens == (9, 10)
        assert (await asyncio.wait_for(fits.result(), 5)).tokens == (9, 10, 11)
        assert [e.ticket for e in pipeline.events if isinstance(e, PromptAssigned)] == [2, 3], "it never ran"


@pytest.mark.parametrize("prepare_ahead", [False, True])
async def test_on_the_token_ring_a_prompt_with_another_reply_limit_gets_a_run_provisioned_with_it(
    prepare_ahead,
):
    # The last stage of a ring stops at its provision's max_tokens: a reply
    # limit known only with the prompt (shortened, or a request's own) must
    # reach it in a provision, not only in the orchestrator's run FSM.
    pipeline = FakePipeline(prepare_ahead=prepare_ahead, feedback="ring")  # a context of 32, max_tokens 3
    async with served(pipeline):
        shortened = pipeline.queue.submit(Prompt(tokens=(1,) * 30, overflow=SHORTEN))
        assert (await asyncio.wait_for(shortened.result(), 5)).tokens == (9, 10)
        longer = pipeline.queue.submit(Prompt(tokens=(1,), options=RunOverrides(max_tokens=5)))
        assert (await asyncio.wait_for(longer.result(), 5)).tokens == (9, 10, 11, 12, 13)
        ran = [rig for rig in pipeline.rigs if rig.driver.result is not None and rig.driver.result.tokens]
        limits = [rig.provisioned(1).ring.max_tokens for rig in ran]  # type: ignore[union-attr]
        assert limits == [2, 5]


async def test_cache_prompt_false_prepares_a_run_that_keeps_nothing():
    """llama-server's cache_prompt: false, one run at a time too."""
    pipeline = FakePipeline()
    async with served(pipeline):
        assert (
            await asyncio.wait_for(pipeline.queue.submit(Prompt(text="a", cache_prompt=False)).result(), 5)
        ).ok
        assert (await asyncio.wait_for(pipeline.queue.submit(Prompt(text="b")).result(), 5)).ok
        assert pipeline.reused == [False, True]
