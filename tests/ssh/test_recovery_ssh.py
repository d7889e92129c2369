"""Recovery of a lost stage over SSH (docs/recovery.md): real
agents through a real sshd on loopback. An agent SIGKILLed mid-decode, or
its host's SSH connection dropped, is started again on its host (a new SSH
connection where the old one is gone); the run is replayed and its greedy
output is the unbroken run's; no agent or bridge is left on the host."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from ggufpipe_tui.session.pipeline import Pipeline
from tests.support.sabotage import Saboteur, assert_recovered, on_token, run_with, signal_agent
from tests.support.ssh_hosts import host_entry, sshd_session_of, three_stages, where
from tests.support.sshd import Sshd

pytestmark = [pytest.mark.ssh, pytest.mark.model]


def inventory_file(tmp_path: Path, sshd: Sshd, cache: Path, model_path: Path) -> Path:
    hosts = {"gpu-a": host_entry(sshd, cache), "gpu-b": host_entry(sshd, cache)}
    return three_stages(tmp_path, model_path, hosts, recovery={"attempts": 2, "deadline": 120})


@pytest.mark.parametrize(("stage", "host"), [(1, "gpu-b"), (0, "gpu-a")])
async def test_agent_killed_mid_decode_is_restarted(
    tmp_path, sshd, cache_dir, model_path, none_left, stage, host
):
    saboteur = Saboteur(on_token(6), signal_agent(stage, signal.SIGKILL))
    result = await run_with(saboteur, inventory_file(tmp_path, sshd, cache_dir, model_path))
    assert_recovered(saboteur, result, model_path, f"stage {stage} on {host} ({where(sshd)})")


async def test_ssh_connection_dropped_is_reconnected(tmp_path, sshd, cache_dir, model_path, none_left):
    def drop(pipeline: Pipeline) -> None:
        hello = pipeline.links[1].hello
        assert hello is not None
        os.kill(sshd_session_of(hello.pid), signal.SIGKILL)

    saboteur = Saboteur(on_token(6), drop)
    result = await run_with(saboteur, inventory_file(tmp_path, sshd, cache_dir, model_path))
    assert_recovered(saboteur, result, model_path, f"stage 1 on gpu-b ({where(sshd)})")
