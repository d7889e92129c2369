"""A host that stops answering altogether (docs/recovery.md): its
stage moves to a spare host. Real agents through the loopback sshd; gpu-b is
reached through a TCP proxy of this test's own, which is cut mid-decode (its
listening socket and every connection closed) while gpu-b's agent is
SIGKILLed: no new connection gets in and nothing of the stage is left. The
inventory's ``spare: true`` host (the same sshd under another name) takes
stage 1 with its layers, the run is replayed and its greedy output is the
unbroken run's; without a spare, or with one too small, recovery gives up
with one reason. No agent or bridge is left on the host."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml

from ggufpipe_tui.core.events import (
    AgentConnected,
    StageDelivery,
    StageRecovery,
)
from ggufpipe_tui.core.recovery import recovery_line
from ggufpipe_tui.session.pipeline import Pipeline
from tests.support.sabotage import Saboteur, assert_recovered, on_token, run_with
from tests.support.ssh_hosts import host_entry, three_stages
from tests.support.sshd import Sshd
from tests.support.tcp_proxy import CuttableProxy, known_hosts_for

pytestmark = [pytest.mark.ssh, pytest.mark.model]


@pytest.fixture
async def proxy(sshd: Sshd):
    front = CuttableProxy(sshd.port)
    front.port = await front.start()  # type: ignore[attr-defined]
    yield front
    await front.close()


def inventory_file(
    tmp_path: Path,
    sshd: Sshd,
    cache: Path,
    model_path: Path,
    port: int,
    spare: dict[str, Any] | None,
    attempts: int,
    send: bool = False,
) -> Path:
    known = known_hosts_for(sshd, port, tmp_path / "known_hosts_proxy")
    hosts = {
        "gpu-a": host_entry(sshd, cache),
        "gpu-b": host_entry(sshd, cache, port=port, known_hosts=str(known)),
    }
    if spare is not None:
        hosts["gpu-c"] = host_entry(sshd, cache, spare=True, **spare)
    path = three_stages(tmp_path, model_path, hosts, recovery={"attempts": attempts, "deadline": 120})
    if send:  # each host is sent its stage file (the spare into a cache of its own)
        document = yaml.safe_load(path.read_text())
        document["model"]["send"] = True
        path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def host_gone(proxy: CuttableProxy, stage: int):
    """gpu-b stops answering: the proxy cut, its agent SIGKILLed."""

    def act(pipeline: Pipeline) -> None:
        hello = pipeline.links[stage].hello
        assert hello is not None
        proxy.cut()
        os.kill(hello.pid, signal.SIGKILL)

    return act


@pytest.mark.parametrize("send", [False, True], ids=["host-copies", "send"])
async def test_a_host_gone_moves_its_stage_to_the_spare(
    tmp_path, sshd, cache_dir, model_path, proxy, none_left, send
):
    spare = {"cache_dir": str(tmp_path / "spare-cache")} if send else {}
    path = inventory_file(tmp_path, sshd, cache_dir, model_path, proxy.port, spare, attempts=2, send=send)
    saboteur = Saboteur(on_token(6), host_gone(proxy, 1))
    result = await run_with(saboteur, path)
    recovered = assert_recovered(
        saboteur, result, model_path, f"stage 1 on gpu-b ({sshd.user}@127.0.0.1:{proxy.port})"
    )
    assert recovered.how == "moved to gpu-c"
    assert "; moved to gpu-c; replayed" in recovery_line(recovered)
    recovery = [e for e in saboteur.events if isinstance(e, StageRecovery)]
    assert (recovery[-1].host, recovery[-1].detail) == ("gpu-c", "moved to gpu-c")
    connected = [e.host for e in saboteur.events if isinstance(e, AgentConnected) and e.stage == 1]
    assert connected == ["gpu-b", "gpu-c"], connected
    if send:  # the spare was sent stage 1's file (its cache had none)
        delivered = [e for e in saboteur.events if isinstance(e, StageDelivery) and e.state == "done"]
        assert [(e.stage, e.outcome) for e in delivered if e.host == "gpu-c"] == [(1, "sent")], delivered
    parts = {k: round(getattr(recovered, k), 2) for k in ("teardown_s", "restart_s", "load_s", "replay_s")}
    print(f"\nloss to the next token, moved to the spare (send: {send}): {sum(parts.values()):.2f} s {parts}")


@pytest.mark.parametrize(
    ("spare", "said"),
    [
        (None, "no spare host (spare: true) to move stage 1 to"),
        ({"memory": "16MiB"}, "no spare host could take stage 1: gpu-c: stage 1 needs"),
    ],
    ids=["no-spare", "spare-too-small"],
)
async def test_a_host_gone_without_a_spare_is_one_reason(
    tmp_path, sshd, cache_dir, model_path, proxy, none_left, spare, said
):
    path = inventory_file(tmp_path, sshd, cache_dir, model_path, proxy.port, spare, attempts=1)
    saboteur = Saboteur(on_token(6), host_gone(proxy, 1))
    result = await run_with(saboteur, path)
    assert saboteur.fired
    assert result.outcome == "faulted"
    reason = result.failure
    assert reason.startswith(f"stage 1 on gpu-b ({sshd.user}@127.0.0.1:{proxy.port})"), reason
    assert "(recovery gave up: 1 of recovery.attempts 1 used; tried: attempt 1 failed: " in reason, reason
    assert "cannot reach the SSH server" in reason, reason
    assert said in reason, reason
    states = [e.state for e in saboteur.events if isinstance(e, StageRecovery)]
    assert states == ["Lost", "Recovering"], states  # the run's fault carries the reason
    print(f"\n{reason}")
