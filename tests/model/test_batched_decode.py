"""Batched decode across the runs in flight (ggufpipe_agent/stage/batching.py):
each run's tokens are what llama.cpp computes when fed the same batches.

A stage computes the decode rows of every run whose step is ready in one
``llama_decode``; a run's output is then what one llama.cpp context per stage
computes when fed those batches (docs/worker.md, "Batched decode"). The test
serves four requests at once on two real agents, records every
``llama_decode`` each stage ran (``GGUFPIPE_BATCH_TRACE``: runs, slots,
positions, rows, stage 0's tokens), feeds in-process engines of the same
stage files the same batches, and compares every run's tokens."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from ggufpipe_agent.wire.protocol import EngineOptions, SamplingParams
from ggufpipe_tui.core.inventory import load_inventory
from ggufpipe_tui.session.pipeline import Pipeline
from ggufpipe_tui.session.runs import Prompt, RunOverrides
from tests.support.parallel_checks import prompts
from tests.support.stage_chain import Chain

pytestmark = [pytest.mark.model, pytest.mark.slow]

CONTEXT, UBATCH, STEPS, PARALLEL = 512, 32, 16, 4
SPLITS = [(0, 13), (13, 30)]
GREEDY = SamplingParams(0.0, 40, 0.95, 0)


def inventory(folder: Path, model_path: Path, batching: bool) -> Path:
    path = folder / "inventory.yaml"
    path.write_text(
        f"model: {{path: {model_path}}}\n"
        "hosts:\n  a: {local: true, threads: 1}\n  b: {local: true, threads: 1}\n"
        f"stages:\n  - {{host: a, layers: [0, 13]}}\n  - {{host: b, layers: [13, 30]}}\n"
        f"run: {{context: {CONTEXT}, ubatch: {UBATCH}, parallel: {PARALLEL}, chat: false, "
        f"batching: {'on' if batching else 'off'}}}\n"
        "timeouts: {connect: 30, ready: 120, step: 30, teardown: 10}\n"
    )
    return path


async def serve_at_once(path: Path, chosen: list[list[int]]) -> list[tuple[int, list[int]]]:
    """Every prompt submitted at once; each run's id and tokens."""
    pipeline = Pipeline(load_inventory(path), lambda event: None)
    await pipeline.start()
    try:
        options = RunOverrides(max_tokens=STEPS, ignore_eos=True)
        handles = [
            pipeline.submit(Prompt(tokens=tuple(p), options=options, cache_prompt=False)) for p in chosen
        ]
        results = await asyncio.gather(*(handle.result() for handle in handles))
    finally:
        await pipeline.close()
    assert all(result.ok for result in results), [result.failure for result in results]
    return [(result.run_id, list(result.tokens)) for result in results]


def replay(model_path: Path, trace: Path) -> dict[int, list[int]]:
    """Each stage's recorded batches fed to an engine of the same stage file:
    the tokens each run's last-stage steps sample."""
    options = EngineOptions(CONTEXT, min(CONTEXT, 2048), UBATCH, threads=1, parallel=PARALLEL)
    chain = Chain(model_path, SPLITS, options)
    rows: dict[tuple[int, int], np.ndarray] = {}  # (run, position) -> the previous stage's row
    sampled: dict[int, list[int]] = defaultdict(list)
    try:
        for index, engine in enumerate(chain.engines):
            last = index == len(chain.engines) - 1
            runs: dict[int, int] = {}  # slot -> the run its cache holds
            outputs: dict[tuple[int, int], np.ndarray] = {}
            for line in (trace / f"stage-{index}.jsonl").read_text().splitlines():
                record = json.loads(line)
                batch = record["rows"]
                inputs = []
                for number, (run, slot, position, count, _more) in enumerate(batch):
                    if runs.get(slot) != run:  # a new run on the slot: cold, as the requests asked
                        engine.use(slot)
                        engine.reset(GREEDY)
                        runs[slot] = run
                    if index == 0:
                        inputs.append(record["tokens"][number])
                    else:
                        inputs.append(np.stack([rows[(run, position + k)] for k in range(count)]))
                if len(batch) == 1:
                    run, slot, position, count, more = batch[0]
                    engine.use(slot)
                    results = [engine.step(inputs[0], position, sample=not more)]
                else:
                    results = engine.step_batch(
                        [(row[1], values) for row, values in zip(batch, inputs, strict=True)]
                    )
                for (run, _slot, position, count, _more), result in zip(batch, results, strict=True):
                    if last:
                        if result is not None:
                            sampled[run].append(int(result[0] if isinstance(result, tuple) else result))
                    else:
                        for k in range(count):
                            outputs[(run, position + k)] = result[k]
            rows = outputs
    finally:
        chain.close()
    return sampled


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "alone"])
async def test_runs_in_flight_are_what_their_batches_compute(
    tmp_path, model_path, no_agent_left, monkeypatch, batching
):
    trace = tmp_path / "trace"
    trace.mkdir()
    monkeypatch.setenv("GGUFPIPE_BATCH_TRACE", str(trace))
    served = await serve_at_once(inventory(tmp_path, model_path, batching), prompts(model_path, PARALLEL))
    sizes = [len(json.loads(line)["rows"]) for line in (trace / "stage-1.jsonl").read_text().splitlines()]
    if batching:
        assert max(sizes) >= 2, f"no decode step was batched: {sizes}"
    else:
        assert max(sizes) == 1, "run.batching: off computes every step alone"
    replayed = replay(model_path, trace)
    for run_id, tokens in served:
        assert replayed[run_id] == tokens, f"run {run_id:016x}"
