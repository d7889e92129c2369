"""The agent's private directory (its data socket) goes with the agent, also
when the agent is SIGKILLed: the next agent removes what a dead one left, and
never a live agent's (issue 14.10)."""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

from tests.agent_client import AgentClient


def private_dir(client: AgentClient) -> Path:
    assert client.hello is not None
    return Path(client.hello.data_endpoint.removeprefix("unix:")).parent


async def test_a_killed_agents_directory_is_removed_by_the_next_agent(no_agent_left):
    killed = AgentClient()
    await killed.start()
    left = private_dir(killed)
    assert stat.S_IMODE(left.stat().st_mode) == 0o700
    live = AgentClient()
    await live.start()
    assert killed.process is not None
    os.kill(killed.process.pid, signal.SIGKILL)
    await killed.process.wait()
    assert left.exists(), "a SIGKILLed agent cannot clean up after itself"
    successor = AgentClient()
    await successor.start()
    try:
        assert not left.exists(), "the next agent removed the dead one's directory"
        assert private_dir(live).exists(), "and left the live one's alone"
    finally:
        assert await successor.close() == 0
        assert await live.close() == 0
    assert not private_dir(live).exists() and not private_dir(successor).exists()
