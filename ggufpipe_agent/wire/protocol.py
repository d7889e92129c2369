"""Control messages: frozen dataclasses, one tag registry, msgpack on the wire.

This is the only module that calls msgpack. A control frame is::

    b"GPCM" | u32 little-endian payload length | msgpack [tag, {field: value}]

Object records (token and activation payloads) have their own fixed binary
header and live in :mod:`ggufpipe_agent.wire.objects`.

Message names and fields follow the design (docs/design.md, "The provisioning
message" and "Control messages and events"); the extra
messages (Hello, Inspect, Tokenize, progress and stats) are documented in
``docs/protocol.md``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import msgpack

from ggufpipe_agent.errors import ProtocolError
from ggufpipe_agent.ids import FIRST_SLOT, NO_RUN, EdgeId, RunId, SlotId

# The messages of model delivery and of the stage cache, and those of the
# direct links (docs/rings.md), are defined in their own modules (to keep this
# one readable): importing them puts their messages in the tag registry.
from ggufpipe_agent.wire import delivery_messages, link_messages  # noqa: F401
from ggufpipe_agent.wire.codec import (  # noqa: F401 - to_plain, Bounds, BOUNDS are this module's API too
    BOUNDS,
    HEAD_LIMITS,
    REGISTRY,
    SMALL,
    Bounds,
    ContainerCount,
    Message,
    build,
    to_plain,
)

# The records inside messages are defined in their own module; they are this
# module's names too.
from ggufpipe_agent.wire.records import (  # noqa: F401
    ChatMessage,
    Device,
    EngineOptions,
    InboundEdgeProvision,
    MemoryFacts,
    ModelFacts,
    ModelIdentity,
    ObjectSpec,
    OutboundEdgeProvision,
    PrefixHeld,
    PrefixOffer,
    RingSpec,
    SamplingParams,
    StageFileRef,
    StageModelFacts,
    StepCounters,
    TokenRingProvision,
)

CONTROL_MAGIC = b"GPCM"
_PREFIX = struct.Struct("<4sI")
CONTROL_PREFIX_SIZE = _PREFIX.size
#: A control message is small; the largest is ModelInfo with a vocabulary of
#: a few hundred thousand pieces. Anything bigger is a broken or hostile peer.
MAX_CONTROL_BYTES = 64 * 1024 * 1024

_REGISTRY = REGISTRY  # every message type by its tag, wherever it is defined


# --------------------------------------------------------------------------- #
# Agent -> orchestrator


@dataclass(frozen=True, slots=True)
class Hello(Message):
    """First frame an agent writes: who it is and what it can run."""

    protocol: int
    version: str
    hostname: str
    pid: int
    python: str
    llama_cpp: str  # llama-cpp-python version, "" when it does not import
    backend: str  # "cpu", "cuda", "metal", ...
    gpu_offload: bool
    devices: tuple[Device, ...]
    memory_total: int
    memory_available: int
    data_endpoint: str  # "unix:/path" of the agent's data socket
    data_token: str  # a data connection must present this first
    # An agent started with --share-process: where further stages of the same
    # orchestrator attach their control streams to this process ("unix:/path"
    # in its private directory) and the secret they present (ShareAttach).
    # Both "" otherwise, and in the Hello of an attached stage.
    share_endpoint: str = ""
    share_token: str = ""


@dataclass(frozen=True, slots=True)
class ModelInfo(Message):
    request_id: int
    facts: ModelFacts
    pieces: tuple[bytes, ...]  # token id -> bytes, empty unless asked
    identity: ModelIdentity | None = None  # what hosts compare (docs/model-delivery.md)
    #: (token id, its text) for the control tokens, whose pieces are empty:
    #: the markup some tool-call formats are written in; with the pieces.
    special: tuple[tuple[int, bytes], ...] = ()


@dataclass(frozen=True, slots=True)
class Tokenized(Message):
    request_id: int
    tokens: tuple[int, ...]
    rendered: str  # the prompt after the chat template


@dataclass(frozen=True, slots=True)
class RequestFailed(Message):
    request_id: int
    reason: str


@dataclass(frozen=True, slots=True)
class StageReady(Message):
    run_id: RunId
    stage_index: int
    node_id: str
    held: PrefixHeld = PrefixHeld()  # what it holds of the provision's PrefixOffer


@dataclass(frozen=True, slots=True)
class StageFault(Message):
    run_id: RunId
    stage_index: int
    node_id: str
    reason: str
    link_peer: int = -1  # >= 0: the fault is a broken direct link to that stage


@dataclass(frozen=True, slots=True)
class StageStopped(Message):
    run_id: RunId
    stage_index: int
    node_id: str
    counters: StepCounters


@dataclass(frozen=True, slots=True)
class StageProgress(Message):
    """Optional diagnostics: a stage FSM state change or load progress."""

    run_id: RunId
    stage_index: int
    state: str
    detail: str
    fraction: float  # 0..1, or -1 when unknown


@dataclass(frozen=True, slots=True)
class StepStats(Message):
    """Optional diagnostics, sent at most a few times a second while running."""

    run_id: RunId
    stage_index: int
    counters: StepCounters


@dataclass(frozen=True, slots=True)
class Refused(Message):
    """A frame or message the agent refused (docs/design.md, "Security model"); it is logged, not fatal."""

    what: str
    reason: str
    # The run the refused message named, 0 for none: a refusal that arrives
    # after its run was replaced (a prepared run torn down for other sampling)
    # is about that old run, not the one now being set up.
    run_id: RunId = NO_RUN


# --------------------------------------------------------------------------- #
# Orchestrator -> agent


@dataclass(frozen=True, slots=True)
class Inspect(Message):
    """Read a model's facts (and optionally its token pieces) where it lives."""

    request_id: int
    path: str
    vocabulary: bool


@dataclass(frozen=True, slots=True)
class Tokenize(Message):
    """Tokenize ``text``, or with ``messages`` a whole conversation, which the
    model's chat template renders ready for the next assistant turn (``chat``
    must be True then). An agent that predates ``messages`` refuses the field
    by name."""

    request_id: int
    path: str
    text: str
    chat: bool  # apply the model's chat template first
    messages: tuple[ChatMessage, ...] = ()
    #: The functions the model may call, JSON text of OpenAI's ``tools`` list,
    #: which the chat template renders as the model was trained; "" none.
    tools: str = ""
    #: A chat template to use instead of the model's own; "" the model's.
    template: str = ""


@dataclass(frozen=True, slots=True)
class ProvisionStage(Message):
    run_id: RunId
    stage_index: int
    stage_count: int
    node_id: str
    gguf_source: str
    layer_start: int
    layer_end_exclusive: int
    inbound: InboundEdgeProvision
    outbound: OutboundEdgeProvision
    model: StageModelFacts
    engine: EngineOptions
    sampling: SamplingParams
    ring: TokenRingProvision | None = None  # None: the orchestrator feeds tokens back
    # Set when the orchestrator sent the stage file (model send: true): the
    # stage loads that cache entry and never reads gguf_source.
    stage_file: StageFileRef | None = None
    reuse: PrefixOffer = PrefixOffer()  # what the stage may keep of the slot's previous run
    slot: SlotId = FIRST_SLOT  # the engine's slot (sequence id) this run uses: 0 .. engine.parallel - 1


@dataclass(frozen=True, slots=True)
class StopRun(Message):
    run_id: RunId
    reason: str


@dataclass(frozen=True, slots=True)
class RewireEdge(Message):
    """A request to point an edge at another peer. Stages always refuse it
    (docs/design.md, "Security model"): only the orchestrator's provision message wires a stage."""

    run_id: RunId
    edge_id: EdgeId
    peer: str


@dataclass(frozen=True, slots=True)
class Shutdown(Message):
    reason: str


@dataclass(frozen=True, slots=True)
class OpenEdge(Message):
    """Stream setup on the data connection: establishes one edge end of a
    provisioned stage. ``role`` is "inbound" (objects to the stage) or
    "outbound" (objects from it)."""

    run_id: RunId
    edge_id: EdgeId
    role: str


@dataclass(frozen=True, slots=True)
class DataAttach(Message):
    """First frame on a data connection: proves it comes from the orchestrator
    that received the agent's Hello."""

    token: str


@dataclass(frozen=True, slots=True)
class ShareAttach(Message):
    """First frame on a connection to a shared agent process's share socket:
    proves it comes from the orchestrator that received the first stage's
    Hello (its ``share_token``). A control session follows, Hello first."""

    token: str


# --------------------------------------------------------------------------- #
# Both ways


@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    """Sent on the control stream every ``interval`` seconds by both sides once
    the orchestrator has sent its first: a side that hears nothing from the
    other for ``timeout`` seconds takes it for gone (the orchestrator reports
    the stage lost; the agent ends the session). The orchestrator's values
    are the session's."""

    interval: float
    timeout: float


# --------------------------------------------------------------------------- #
# A hand-started agent's handshake (ggufpipe_agent/process/key_file.py)


@dataclass(frozen=True, slots=True)
class AuthChallenge(Message):
    """The first frame on a ``--listen`` connection, instead of Hello."""

    protocol: int
    nonce: bytes


@dataclass(frozen=True, slots=True)
class AuthResponse(Message):
    """The orchestrator's nonce and its proof that it holds the listen key."""

    nonce: bytes
    proof: bytes


@dataclass(frozen=True, slots=True)
class AuthProof(Message):
    """The agent's proof that it holds the listen key; Hello follows."""

    proof: bytes


# --------------------------------------------------------------------------- #
# Encoding


def encode_message(message: Message) -> bytes:
    """A whole control frame: prefix and msgpack payload."""
    payload = msgpack.packb([message.tag, to_plain(message)], use_bin_type=True)
    return _PREFIX.pack(CONTROL_MAGIC, len(payload)) + payload


def parse_prefix(prefix: bytes, limit: int = MAX_CONTROL_BYTES) -> int:
    """Check a control frame prefix and return its payload length (at most
    ``limit``: a connection that has not authenticated gets a small one)."""
    magic, length = _PREFIX.unpack(prefix)
    if magic != CONTROL_MAGIC:
        raise ProtocolError(f"bad control frame magic {magic!r}")
    if length > limit:
        raise ProtocolError(f"control frame of {length} bytes exceeds {limit}")
    return length


def decode_payload(payload: bytes | bytearray | memoryview) -> Message:
    """A message from a frame's payload. The tag is read first, under tiny
    limits; the fields then under the bounds of that message type, so nothing
    a peer sends can make the decoder allocate much more than the frame."""
    view = memoryview(payload)
    head = msgpack.Unpacker(raw=False, **HEAD_LIMITS)
    head.feed(view[:96])
    try:
        if head.read_array_header() != 2:
            raise ProtocolError("undecodable control message: not [tag, fields]")
        tag = head.unpack()
    except (ValueError, TypeError, msgpack.UnpackException) as error:
        raise ProtocolError(f"undecodable control message: {error or type(error).__name__}") from None
    if not isinstance(tag, str) or tag not in _REGISTRY:
        raise ProtocolError(f"unknown control message {tag!r}")
    bounds = BOUNDS.get(tag, SMALL)
    count = ContainerCount(tag, bounds.containers)
    try:
        body = msgpack.unpackb(
            view[head.tell() :],
            raw=False,
            strict_map_key=True,
            object_pairs_hook=count.map,
            list_hook=count.array,
            max_str_len=bounds.str_len,
            max_bin_len=bounds.bin_len,
            max_array_len=bounds.array_len,
            max_map_len=bounds.map_len,
            max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.UnpackException) as error:
        raise ProtocolError(f"{tag}: undecodable control message: {error}") from None
    message: Message = build(_REGISTRY[tag], body, tag)
    return message


def decode_message(frame: bytes) -> Message:
    """Decode one whole control frame (prefix included)."""
    if len(frame) < CONTROL_PREFIX_SIZE:
        raise ProtocolError("truncated control frame")
    length = parse_prefix(frame[:CONTROL_PREFIX_SIZE])
    if len(frame) != CONTROL_PREFIX_SIZE + length:
        raise ProtocolError(f"control frame says {length} bytes, has {len(frame) - CONTROL_PREFIX_SIZE}")
    return decode_payload(frame[CONTROL_PREFIX_SIZE:])
