"""A hand-started agent (``ggufpipe-agent --listen``) serves nobody who cannot
prove they hold its listen key, and the orchestrator believes no endpoint
that cannot prove it in turn (docs/security.md, "The channels and what protects each"). Real agent
processes; the SSH attachment through the bridge is in test_ssh.py."""

from __future__ import annotations

import asyncio
import os
import secrets
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ggufpipe_agent import PROTOCOL_VERSION
from ggufpipe_agent.process import key_file as listen_keys
from ggufpipe_agent.wire.framing import FrameReader, FrameWriter
from ggufpipe_agent.wire.protocol import (
    AuthChallenge,
    AuthProof,
    AuthResponse,
    Heartbeat,
    Hello,
    Inspect,
    Message,
    Refused,
)
from ggufpipe_tui.core.inventory import HostSpec, load_inventory
from ggufpipe_tui.session.pipeline import Pipeline
from ggufpipe_tui.transports.connection import TransportError
from ggufpipe_tui.transports.local import LocalAgent
from tests.support.common import start_then_close
from tests.support.listening import HandStarted, start_listening, stop
from tests.support.sshd import free_port


@pytest.fixture
def listening(tmp_path: Path, no_agent_left: None) -> Iterator[HandStarted]:
    agent = start_listening(f"127.0.0.1:{free_port()}", tmp_path / "keys" / "agent.key")
    yield agent
    stop(agent)


async def connect(agent: HandStarted) -> tuple[FrameReader, FrameWriter, asyncio.StreamWriter]:
    host, port = agent.endpoint.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    return FrameReader(reader, "test connection"), FrameWriter(writer), writer


async def next_message(frames: FrameReader) -> Message | None:
    return await asyncio.wait_for(frames.message(), 15)


async def answer_challenge(
    agent: HandStarted, key: bytes
) -> tuple[FrameReader, FrameWriter, asyncio.StreamWriter, AuthChallenge, bytes]:
    """Connected, challenged, and answered with a proof of ``key``: the
    connection, the challenge and the nonce the answer carried."""
    frames, out, writer = await connect(agent)
    challenge = await next_message(frames)
    assert isinstance(challenge, AuthChallenge)
    nonce = listen_keys.new_nonce()
    await out.send(
        AuthResponse(nonce, listen_keys.proof(key, listen_keys.ORCHESTRATOR, challenge.nonce, nonce))
    )
    return frames, out, writer, challenge, nonce


async def test_a_stranger_gets_a_challenge_and_nothing_else(listening):
    """The issue's probe got a Hello with the data token before anything was
    checked, then could Inspect paths. Now: a challenge, a refusal, the end."""
    frames, out, writer = await connect(listening)
    challenge = await next_message(frames)
    assert isinstance(challenge, AuthChallenge), f"got {challenge} before authenticating"
    assert challenge.protocol == PROTOCOL_VERSION and len(challenge.nonce) == listen_keys.NONCE_BYTES
    await out.send(Inspect(1, "/etc/passwd", False))
    refused = await next_message(frames)
    assert isinstance(refused, Refused) and "authentication failed" in refused.reason
    assert await next_message(frames) is None, "the connection is closed after the refusal"
    writer.close()


async def test_a_wrong_key_is_refused(listening):
    guess = secrets.token_bytes(listen_keys.KEY_BYTES)
    frames, _, writer, _, _ = await answer_challenge(listening, guess)
    refused = await next_message(frames)
    assert isinstance(refused, Refused) and "not this agent's listen key" in refused.reason
    assert await next_message(frames) is None
    writer.close()


async def test_the_right_key_is_answered_with_the_agents_proof_then_hello(listening):
    key = listen_keys.read_key_file(listening.key_file)
    frames, _, writer, challenge, nonce = await answer_challenge(listening, key)
    answer = await next_message(frames)
    assert isinstance(answer, AuthProof)
    assert listen_keys.verify(key, listen_keys.AGENT, challenge.nonce, nonce, answer.proof)
    assert isinstance(await next_message(frames), Hello)
    writer.close()


async def test_a_silent_stranger_locks_nobody_out(listening):
    """Before, whoever connected first held the one session: a connection
    that says nothing must not keep the orchestrator out."""
    _, _, squatter = await connect(listening)
    await asyncio.sleep(0.3)
    link = LocalAgent(listening.host(), 0, lambda line: None)
    try:
        hello = await link.start(15)
        assert hello.pid == listening.process.pid
    finally:
        await link.close(1)
        squatter.close()


def test_the_key_file_is_private_and_removed_at_exit(tmp_path, no_agent_left):
    agent = start_listening(f"127.0.0.1:{free_port()}", tmp_path / "keys" / "agent.key")
    try:
        info = agent.key_file.stat()
        assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.getuid()
        assert stat.S_IMODE(agent.key_file.parent.stat().st_mode) == 0o700
        assert len(listen_keys.read_key_file(agent.key_file)) == listen_keys.KEY_BYTES
        assert any(str(agent.key_file) in line for line in agent.stderr), "the agent prints where its key is"
    finally:
        stop(agent)
    assert not agent.key_file.exists(), "the key goes with the agent"


def test_a_unix_socket_is_created_private(tmp_path, no_agent_left):
    path = tmp_path / "agent.sock"
    agent = start_listening(f"unix:{path}", tmp_path / "agent.key")
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    finally:
        stop(agent)


def test_listening_beyond_loopback_warns(tmp_path, no_agent_left):
    agent = start_listening(f"0.0.0.0:{free_port()}", tmp_path / "agent.key")
    stop(agent)
    warned = [line for line in agent.stderr if "WARNING" in line and "reachable from the network" in line]
    assert warned, "".join(agent.stderr)


class Impostor:
    """Whoever bound the port first: it plays a hand-started agent as well as
    it can without the key, and records what it is sent."""

    def __init__(self, opening: Message) -> None:
        self.opening = opening
        self.received: list[Message] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frames, out = FrameReader(reader), FrameWriter(writer)
        await out.send(self.opening)
        while (message := await frames.message()) is not None:
            self.received.append(message)
            if isinstance(message, AuthResponse):
                await out.send(AuthProof(secrets.token_bytes(32)))  # it cannot compute the real one


@pytest.mark.parametrize("opening", ["challenge", "hello"])
async def test_the_orchestrator_refuses_an_endpoint_without_the_key(tmp_path, opening):
    key_file = tmp_path / "agent.key"
    listen_keys.write_key_file(key_file)  # the real agent's key, which the impostor does not have
    first: Message
    if opening == "challenge":
        first = AuthChallenge(PROTOCOL_VERSION, listen_keys.new_nonce())
    else:  # what an agent said first before this issue: the orchestrator believed it
        first = Hello(PROTOCOL_VERSION, "0", "h", 1, "3", "", "cpu", False, (), 0, 0, "unix:/nowhere", "t")
    impostor = Impostor(first)
    server = await asyncio.start_server(impostor.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    host = HostSpec(name="manual", line=1, local=True, listen=f"127.0.0.1:{port}", listen_key=str(key_file))
    link = LocalAgent(host, 0, lambda line: None)
    try:
        with pytest.raises(TransportError) as caught:
            await start_then_close(link, 5)
    finally:
        server.close()
    assert "nothing was sent to it" in str(caught.value), caught.value
    assert all(isinstance(message, AuthResponse) for message in impostor.received), impostor.received


async def test_a_run_through_a_hand_started_agent(tmp_path, model_path, listening):
    inventory_path = tmp_path / "inventory.yaml"
    inventory_path.write_text(
        f"model: {{path: {model_path}}}\n"
        f"hosts:\n  manual: {{local: true, listen: '{listening.endpoint}', listen_key: '{listening.key_file}'}}\n"
        "stages:\n  - {host: manual}\n"
        "run: {context: 256, max_tokens: 4, ignore_eos: true, chat: false}\n"
    )
    pipeline = Pipeline(load_inventory(inventory_path), lambda event: None)
    try:
        await pipeline.start()
        result = await pipeline.generate("The capital of France is")
    finally:
        await pipeline.close()
    assert result.outcome == "completed" and len(result.tokens) == 4, result.failure
    assert listening.process.poll() is None, "a hand-started agent outlives its orchestrator"


async def test_a_missing_key_file_is_named(listening, tmp_path):
    link = LocalAgent(listening.host(listen_key=str(tmp_path / "absent.key")), 0, lambda line: None)
    try:
        with pytest.raises(TransportError, match="cannot read the listen key .*absent.key: No such file"):
            await link.start(10)
    finally:
        await link.close(1)


def test_the_default_key_path_is_the_same_on_both_sides():
    assert (
        listen_keys.default_key_path("127.0.0.1:7000")
        == "~/.local/state/ggufpipe/listen/tcp-127.0.0.1-7000.key"
    )
    assert listen_keys.default_key_path("tcp:127.0.0.1:7000") == listen_keys.default_key_path(
        "127.0.0.1:7000"
    )
    assert (
        listen_keys.default_key_path("unix:/run/a b.sock")
        == "~/.local/state/ggufpipe/listen/unix-run_a_b.sock.key"
    )


async def test_an_attached_orchestrator_that_falls_silent_is_detached(listening):
    """The idle bound of an attached session is its orchestrator's heartbeat:
    an orchestrator that says nothing for that long (its machine froze, its
    network went) is detached, and the next one can attach."""
    key = listen_keys.read_key_file(listening.key_file)
    frames, out, writer, _, _ = await answer_challenge(listening, key)
    assert isinstance(await next_message(frames), AuthProof)
    assert isinstance(await next_message(frames), Hello)
    await out.send(Heartbeat(0.2, 1.0))
    silent = time.monotonic()
    while (message := await next_message(frames)) is not None:
        assert isinstance(message, Heartbeat), message  # the agent beats back meanwhile
    assert time.monotonic() - silent < 5, "detached within the bound"
    writer.close()
    link = LocalAgent(listening.host(), 0, lambda line: None)
    try:
        assert (await link.start(15)).pid == listening.process.pid
    finally:
        await link.close(1)
    assert any("detached: no message from the orchestrator for 1s" in line for line in listening.stderr)
