"""End to end over the local transport: real agent processes, real llama.cpp,
the real SmolLM2 model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ggufpipe_tui.core.events import (
    AgentLog,
    DataPath,
    RunPhaseChanged,
    StageStateChanged,
    TokenStreamed,
)
from ggufpipe_tui.core.inventory import load_inventory
from ggufpipe_tui.session.pipeline import Pipeline
from tests.support.common import DATA_MODES, LONG_PROMPT, mode_yaml, whole_model_greedy
from tests.support.local import UNEVEN, run_cli, write_inventory
from tests.support.one_run import generate_once

pytestmark = pytest.mark.model


@pytest.mark.parametrize("mode", list(DATA_MODES))
async def test_three_local_stages_match_the_whole_model(tmp_path, model_path, no_agent_left, mode):
    data, feedback = mode_yaml(mode)
    run = f"max_tokens: 72, ignore_eos: true, chat: false, {feedback}"
    inventory = load_inventory(write_inventory(tmp_path, model_path, UNEVEN, run, data))
    events: list[object] = []
    result = await generate_once(inventory, events)
    assert result.outcome == "completed" and result.stop_reason == "max_tokens", result.failure
    assert len(result.prompt_tokens) > 64, "the prompt must span several ubatches"
    reference = whole_model_greedy(model_path, list(result.prompt_tokens), 72, n_ctx=512, n_ubatch=32)
    assert list(result.tokens) == reference
    streamed = "".join(e.text for e in events if isinstance(e, TokenStreamed))
    assert streamed == result.text and len(result.text) > 50
    phases = [e.phase for e in events if isinstance(e, RunPhaseChanged)]
    assert phases == ["Provisioning", "WaitingReady", "Running", "Completed", "TearingDown", "Done"]
    for stage in range(3):
        states = [e.state for e in events if isinstance(e, StageStateChanged) and e.stage == stage]
        assert states == ["Preparing", "Ready", "Stopping", "Stopped"], states
    assert any(isinstance(e, AgentLog) for e in events), "agent stderr reaches the orchestrator"
    assert all(ms > 0 for ms in result.timings.stage_mean_step_ms)
    assert Path(result.log_path).exists()
    paths = {(e.producer, e.consumer): (e.data, e.transport) for e in events if isinstance(e, DataPath)}
    way = ("direct", "unix") if DATA_MODES[mode]["data"] == "direct" else ("relay", "relay")
    assert paths == {(0, 1): way, (1, 2): way, (2, 0): way}, "every link of one host: a Unix socket"


async def test_second_run_reuses_the_loaded_stages(tmp_path, model_path, no_agent_left):
    inventory = load_inventory(write_inventory(tmp_path, model_path, UNEVEN, "max_tokens: 8"))
    events: list[object] = []
    pipeline = Pipeline(inventory, events.append)
    try:
        await pipeline.start()
        first = await pipeline.generate("Name a colour.")
        pids = [link.hello.pid for link in pipeline.links]
        loads = sum(1 for e in events if isinstance(e, AgentLog) and "load_tensors" in e.line)
        second = await pipeline.generate("Name a colour.")
        assert [link.hello.pid for link in pipeline.links] == pids
    finally:
        await pipeline.close()
    assert first.run_id != second.run_id
    assert first.tokens == second.tokens  # greedy, fresh KV cache each run
    assert loads == sum(1 for e in events if isinstance(e, AgentLog) and "load_tensors" in e.line)


def test_headless_json(tmp_path, model_path, no_agent_left):
    inventory = write_inventory(tmp_path, model_path, UNEVEN)
    done = run_cli(str(inventory), "--prompt", "What is 2+2?", "--max-tokens", "12", "--json", "-q")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["outcome"] == "completed" and result["architecture"] == "llama"
    assert result["prompt_tokens"] and 0 < len(result["tokens"]) <= 12
    assert result["prompt_reused"] == 0, "one prompt: nothing to reuse"
    assert set(result["timings"]) == {
        "ttft_ms",
        "prefill_ms",
        "decode_ms",
        "decode_tokens_per_s",
        "stage_mean_step_ms",
    }
    assert len(result["timings"]["stage_mean_step_ms"]) == 3
    assert result["feedback"] == "ring"
    assert [(e["producer"], e["consumer"], e["data"]) for e in result["edges"]] == [
        (0, 1, "direct"),
        (1, 2, "direct"),
        (2, 0, "direct"),
    ]


def test_headless_streams_text_and_exits_non_zero_on_a_fault(tmp_path, model_path, no_agent_left):
    inventory = write_inventory(tmp_path, model_path, UNEVEN)
    # A context of 96 positions overflows during decode: the run faults after
    # producing some text, which must still be printed.
    done = run_cli(
        str(inventory),
        "--prompt",
        LONG_PROMPT[:200],
        "--raw",
        "--ignore-eos",
        "--max-tokens",
        "200",
        "--context",
        "96",
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ggufpipe: run faulted: stage 0") and "context full" in last, done.stderr
    assert done.stdout.strip(), "the text produced before the fault is kept"


def test_bad_inventory_exit_status(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {path: m.gguf}\nhosts: {h: {local: true}}\nstages: [{host: nope}]\n")
    done = run_cli(str(bad), "--prompt", "x")
    assert done.returncode == 2
    assert f"{bad}:3: stages[0].host: 'nope' is not defined" in done.stderr


def test_missing_model_names_the_path(tmp_path, no_agent_left):
    inventory = write_inventory(tmp_path, tmp_path / "absent.gguf", "- {host: here}\n")
    done = run_cli(str(inventory), "--prompt", "x")
    assert done.returncode == 2
    assert "absent.gguf: no such file" in done.stderr and "model.path" in done.stderr


def test_the_agent_package_is_a_leaf():
    code = (
        "import sys, ggufpipe_agent.cli, ggufpipe_agent.process.runtime, ggufpipe_agent.llama.engine;"
        "bad = [m for m in sys.modules if m.startswith(('ggufpipe_tui', 'textual', 'asyncssh'))];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


async def test_one_stage_feeds_itself(tmp_path, model_path, no_agent_left):
    """A one-stage token ring: the stage is its own consumer, no link at all."""
    inventory = load_inventory(
        write_inventory(
            tmp_path, model_path, "- {host: here}\n", "max_tokens: 24, ignore_eos: true, chat: false"
        )
    )
    events: list[object] = []
    result = await generate_once(inventory, events, "The capital of France is")
    assert result.outcome == "completed", result.failure
    assert list(result.tokens) == whole_model_greedy(model_path, list(result.prompt_tokens), 24, 512, 32)
    assert [(e.data, e.transport) for e in events if isinstance(e, DataPath)] == [("direct", "self")]


async def test_close_leaves_no_task_running(tmp_path, model_path, no_agent_left):
    """Pipeline.close cancels what it started and awaits it: after it, not
    one task of the pipeline, its links or its runs is left (a long session stays the same size)."""
    import asyncio

    inventory = load_inventory(write_inventory(tmp_path, model_path, UNEVEN, "max_tokens: 3, chat: false"))
    before = asyncio.all_tasks()
    pipeline = Pipeline(inventory, lambda event: None, prepare_ahead=True)
    await pipeline.start()
    assert (await pipeline.generate("Hello")).outcome == "completed"
    await pipeline.close()
    left = [task for task in asyncio.all_tasks() - before if not task.done()]
    assert not left, [task.get_name() for task in left]
    assert not pipeline.tasks.pending() and all(not link.tasks.pending() for link in pipeline.links)
