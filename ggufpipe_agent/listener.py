"""``ggufpipe-agent --listen ADDR``: an agent started by hand, serving one
authenticated orchestrator at a time.

Nothing is served before the peer has proved it holds the listen key
(:mod:`ggufpipe_agent.credential`): a connection gets an AuthChallenge, and
anything but a valid AuthResponse within :data:`AUTH_TIMEOUT` is refused and
closed, before the Hello (and its data token) is sent. Only then does the
"one orchestrator at a time" rule apply, so a stranger holding a connection
open locks nobody out. An attached session ends when its orchestrator goes
quiet past the heartbeat bound (:class:`~ggufpipe_agent.runtime.Session`),
and the agent waits for the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
from pathlib import Path

from ggufpipe_agent import PROTOCOL_VERSION
from ggufpipe_agent.bridge import parse_endpoint
from ggufpipe_agent.credential import (
    AGENT,
    NONCE_BYTES,
    ORCHESTRATOR,
    CredentialError,
    default_key_path,
    new_nonce,
    proof,
    remove_key_file,
    verify,
    write_key_file,
)
from ggufpipe_agent.errors import ProtocolError
from ggufpipe_agent.framing import FrameReader, FrameWriter
from ggufpipe_agent.protocol import AuthChallenge, AuthProof, AuthResponse, Refused
from ggufpipe_agent.runtime import Agent
from ggufpipe_agent.session import Session

log = logging.getLogger("ggufpipe.agent")

#: How long a new connection has to authenticate.
AUTH_TIMEOUT = 10.0
#: The largest frame read from a peer that has not authenticated.
AUTH_FRAME_LIMIT = 4096
#: Connections authenticating at once; more are closed unanswered.
MAX_PENDING = 16


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Listener:
    def __init__(self, endpoint: str, cache_dir: Path | None, key_path: Path) -> None:
        self.endpoint = endpoint
        self.key_path = key_path
        self.key = b""
        self.agent = Agent(cache_dir)
        self.busy = asyncio.Lock()
        self.pending = 0

    async def serve(self) -> None:
        where, port = parse_endpoint(self.endpoint)
        if port is None:
            server = await self._bind_unix(where)
        else:
            server = await asyncio.start_server(self._on_connect, where, port, limit=1 << 20)
            if not is_loopback(where):
                log.warning(
                    "listening on %s, reachable from the network: prompts and activations cross it "
                    "unencrypted (the listen key only authenticates). Bind to 127.0.0.1 and let the "
                    "orchestrator reach the agent over SSH (docs/ssh.md)",
                    self.endpoint,
                )
        # The key is written only once the endpoint is ours: an agent that
        # cannot bind must not replace the key of the one that did.
        try:
            self.key = write_key_file(self.key_path)
        except (CredentialError, OSError) as error:
            server.close()
            raise CredentialError(f"cannot write the listen key {self.key_path}: {error}") from None
        try:
            await self.agent.start()
            log.info(
                "listening on %s (listen key %s; data socket unix:%s)",
                self.endpoint,
                self.key_path,
                self.agent.data_path,
            )
            if str(self.key_path) != os.path.expanduser(default_key_path(self.endpoint)):
                log.info("orchestrators need listen_key: %s in this host's inventory entry", self.key_path)
            async with server:
                await server.serve_forever()
        finally:
            remove_key_file(self.key_path, self.key)
            self.agent.close()

    async def _bind_unix(self, path: str) -> asyncio.AbstractServer:
        """A Unix socket only this user can connect to. asyncio removes an
        existing socket file before it binds, so one in use is refused first."""
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as probe:
            probe.connect(path)
            raise CredentialError(f"unix:{path} is in use by another process")
        previous = os.umask(0o177)
        try:
            server = await asyncio.start_unix_server(self._on_connect, path=path, limit=1 << 20)
        finally:
            os.umask(previous)
        os.chmod(path, 0o600)
        return server

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername") or "a unix peer"
        try:
            if self.pending >= MAX_PENDING:
                log.warning("refused %s: %d connections are already authenticating", peer, MAX_PENDING)
                return
            self.pending += 1
            try:
                authenticated = await asyncio.wait_for(self._authenticate(reader, writer, peer), AUTH_TIMEOUT)
            except asyncio.TimeoutError:
                log.warning("refused %s: no answer to the challenge within %gs", peer, AUTH_TIMEOUT)
                return
            except (ProtocolError, ConnectionError, OSError) as error:
                log.warning("refused %s: %s", peer, error or type(error).__name__)
                return
            finally:
                self.pending -= 1
            if not authenticated:
                return
            if self.busy.locked():
                log.warning("refused orchestrator %s: another one is attached", peer)
                with contextlib.suppress(ConnectionError, OSError):
                    await self._say(writer, Refused("connection", "another orchestrator is attached"))
                return
            async with self.busy:
                log.info("orchestrator attached from %s", peer)
                reason = await Session(self.agent, reader, writer).serve()
                log.info("orchestrator detached: %s", reason)
        except asyncio.CancelledError:
            return  # the agent is ending (see Agent._data_connection)
        finally:
            writer.close()

    async def _authenticate(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: object
    ) -> bool:
        challenge = new_nonce()
        await self._say(writer, AuthChallenge(PROTOCOL_VERSION, challenge))
        reply = await FrameReader(reader, "listening connection").message(AUTH_FRAME_LIMIT)
        if (
            isinstance(reply, AuthResponse)
            and len(reply.nonce) == NONCE_BYTES
            and verify(self.key, ORCHESTRATOR, challenge, reply.nonce, reply.proof)
        ):
            await self._say(writer, AuthProof(proof(self.key, AGENT, challenge, reply.nonce)))
            return True
        what = "nothing" if reply is None else reply.tag
        log.warning("refused %s: it sent %s, not a proof of this agent's listen key", peer, what)
        await self._say(writer, Refused("connection", "authentication failed: not this agent's listen key"))
        return False

    @staticmethod
    async def _say(writer: asyncio.StreamWriter, message: AuthChallenge | AuthProof | Refused) -> None:
        await FrameWriter(writer, drain_timeout=AUTH_TIMEOUT, what="listening connection").send(message)


async def serve_listen(endpoint: str, cache_dir: Path | None, key_file: Path | None = None) -> None:
    """A hand-started agent on ``endpoint`` until it is stopped."""
    key_path = key_file or Path(os.path.expanduser(default_key_path(endpoint)))
    await Listener(endpoint, cache_dir, key_path).serve()
