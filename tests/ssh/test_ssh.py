"""The SSH transport against a real OpenSSH server on loopback with forwarding
off: real agents started through sshd, real llama.cpp, the real model.

Every agent the tests start runs in a session of this module's sshd; the
"nothing left behind" checks look only at those (SSH_CONNECTION names our
port), so agents of other work on the same machine do not count.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ggufpipe_tui.core.events import AgentLog, DataPath, TokenStreamed
from ggufpipe_tui.core.inventory import HostSpec, load_inventory
from ggufpipe_tui.session.pipeline import Pipeline
from ggufpipe_tui.transports.connection import TransportError
from ggufpipe_tui.transports.ssh import SshAgent
from tests.support.common import DATA_MODES, LONG_PROMPT, MODES, REPO, start_then_close, whole_model_greedy
from tests.support.ssh_hosts import (
    AGENT,
    host_entry,
    sshd_host,
    wait_no_session_agents,
    wait_session_agents,
    write_inventory,
)
from tests.support.sshd import Sshd, free_port, keygen

pytestmark = [pytest.mark.ssh, pytest.mark.model]


UNEVEN = [[0, 7], [7, 20], [20, 30]]


def one_stage(tmp_path: Path, model_path: Path, hosts: dict[str, Any], stages: list[Any]) -> Path:
    return write_inventory(tmp_path / "inv.yaml", model_path, hosts, stages)


async def start_failure(inventory_path: Path) -> tuple[str, float]:
    pipeline = Pipeline(load_inventory(inventory_path), lambda event: None)
    started = time.monotonic()
    with pytest.raises(TransportError) as caught:
        await pipeline.start()
    return str(caught.value), time.monotonic() - started


# ------------------------------------------------------------ the pipeline


@pytest.mark.parametrize("mode", MODES)
async def test_three_stages_over_ssh_match_the_whole_model(
    tmp_path, sshd, cache_dir, model_path, none_left, mode
):
    """Two hosts (one sshd), stages 0 and 1 on the first: one connection per
    host, two exec sessions per stage (control + data bridge: sshd refuses
    forwarding). Direct links: a Unix socket from stage 0 to 1 (one host),
    mutual TLS from 1 to 2 and on the ring from 2 to 0 (two hosts)."""
    hosts = {"gpu-a": host_entry(sshd, cache_dir), "gpu-b": host_entry(sshd, cache_dir)}
    stages = [("gpu-a", UNEVEN[0]), ("gpu-a", UNEVEN[1]), ("gpu-b", UNEVEN[2])]
    path = tmp_path / "inv.yaml"
    inventory = load_inventory(
        write_inventory(path, model_path, hosts, stages, mode=mode, max_tokens=64, ignore_eos=True)
    )
    logins, sessions = sshd.accepted_logins(), sshd.log_text().count("Starting session: command")
    events: list[Any] = []
    pipeline = Pipeline(inventory, events.append)
    try:
        await pipeline.start()
        assert wait_session_agents(sshd, 3, 3) == (3, 3), "3 agents and 3 data bridges, all under sshd"
        result = await pipeline.generate(LONG_PROMPT)
    finally:
        await pipeline.close()
    assert result.outcome == "completed" and result.stop_reason == "max_tokens", result.failure
    assert len(result.prompt_tokens) > 64, "the prompt spans several ubatches (large activation objects)"
    reference = whole_model_greedy(model_path, list(result.prompt_tokens), 64, n_ctx=512, n_ubatch=32)
    assert list(result.tokens) == reference
    logged = {event.stage for event in events if isinstance(event, AgentLog)}
    assert logged == {0, 1, 2}, "the stderr of every stage reaches the log"
    assert sshd.accepted_logins() - logins == 2, "stages on one host share its connection"
    assert sshd.log_text().count("Starting session: command") - sessions == 6
    assert {link.data_route for link in pipeline.links} == {"exec bridge"}, "forwarding is refused here"
    paths = {(e.producer, e.consumer): (e.data, e.transport) for e in events if isinstance(e, DataPath)}
    if DATA_MODES[mode]["data"] == "direct":
        assert paths == {(0, 1): ("direct", "unix"), (1, 2): ("direct", "tls"), (2, 0): ("direct", "tls")}
    else:
        assert set(paths.values()) == {("relay", "relay")}


async def test_data_channels_use_stream_local_forwarding_where_sshd_allows_it(
    tmp_path, sshd_forwarding, cache_dir, model_path
):
    """Where sshd allows stream-local forwarding, the relay reaches each
    agent's data socket through sshd itself: no bridge process."""
    sshd = sshd_forwarding
    hosts = {"gpu-a": host_entry(sshd, cache_dir)}
    stages = [("gpu-a", layers) for layers in UNEVEN]
    path = write_inventory(
        tmp_path / "inv.yaml", model_path, hosts, stages, mode="relay-loop", max_tokens=24, ignore_eos=True
    )
    pipeline = Pipeline(load_inventory(path), lambda event: None)
    try:
        await pipeline.start()
        assert wait_session_agents(sshd, 3, 0) == (3, 0), "3 agents and no data bridge"
        result = await pipeline.generate(LONG_PROMPT)
        assert {link.data_route for link in pipeline.links} == {"stream-local forwarding"}
    finally:
        await pipeline.close()
    assert result.outcome == "completed", result.failure
    reference = whole_model_greedy(model_path, list(result.prompt_tokens), 24, n_ctx=512, n_ubatch=32)
    assert list(result.tokens) == reference
    assert wait_no_session_agents(sshd, 10) == {}


async def test_hand_started_agent_is_attached_through_ssh(tmp_path, sshd, cache_dir, model_path, none_left):
    """An agent started by hand on 127.0.0.1:PORT is reached with an exec
    bridge for control and one for data; it keeps running after the run."""
    port = free_port()
    by_hand = subprocess.Popen(
        [*AGENT.split(), "--listen", f"127.0.0.1:{port}", "--cache-dir", str(cache_dir)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        assert by_hand.stderr is not None
        while "listening on" not in by_hand.stderr.readline():
            assert by_hand.poll() is None and time.monotonic() < deadline, "the agent did not listen"
        threading.Thread(target=by_hand.stderr.read, daemon=True).start()  # keep its stderr drained
        hosts = {
            "manual": host_entry(sshd, cache_dir, listen=f"127.0.0.1:{port}", cache_dir=None),
            "gpu": host_entry(sshd, cache_dir),
        }
        stages = [("manual", [0, 12]), ("gpu", [12, 30])]
        inventory = load_inventory(
            write_inventory(tmp_path / "inv.yaml", model_path, hosts, stages, max_tokens=12, ignore_eos=True)
        )
        pipeline = Pipeline(inventory, lambda event: None)
        try:
            await pipeline.start()
            assert pipeline.links[0].hello is not None and pipeline.links[0].hello.pid == by_hand.pid
            second = SshAgent(inventory.hosts["manual"], 0, lambda line: None)
            try:
                with pytest.raises(
                    TransportError, match="the agent refused the connection: another orchestrator is attached"
                ) as busy:
                    await second.start(10)
                assert "no agent reachable" not in str(busy.value), "it is there, only busy"
            finally:
                await second.close(1)
            result = await pipeline.generate("The capital of France is")
        finally:
            await pipeline.close()
        assert result.outcome == "completed", result.failure
        reference = whole_model_greedy(model_path, list(result.prompt_tokens), 12, n_ctx=512, n_ubatch=32)
        assert list(result.tokens) == reference
        assert wait_no_session_agents(sshd, 10) == {}, "bridges end with the orchestrator"
        assert by_hand.poll() is None, "a hand-started agent outlives the orchestrator by design"
    finally:
        by_hand.terminate()
        by_hand.wait(10)


async def test_missing_hand_started_agent_says_how_to_start_it(tmp_path, sshd, cache_dir, model_path):
    port = free_port()
    hosts = {"manual": host_entry(sshd, cache_dir, listen=f"127.0.0.1:{port}")}
    message, _ = await start_failure(one_stage(tmp_path, model_path, hosts, [("manual", [0, 30])]))
    assert f"no agent reachable at 127.0.0.1:{port} on manual" in message
    assert f"--listen 127.0.0.1:{port}" in message and "cannot connect" in message


# ------------------------------------------------------- connection errors


@pytest.mark.parametrize("case", ["changed", "unknown"])
async def test_host_key_mismatch_is_refused(tmp_path, sshd, cache_dir, model_path, case):
    known = tmp_path / "known_hosts"
    if case == "changed":
        impostor = keygen(tmp_path / "impostor", "impostor")
        known.write_text(sshd.host_line(impostor))
    else:
        known.write_text("")
    hosts = {"gpu": host_entry(sshd, cache_dir, known_hosts=str(known))}
    before = sshd.accepted_logins()
    message, _ = await start_failure(one_stage(tmp_path, model_path, hosts, [("gpu", [0, 30])]))
    assert "gpu (" in message and "host key verification failed" in message, message
    assert str(known) in message
    assert sshd.accepted_logins() == before, "nothing was sent to a host that failed verification"


async def test_insecure_no_host_key_check_logs_a_loud_warning(sshd, cache_dir, caplog):
    host = sshd_host(
        sshd,
        "risky",
        insecure_no_host_key_check=True,  # and the key is in no known_hosts file we use
        cache_dir=str(cache_dir),
    )
    lines: list[str] = []
    link = SshAgent(host, 0, lines.append)
    with caplog.at_level(logging.WARNING, logger="ggufpipe.ssh"):
        try:
            hello = await link.start(20)
            assert hello.pid > 0
        finally:
            await link.close(3)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("INSECURE" in text and "risky" in text for text in warnings), warnings
    assert any("host key checking is OFF for risky" in line for line in lines), lines


async def test_ssh_config_and_ssh_agent_are_used_like_ssh_does(tmp_path, sshd, cache_dir, monkeypatch):
    """A host entry with only an alias: ~/.ssh/config gives the address, port,
    user and known_hosts file; the key comes from ssh-agent."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text(
        f"Host gpu-alias\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User {sshd.user}\n"
        f"  UserKnownHostsFile {sshd.known_hosts}\n"
    )
    socket_path = tmp_path / "agent.sock"
    ssh_agent = subprocess.Popen(["ssh-agent", "-D", "-a", str(socket_path)], stdout=subprocess.DEVNULL)
    try:
        for _ in range(100):
            if socket_path.exists():
                break
            time.sleep(0.05)
        environment = {**os.environ, "SSH_AUTH_SOCK": str(socket_path)}
        subprocess.run(
            ["ssh-add", "-q", str(sshd.client_key)], env=environment, check=True, capture_output=True
        )
        monkeypatch.setenv("HOME", str(home))
        monkeypatch.setenv("SSH_AUTH_SOCK", str(socket_path))
        host = HostSpec(name="aliased", line=1, address="gpu-alias", agent=AGENT, cache_dir=str(cache_dir))
        link = SshAgent(host, 0, lambda line: None)
        try:
            hello = await link.start(20)
            assert hello.pid > 0
        finally:
            await link.close(3)
    finally:
        ssh_agent.terminate()
        ssh_agent.wait(5)


def aliased_home(tmp_path: Path, sshd: Sshd, *lines: str) -> Path:
    """A HOME whose ~/.ssh/config reaches the test sshd as gpu-alias."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text(
        f"Host gpu-alias\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User {sshd.user}\n"
        f"  IdentityFile {sshd.client_key}\n" + "".join(f"  {line}\n" for line in lines)
    )
    return home


async def test_user_known_hosts_file_none_is_refused(tmp_path, sshd, cache_dir, monkeypatch, none_left):
    """asyncssh reads 'UserKnownHostsFile none' as 'check nothing': a line in
    ~/.ssh/config must not turn host keys off without a word (docs/security.md, "The channels and what protects each")."""
    monkeypatch.setenv("HOME", str(aliased_home(tmp_path, sshd, "UserKnownHostsFile none")))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    before = sshd.accepted_logins()
    host = HostSpec(name="aliased", line=1, address="gpu-alias", agent=AGENT, cache_dir=str(cache_dir))
    link = SshAgent(host, 0, lambda line: None)
    with pytest.raises(TransportError) as caught:
        await start_then_close(link, 20)
    message = str(caught.value)
    assert "UserKnownHostsFile none" in message and "insecure_no_host_key_check: true" in message, message
    assert sshd.accepted_logins() == before, "nothing was sent to a host whose key nobody checked"
    # Said in the inventory, it is allowed (with its warning).
    insecure = SshAgent(replace(host, insecure_no_host_key_check=True), 0, lambda line: None)
    try:
        assert (await insecure.start(20)).pid > 0
    finally:
        await insecure.close(3)


async def test_the_host_key_error_names_the_known_hosts_file_used(tmp_path, sshd, cache_dir, monkeypatch):
    elsewhere = tmp_path / "elsewhere_known_hosts"
    elsewhere.write_text("")
    monkeypatch.setenv("HOME", str(aliased_home(tmp_path, sshd, f"UserKnownHostsFile {elsewhere}")))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    host = HostSpec(name="aliased", line=1, address="gpu-alias", agent=AGENT, cache_dir=str(cache_dir))
    link = SshAgent(host, 0, lambda line: None)
    with pytest.raises(TransportError, match="host key verification failed") as caught:
        await start_then_close(link, 20)
    assert str(elsewhere) in str(caught.value) and "~/.ssh/known_hosts" not in str(caught.value)


async def test_failed_authentication_is_clear_and_quick(tmp_path, sshd, cache_dir, model_path):
    hosts = {"gpu": host_entry(sshd, cache_dir, identity=str(sshd.stranger_key))}
    path = write_inventory(tmp_path / "inv.yaml", model_path, hosts, [("gpu", [0, 30])], connect=5)
    message, elapsed = await start_failure(path)
    assert "gpu (" in message and "authentication failed" in message and str(sshd.stranger_key) in message
    assert elapsed < 5


async def test_refused_port_is_clear(tmp_path, sshd, cache_dir, model_path):
    hosts = {"gpu": host_entry(sshd, cache_dir, port=free_port())}
    message, elapsed = await start_failure(one_stage(tmp_path, model_path, hosts, [("gpu", [0, 30])]))
    assert "gpu (" in message and "cannot reach the SSH server" in message and "refused" in message.lower()
    assert elapsed < 5


async def test_silent_host_times_out_within_the_connect_timeout(tmp_path, sshd, cache_dir, model_path):
    """A host that accepts TCP and never speaks SSH (a black hole behind a
    firewall looks the same to the orchestrator)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        hosts = {"gpu": host_entry(sshd, cache_dir, port=silent.getsockname()[1])}
        path = write_inventory(tmp_path / "inv.yaml", model_path, hosts, [("gpu", [0, 30])], connect=1.5)
        message, elapsed = await start_failure(path)
    assert "gpu (" in message and "no SSH answer within 1.5s" in message, message
    assert elapsed < 1.5 + 2


async def test_missing_agent_says_how_to_install_it(tmp_path, sshd, cache_dir, model_path, none_left):
    hosts = {"gpu": host_entry(sshd, cache_dir, agent="/opt/nowhere/bin/ggufpipe-agent")}
    message, _ = await start_failure(one_stage(tmp_path, model_path, hosts, [("gpu", [0, 30])]))
    assert "not available on gpu" in message and "exit status 127" in message, message
    assert "give the agent's full path in the host's agent:" in message, message
    assert (
        "leave agent: out and ggufpipe sets one up there" in message
        and "Getting the agent onto a host" in message
    )


# ---------------------------------------------------- nothing outlives us


async def test_faulted_run_leaves_no_agent(tmp_path, sshd, cache_dir, model_path, none_left):
    hosts = {"gpu": host_entry(sshd, cache_dir)}
    stages = [("gpu", layers) for layers in UNEVEN]
    inventory = load_inventory(
        write_inventory(
            tmp_path / "inv.yaml",
            model_path,
            hosts,
            stages,
            recovery={"attempts": 0},
            max_tokens=400,
            ignore_eos=True,
        )
    )
    streamed = asyncio.Event()
    count = 0

    def on_event(event: Any) -> None:
        nonlocal count
        if isinstance(event, TokenStreamed):
            count += 1
            if count == 5:
                streamed.set()

    pipeline = Pipeline(inventory, on_event)
    try:
        await pipeline.start()
        running = asyncio.ensure_future(pipeline.generate("Count from one to one thousand."))
        await asyncio.wait_for(streamed.wait(), 60)
        hello = pipeline.links[1].hello
        assert hello is not None
        os.kill(hello.pid, signal.SIGKILL)  # the "host" is this machine
        result = await asyncio.wait_for(running, 60)
        killed = pipeline.links[1]
        assert not killed.alive() and "killed by signal KILL" in killed.exit_detail(), killed.exit_detail()
        assert pipeline.links[0].alive() and pipeline.links[2].alive()
    finally:
        await pipeline.close()
    assert result.outcome == "faulted" and "stage 1 on gpu" in result.failure, result.failure


@pytest.mark.parametrize("stopped_agent", [False, True], ids=["running", "one-agent-sigstopped"])
async def test_sigkilled_orchestrator_leaves_no_agent(tmp_path, sshd, cache_dir, model_path, stopped_agent):
    """Also when one agent is stopped (SIGSTOP) and cannot read the EOF of its
    stdin: it dies with the sshd session that started it (PR_SET_PDEATHSIG)."""
    hosts = {"gpu": host_entry(sshd, cache_dir)}
    stages = [("gpu", layers) for layers in UNEVEN]
    path = write_inventory(tmp_path / "inv.yaml", model_path, hosts, stages)
    orchestrator = subprocess.Popen(
        [
            str(REPO / ".venv" / "bin" / "ggufpipe-tui"),
            str(path),
            "--prompt",
            "Count to a thousand.",
            "--max-tokens",
            "400",
            "--ignore-eos",
            "--quiet",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert orchestrator.stdout is not None
        text = b""
        while len(text) < 20:  # generation is under way
            chunk = orchestrator.stdout.read1(64)  # type: ignore[attr-defined]
            assert chunk, "the orchestrator ended before generating"
            text += chunk
        assert wait_session_agents(sshd, 3, 3) == (3, 3), "3 agents and 3 data bridges"
        if stopped_agent:
            agent = next(pid for pid, args in sshd.session_agents().items() if "bridge" not in args)
            os.kill(agent, signal.SIGSTOP)
        orchestrator.kill()
        orchestrator.wait(5)
        killed = time.monotonic()
        left = wait_no_session_agents(sshd, 10)
        assert not left, f"left on the host after SIGKILL: {left}"
        assert time.monotonic() - killed < 5
    finally:
        if orchestrator.poll() is None:
            orchestrator.kill()
            orchestrator.wait()


# ----------------------------------------------------------- backpressure


async def test_bridge_channel_keeps_backpressure_both_ways(tmp_path, sshd, cache_dir):
    """A data channel (exec session + bridge) to a socket on the host buffers a
    bounded amount: a consumer that stops reading stops its producer."""
    total, chunk, bound = 48 << 20, 1 << 20, 16 << 20
    path = str(tmp_path / "peer.sock")
    reading = asyncio.Event()
    received = hashlib.sha256()
    got = 0
    server_wrote = 0
    done = asyncio.Event()

    async def peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal got, server_wrote
        await reading.wait()  # a stalled consumer first
        while got < total:
            data = await reader.read(1 << 18)
            assert data
            received.update(data)
            got += len(data)
        block = bytes(range(256)) * (chunk // 256)
        while server_wrote < total:  # then a producer towards the orchestrator
            writer.write(block)
            await writer.drain()
            server_wrote += len(block)
        writer.close()
        done.set()

    server = await asyncio.start_unix_server(peer, path=path)
    host = sshd_host(sshd, "gpu", known_hosts=(str(sshd.known_hosts),))
    link = SshAgent(host, 0, lambda line: None)
    try:
        await link.connect(10)
        reader, writer = await link.open_bridge(f"unix:{path}", 10)
        sent, digest, stalled = 0, hashlib.sha256(), False
        payload = os.urandom(chunk)
        while sent < total:
            writer.write(payload)
            digest.update(payload)
            sent += chunk
            try:
                await asyncio.wait_for(writer.drain(), 1.0)
            except asyncio.TimeoutError:
                stalled = True
                break
        assert stalled and sent <= bound, f"{sent >> 20} MiB accepted with nobody reading on the host"
        reading.set()
        await asyncio.wait_for(writer.drain(), 30)
        while sent < total:
            writer.write(payload)
            digest.update(payload)
            sent += chunk
            await asyncio.wait_for(writer.drain(), 30)
        for _ in range(300):
            if got == total:
                break
            await asyncio.sleep(0.1)
        assert got == total and received.digest() == digest.digest()
        await asyncio.sleep(1.0)  # the orchestrator reads nothing: the host's writes must stall
        assert server_wrote <= bound, f"the host wrote {server_wrote >> 20} MiB nobody read"
        seen = 0
        while seen < total:
            data = await asyncio.wait_for(reader.read(1 << 18), 30)
            assert data
            seen += len(data)
        await asyncio.wait_for(done.wait(), 30)
        writer.close()
    finally:
        await link.close(1)
        server.close()
