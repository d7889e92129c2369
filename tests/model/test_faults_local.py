"""Faults over the local transport: every failure ends in one clear reason, a
full teardown, no process left behind, and the output so far kept."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ggufpipe_tui.core.events import RunPhaseChanged, TokenStreamed
from ggufpipe_tui.core.inventory import load_inventory
from ggufpipe_tui.session.pipeline import Pipeline, PipelineError
from tests.support.common import MODES, mode_yaml
from tests.support.local import run_cli, write_inventory
from tests.support.sabotage import Saboteur, on_state, on_token, run_with, signal_agent, text_so_far

pytestmark = pytest.mark.model


def inventory_file(
    tmp_path: Path,
    model_path: Path,
    hosts: str = "",
    stage_hosts=("here", "here", "here"),
    mode: str = "direct",
    **timeouts,
) -> Path:
    limits = {"connect": 30, "ready": 60, "step": 30, "teardown": 5, **timeouts}
    data, feedback = mode_yaml(mode)
    ranges = [(0, 7), (7, 23), (23, 30)]
    stages = "".join(
        f"- {{host: {h}, layers: [{a}, {b}]}}\n" for h, (a, b) in zip(stage_hosts, ranges, strict=True)
    )
    return write_inventory(
        tmp_path,
        model_path,
        stages,
        f"max_tokens: 40, ignore_eos: true, chat: false, {feedback}",
        data,
        hosts=hosts,
        timeouts=", ".join(f"{k}: {v}" for k, v in limits.items()),
        # These tests are of the fault itself: recovery (tests/e2e/test_recovery.py) is off.
        extra="recovery: {attempts: 0}\n",
    )


def log_events(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


async def test_agent_killed_while_loading(tmp_path, model_path, no_agent_left):
    saboteur = Saboteur(on_state(1, "Preparing"), signal_agent(1, signal.SIGKILL))
    result = await run_with(saboteur, inventory_file(tmp_path, model_path))
    assert saboteur.fired and result.outcome == "faulted" and result.tokens == ()
    assert result.failure.startswith("stage 1 on here (local)") and "killed by signal 9" in result.failure
    assert saboteur.phases() == ["Provisioning", "WaitingReady", "Faulted", "TearingDown", "Done"]
    records = log_events(result.log_path)
    assert any(
        r["event"] == "RunPhaseChanged" and r["phase"] == "Faulted" and "signal 9" in r["detail"]
        for r in records
    )


@pytest.mark.parametrize("mode", MODES)
async def test_agent_killed_during_prefill(tmp_path, model_path, no_agent_left, mode):
    saboteur = Saboteur(
        lambda e: isinstance(e, RunPhaseChanged) and e.phase == "Running", signal_agent(2, signal.SIGKILL)
    )
    result = await run_with(saboteur, inventory_file(tmp_path, model_path, mode=mode))
    assert result.outcome == "faulted" and result.tokens == ()
    assert "stage 2 on here" in result.failure and "signal 9" in result.failure
    assert saboteur.phases()[-3:] == ["Faulted", "TearingDown", "Done"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stage", [0, 2])
async def test_agent_killed_during_decode_keeps_the_output(tmp_path, model_path, no_agent_left, mode, stage):
    """Stage 0 (the token ring's consumer) or the last stage (its producer)."""
    saboteur = Saboteur(on_token(5), signal_agent(stage, signal.SIGKILL))
    result = await run_with(saboteur, inventory_file(tmp_path, model_path, mode=mode))
    assert result.outcome == "faulted"
    assert result.failure == f"stage {stage} on here (local): the agent exited (killed by signal 9)", (
        "the dead stage is the one reason, not the links it took with it"
    )
    assert 6 <= len(result.tokens) < 40 and result.text.strip()
    streamed = "".join(e.text for e in saboteur.events if isinstance(e, TokenStreamed))
    assert streamed == result.text


@pytest.mark.parametrize("mode", MODES)
async def test_a_hanging_stage_hits_the_step_timeout(tmp_path, model_path, no_agent_left, mode):
    saboteur = Saboteur(on_token(3), signal_agent(1, signal.SIGSTOP))
    result = await run_with(saboteur, inventory_file(tmp_path, model_path, mode=mode, step=2, teardown=2))
    # On the token ring the stages may be a token or two ahead of the orchestrator.
    assert result.outcome == "faulted"
    assert result.failure == f"step timeout waiting for token {len(result.tokens)}"
    assert 4 <= len(result.tokens) < 40
    assert any("no StageStopped from stage(s) 1" in note for note in result.notes)


async def test_a_stage_that_never_becomes_ready(tmp_path, model_path, no_agent_left):
    saboteur = Saboteur(on_state(2, "Preparing"), signal_agent(2, signal.SIGSTOP))
    result = await run_with(saboteur, inventory_file(tmp_path, model_path, ready=3, teardown=2))
    assert result.outcome == "faulted"
    # On the direct token ring stage 0's ring end is opened by the stopped
    # stage 2, so stage 0 waits for it too (and says so); a stage still
    # loading when the 3 s are up (a busy machine) is named as well.
    named = result.failure.removeprefix("readiness timeout: stage(s) ").removesuffix(" never became ready")
    assert {0, 2} <= {int(stage) for stage in named.split(", ")}, result.failure


async def refused_at_start(
    tmp_path: Path, model_path: Path, other: Path, stage_hosts: tuple[str, ...]
) -> str:
    """Why a run with host "other"'s copy at ``other`` is refused; no run began."""
    hosts = f"  other: {{local: true, model_path: {other}}}\n"
    saboteur = Saboteur(lambda e: False, lambda pipeline: None)
    with pytest.raises(PipelineError) as refused:
        await run_with(saboteur, inventory_file(tmp_path, model_path, hosts, stage_hosts))
    assert saboteur.phases() == [], "refused before any run"
    return str(refused.value)


async def test_model_missing_on_one_host(tmp_path, model_path, no_agent_left):
    """Every host's copy is read (and checked to be stage 0's model) before
    anything loads: a missing one is refused at the start, naming the host."""
    reason = await refused_at_start(
        tmp_path, model_path, tmp_path / "elsewhere.gguf", ("here", "other", "here")
    )
    assert reason.startswith(f"model on other: {tmp_path / 'elsewhere.gguf'}: no such file (")


async def test_corrupt_gguf_on_one_host(tmp_path, model_path, no_agent_left):
    corrupt = tmp_path / "corrupt.gguf"
    with model_path.open("rb") as source, corrupt.open("wb") as target:
        target.write(source.read(5 * 2**20))  # the header is whole, the tensor data is cut
    reason = await refused_at_start(tmp_path, model_path, corrupt, ("here", "here", "other"))
    assert reason.startswith(f"model on other: {corrupt}: corrupt or truncated GGUF")


async def test_corrupt_gguf_where_the_model_is_inspected(tmp_path, model_path, no_agent_left):
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF\x03\x00\x00\x00" + os.urandom(64))
    pipeline = Pipeline(load_inventory(inventory_file(tmp_path, corrupt)), lambda e: None)
    with pytest.raises(PipelineError, match="corrupt.gguf: corrupt or truncated GGUF"):
        try:
            await pipeline.start()
        finally:
            await pipeline.close()


def test_headless_fault_prints_the_output_so_far(tmp_path, model_path, no_agent_left):
    """SIGSTOP an agent from outside mid-decode: the step timeout faults the
    run, the text so far stays on stdout, the reason is the last stderr line."""
    inventory = inventory_file(tmp_path, model_path, step=3, teardown=2)
    command = [
        sys.executable,
        "-m",
        "ggufpipe_tui.cli",
        str(inventory),
        "--prompt",
        "Count to fifty.",
        "--raw",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = text_so_far(process)
    children = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(process.pid)], capture_output=True, text=True
    )
    os.kill(int(children.stdout.split()[1]), signal.SIGSTOP)
    rest, errors = process.communicate(timeout=120)
    assert process.returncode == 1, errors
    assert len(seen + rest.strip()) >= 20, "the text generated before the fault is printed"
    lines = errors.strip().splitlines()
    assert lines[-1].startswith("ggufpipe: run faulted: step timeout waiting for token"), errors
    assert lines[-2].startswith("ggufpipe: run log ")


def test_headless_missing_model_exit_status(tmp_path, no_agent_left):
    done = run_cli(str(inventory_file(tmp_path, tmp_path / "gone.gguf")), "--prompt", "x")
    assert done.returncode == 2 and "gone.gguf: no such file" in done.stderr
