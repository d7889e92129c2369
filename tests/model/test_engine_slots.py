"""Slots (docs/worker.md, "Slots"): a stage engine with ``parallel`` sequences, each its own
KV cache. Runs interleaved step by step on different slots give, token for
token, what each gives alone, and what one llama.cpp context gives."""

from __future__ import annotations

from pathlib import Path

import pytest

from ggufpipe_agent.errors import EngineError, StepNotStarted
from ggufpipe_agent.wire.protocol import EngineOptions, SamplingParams
from tests.support.common import LONG_PROMPT, whole_model_greedy
from tests.support.local import tokenize
from tests.support.stage_chain import Chain

pytestmark = pytest.mark.model

STEPS = 24
SPLITS = [(0, 13), (13, 30)]


def options(parallel: int) -> EngineOptions:
    return EngineOptions(n_ctx=512, n_batch=512, n_ubatch=512, parallel=parallel)


@pytest.fixture(scope="module")
def prompts(model_path: Path) -> list[list[int]]:
    texts = [LONG_PROMPT, "The capital of France is", LONG_PROMPT + " Say it again.", "1, 2, 3, 4,"]
    return [tokenize(model_path, text, bos=True) for text in texts]


def interleaved(chain: Chain, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Every prompt on its own slot, one step of each in turn."""
    outputs: list[list[int]] = [[] for _ in prompts]
    for slot in range(len(prompts)):
        for engine in chain.engines:
            engine.use(slot)
        chain.reset()
    for step in range(steps):
        for slot, prompt in enumerate(prompts):
            for engine in chain.engines:
                engine.use(slot)
            out = outputs[slot]
            out.append(chain.step(step, prompt if step == 0 else [out[-1]]))
    return outputs


def test_interleaved_slots_match_each_alone(model_path, prompts):
    alone = [whole_model_greedy(model_path, prompt, STEPS, n_ctx=512, n_ubatch=512) for prompt in prompts]
    chain = Chain(model_path, SPLITS, options(len(prompts)))
    try:
        together = interleaved(chain, prompts, STEPS)
    finally:
        chain.close()
    assert together == alone
    assert len({tuple(out) for out in alone}) == len(prompts)


def test_a_slot_keeps_its_cache_while_another_is_emptied(model_path, prompts):
    chain = Chain(model_path, SPLITS, options(2))
    try:
        first = interleaved(chain, prompts[:2], 4)
        for engine in chain.engines:
            engine.use(1)
        chain.reset()  # slot 1 only
        for engine in chain.engines:
            engine.use(0)
            assert engine.n_past == len(prompts[0]) + 3
            engine.use(1)
            assert engine.n_past == 0
        # slot 0 goes on where it was, as if alone
        for engine in chain.engines:
            engine.use(0)
        more = [first[0][-1]]
        for step in range(4, 8):
            more.append(chain.step(step, [more[-1]]))
    finally:
        chain.close()
    alone = whole_model_greedy(model_path, prompts[0], 8, n_ctx=512, n_ubatch=512)
    assert first[0] + more[1:] == alone


def test_a_slot_outside_the_engine_is_refused(model_path):
    chain = Chain(model_path, SPLITS, options(2))
    try:
        with pytest.raises(EngineError, match="slot 2 does not exist"):
            chain.engines[0].use(2)
        chain.engines[0].reset(SamplingParams())
    finally:
        chain.close()


def test_a_step_queued_after_an_abort_computes_nothing_and_keeps_the_cache(model_path, prompts):
    """StopRun aborts a slot's steps; one that had not started is refused
    before it computes (StepNotStarted), so the slot's cache is as the run's
    earlier steps left it, and after its next reset (keeping the cache) the
    run goes on from there as if nothing had happened (a recovery carries
    it on in proportion, docs/recovery.md)."""
    prompt = prompts[1]
    alone = whole_model_greedy(model_path, prompt, 6, n_ctx=512, n_ubatch=512)
    chain = Chain(model_path, SPLITS, options(2))
    try:
        chain.reset()
        out = [chain.step(0, prompt)]
        out.append(chain.step(1, [out[-1]]))
        first = chain.engines[0]
        first.abort(0)
        with pytest.raises(StepNotStarted):
            first.step([out[-1]])
        assert first.n_past == len(prompt) + 1, "nothing was written"
        for engine in chain.engines:
            engine.reset(SamplingParams(), keep=True)  # the carried-on run's provision
        while len(out) < 6:
            out.append(chain.step(len(out), [out[-1]]))
    finally:
        chain.close()
    assert out == alone
