"""Heartbeats on the control channel both ways (docs/protocol.md, "Heartbeats"): a stage that
says nothing for ``timeouts.heartbeat`` seconds is lost with "no answer from
stage N on HOST for T s", and an agent whose orchestrator says nothing for
as long ends on its own. Frozen processes (SIGSTOP) and a network that stops
carrying packets without a reset (a TCP proxy in front of the loopback sshd
that stops forwarding), with real agents and the real model."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from ggufpipe_tui.core.inventory import load_inventory
from ggufpipe_tui.session.pipeline import Pipeline
from tests.support.common import REPO
from tests.support.ssh_hosts import host_entry, wait_no_session_agents, write_inventory
from tests.support.sshd import Sshd

pytestmark = pytest.mark.model


def local_inventory(tmp_path: Path, model_path: Path, heartbeat: float, **timeouts: float) -> Path:
    limits = {"connect": 30, "ready": 180, "step": 30, "teardown": 5, "heartbeat": heartbeat, **timeouts}
    path = tmp_path / "inventory.yaml"
    path.write_text(
        f"model: {{path: {model_path}}}\n"
        "hosts:\n  here: {local: true, threads: 1}\n"
        "stages:\n  - {host: here, layers: [0, 10]}\n  - {host: here, layers: [10, 20]}\n"
        "  - {host: here, layers: [20, 30]}\n"
        "run: {context: 256, max_tokens: 4, ignore_eos: true, chat: false}\n"
        f"timeouts: {{{', '.join(f'{k}: {v}' for k, v in limits.items())}}}\n"
        "recovery: {attempts: 0}\n"  # the fault the heartbeat finds (test_recovery.py recovers it)
    )
    return path


def children(pid: int) -> set[int]:
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            found |= {int(child) for child in (task / "children").read_text().split()}
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return state != b"Z"


async def test_a_frozen_agent_is_reported_within_the_bound(tmp_path, model_path, no_agent_left):
    """Between two runs stage 1's agent is stopped: the next run ends with the
    heartbeat's reason after about 3 s, not at the readiness timeout."""
    pipeline = Pipeline(load_inventory(local_inventory(tmp_path, model_path, heartbeat=3)), lambda e: None)
    try:
        await pipeline.start()
        warm = await pipeline.generate("One")
        assert warm.outcome == "completed", warm.failure
        hello = pipeline.links[1].hello
        assert hello is not None
        os.kill(hello.pid, signal.SIGSTOP)
        started = time.monotonic()
        result = await asyncio.wait_for(pipeline.generate("Two"), 25)
        took = time.monotonic() - started
    finally:
        await pipeline.close()  # SIGKILL ends a stopped agent too
    assert result.outcome == "faulted"
    assert result.failure == "no answer from stage 1 on here (local) for 3 s", result.failure
    assert took < 8, f"noticed after {took:.1f}s"


def test_an_agent_whose_orchestrator_froze_ends_on_its_own(tmp_path, model_path, no_agent_left):
    """The orchestrator is stopped mid-run: its agents hear nothing more and
    exit within the bound (PR_SET_PDEATHSIG only covers an orchestrator that
    dies, not one that is frozen)."""
    inventory = local_inventory(tmp_path, model_path, heartbeat=3)
    command = [str(REPO / ".venv" / "bin" / "ggufpipe-tui"), str(inventory), "--prompt", "Count to 500."]
    orchestrator = subprocess.Popen(
        [*command, "--max-tokens", "400", "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        assert orchestrator.stdout is not None
        text = b""
        while len(text.strip()) < 10:  # generation is under way
            chunk = orchestrator.stdout.read1(64)  # type: ignore[attr-defined]
            assert chunk, "the orchestrator ended before generating"
            text += chunk
        agents = children(orchestrator.pid)
        assert len(agents) == 3, agents
        os.kill(orchestrator.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        while any(alive(pid) for pid in agents) and time.monotonic() - stopped < 15:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in agents), "agents outlived a frozen orchestrator"
        assert time.monotonic() - stopped < 8
    finally:
        orchestrator.kill()
        orchestrator.wait()


class Blackhole:
    """A TCP proxy to ``target`` that can stop forwarding without closing
    anything: packets stop, no FIN, no RST, like a pulled cable."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.frozen = False
        self.thaw = asyncio.Event()
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        self.writers += [writer, up_writer]
        with contextlib.suppress(asyncio.CancelledError):  # the test's loop ending
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))

    async def _pump(self, source: asyncio.StreamReader, target: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while True:
                if self.frozen:
                    await self.thaw.wait()  # nothing is read or written any more
                    return
                data = await source.read(1 << 16)
                if not data:
                    return
                if self.frozen:  # in flight when the cable went: lost
                    await self.thaw.wait()
                    return
                target.write(data)
                await target.drain()

    async def close(self) -> None:
        self.thaw.set()
        for writer in self.writers:
            writer.close()
        if self.server is not None:
            self.server.close()


@pytest.mark.ssh
async def test_a_network_that_vanishes_without_a_reset(tmp_path, sshd: Sshd, cache_dir, model_path):
    """The orchestrator reaches the host through a proxy that stops carrying
    packets: the session ends with the heartbeat's reason within the bound,
    the agent on the host ends on its own, and closing is bounded."""
    proxy = Blackhole(sshd.port)
    port = await proxy.start()
    known = tmp_path / "known_hosts"  # the host's key, under the proxy's port
    kind, blob = sshd.host_key.with_suffix(".pub").read_text().split()[:2]
    known.write_text(f"[127.0.0.1]:{port} {kind} {blob}\n")
    hosts = {"gpu": host_entry(sshd, cache_dir, port=port, known_hosts=str(known))}
    stages = [("gpu", [0, 15]), ("gpu", [15, 30])]
    path = write_inventory(
        tmp_path / "inventory.yaml", model_path, hosts, stages, max_tokens=4, ignore_eos=True
    )
    document = yaml.safe_load(path.read_text())
    document["timeouts"]["heartbeat"] = 3
    document["recovery"] = {"attempts": 0}  # the fault itself
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    pipeline = Pipeline(load_inventory(path), lambda event: None)
    try:
        await pipeline.start()
        assert (await pipeline.generate("One")).outcome == "completed"
        proxy.frozen = True
        cut = time.monotonic()
        reason = await asyncio.wait_for(pipeline.wait_stopped(), 20)
        noticed = time.monotonic() - cut
        assert reason.startswith("no answer from stage ") and f"127.0.0.1:{port}) for 3 s" in reason, reason
        assert noticed < 8, f"noticed after {noticed:.1f}s"
        assert wait_no_session_agents(sshd, 10) == {}, "the agents on the host ended on their own"
        closing = time.monotonic()
    finally:
        await pipeline.close()
        await proxy.close()
    assert time.monotonic() - closing < 30, "closing a pipeline whose network is gone is bounded"
