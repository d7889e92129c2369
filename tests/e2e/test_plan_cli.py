"""``--plan`` and the refusal of a plan that does not fit, end to end: real
agent processes over the local transport, the real SmolLM2 model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ggufpipe_agent.gguf.memory import GIB
from tests.support.common import REPO

pytestmark = pytest.mark.model


def write_inventory(tmp_path: Path, model_path: Path, caps: tuple[str, str], stages: str = "") -> Path:
    """Two local hosts with memory caps; their agents log llama.cpp's own
    messages (-v), which say whether weights were loaded."""
    agent = f"{sys.executable} -m ggufpipe_agent -v"
    cache = tmp_path / "cache"
    hosts = "".join(
        f"  {name}: {{local: true, memory: {cap}, cache_dir: {cache}, agent: '{agent}'}}\n"
        for name, cap in zip("ab", caps, strict=True)
    )
    path = tmp_path / "inventory.yaml"
    path.write_text(
        f"model: {{path: {model_path}}}\nhosts:\n{hosts}"
        f"stages:\n{stages or '  - {host: a}' + chr(10) + '  - {host: b}' + chr(10)}"
        "run: {context: 2048, max_tokens: 4}\n"
        "timeouts: {connect: 30, ready: 120, step: 30, teardown: 10}\n"
    )
    return path


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ggufpipe_tui.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def nothing_loaded(tmp_path: Path, stderr: str) -> None:
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir()), (
        "a stage file was written"
    )
    assert "ggufpipe.llama" in stderr, "the agents' llama.cpp log should be on (-v)"
    assert "load_tensors" not in stderr and "model buffer size" not in stderr, "weights were loaded"


def test_plan_prints_the_plan_and_loads_nothing(tmp_path, model_path, no_agent_left):
    inventory = write_inventory(tmp_path, model_path, ("1GiB", "2GiB"))
    done = cli(str(inventory), "--plan", "--json", "-v")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    layers = [stage["layers"] for stage in plan["stages"]]
    assert layers[0][0] == 0 and layers[0][1] == layers[1][0] and layers[1][1] == 30
    assert all(isinstance(bound, int) for pair in layers for bound in pair)
    # The smaller cap gets fewer blocks.
    assert layers[0][1] - layers[0][0] < layers[1][1] - layers[1][0]
    assert [stage["available_bytes"] for stage in plan["stages"]] == [GIB, 2 * GIB]
    assert plan["fits"] and plan["context"] == 2048 and plan["automatic"]
    nothing_loaded(tmp_path, done.stderr)


def test_plan_as_text(tmp_path, model_path, no_agent_left):
    inventory = write_inventory(tmp_path, model_path, ("1GiB", "2GiB"))
    done = cli(str(inventory), "--plan", "-q")
    assert done.returncode == 0, done.stderr
    assert "split by memory" in done.stdout and "1.00 GiB" in done.stdout and "2.00 GiB" in done.stdout
    assert "[0, " in done.stdout and ", 30)" in done.stdout


def test_a_plan_that_does_not_fit_is_refused_before_anything_loads(tmp_path, model_path, no_agent_left):
    stages = "  - {host: a, layers: [0, 20]}\n  - {host: b, layers: [20, 30]}\n"
    inventory = write_inventory(tmp_path, model_path, ("500MiB", "2GiB"), stages)
    done = cli(str(inventory), "--prompt", "Hello", "-v")
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "ggufpipe: error: the plan does not fit in memory: stage 0 on a (local), layers [0, 20)"
    )
    assert "of RAM" in last and "a has 500 MiB there for the plan (memory: 500 MiB in the inventory)" in last
    # Even one block does not fit there at this context (the fixed parts), so
    # the advice is a shorter context or a bigger cap.
    assert "What would fit: a context of 768 tokens (--context 768; now 2048)" in last
    assert "or memory: 768MiB or more on a" in last
    nothing_loaded(tmp_path, done.stderr)
    # --plan shows the same plan, marked, with the same status.
    shown = cli(str(inventory), "--plan", "-q")
    assert shown.returncode == 2 and "DOES NOT FIT" in shown.stdout
