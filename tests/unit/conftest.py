"""The unit lane: no real model, no agent process, no server. Whatever
needs one fails here at once, naming the lane it belongs in, so the fast lane
(scripts/test --fast) stays fast and no marker can be forgotten."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

WHERE = "tests/agent, tests/model, tests/ssh, tests/tui or tests/e2e"
#: A command that runs one of ours: ``-m PACKAGE`` or an entry point.
MODULES = ("ggufpipe_agent", "ggufpipe_agent.cli", "ggufpipe_tui.cli")
ENTRY_POINTS = ("ggufpipe-agent", "ggufpipe-tui")


def _refused(what: str) -> pytest.fail.Exception:
    return pytest.fail.Exception(f"the unit lane {what}: this test belongs in {WHERE}")


def _ours(args: Any) -> bool:
    words = [args] if isinstance(args, str | bytes) else list(args)
    words = [w.decode() if isinstance(w, bytes) else str(w) for w in words]
    return any(w in MODULES or w.endswith(ENTRY_POINTS) for w in words)


@pytest.fixture(autouse=True)
def unit_lane(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    popen = subprocess.Popen.__init__

    def guarded_popen(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
        if _ours(args):
            raise _refused("starts no ggufpipe process")
        popen(self, args, *rest, **kwargs)

    exec_ = asyncio.create_subprocess_exec

    async def guarded_exec(program: Any, *args: Any, **kwargs: Any) -> Any:
        if _ours([program, *args]):
            raise _refused("starts no ggufpipe process")
        return await exec_(program, *args, **kwargs)

    def no_model(*args: Any, **kwargs: Any) -> None:
        raise _refused("loads no model into llama.cpp")

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded_popen)
    monkeypatch.setattr(asyncio, "create_subprocess_exec", guarded_exec)
    monkeypatch.setattr("llama_cpp.llama_model_load_from_file", no_model)
    yield


@pytest.fixture
def model_path() -> None:
    raise _refused("uses no real model")


@pytest.fixture
def gemma3_path() -> None:
    raise _refused("uses no real model")


# ------------------------------------------- an agent in this process (fakes)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """The synthetic llama model's file (tests/support/inprocess_agent.py)."""
    from tests.support.inprocess_agent import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture
async def agent(tmp_path, caplog):
    """The agent's own runtime and control session in this process, llama.cpp
    replaced by a fake engine; it must end cleanly and log no traceback."""
    from tests.support.inprocess_agent import InProcessAgent, no_crash

    client = InProcessAgent(tmp_path / "stages")
    await client.start()
    await client.attach_data()
    yield client
    assert await client.close() == "the orchestrator closed the control stream"
    no_crash(caplog)
