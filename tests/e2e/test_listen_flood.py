"""One bad peer must not wedge a hand-started agent (docs/security.md, "Someone on the same host as a stage"): connections
held open by another user keep no orchestrator out, hammering the port
writes a few log lines, not one per connection, and an orchestrator that
meets a busy agent tries again and, when it gives up, says what each try
met. Real agent processes on loopback; every loop stops by itself."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ggufpipe_agent.process import key_file as listen_keys
from ggufpipe_agent.process import listener
from ggufpipe_agent.wire.framing import FrameReader, FrameWriter
from ggufpipe_agent.wire.protocol import AuthChallenge, AuthResponse, Refused, encode_message
from ggufpipe_tui.core.inventory import HostSpec, load_inventory
from ggufpipe_tui.session.pipeline import Pipeline
from ggufpipe_tui.transports.connection import TransportError
from ggufpipe_tui.transports.local import LocalAgent
from ggufpipe_tui.transports.ssh import SshAgent
from tests.support.common import start_then_close
from tests.support.listening import HandStarted, start_listening, stop
from tests.support.ssh_hosts import host_entry, write_inventory
from tests.support.sshd import free_port

#: The squatter runs as another user, on the system's Python (the test's may
#: live in root's home, which that user cannot read): stdlib only.
SYSTEM_PYTHON = "/usr/bin/python3"
NOBODY = 65534

#: Holds COUNT connections to HOST:PORT without answering, and reopens each
#: (after PAUSE s) as soon as the agent closes it, for SECONDS s.
SQUATTER = r"""
import selectors, socket, sys, time
host, port, count, seconds, pause = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
selector = selectors.DefaultSelector()
opened = 0
def open_one():
    global opened
    try:
        sock = socket.create_connection((host, port), timeout=2)
    except OSError:
        return
    sock.setblocking(False)
    selector.register(sock, selectors.EVENT_READ)
    opened += 1
for _ in range(count):
    open_one()
print("holding", opened, flush=True)
end = time.monotonic() + seconds
due = []
while time.monotonic() < end:
    for key, _ in selector.select(0.05):
        try:
            data = key.fileobj.recv(65536)  # a challenge or a refusal: never answered
        except OSError:
            data = b""
        if not data:
            selector.unregister(key.fileobj)
            key.fileobj.close()
            due.append(time.monotonic() + pause)
    while due and due[0] <= time.monotonic():
        due.pop(0)
        open_one()
print("opened", opened, flush=True)
"""


@pytest.fixture
def listening(tmp_path: Path, no_agent_left: None) -> Iterator[HandStarted]:
    agent = start_listening(f"127.0.0.1:{free_port()}", tmp_path / "keys" / "agent.key")
    yield agent
    stop(agent)


def address(agent: HandStarted) -> tuple[str, int]:
    host, port = agent.endpoint.rsplit(":", 1)
    return host, int(port)


def run_inventory(tmp_path: Path, model_path: Path, agent: HandStarted) -> Path:
    path = tmp_path / "inventory.yaml"
    path.write_text(
        f"model: {{path: {model_path}}}\n"
        f"hosts:\n  manual: {{local: true, listen: '{agent.endpoint}', listen_key: '{agent.key_file}'}}\n"
        "stages:\n  - {host: manual}\n"
        "run: {context: 256, max_tokens: 4, ignore_eos: true, chat: false}\n"
    )
    return path


# ------------------------------------------------------- (a) a squatter


@pytest.mark.skipif(os.geteuid() != 0, reason="holding connections as another user needs root")
@pytest.mark.skipif(not os.path.exists(SYSTEM_PYTHON), reason=f"no {SYSTEM_PYTHON} for the squatter")
async def test_another_user_holding_many_silent_connections_keeps_no_orchestrator_out(
    tmp_path, model_path, listening
):
    """The issue's squatter: 16 silent connections, each reopened as soon as
    it is closed. It was 16 of the 16 handshake slots; now it fills its own
    budget (a peer on loopback is its user) and the orchestrator, another
    user, attaches at its first try and runs."""
    host, port = address(listening)
    squatter = subprocess.Popen(
        [SYSTEM_PYTHON, "-c", SQUATTER, host, str(port), "16", "30", "0.02"],
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        cwd="/",
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert squatter.stdout is not None
        assert squatter.stdout.readline().split() == ["holding", "16"]
        await asyncio.sleep(0.5)  # the agent has turned its extra connections away, and they came back
        pipeline = Pipeline(
            load_inventory(run_inventory(tmp_path, model_path, listening)), lambda event: None
        )
        try:
            await pipeline.start()
            result = await pipeline.generate("The capital of France is")
        finally:
            await pipeline.close()
        assert squatter.poll() is None, "the squatter was there all along"
    finally:
        squatter.kill()
        squatter.wait()
    assert result.outcome == "completed" and len(result.tokens) == 4, result.failure
    log = "".join(listening.stderr)
    assert f"(uid {NOBODY}): {listener.PEER_PENDING} of its connections are already authenticating" in log, (
        log
    )
    assert f"(uid {os.getuid()}): " not in log, f"the orchestrator was refused:\n{log}"
    assert "orchestrator attached from" in log


# --------------------------------------------------------- (b) a hammer


async def hammer(host: str, port: int, key_guess: bytes, seconds: float) -> int:
    """Bad connections of every kind, back to back, for ``seconds``: closed at
    once, garbage instead of a frame, a proof of the wrong key, and (the
    held ones) nothing at all. Returns how many were made."""
    held = [await asyncio.open_connection(host, port) for _ in range(listener.PEER_PENDING - 1)]
    made = len(held)
    end = time.monotonic() + seconds

    async def one(kind: int) -> None:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            if kind == 0:
                return  # closed at once
            if kind == 1:
                writer.write(b"\xff" * 64)
                await writer.drain()
            else:
                challenge = await asyncio.wait_for(FrameReader(reader).message(), 1)
                if isinstance(challenge, AuthChallenge):
                    nonce = listen_keys.new_nonce()
                    wrong = listen_keys.proof(key_guess, listen_keys.ORCHESTRATOR, challenge.nonce, nonce)
                    await FrameWriter(writer).send(AuthResponse(nonce, wrong))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(reader.read(), 1)  # the refusal, and the agent closes it
        except (ConnectionError, OSError, asyncio.TimeoutError):
            pass
        finally:
            writer.close()

    async def worker(offset: int) -> int:
        count = 0
        while time.monotonic() < end:
            await one((count + offset) % 3)
            count += 1
        return count

    try:
        made += sum(await asyncio.gather(*(worker(offset) for offset in range(6))))
    finally:
        for _, writer in held:
            writer.close()
    return made


async def test_hammering_the_port_writes_a_few_log_lines(listening):
    """Each refused connection was one warning: tens of MB of them. Now the
    first few of a peer per minute, then one line that counts the rest."""
    host, port = address(listening)
    before = len(listening.stderr)
    made = await hammer(host, port, secrets.token_bytes(listen_keys.KEY_BYTES), 3.0)
    await asyncio.sleep(0.3)
    # (the agent's second startup line may arrive after "listening on")
    during = [line for line in listening.stderr[before:] if "orchestrators need listen_key" not in line]
    assert made >= 100, f"only {made} connections: the hammer did not hammer"
    assert len(during) <= listener.WARN_PER_PEER, "".join(during)
    assert all("refused" in line for line in during), "".join(during)
    link = LocalAgent(
        HostSpec(
            name="manual", line=1, local=True, listen=listening.endpoint, listen_key=str(listening.key_file)
        ),
        0,
        lambda line: None,
    )
    try:
        assert (await link.start(10)).pid == listening.process.pid, "and it still serves"
    finally:
        await link.close(1)
    stop(listening)  # the window's count is said when it ends, at the latest when the agent does
    summary = [line for line in listening.stderr if "more refused from" in line]
    assert len(summary) == 1, "".join(listening.stderr)
    counted = re.search(r"(\d+) more refused from uid \d+ on loopback in the last \d+s", summary[0])
    assert counted and int(counted[1]) >= made - listener.WARN_PER_PEER - listener.PEER_PENDING, summary


def test_refusals_are_counted_per_peer_and_in_all(caplog):
    """The limiter's arithmetic: per peer, in all, and the one line at the end."""
    logger = logging.getLogger("test.refusals")
    refusals = listener.RefusalLog(window=60, per_peer=3, overall=4, logger=logger)
    a, b = listener.Peer("uid 1000 on loopback", "a"), listener.Peer("203.0.113.7", "b")

    async def scenario() -> None:
        for _ in range(10):
            refusals.warn(a, "refused %s", a.label)
        for _ in range(2):
            refusals.warn(b, "refused %s", b.label)
        refusals.flush()
        refusals.warn(b, "refused %s", b.label)  # a new window
        refusals.flush()

    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        asyncio.run(scenario())
    lines = [record.getMessage() for record in caplog.records]
    assert lines[:4] == ["refused a"] * 3 + ["refused b"], lines
    assert lines[4] == "8 more refused from 2 peers in the last 0s (the most from uid 1000 on loopback: 7)"
    assert lines[5:] == ["refused b"], "a window that suppressed nothing ends without a line"


async def test_a_loopback_peer_is_its_user():
    """On loopback the address says nothing (every local user has it): the
    kernel says whose socket the other end is."""
    accepted: asyncio.Future[listener.Peer] = asyncio.get_running_loop().create_future()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set_result(listener.identify(writer))
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    _, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    try:
        peer = await asyncio.wait_for(accepted, 5)
    finally:
        writer.close()
        server.close()
    if not hasattr(socket, "AF_NETLINK"):
        assert peer.key == "loopback"
    else:
        assert peer.key == f"uid {os.getuid()} on loopback", peer


# ------------------------------------------------ (c) the orchestrator's retries


def host_for(endpoint: str, key_file: Path) -> HostSpec:
    return HostSpec(name="manual", line=1, local=True, listen=endpoint, listen_key=str(key_file))


async def test_a_busy_agent_is_retried_and_the_error_names_each_try(listening):
    first = LocalAgent(host_for(listening.endpoint, listening.key_file), 0, lambda line: None)
    second = LocalAgent(host_for(listening.endpoint, listening.key_file), 0, lambda line: None)
    try:
        await first.start(10)
        began = time.monotonic()
        with pytest.raises(TransportError) as caught:
            await second.start(3)
        took = time.monotonic() - began
    finally:
        await second.close(1)
        await first.close(1)
    message = str(caught.value)
    assert "try 1: busy: serving another orchestrator; try 2: busy: serving another orchestrator" in message
    assert "the agent refused the connection: another orchestrator is attached" in message, message
    assert 1.0 < took < 4.0, f"{took:.1f}s: retried, within the connect timeout"


class Doorman:
    """An endpoint in front of a real agent: the first connections get what
    ``turns`` says ("refuse": a refusal before any challenge, as a agent
    past its budget sends; "close": closed unanswered), later ones are
    relayed to the agent."""

    def __init__(self, agent: HandStarted | None, turns: list[str]) -> None:
        self.agent, self.turns, self.connections = agent, turns, 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        turn = self.turns[self.connections] if self.connections < len(self.turns) else "relay"
        self.connections += 1
        if turn == "refuse":
            writer.write(
                encode_message(Refused("connection", "busy: 4 connections from you are authenticating"))
            )
        if turn != "relay" or self.agent is None:
            writer.close()
            return
        upstream_reader, upstream_writer = await asyncio.open_connection(*address(self.agent))

        async def pipe(source: asyncio.StreamReader, target: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await source.read(65536):
                    target.write(data)
                    await target.drain()
            target.close()

        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))


@contextlib.asynccontextmanager
async def doorman_at(agent: HandStarted | None, script: list[str]) -> Any:
    """A Doorman on a free loopback port: (it, its endpoint)."""
    doorman = Doorman(agent, script)
    server = await asyncio.start_server(doorman.serve, "127.0.0.1", 0)
    try:
        yield doorman, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def test_connections_closed_before_the_challenge_are_retried_then_named(tmp_path):
    key_file = tmp_path / "agent.key"
    listen_keys.write_key_file(key_file)
    async with doorman_at(None, ["close"] * 100) as (doorman, endpoint):
        link = LocalAgent(host_for(endpoint, key_file), 0, lambda line: None)
        with pytest.raises(TransportError) as caught:
            await start_then_close(link, 3)
    message = str(caught.value)
    tries = re.findall(r"try (\d+): closed before its challenge", message)
    assert len(tries) >= 3 and len(tries) == doorman.connections, (doorman.connections, message)
    assert "the agent closed the connection before its challenge" in message, message


async def test_an_agent_past_its_budget_is_reached_on_a_later_try(listening):
    async with doorman_at(listening, ["refuse", "close"]) as (doorman, endpoint):
        link = LocalAgent(host_for(endpoint, listening.key_file), 0, lambda line: None)
        hello = await start_then_close(link, 10)
    assert hello.pid == listening.process.pid and doorman.connections == 3


async def test_a_refusal_before_the_challenge_is_named(tmp_path):
    key_file = tmp_path / "agent.key"
    listen_keys.write_key_file(key_file)
    async with doorman_at(None, ["refuse"] * 100) as (doorman, endpoint):
        link = LocalAgent(host_for(endpoint, key_file), 0, lambda line: None)
        with pytest.raises(TransportError, match="try 2: busy: 4 connections from you are authenticating"):
            await start_then_close(link, 2)


async def test_a_wrong_key_is_not_retried(listening, tmp_path):
    wrong = tmp_path / "wrong.key"
    listen_keys.write_key_file(wrong)
    link = LocalAgent(host_for(listening.endpoint, wrong), 0, lambda line: None)
    began = time.monotonic()
    with pytest.raises(TransportError, match="not the one that agent printed") as caught:
        await start_then_close(link, 10)
    assert "try 1" not in str(caught.value) and time.monotonic() - began < 3


async def test_no_challenge_in_time_is_not_mistaken_for_busy(tmp_path):
    """Silence is not retried: it is said as before."""
    key_file = tmp_path / "agent.key"
    listen_keys.write_key_file(key_file)
    held: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    endpoint = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    link = LocalAgent(host_for(endpoint, key_file), 0, lambda line: None)
    try:
        with pytest.raises(TransportError, match="sent no challenge within"):
            await link.start(1.5)
    finally:
        await link.close(1)
        for writer in held:
            writer.close()
        server.close()
    assert len(held) == 1


# ------------------------------------------- the same through an SSH bridge


def ssh_host(tmp_path: Path, sshd: Any, cache: Path, model_path: Path, endpoint: str, key: Path) -> HostSpec:
    hosts = {"manual": host_entry(sshd, cache, listen=endpoint, listen_key=str(key), cache_dir=None)}
    inventory = write_inventory(tmp_path / "inventory.yaml", model_path, hosts, [("manual", [0, 30])])
    return load_inventory(inventory).hosts["manual"]


@pytest.mark.ssh
async def test_through_ssh_a_closed_connection_is_not_a_missing_agent(tmp_path, sshd, cache_dir, model_path):
    """Over SSH the bridge that connected and was closed exits 0 (one that
    could not connect says why and exits 1): retried, not "no agent"."""
    key_file = tmp_path / "agent.key"
    listen_keys.write_key_file(key_file)
    async with doorman_at(None, ["refuse"] + ["close"] * 100) as (doorman, endpoint):
        link = SshAgent(
            ssh_host(tmp_path, sshd, cache_dir, model_path, endpoint, key_file), 0, lambda line: None
        )
        with pytest.raises(TransportError) as caught:
            await start_then_close(link, 4)
    message = str(caught.value)
    assert (
        "try 1: busy: 4 connections from you are authenticating; try 2: closed before its challenge"
        in message
    )
    assert "no agent reachable" not in message, message


@pytest.mark.ssh
async def test_through_ssh_a_later_try_reaches_the_agent(tmp_path, sshd, cache_dir, model_path, listening):
    async with doorman_at(listening, ["close", "refuse"]) as (doorman, endpoint):
        host = ssh_host(tmp_path, sshd, cache_dir, model_path, endpoint, listening.key_file)
        link = SshAgent(host, 0, lambda line: None)
        hello = await start_then_close(link, 10)
    assert hello.pid == listening.process.pid and doorman.connections == 3


def test_a_host_that_cannot_tell_loopback_users_apart_is_known(monkeypatch):
    """Where sock_diag is missing the agent warns at start (every local user
    would share one budget); here it works."""
    assert listener.uid_lookup_works()
    monkeypatch.setattr(listener, "tcp_peer_uid", lambda *args: None)
    assert not listener.uid_lookup_works()
