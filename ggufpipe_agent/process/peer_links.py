"""Direct stage links, the agent's side: one stream from a producer stage's
agent to its consumer's agent, so activations (and the token ring) skip the
orchestrator (docs/rings.md).

The orchestrator sets a link up once per session, over the control channels:

1. ``LinkListen`` to the consumer: it opens a one-shot listener (a Unix socket
   in its private directory when both stages share a host, else TLS over TCP)
   and answers ``LinkListening`` with where it is.
2. ``LinkConnect`` to the producer: it connects, presents the link token
   (``LinkAttach``), waits for the consumer's answer and reports
   ``LinkConnected`` with the round trip: the probe. A producer that cannot
   reach its consumer answers ``RequestFailed`` and the orchestrator relays
   that edge instead.

Authentication: between hosts, mutual TLS 1.3 with certificates of a
per-session authority the orchestrator made and handed out over the control
channels (its key stays with the orchestrator): the consumer accepts only a
client certificate naming its producer, the producer only a server
certificate naming its consumer. On one host, the socket lives in the
agent's private directory (mode 0700): only processes of the same user reach
it, which is also who could read the agent's memory. Both ways the first
frame must carry the link token, and a listener closes after one accepted
link or its timeout.

Each run, ``LinkEdge`` makes the link the producer's outbound end (or its
token-ring end); the producer sends ``OpenEdge`` on the link and the consumer
serves the link exactly like its data stream from the orchestrator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import ssl
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from ggufpipe_agent.errors import ProtocolError
from ggufpipe_agent.ids import RunId
from ggufpipe_agent.stage.fsm import EdgeEstablished, SetupFailed, StageState
from ggufpipe_agent.stage.handover import ConsumerRun, chaining_enabled
from ggufpipe_agent.stage.job import StageJob
from ggufpipe_agent.stage.writers import Forward, LocalFeed, RecordSink
from ggufpipe_agent.wire.endpoints import parse_endpoint
from ggufpipe_agent.wire.framing import FrameReader, FrameWriter
from ggufpipe_agent.wire.link_messages import (
    LinkAttach,
    LinkConnect,
    LinkConnected,
    LinkCredentials,
    LinkDown,
    LinkEdge,
    LinkListen,
    LinkListening,
    stage_name,
)
from ggufpipe_agent.wire.protocol import Message, OpenEdge, RequestFailed

log = logging.getLogger("ggufpipe.links")

#: How long a peer may take for its TLS handshake and its first frame.
ATTACH_TIMEOUT = 10.0
#: The attach frame each way is a token: nothing bigger is read before it.
ATTACH_FRAME_LIMIT = 4096
STREAM_LIMIT = 1 << 20

#: Serves an accepted inbound link (the session's data-stream loop); returns
#: why the stream ended.
ServeLink = Callable[[Any, Any, int], Awaitable[str]]

#: The Unix-socket link listeners of this process, by path, with the stage
#: each serves and its delivery: a producer that connects to one of them is a
#: stage of the same (shared) process, whose worker may run the consumer's
#: steps (ggufpipe_agent/stage/handover.py) and whose records are handed to the
#: consumer's delivery instead of through the socket (``LocalFeed``). Only
#: while the listener waits for its producer.
_IN_PROCESS: dict[str, tuple[ConsumerRun, Forward]] = {}


def _load_identity(context: ssl.SSLContext, credentials: LinkCredentials, directory: Path) -> None:
    """The ssl module loads a key only from a file: written to the agent's
    private directory (mode 0600 inside 0700) for the moment it is read."""
    path = directory / f"link-identity-{secrets.token_hex(4)}.pem"
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(credentials.key + b"\n" + credentials.certificate)
        context.load_cert_chain(str(path))
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
    # Only the session's authority: no system trust store is ever loaded.
    context.load_verify_locations(cadata=credentials.authority.decode("ascii"))


def server_context(certificate: bytes, key: bytes, authority: bytes, directory: Path) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.verify_mode = ssl.CERT_REQUIRED
    _load_identity(context, LinkCredentials(certificate, key, authority), directory)
    return context


def client_context(certificate: bytes, key: bytes, authority: bytes, directory: Path) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the server and its name
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    _load_identity(context, LinkCredentials(certificate, key, authority), directory)
    return context


def _peer_names(writer: Any) -> list[str]:
    certificate = writer.get_extra_info("peercert") or {}
    return [value for kind, value in certificate.get("subjectAltName", ()) if kind == "DNS"]


def _ssh_address() -> tuple[str, ...]:
    """The address this host's SSH connection arrived at, if it came by SSH:
    a peer host is likely to reach it there too."""
    parts = os.environ.get("SSH_CONNECTION", "").split()
    return (parts[2],) if len(parts) == 4 else ()


def _split(endpoint: str) -> tuple[str, int | None]:
    where, port = parse_endpoint(endpoint)
    return where.strip("[]"), port


class Link:
    """One established link end: its frames in and out."""

    def __init__(
        self,
        reader: Any,
        writer: Any,
        peer: int,
        what: str,
        local: tuple[ConsumerRun, Forward] | None = None,
        token: str = "",
    ) -> None:
        self.reader = FrameReader(reader, what)
        self.writer = FrameWriter(writer, what=what)
        self.peer = peer
        self.token = token  # its LinkListen's: what its LinkDown names
        self.replaced = False  # a newer link took its place: its end is not news
        self._stream = writer
        # The consumer's run and delivery, when it is in this process.
        self.consumer: ConsumerRun | None = None
        self.forward: Forward | None = None
        if local is not None:
            self.consumer, self.forward = local

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._stream.close()


class Links:
    """The links of one orchestrator session: at most one inbound (this stage
    consumes) and one outbound (this stage produces), and their listener."""

    def __init__(
        self,
        directory: Path,
        post: Callable[[Message], None],
        serve: ServeLink,
        spawn: Callable[..., asyncio.Task[Any]],
        current_run: ConsumerRun | None = None,
        forward: Forward | None = None,
    ) -> None:
        self.directory = directory
        self.post = post
        self.serve = serve
        self.spawn = spawn
        # This channel's stage job (by run id) and how to hand it an object, for a
        # producer in this process.
        self.current_run = current_run
        self.forward = forward
        self._listening: list[str] = []
        self.outbound: Link | None = None
        self._servers: list[asyncio.AbstractServer] = []
        self._writers: list[Any] = []
        self.closing = False

    # ----------------------------------------------------------- consumer

    async def listen(self, request: LinkListen) -> Message:
        accepted = asyncio.Event()
        context: ssl.SSLContext | None = None
        if request.transport == "tls":
            c = request.credentials
            context = server_context(c.certificate, c.key, c.authority, self.directory)

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if accepted.is_set():
                writer.close()  # one producer per link
                return
            if context is not None and stage_name(request.peer) not in _peer_names(writer):
                log.warning("refused a link: the certificate does not name stage %d", request.peer)
                writer.close()
                return
            try:
                attach = FrameReader(reader, "link").message(ATTACH_FRAME_LIMIT)
                first = await asyncio.wait_for(attach, ATTACH_TIMEOUT)
            except (asyncio.TimeoutError, ProtocolError, ConnectionError, OSError) as error:
                log.warning("refused a link: %s", error or type(error).__name__)
                writer.close()
                return
            if not isinstance(first, LinkAttach) or not secrets.compare_digest(first.token, request.token):
                log.warning("refused a link without the link token")
                writer.close()
                return
            accepted.set()
            server.close()
            link = Link(reader, writer, request.peer, f"link from stage {request.peer}")
            self._writers.append(writer)
            try:
                await link.writer.send(LinkAttach(request.token))
            except (ConnectionError, OSError) as error:
                reason = f"the link from stage {request.peer} broke ({error})"
                self.post(LinkDown(request.peer, reason, request.token))
                return
            log.info("link from stage %d accepted (%s)", request.peer, request.transport)
            # Served by a task of the session (ended with it), not of the server.
            serving = self._serve(reader, writer, request.peer, request.token)
            self.spawn(serving, f"link from stage {request.peer}")

        if request.transport == "unix":
            path = self.directory / f"link-{secrets.token_hex(4)}.sock"
            server = await asyncio.start_unix_server(on_connect, path=str(path), limit=STREAM_LIMIT)
            os.chmod(path, 0o600)
            endpoint = f"unix:{path}"
            if self.current_run is not None and self.forward is not None and chaining_enabled():
                _IN_PROCESS[str(path)] = (self.current_run, self.forward)
                self._listening.append(str(path))
        elif request.transport == "tls":
            server = await asyncio.start_server(
                on_connect,
                "0.0.0.0",
                0,
                ssl=context,
                ssl_handshake_timeout=ATTACH_TIMEOUT,
                limit=STREAM_LIMIT,
            )
            port = server.sockets[0].getsockname()[1]
            endpoint = f"tcp:{port}"
        else:
            return RequestFailed(request.request_id, f"unknown link transport {request.transport!r}")
        self._servers.append(server)
        self.spawn(self._expire(server, accepted, request.timeout), "link listener timeout")
        return LinkListening(request.request_id, endpoint, _ssh_address())

    async def _serve(self, reader: Any, writer: Any, peer: int, token: str) -> None:
        reason = await self.serve(reader, writer, peer)
        writer.close()
        if not self.closing:
            self.post(LinkDown(peer, f"the link from stage {peer} ended: {reason}", token))

    async def _expire(self, server: asyncio.AbstractServer, accepted: asyncio.Event, timeout: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(accepted.wait(), timeout)
        server.close()
        self._forget_listeners()

    def _forget_listeners(self) -> None:
        for path in self._listening:
            _IN_PROCESS.pop(path, None)
        self._listening.clear()

    # ----------------------------------------------------------- producer

    async def connect(self, request: LinkConnect) -> Message:
        context: ssl.SSLContext | None = None
        if request.transport == "tls":
            c = request.credentials
            context = client_context(c.certificate, c.key, c.authority, self.directory)
        failures = []
        for endpoint in request.endpoints:
            try:
                link, round_trip = await asyncio.wait_for(
                    self._attach(endpoint, context, request), request.timeout
                )
            except asyncio.TimeoutError:
                failures.append(f"{endpoint}: no answer within {request.timeout:g}s")
                continue
            except (OSError, ProtocolError, ssl.SSLError, ValueError) as error:
                failures.append(f"{endpoint}: {error}")
                continue
            if self.outbound is not None:
                # A new data plane (a repair) replaces the link: the old one
                # is closed (its consumer's end ends too, named by its token).
                self.outbound.replaced = True
                self.outbound.close()
            self.outbound = link
            self.spawn(self._watch(link), f"link to stage {request.peer}")
            log.info("link to stage %d at %s (%.2f ms)", request.peer, endpoint, round_trip)
            return LinkConnected(request.request_id, endpoint, round_trip)
        tried = "; ".join(failures or ["no endpoint"])
        return RequestFailed(request.request_id, f"cannot reach stage {request.peer}: {tried}")

    async def _attach(
        self, endpoint: str, context: ssl.SSLContext | None, request: LinkConnect
    ) -> tuple[Link, float]:
        where, port = _split(endpoint)
        local = None
        if port is None:
            local = _IN_PROCESS.get(where)
            reader, writer = await asyncio.open_unix_connection(where, limit=STREAM_LIMIT)
        else:
            reader, writer = await asyncio.open_connection(
                where,
                port,
                ssl=context,
                server_hostname=stage_name(request.peer) if context else None,
                limit=STREAM_LIMIT,
            )
        self._writers.append(writer)
        link = Link(reader, writer, request.peer, f"link to stage {request.peer}", local, request.token)
        started = time.perf_counter()
        await link.writer.send(LinkAttach(request.token))
        answer = await link.reader.message(ATTACH_FRAME_LIMIT)
        if not isinstance(answer, LinkAttach) or not secrets.compare_digest(answer.token, request.token):
            writer.close()
            raise ProtocolError("the consumer did not accept the link")
        return link, (time.perf_counter() - started) * 1000.0

    async def _watch(self, link: Link) -> None:
        """Nothing comes back on an outbound link: its end is the link's end."""
        try:
            while True:
                frame = await link.reader.frame(0)
                if frame is None:
                    break
        except (ProtocolError, ConnectionError, OSError):
            pass
        if not self.closing and not link.replaced:
            self.post(LinkDown(link.peer, f"the link to stage {link.peer} ended", link.token))

    # ------------------------------------------------------------ each run

    async def edge(
        self,
        run: StageJob,
        message: LinkEdge,
        refuse: Callable[[str, str, RunId], None],
        forward: Forward,
    ) -> None:
        """``run``'s outbound (or ring-out) end on the outbound link: the
        consumer's end is opened with an OpenEdge on the link itself, so it
        cannot overtake anything the consumer was sent before."""
        expected = run.edge_ids(False).get(message.role)
        if message.role not in ("outbound", "ring-out") or expected != message.edge_id:
            reason = f"edge {message.edge_id} ({message.role}) is not this stage's to link"
            refuse("LinkEdge", reason, message.run_id)
            return
        if run.fsm.state is not StageState.PREPARING:
            refuse("LinkEdge", f"edge {message.edge_id} set up outside Preparing", message.run_id)
            return
        ring = run.provision.ring
        if message.role == "ring-out" and ring is not None and ring.consume:
            # A one-stage ring: the stage feeds itself, no link at all.
            run.ring_out = LocalFeed(forward)
            run.apply(EdgeEstablished("ring-out"))
            run.apply(EdgeEstablished("ring-in"))
            return
        link = self.outbound
        if link is None:
            refuse("LinkEdge", "this stage has no link (LinkConnect first)", message.run_id)
            return
        consumer_role = "inbound" if message.role == "outbound" else "ring-in"
        try:
            await link.writer.send(OpenEdge(message.run_id, message.edge_id, consumer_role))
        except (ConnectionError, OSError) as error:
            if run.fsm.state is StageState.PREPARING:
                run.fault_peer = link.peer  # the peer may have died: the orchestrator checks
                run.apply(SetupFailed(f"the link to stage {link.peer} broke ({error})"))
            return
        # A consumer in this process takes the records from our hand: the
        # link's socket still carries the OpenEdge above (which the consumer
        # takes before it is Ready, so before any record can come) and its
        # end is still the link's end.
        writer: RecordSink = link.writer if link.forward is None else LocalFeed(link.forward)
        if message.role == "outbound":
            run.outbound, run.outbound_peer = writer, link.peer
            run.local_next = link.consumer
        else:
            run.ring_out, run.ring_peer = writer, link.peer
        if run.fsm.state is StageState.PREPARING:
            run.apply(EdgeEstablished(message.role))

    # ------------------------------------------------------------- closing

    def close(self) -> None:
        self.closing = True
        self._forget_listeners()
        for server in self._servers:
            server.close()
        for writer in self._writers:
            with contextlib.suppress(Exception):
                writer.close()
