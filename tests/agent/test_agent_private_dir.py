"""The agent's private directory (its data socket) goes with the agent, also
when the agent is SIGKILLed: the next agent removes what a dead one left, and
never a live agent's (a long-lived host stays clean)."""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

from ggufpipe_agent.process.socket_dir import LOCK_NAME, PREFIX, STARTING_NAME, PrivateDirectory, remove_stale
from tests.support.agent_client import AgentClient


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


def test_an_agent_still_starting_keeps_its_directory_and_a_dead_ones_goes(tmp_path):
    """Two agents of one account start at the same moment (two stages on one
    host): the directory of the one still starting (its lock file not yet in
    place) is not taken for a dead agent's; a directory whose lock nobody
    holds is."""
    starting = tmp_path / f"{PREFIX}starting"
    starting.mkdir(mode=0o700)
    (starting / STARTING_NAME).touch()  # being locked: not yet renamed into place
    dead = tmp_path / f"{PREFIX}dead"
    dead.mkdir(mode=0o700)
    (dead / LOCK_NAME).touch()  # nobody holds it
    assert remove_stale(str(tmp_path)) == 1
    assert starting.exists() and not dead.exists()
    live = PrivateDirectory(str(tmp_path))
    try:
        assert sorted(path.name for path in live.path.iterdir()) == [LOCK_NAME], "locked, then in place"
        assert remove_stale(str(tmp_path)) == 0 and live.path.exists(), "a live agent's lock is held"
    finally:
        live.remove()
