"""``ggufpipe-agent --listen ADDR``: an agent started by hand, serving one
authenticated orchestrator at a time.

Nothing is served before the peer has proved it holds the listen key
(:mod:`ggufpipe_agent.process.key_file`): a connection gets an AuthChallenge, and
anything but a valid AuthResponse within :data:`AUTH_TIMEOUT` is refused and
closed, before the Hello (and its data token) is sent. Only then does the
"one orchestrator at a time" rule apply, so a stranger holding a connection
open locks nobody out. An attached session ends when its orchestrator goes
quiet past the heartbeat bound (:class:`~ggufpipe_agent.process.runtime.ControlChannel`),
and the agent waits for the next one.

Handshakes are budgeted per peer (docs/security.md, "Someone on the same host as
a stage"): a peer is the user behind a
loopback or Unix connection (the kernel says which: ``sock_diag`` for TCP,
``SO_PEERCRED`` for Unix sockets), else its address (an IPv6 peer's /64).
One peer may have :data:`PEER_PENDING` connections authenticating at once,
all peers together :data:`MAX_PENDING`, which no single peer can fill; a
connection past either is refused before its challenge. So another user
holding connections open, and reopening each as it is closed, keeps nobody
else out. The warnings about refused connections are rate-limited
(:class:`RefusalLog`): hammering the port writes a few lines a minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ggufpipe_agent import PROTOCOL_VERSION
from ggufpipe_agent.errors import ProtocolError
from ggufpipe_agent.process.control import ControlChannel
from ggufpipe_agent.process.key_file import remove_key_file, write_key_file
from ggufpipe_agent.process.runtime import Agent
from ggufpipe_agent.wire.endpoints import parse_endpoint
from ggufpipe_agent.wire.framing import FrameReader, FrameWriter
from ggufpipe_agent.wire.listen_key import (
    AGENT,
    NONCE_BYTES,
    ORCHESTRATOR,
    ListenKeyError,
    default_key_path,
    new_nonce,
    proof,
    verify,
)
from ggufpipe_agent.wire.protocol import AuthChallenge, AuthProof, AuthResponse, Refused, encode_message

log = logging.getLogger("ggufpipe.agent")

#: How long a new connection has to authenticate: an orchestrator needs one
#: round trip (and, on its first try, a read of the key file, which it starts
#: when it connects), so a slot held by a silent peer is freed soon.
AUTH_TIMEOUT = 5.0
#: The largest frame read from a peer that has not authenticated.
AUTH_FRAME_LIMIT = 4096
#: Connections one peer may have authenticating at once; more from it are
#: refused before their challenge. An orchestrator needs one (two while a
#: retry overlaps a connection the agent has not seen close yet).
PEER_PENDING = 4
#: Connections authenticating at once from all peers together; more are
#: refused before their challenge. Many times PEER_PENDING: no single peer
#: can fill it.
MAX_PENDING = 64
#: Warnings about refused connections: in each window of WARN_WINDOW seconds
#: the first WARN_PER_PEER of each peer are logged, and WARN_OVERALL in all;
#: the rest are counted in one line at the window's end.
WARN_WINDOW = 60.0
WARN_PER_PEER = 3
WARN_OVERALL = 12
#: How many peers' suppressed warnings are counted one by one in a window.
WARN_TRACKED = 1024

assert PEER_PENDING < MAX_PENDING


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ----------------------------------------------------------------- peers


@dataclass(frozen=True)
class Peer:
    """Who a connection is from. ``key`` is what handshake budgets and log
    limits count by; ``label`` is the connection, for the log."""

    key: str
    label: str


_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_HEADER = struct.Struct("=IHHII")
_NO_COOKIE = 0xFFFFFFFF
_INET_DIAG_MSG = 72  # struct inet_diag_msg
_INET_DIAG_UID = 64  # its idiag_uid


def tcp_peer_uid(
    peer: ipaddress.IPv4Address | ipaddress.IPv6Address,
    peer_port: int,
    local: ipaddress.IPv4Address | ipaddress.IPv6Address,
    local_port: int,
) -> int | None:
    """The uid owning the other end of a TCP connection on this machine (a
    loopback peer), from the kernel's socket diagnostics (``sock_diag``, what
    ``ss -e`` shows; no privilege needed); None where it cannot be learned
    (not Linux, not found, filtered)."""
    if peer.version != local.version or not hasattr(socket, "AF_NETLINK"):
        return None
    family = socket.AF_INET if peer.version == 4 else socket.AF_INET6
    # struct inet_diag_req_v2 naming the peer's socket: its local end is
    # peer:peer_port, its remote end ours. No cookie: an exact lookup.
    sockid = struct.pack(
        "!HH16s16s", peer_port, local_port, peer.packed.ljust(16, b"\0"), local.packed.ljust(16, b"\0")
    ) + struct.pack("=III", 0, _NO_COOKIE, _NO_COOKIE)
    request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
    message = _NLMSG_HEADER.pack(
        _NLMSG_HEADER.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0
    )
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as diag:
            # The kernel answers within the send: a reply is waiting, or none comes.
            diag.settimeout(0.05)
            diag.send(message + request)
            reply = diag.recv(4096)
    except OSError:
        return None
    if len(reply) < _NLMSG_HEADER.size + _INET_DIAG_MSG:
        return None
    kind = _NLMSG_HEADER.unpack_from(reply)[1]
    (sport,) = struct.unpack_from("!H", reply, _NLMSG_HEADER.size + 4)
    if kind != _SOCK_DIAG_BY_FAMILY or sport != peer_port:
        return None
    (uid,) = struct.unpack_from("=I", reply, _NLMSG_HEADER.size + _INET_DIAG_UID)
    return int(uid)


def uid_lookup_works() -> bool:
    """Whether :func:`tcp_peer_uid` finds the owner of a loopback connection
    here (a connection of this process to itself, looked up once)."""
    try:
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            with socket.create_connection(server.getsockname(), timeout=2) as client:
                accepted, _ = server.accept()
                with accepted:
                    host, port = client.getsockname()[:2]
                    listening = server.getsockname()[1]
                    address = ipaddress.ip_address(host)
                    return tcp_peer_uid(address, port, address, listening) == os.geteuid()
    except OSError:
        return False


def unix_peer_uid(sock: object) -> int | None:
    """The uid of a Unix socket's peer (``SO_PEERCRED``, Linux)."""
    option = getattr(socket, "SO_PEERCRED", None)
    getsockopt = getattr(sock, "getsockopt", None)
    if option is None or getsockopt is None:
        return None
    try:
        _pid, uid, _gid = struct.unpack("3i", getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i")))
    except (OSError, struct.error, TypeError):
        return None
    return int(uid)


def identify(writer: asyncio.StreamWriter) -> Peer:
    """Who a new connection is from: a local user (loopback TCP, Unix socket)
    by uid, everyone else by address, an IPv6 one by its /64 (one host
    usually holds a whole /64). Every address of 127/8 is the same loopback
    peer when the uid cannot be learned."""
    sock = writer.get_extra_info("socket")
    peername = writer.get_extra_info("peername")
    if getattr(sock, "family", None) == getattr(socket, "AF_UNIX", None) or not isinstance(peername, tuple):
        uid = unix_peer_uid(sock)
        who = f"uid {uid}" if uid is not None else "a unix peer"
        return Peer(who, f"a unix peer ({who})" if uid is not None else who)
    host, port = str(peername[0]), int(peername[1])
    label = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return Peer(host, label)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_loopback:
        sockname = writer.get_extra_info("sockname")
        uid = None
        if isinstance(sockname, tuple):
            with contextlib.suppress(ValueError):
                local = ipaddress.ip_address(str(sockname[0]).split("%", 1)[0])
                if isinstance(local, ipaddress.IPv6Address) and local.ipv4_mapped is not None:
                    local = local.ipv4_mapped
                uid = tcp_peer_uid(address, port, local, int(sockname[1]))
        if uid is None:
            return Peer("loopback", label)
        return Peer(f"uid {uid} on loopback", f"{label} (uid {uid})")
    if address.version == 6:
        return Peer(str(ipaddress.ip_network(f"{address}/64", strict=False)), label)
    return Peer(str(address), label)


class RefusalLog:
    """Warnings about refused connections, rate-limited: in each window the
    first ``per_peer`` of each peer and ``overall`` in all are logged; the
    others are counted, and said in one line when the window ends ("N more
    refused from X in the last T s")."""

    def __init__(
        self,
        window: float = WARN_WINDOW,
        per_peer: int = WARN_PER_PEER,
        overall: int = WARN_OVERALL,
        logger: logging.Logger = log,
    ) -> None:
        self.window, self.per_peer, self.overall, self.log = window, per_peer, overall, logger
        self.started: float | None = None
        self.logged: Counter[str] = Counter()
        self.suppressed: Counter[str] = Counter()
        self.untracked = 0  # suppressed from peers past WARN_TRACKED
        self._flush: asyncio.TimerHandle | None = None

    def warn(self, peer: Peer, message: str, *args: object) -> None:
        loop = asyncio.get_running_loop()
        if self.started is None:
            self.started = loop.time()
            self._flush = loop.call_later(self.window, self.flush)
        if self.logged[peer.key] < self.per_peer and sum(self.logged.values()) < self.overall:
            self.logged[peer.key] += 1
            self.log.warning(message, *args)
        elif peer.key in self.suppressed or len(self.suppressed) < WARN_TRACKED:
            self.suppressed[peer.key] += 1
        else:
            self.untracked += 1

    def flush(self) -> None:
        """End the window: the line for what was not logged in it, if anything."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        if self.started is None:
            return
        elapsed = asyncio.get_running_loop().time() - self.started
        count = sum(self.suppressed.values()) + self.untracked
        if count:
            peers = len(self.suppressed) + (1 if self.untracked else 0)
            if peers == 1 and not self.untracked:
                (who,) = self.suppressed
                self.log.warning("%d more refused from %s in the last %.0fs", count, who, elapsed)
            else:
                (who, most), *_ = self.suppressed.most_common(1) or [("others", self.untracked)]
                self.log.warning(
                    "%d more refused from %s%d peers in the last %.0fs (the most from %s: %d)",
                    count,
                    "over " if self.untracked else "",
                    peers,
                    elapsed,
                    who,
                    most,
                )
        self.started = None
        self.logged.clear()
        self.suppressed.clear()
        self.untracked = 0


class Listener:
    def __init__(self, endpoint: str, cache_dir: Path | None, key_path: Path) -> None:
        self.endpoint = endpoint
        self.key_path = key_path
        self.key = b""
        self.agent = Agent(cache_dir)
        self.busy = asyncio.Lock()
        self.pending: Counter[str] = Counter()  # connections authenticating, by peer
        self.refusals = RefusalLog()

    async def serve(self) -> None:
        where, port = parse_endpoint(self.endpoint)
        if port is None:
            server = await self._bind_unix(where)
        else:
            server = await asyncio.start_server(self._on_connect, where, port, limit=1 << 20)
            if not uid_lookup_works():
                log.warning(
                    "this host cannot tell which user holds a loopback connection (no sock_diag): "
                    "every local user shares one budget of %d handshakes, which one of them can fill; "
                    "listen on unix:PATH instead, where each user has a budget of their own",
                    PEER_PENDING,
                )
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
        except (ListenKeyError, OSError) as error:
            server.close()
            raise ListenKeyError(f"cannot write the listen key {self.key_path}: {error}") from None
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
            with contextlib.suppress(RuntimeError):
                self.refusals.flush()
            remove_key_file(self.key_path, self.key)
            self.agent.close()

    async def _bind_unix(self, path: str) -> asyncio.AbstractServer:
        """A Unix socket only this user can connect to. asyncio removes an
        existing socket file before it binds, so one in use is refused first."""
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as probe:
            probe.connect(path)
            raise ListenKeyError(f"unix:{path} is in use by another process")
        previous = os.umask(0o177)
        try:
            server = await asyncio.start_unix_server(self._on_connect, path=path, limit=1 << 20)
        finally:
            os.umask(previous)
        os.chmod(path, 0o600)
        return server

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            peer = identify(writer)
            if self.pending[peer.key] >= PEER_PENDING:
                self.refusals.warn(
                    peer,
                    "refused %s: %d of its connections are already authenticating",
                    peer.label,
                    PEER_PENDING,
                )
                self._turn_away(
                    writer, f"busy: {PEER_PENDING} connections from {peer.key} are authenticating"
                )
                return
            if sum(self.pending.values()) >= MAX_PENDING:
                self.refusals.warn(
                    peer, "refused %s: %d connections are already authenticating", peer.label, MAX_PENDING
                )
                self._turn_away(writer, f"busy: {MAX_PENDING} connections are authenticating")
                return
            self.pending[peer.key] += 1
            try:
                authenticated = await asyncio.wait_for(self._authenticate(reader, writer, peer), AUTH_TIMEOUT)
            except asyncio.TimeoutError:
                self.refusals.warn(
                    peer, "refused %s: no answer to the challenge within %gs", peer.label, AUTH_TIMEOUT
                )
                return
            except (ProtocolError, ConnectionError, OSError) as error:
                self.refusals.warn(peer, "refused %s: %s", peer.label, error or type(error).__name__)
                return
            finally:
                self.pending[peer.key] -= 1
                if not self.pending[peer.key]:
                    del self.pending[peer.key]
            if not authenticated:
                return
            if self.busy.locked():
                self.refusals.warn(peer, "refused orchestrator %s: another one is attached", peer.label)
                with contextlib.suppress(ConnectionError, OSError):
                    await self._say(writer, Refused("connection", "another orchestrator is attached"))
                return
            async with self.busy:
                log.info("orchestrator attached from %s", peer.label)
                reason = await ControlChannel(self.agent, reader, writer).serve()
                log.info("orchestrator detached: %s", reason)
        except asyncio.CancelledError:
            return  # the agent is ending (see Agent._data_connection)
        finally:
            writer.close()

    async def _authenticate(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: Peer
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
        self.refusals.warn(
            peer, "refused %s: it sent %s, not a proof of this agent's listen key", peer.label, what
        )
        with contextlib.suppress(ConnectionError, OSError):  # one refusal, one warning
            await self._say(
                writer, Refused("connection", "authentication failed: not this agent's listen key")
            )
        return False

    @staticmethod
    def _turn_away(writer: asyncio.StreamWriter, reason: str) -> None:
        """A connection past the handshake budgets: its refusal instead of a
        challenge, not waited for (a small frame on a new connection: the
        socket's buffer takes it), then the caller closes it."""
        with contextlib.suppress(ConnectionError, OSError):
            writer.write(encode_message(Refused("connection", reason)))

    @staticmethod
    async def _say(writer: asyncio.StreamWriter, message: AuthChallenge | AuthProof | Refused) -> None:
        await FrameWriter(writer, drain_timeout=AUTH_TIMEOUT, what="listening connection").send(message)


async def serve_listen(endpoint: str, cache_dir: Path | None, key_file: Path | None = None) -> None:
    """A hand-started agent on ``endpoint`` until it is stopped."""
    key_path = key_file or Path(os.path.expanduser(default_key_path(endpoint)))
    await Listener(endpoint, cache_dir, key_path).serve()
