"""The decode-thread governor on a real engine (ggufpipe_agent/llama/threads.py):
an engine whose threads are left at 0 is tracked from its load to its close,
and a step after the governor took a thread away gives the same greedy tokens
as the whole model (llama.cpp's CPU kernels split rows, not sums, between
threads)."""

from __future__ import annotations

import os
from pathlib import Path

import llama_cpp
import pytest

from ggufpipe_agent.llama.engine import StageShape
from ggufpipe_agent.llama.loaded import LoadedEngine
from ggufpipe_agent.llama.threads import governor
from ggufpipe_agent.wire.protocol import EngineOptions, SamplingParams
from tests.support.common import LONG_PROMPT, whole_model_greedy
from tests.support.local import tokenize

pytestmark = pytest.mark.model

STEPS = 24
SHAPE = StageShape(True, True, 30, 576)


def test_an_engine_with_threads_0_is_governed_and_decodes_the_same(model_path: Path) -> None:
    prompt = tokenize(model_path, LONG_PROMPT, bos=True)
    reference = whole_model_greedy(model_path, prompt, STEPS, n_ctx=512, n_ubatch=512)
    adapting = governor()
    assert adapting is not None, "GGUFPIPE_ADAPT_THREADS=0 in the test's environment"
    slots = LoadedEngine()
    engine, loaded = slots.get(
        model_path, SHAPE, EngineOptions(n_ctx=512, n_batch=512, n_ubatch=512), lambda _f: None
    )
    try:
        assert loaded
        cores = os.cpu_count() or 1
        if cores > 1:
            assert engine.context in adapting._tracked
        # What the governor does beside a busy neighbour: one decode thread,
        # every core for the prompt.
        llama_cpp.llama_set_n_threads(engine.context, 1, cores)
        engine.reset(SamplingParams())
        token = engine.step(prompt)
        tokens = [token]
        for _ in range(STEPS - 1):
            token = engine.step([token])
            tokens.append(token)
        assert tokens == reference
    finally:
        context = engine.context
        slots.close()
    assert context not in adapting._tracked


def test_an_engine_with_threads_given_is_left_alone(model_path: Path) -> None:
    adapting = governor()
    assert adapting is not None
    slots = LoadedEngine()
    options = EngineOptions(n_ctx=256, n_batch=256, n_ubatch=256, threads=2)
    engine, _ = slots.get(model_path, SHAPE, options, lambda _f: None)
    try:
        assert engine.context not in adapting._tracked
    finally:
        slots.close()
