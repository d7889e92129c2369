"""Faults over the SSH transport (docs/design.md, "Run state machine", "Security model", "Correctness guarantees"): real agents
started through a real sshd on loopback (forwarding off), the real model.

Two hosts, gpu-a and gpu-b, each with its own SSH connection to the same
sshd; stages 0 and 2 on gpu-a, stage 1 on gpu-b. Every fault ends in one
reason naming the stage, the host and the cause, the run's output so far is
kept, and no agent or data bridge is left on the host (processes whose
SSH_CONNECTION names this module's sshd): teardown is the code under test's
own, nothing here kills a leftover.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from ggufpipe_tui.core.events import DataPath, RunPhaseChanged, TokenStreamed
from ggufpipe_tui.core.inventory import HostSpec, load_inventory
from ggufpipe_tui.session.pipeline import Pipeline, PipelineError
from ggufpipe_tui.transports.ssh import SshAgent
from tests.support.common import LONG_PROMPT, MODES, REPO
from tests.support.sabotage import Saboteur, on_state, on_token, run_with, signal_agent, text_so_far
from tests.support.ssh_hosts import AGENT, host_entry, sshd_session_of, three_stages, where
from tests.support.sshd import Sshd

pytestmark = [pytest.mark.ssh, pytest.mark.model]


def inventory_file(
    tmp_path: Path,
    sshd: Sshd,
    cache: Path,
    model_path: Path,
    b_model: Path | None = None,
    mode: str = "direct",
    **timeouts: float,
) -> Path:
    hosts = {
        "gpu-a": host_entry(sshd, cache),
        "gpu-b": host_entry(sshd, cache, model_path=str(b_model) if b_model else None),
    }
    path = three_stages(tmp_path, model_path, hosts, mode=mode)
    if timeouts:  # write_inventory's timeouts, with these changed
        limits = {"connect": 20, "ready": 120, "step": 30, "teardown": 10, **timeouts}
        text = path.read_text().split("timeouts:")[0]
        path.write_text(text + "timeouts: {" + ", ".join(f"{k}: {v}" for k, v in limits.items()) + "}\n")
    # These tests are of the fault itself: recovery (tests/ssh/test_recovery_ssh.py) is off.
    path.write_text(path.read_text() + "recovery: {attempts: 0}\n")
    return path


async def test_agent_killed_while_loading(tmp_path, sshd, cache_dir, model_path, none_left):
    saboteur = Saboteur(on_state(1, "Preparing"), signal_agent(1, signal.SIGKILL))
    result = await run_with(saboteur, inventory_file(tmp_path, sshd, cache_dir, model_path))
    assert saboteur.fired and result.outcome == "faulted" and result.tokens == ()
    assert result.failure == f"stage 1 on gpu-b ({where(sshd)}): the agent exited (killed by signal KILL)"
    assert saboteur.phases() == ["Provisioning", "WaitingReady", "Faulted", "TearingDown", "Done"]
    assert saboteur.stopped() == {0, 2}, "the other host's stages stopped"


@pytest.mark.parametrize("mode", MODES)
async def test_agent_killed_during_prefill(tmp_path, sshd, cache_dir, model_path, none_left, mode):
    saboteur = Saboteur(
        lambda e: isinstance(e, RunPhaseChanged) and e.phase == "Running", signal_agent(2, signal.SIGKILL)
    )
    result = await run_with(saboteur, inventory_file(tmp_path, sshd, cache_dir, model_path, mode=mode))
    assert result.outcome == "faulted" and result.tokens == ()
    assert result.failure == f"stage 2 on gpu-a ({where(sshd)}): the agent exited (killed by signal KILL)"
    assert saboteur.phases()[-3:] == ["Faulted", "TearingDown", "Done"]
    assert saboteur.stopped() == {0, 1}


@pytest.mark.parametrize("mode", MODES)
async def test_agent_killed_during_decode_keeps_the_output(
    tmp_path, sshd, cache_dir, model_path, none_left, mode
):
    saboteur = Saboteur(on_token(5), signal_agent(0, signal.SIGKILL))
    result = await run_with(saboteur, inventory_file(tmp_path, sshd, cache_dir, model_path, mode=mode))
    assert result.outcome == "faulted", result.failure
    assert result.failure == f"stage 0 on gpu-a ({where(sshd)}): the agent exited (killed by signal KILL)"
    assert 6 <= len(result.tokens) < 40 and result.text.strip()
    streamed = "".join(e.text for e in saboteur.events if isinstance(e, TokenStreamed))
    assert streamed == result.text
    assert saboteur.stopped() == {1, 2}


@pytest.mark.parametrize("mode", MODES)
async def test_ssh_connection_dropped_mid_run(tmp_path, sshd, cache_dir, model_path, none_left, mode):
    """The sshd process serving gpu-b's connection dies mid-decode: the run
    faults naming gpu-b and the lost connection; gpu-a's stages stop."""
    dropped: list[int] = []

    def drop(pipeline: Pipeline) -> None:
        hello = pipeline.links[1].hello
        assert hello is not None
        dropped.append(sshd_session_of(hello.pid))
        os.kill(dropped[0], signal.SIGKILL)

    saboteur = Saboteur(on_token(5), drop)
    result = await run_with(saboteur, inventory_file(tmp_path, sshd, cache_dir, model_path, mode=mode))
    assert result.outcome == "faulted", result.failure
    # Not "the agent exited": sshd reported no exit, only the connection went.
    assert result.failure.startswith(f"stage 1 on gpu-b ({where(sshd)}): the SSH connection was lost ("), (
        result.failure
    )
    assert 6 <= len(result.tokens) < 40 and result.text.strip()
    assert saboteur.stopped() == {0, 2}, "gpu-a's stages were torn down"


def kill_tcp(port: int) -> None:
    """Abort both ends of the TCP connections to ``port`` (the kernel's
    SOCK_DESTROY, as a dropped network path or a stateful firewall would)."""
    for selector in (
        ["dst", "127.0.0.1", "dport", "=", str(port)],
        ["src", "127.0.0.1", "sport", "=", str(port)],
    ):
        subprocess.run(["ss", "-K", *selector], capture_output=True, check=False)


async def test_a_direct_link_dropped_mid_run(tmp_path, sshd, cache_dir, model_path, none_left):
    """The TLS link from stage 1 (gpu-b) to stage 2 (gpu-a) is cut mid-decode,
    both agents alive, recovery off: the run faults naming the link (with the
    end that saw it), the output so far is kept, every stage takes its StopRun.
    With recovery the link is made again (tests/ssh/test_link_repair_ssh.py)."""

    def cut(pipeline: Pipeline) -> None:
        (path,) = [e for e in saboteur.events if isinstance(e, DataPath) and e.producer == 1]
        assert path.transport == "tls", path
        kill_tcp(int(path.endpoint.rsplit(":", 1)[1]))

    saboteur = Saboteur(on_token(5), cut)
    result = await run_with(saboteur, inventory_file(tmp_path, sshd, cache_dir, model_path, mode="direct"))
    assert saboteur.fired and result.outcome == "faulted", result.failure
    assert result.failure.startswith(
        (
            "the direct link from stage 1 to stage 2 broke (stage 1 on gpu-b",
            "the direct link from stage 1 to stage 2 broke (stage 2 on gpu-a",
        )
    ), result.failure
    assert 6 <= len(result.tokens) < 40 and result.text.strip(), "the output so far is kept"
    assert saboteur.stopped() == {0, 1, 2}, "every agent is alive and stops"


def ended_by_teardown(saboteur: Saboteur, stage: int) -> None:
    """A SIGSTOPped agent reads no EOF, sshd refuses signal requests on a root
    login and closing the channel or connection signals nothing: the close
    path's own kill by pid must have ended it."""
    assert saboteur.pipeline is not None
    link = saboteur.pipeline.links[stage]
    assert "(killed by signal KILL)" in link.exit_detail(), link.exit_detail()
    assert any("did not end on EOF or signals; killed it" in line for line in saboteur.logged(stage))
    assert saboteur.close_seconds < 8, f"closing took {saboteur.close_seconds:.1f}s"


@pytest.mark.parametrize("mode", MODES)
async def test_a_hanging_stage_hits_the_step_timeout(tmp_path, sshd, cache_dir, model_path, none_left, mode):
    saboteur = Saboteur(on_token(3), signal_agent(1, signal.SIGSTOP))
    inventory = inventory_file(tmp_path, sshd, cache_dir, model_path, mode=mode, step=2, teardown=2)
    result = await run_with(saboteur, inventory)
    # On the token ring the stages may be a token or two ahead of the orchestrator.
    assert result.outcome == "faulted"
    assert result.failure == f"step timeout waiting for token {len(result.tokens)}"
    assert 4 <= len(result.tokens) < 40 and result.text.strip(), "the output so far is kept"
    assert result.notes == ("teardown timeout: no StageStopped from stage(s) 1",)
    assert saboteur.stopped() == {0, 2}
    ended_by_teardown(saboteur, 1)


async def test_a_stage_that_never_becomes_ready(tmp_path, sshd, cache_dir, model_path, none_left):
    saboteur = Saboteur(on_state(1, "Preparing"), signal_agent(1, signal.SIGSTOP))
    inventory = inventory_file(tmp_path, sshd, cache_dir, model_path, ready=3, teardown=2)
    result = await run_with(saboteur, inventory)
    assert result.outcome == "faulted" and result.tokens == ()
    # Direct links: stage 2's inbound end is opened by the stopped stage 1,
    # so stage 2 waits for it too (and says so).
    assert result.failure == "readiness timeout: stage(s) 1, 2 never became ready"
    assert saboteur.stopped() == {0, 2}
    ended_by_teardown(saboteur, 1)


async def test_teardown_kills_only_what_its_connection_started(sshd, cache_dir, none_left):
    """The kill by pid runs only on a process whose SSH_CONNECTION is the
    connection's own: given the pid of an agent another connection started
    (or a pid an agent reports from inside a container), it does nothing."""
    hosts = {
        name: HostSpec(
            name=name,
            line=1,
            address="127.0.0.1",
            port=sshd.port,
            user=sshd.user,
            identity=(str(sshd.client_key),),
            known_hosts=(str(sshd.known_hosts),),
            agent=AGENT,
            cache_dir=str(cache_dir),
        )
        for name in ("gpu-a", "gpu-b")
    }
    ours, other = (
        SshAgent(hosts["gpu-a"], 0, lambda line: None),
        SshAgent(hosts["gpu-b"], 1, lambda line: None),
    )
    try:
        own, others = await asyncio.gather(ours.start(20), other.start(20))
        ours.hello = replace(own, pid=others.pid)
        await ours._kill_by_pid(5)
        await asyncio.sleep(0.5)
        assert other.alive() and Path(f"/proc/{others.pid}").exists(), "another connection's agent was killed"
        ours.hello = own
    finally:
        await asyncio.gather(ours.close(3), other.close(3))


async def test_model_missing_on_one_host(tmp_path, sshd, cache_dir, model_path, none_left):
    """Every host's copy is read before anything loads (and checked to be
    stage 0's model): a missing one is refused at the start, naming the host
    and its model_path."""
    saboteur = Saboteur(lambda e: False, lambda p: None)
    inventory = inventory_file(tmp_path, sshd, cache_dir, model_path, tmp_path / "elsewhere.gguf")
    with pytest.raises(PipelineError) as refused:
        await run_with(saboteur, inventory)
    missing = tmp_path / "elsewhere.gguf"
    line = load_inventory(inventory).hosts["gpu-b"].line
    assert (
        str(refused.value)
        == f"model on gpu-b: {missing}: no such file (hosts.gpu-b.model_path at {inventory}:{line})"
    )
    assert saboteur.phases() == [], "no run was planned"


async def test_corrupt_gguf_on_one_host(tmp_path, sshd, cache_dir, model_path, none_left):
    corrupt = tmp_path / "corrupt.gguf"
    with model_path.open("rb") as source, corrupt.open("wb") as target:
        target.write(source.read(5 * 2**20))  # the header is whole, the tensor data is cut
    saboteur = Saboteur(lambda e: False, lambda p: None)
    with pytest.raises(PipelineError) as refused:
        await run_with(saboteur, inventory_file(tmp_path, sshd, cache_dir, model_path, corrupt))
    assert str(refused.value).startswith(f"model on gpu-b: {corrupt}: corrupt or truncated GGUF ("), (
        refused.value
    )
    assert saboteur.phases() == [], "refused before any run"


def test_headless_fault_prints_the_output_so_far(tmp_path, sshd, cache_dir, model_path, none_left):
    """ggufpipe-tui INVENTORY --prompt against the SSH hosts; gpu-b's agent is
    SIGKILLed mid-decode: the text so far stays on stdout, the exit status is 1
    and the reason is the last stderr line."""
    inventory = inventory_file(tmp_path, sshd, cache_dir, model_path)
    command = [
        *(str(REPO / ".venv" / "bin" / "ggufpipe-tui"), str(inventory), "--prompt", LONG_PROMPT),
        *("--raw", "--max-tokens", "400"),  # long enough to be under way when the agent dies
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = text_so_far(process)
        agents = [pid for pid, line in sshd.session_agents().items() if " bridge " not in line]
        sessions = [sshd_session_of(pid) for pid in agents]
        (gpu_b,) = [
            pid for pid, session in zip(agents, sessions, strict=True) if sessions.count(session) == 1
        ]
        os.kill(gpu_b, signal.SIGKILL)
        rest, errors = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 1, errors
    assert len(seen + rest.strip()) >= 20, "the text generated before the fault is printed"
    lines = errors.strip().splitlines()
    assert lines[-1] == (
        f"ggufpipe: run faulted: stage 1 on gpu-b ({where(sshd)}): the agent exited (killed by signal KILL)"
    ), errors
    assert lines[-2].startswith("ggufpipe: run log ")
