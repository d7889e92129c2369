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

from ggufpipe_tui.core.events import RunRecovered, StageRecovery, TokenStreamed
from ggufpipe_tui.session.pipeline import Pipeline
from tests.support.common import whole_model_greedy
from tests.support.sabotage import Saboteur, assert_recovered, on_token, run_with, signal_agent
from tests.support.ssh_hosts import (
    RANGES,
    host_entry,
    sshd_session_of,
    three_stages,
    where,
    write_inventory,
)
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


async def test_a_shared_process_killed_is_started_again_over_ssh(
    tmp_path, sshd, cache_dir, model_path, none_left
):
    """Stages 0 and 2 share gpu-a's agent process (share_process: true; stage
    2 attached through an exec bridge), stage 1 runs on gpu-b: the shared
    process SIGKILLed mid-decode is started again with both its stages, the
    run is replayed, and the reply is the unbroken one."""
    hosts = {"gpu-a": host_entry(sshd, cache_dir, share_process=True), "gpu-b": host_entry(sshd, cache_dir)}
    stages = [("gpu-a", list(RANGES[0])), ("gpu-b", list(RANGES[1])), ("gpu-a", list(RANGES[2]))]
    path = write_inventory(
        tmp_path / "inv.yaml",
        model_path,
        hosts,
        stages,
        mode="direct",
        recovery={"attempts": 2, "deadline": 120},
        max_tokens=40,
        ignore_eos=True,
    )
    saboteur = Saboteur(on_token(6), signal_agent(2, signal.SIGKILL))
    result = await run_with(saboteur, path)
    assert saboteur.fired and result.outcome == "completed", result.failure
    expected = whole_model_greedy(model_path, list(result.prompt_tokens), 40, n_ctx=512, n_ubatch=32)
    assert list(result.tokens) == expected, "the output differs from an unbroken run"
    streamed = [e.token for e in saboteur.events if isinstance(e, TokenStreamed) and e.sequence >= 0]
    assert streamed == list(result.tokens), "every token streamed once, in order"
    (recovered,) = [e for e in saboteur.events if isinstance(e, RunRecovered)]
    assert recovered.stages == f"stages 0, 2 on gpu-a ({where(sshd)}), one agent process"
    ready = sorted(e.stage for e in saboteur.events if isinstance(e, StageRecovery) and e.state == "Ready")
    assert ready == [0, 2], "both stages of the process started again, gpu-b's kept"
