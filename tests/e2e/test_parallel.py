"""Runs in flight at once on local agents (docs/architecture.md, "Runs in flight"): two stages on two
local hosts (an agent process each), eight slots; 2, 4 and 8 requests at
once, prefixes shared and not, each equal to the same request alone; and
conversations interleaved on the slots, each keeping its own cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import pytest_asyncio

from ggufpipe_tui.core.inventory import load_inventory
from ggufpipe_tui.session.pipeline import Pipeline
from tests.support.parallel_checks import concurrent_equal_alone, conversations_keep_their_caches

# One pipeline for the module: its tests share the module's event loop.
pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

CONTEXT, UBATCH, STEPS = 512, 32, 12


def local_pipeline(folder: Path, model_path: Path, hosts: str, stages: str, parallel: int) -> Pipeline:
    path = folder / "inventory.yaml"
    path.write_text(
        f"model: {{path: {model_path}}}\nhosts:\n{hosts}stages:\n{stages}"
        f"run: {{context: {CONTEXT}, ubatch: {UBATCH}, parallel: {parallel}, chat: false}}\n"
        "timeouts: {connect: 30, ready: 120, step: 30, teardown: 10}\n"
    )
    return Pipeline(load_inventory(path), lambda event: None)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pipeline(tmp_path_factory: pytest.TempPathFactory, model_path: Path):
    hosts = "  a: {local: true, threads: 1}\n  b: {local: true, threads: 1}\n"
    stages = "  - {host: a, layers: [0, 13]}\n  - {host: b, layers: [13, 30]}\n"
    running = local_pipeline(tmp_path_factory.mktemp("parallel"), model_path, hosts, stages, 8)
    await running.start()
    try:
        yield running
    finally:
        await running.close()


@pytest.mark.parametrize("count", [2, 4, 8])
async def test_requests_in_flight_each_equal_it_alone(
    pipeline: Pipeline, model_path: Path, count: int
) -> None:
    await concurrent_equal_alone(pipeline, model_path, count, STEPS, CONTEXT, UBATCH)


async def test_interleaved_conversations_each_keep_their_cache(pipeline: Pipeline, model_path: Path) -> None:
    await conversations_keep_their_caches(pipeline, model_path, 3, 3, STEPS, CONTEXT, UBATCH)


async def test_in_one_shared_agent_process_too(tmp_path: Path, model_path: Path) -> None:
    """The example inventory's way (share_process: true, the stages of a host
    in one agent process, one worker thread, decode steps handed over
    in-process): runs in flight are each what they are alone there too."""
    hosts = "  here: {local: true, share_process: true}\n"
    stages = "".join(f"  - {{host: here, layers: [{a}, {b}]}}\n" for a, b in ((0, 8), (8, 21), (21, 30)))
    shared = local_pipeline(tmp_path, model_path, hosts, stages, 4)
    await shared.start()
    try:
        await concurrent_equal_alone(shared, model_path, 4, STEPS, CONTEXT, UBATCH)
    finally:
        await shared.close()
