"""The direct links' control messages (docs/rings.md, :mod:`ggufpipe_agent.process.peer_links`):
set up by the orchestrator over each stage's control stream, then the first
frame on a link and its end: control messages like every other
(:class:`ggufpipe_agent.wire.codec.Message`, registered by class name, encoded and
decoded only by :mod:`ggufpipe_agent.wire.protocol`, which re-exports them)."""

from __future__ import annotations

from dataclasses import dataclass

from ggufpipe_agent.ids import EdgeId, RunId
from ggufpipe_agent.wire.codec import Message

#: The domain of the names in the link certificates of a session.
LINK_DOMAIN = "ggufpipe.invalid"


def stage_name(index: int) -> str:
    """The name a stage's link certificate carries."""
    return f"stage-{index}.{LINK_DOMAIN}"


@dataclass(frozen=True, slots=True)
class LinkCredentials:
    """A stage's TLS identity for links to another host: its key and
    certificate and the session authority's certificate (PEM). Empty for a
    Unix-socket link (same host: file permissions authenticate)."""

    certificate: bytes = b""
    key: bytes = b""
    authority: bytes = b""


@dataclass(frozen=True, slots=True)
class LinkListen(Message):
    """o -> consumer: accept one link from stage ``peer`` that presents
    ``token`` (and, for "tls", a certificate of this session naming ``peer``)."""

    request_id: int
    transport: str  # "unix" or "tls"
    peer: int
    token: str
    credentials: LinkCredentials
    timeout: float  # seconds the listener waits for its producer


@dataclass(frozen=True, slots=True)
class LinkListening(Message):
    """consumer -> o: where the producer connects. ``endpoint`` is "unix:PATH"
    or "tcp:PORT"; ``addresses`` are this host's own idea of where it is (the
    address its SSH connection arrived at)."""

    request_id: int
    endpoint: str
    addresses: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class LinkConnect(Message):
    """o -> producer: connect to stage ``peer`` at the first of ``endpoints``
    that answers ("unix:PATH" or "HOST:PORT") and attach with ``token``."""

    request_id: int
    transport: str
    peer: int
    endpoints: tuple[str, ...]
    token: str
    credentials: LinkCredentials
    timeout: float  # seconds per endpoint


@dataclass(frozen=True, slots=True)
class LinkConnected(Message):
    """producer -> o: the link is up (the probe): where, and the attach round trip."""

    request_id: int
    endpoint: str
    round_trip_ms: float


@dataclass(frozen=True, slots=True)
class LinkAttach(Message):
    """First frame on a link, both ways: the producer presents the token, the
    consumer answers with it once it has accepted the link."""

    token: str


@dataclass(frozen=True, slots=True)
class LinkEdge(Message):
    """o -> producer: set up this run's ``role`` end ("outbound": the activation
    edge; "ring-out": the token ring) on the stage's link; the agent opens the
    consumer's end by sending OpenEdge on the link."""

    run_id: RunId
    edge_id: EdgeId
    role: str


@dataclass(frozen=True, slots=True)
class LinkDown(Message):
    """a -> o: the link to or from stage ``peer`` ended (between runs too).
    ``token`` is the link's (its LinkListen's): a link a repair replaced
    says so late, and the orchestrator tells it from the new one."""

    peer: int
    reason: str
    token: str = ""
