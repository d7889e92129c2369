"""Paths the wire can set (Inspect.path, Tokenize.path, ProvisionStage.gguf_source)
all go through ``check_gguf_path``: only ``~`` of the agent's own user is
expanded, never an environment variable or another user's ``~name``, and an
error never quotes the file's bytes (docs/security.md, "A misbehaving stage or orchestrator")."""

from __future__ import annotations

import getpass
import os
from pathlib import Path

import pytest

from ggufpipe_agent.errors import ModelError
from ggufpipe_agent.gguf.facts import check_gguf_path
from ggufpipe_agent.wire.protocol import Inspect, RequestFailed
from tests.support.agent_client import AgentClient


def test_environment_variables_are_not_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("GGUFPIPE_TEST_SECRET", "hunter2")
    with pytest.raises(ModelError) as caught:
        check_gguf_path("$GGUFPIPE_TEST_SECRET/model.gguf")
    assert "hunter2" not in str(caught.value)
    assert "$GGUFPIPE_TEST_SECRET/model.gguf: no such file" in str(caught.value)
    with pytest.raises(ModelError) as caught:
        check_gguf_path("${GGUFPIPE_TEST_SECRET}")
    assert "hunter2" not in str(caught.value)


def test_only_the_agents_own_home_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\x00" * 12)
    assert check_gguf_path("~/m.gguf") == model
    with pytest.raises(ModelError, match="only ~/ of the agent's own user is expanded"):
        check_gguf_path("~root/m.gguf")
    with pytest.raises(ModelError, match="only ~/ of the agent's own user is expanded"):
        check_gguf_path(f"~{getpass.getuser()}/m.gguf")


def test_errors_never_quote_the_files_bytes(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"pass=hunter2\n")
    with pytest.raises(ModelError) as caught:
        check_gguf_path(secret)
    assert str(caught.value) == f"{secret}: not a GGUF file"
    assert "pass" not in str(caught.value) and "hunter2" not in str(caught.value)


async def test_an_agent_reads_no_variable_back_to_the_orchestrator(no_agent_left, monkeypatch):
    """The probe of the issue: Inspect of a path made of a variable, answered
    by a real agent process."""
    monkeypatch.setenv("GGUFPIPE_TEST_SECRET", "hunter2")  # the agent inherits it
    client = AgentClient()
    await client.start()
    try:
        await client.send(Inspect(1, "$GGUFPIPE_TEST_SECRET", False))
        reply = await client.expect(RequestFailed)
        assert "hunter2" not in reply.reason and "$GGUFPIPE_TEST_SECRET" in reply.reason
        await client.send(Inspect(2, str(Path(os.__file__)), False))
        reply = await client.expect(RequestFailed)
        assert reply.reason.endswith("os.py: not a GGUF file"), reply.reason
    finally:
        await client.close()
