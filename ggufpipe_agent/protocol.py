"""Control messages: frozen dataclasses, one tag registry, msgpack on the wire.

This is the only module that calls msgpack. A control frame is::

    b"GPCM" | u32 little-endian payload length | msgpack [tag, {field: value}]

Object records (token and activation payloads) have their own fixed binary
header and live in :mod:`ggufpipe_agent.objects`.

Message names and fields follow the orchestration spec (§4, §8); the extra
messages (Hello, Inspect, Tokenize, progress and stats) are documented in
``docs/protocol.md``.
"""

from __future__ import annotations

import dataclasses
import struct
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import msgpack

from ggufpipe_agent.errors import ProtocolError

CONTROL_MAGIC = b"GPCM"
_PREFIX = struct.Struct("<4sI")
CONTROL_PREFIX_SIZE = _PREFIX.size
#: A control message is small; the largest is ModelInfo with a vocabulary of
#: a few hundred thousand pieces. Anything bigger is a broken or hostile peer.
MAX_CONTROL_BYTES = 64 * 1024 * 1024

_REGISTRY: dict[str, type[Message]] = {}


class Message:
    """Base of every control message; subclasses register under their class name."""

    __slots__ = ()
    tag: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.tag = cls.__name__
        existing = _REGISTRY.get(cls.tag)
        # dataclass(slots=True) builds the class a second time; that is no clash.
        if existing is not None and existing.__qualname__ != cls.__qualname__:
            raise TypeError(f"duplicate control message tag {cls.tag}")
        _REGISTRY[cls.tag] = cls


# --------------------------------------------------------------------------- #
# Shared records (not messages on their own)


@dataclass(frozen=True, slots=True)
class ObjectSpec:
    """What one edge carries: rows of ``width`` elements of ``dtype``."""

    kind: str  # "tokens" or "activation"
    dtype: str  # "int32", "float32" or "float16"
    width: int  # 1 for tokens, hidden_dim for activations
    max_rows: int  # the run's max_seq_len

    @property
    def itemsize(self) -> int:
        return {"int32": 4, "float32": 4, "float16": 2}[self.dtype]

    @property
    def max_extent(self) -> int:
        """Spec §9: ``max_seq_len * hidden_dim * dtype_width_bytes``."""
        return self.max_rows * self.width * self.itemsize


@dataclass(frozen=True, slots=True)
class RingSpec:
    """A bounded ring of object records at one edge end (docs/rings.md)."""

    slots: int
    slot_bytes: int


@dataclass(frozen=True, slots=True)
class InboundEdgeProvision:
    edge_id: int
    kind: str  # EdgeKind: "TokenIn" or "Activation"
    object_spec: ObjectSpec
    ring_spec: RingSpec


@dataclass(frozen=True, slots=True)
class OutboundEdgeProvision:
    edge_id: int
    kind: str  # EdgeKind: "Activation" or "TokenOut"
    consumer_node_id: str
    object_spec: ObjectSpec
    ring_spec: RingSpec


@dataclass(frozen=True, slots=True)
class StageModelFacts:
    model_id: str
    architecture: str
    block_count: int
    hidden_dim: int
    vocab_size: int
    dtype_family: str  # "float"
    dtype_width_bytes: int  # 4 for float32 activations, 2 for float16
    max_seq_len: int


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """How a stage runs llama.cpp. ``threads=0`` means one per core;
    ``gpu_layers=-1`` offloads every layer when the build has a GPU backend."""

    n_ctx: int
    n_batch: int
    n_ubatch: int
    threads: int = 0
    gpu_layers: int = -1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Greedy when ``temperature <= 0``; otherwise top-k, top-p, temperature
    and a seeded draw, in llama.cpp's sampler chain."""

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    seed: int = 0


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One turn of a conversation, as the model's chat template takes it."""

    role: str  # "system", "user" or "assistant"
    content: str


@dataclass(frozen=True, slots=True)
class Device:
    name: str
    description: str
    memory_total: int
    memory_free: int


@dataclass(frozen=True, slots=True)
class MemoryFacts:
    """What llama.cpp's memory for a layer range depends on, read from the GGUF
    header where the model lives (:func:`ggufpipe_agent.memory.memory_facts`);
    :mod:`ggufpipe_agent.memory` sizes a stage from it (docs/planning.md)."""

    block_bytes: tuple[int, ...]  # tensor bytes of each block
    token_embd_bytes: int
    output_norm_bytes: int
    output_bytes: int  # output.weight; 0 when the projection is tied to token_embd
    global_bytes: int  # other tensors outside the blocks (rope_freqs, rope factors, ...)
    kv_widths: tuple[int, ...]  # per block: K + V elements per cache cell
    swa_blocks: tuple[bool, ...]  # per block: a sliding-window block
    sliding_window: int  # 0 when the model has none
    n_embd: int
    n_vocab: int
    n_ff: int  # feed-forward width per token (n_ff_exp * n_expert_used for experts)
    q_width: int  # n_head * key_length


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the orchestrator needs to know of a GGUF model (spec §3 GgufModelPlan)."""

    path: str
    name: str
    architecture: str
    file_type: str
    file_size: int
    block_count: int
    hidden_dim: int
    context_length: int
    vocab_size: int
    head_count: int
    head_count_kv: int
    key_length: int
    value_length: int
    bos_token_id: int  # -1 when the model has none
    eos_token_id: int
    eog_token_ids: tuple[int, ...]
    add_bos: bool
    chat_template: str  # "" when the file has none
    block_bytes: tuple[int, ...]  # tensor bytes of each block
    embedding_bytes: int  # token_embd.weight
    output_bytes: int  # output_norm.weight and output.weight when present
    memory: MemoryFacts | None = None  # None: a hand-made record (tests); see memory.memory_facts_of

    @property
    def stem(self) -> str:
        return self.name or self.path.rsplit("/", 1)[-1]


@dataclass(frozen=True, slots=True)
class PrefixOffer:
    """In a provision: the stage may keep up to ``positions`` positions of
    its KV cache written by run ``run_id`` (the previous run on this chain;
    0: none, start empty). What it keeps is decided when the prompt comes,
    by the prompt object's position (docs/worker.md, "Prefix reuse")."""

    run_id: int = 0
    positions: int = 0


@dataclass(frozen=True, slots=True)
class PrefixHeld:
    """In StageReady: what a stage still holds of the offered run. A prompt
    may start at position K only if K is 0, or K <= ``positions`` and K is a
    multiple of ``granularity`` (1 where the stage's kernels are exact at
    any batch size, else the ubatch: see docs/worker.md). ``reason`` says
    why it holds less than it was offered ("" when it holds all of it)."""

    run_id: int = 0
    positions: int = 0
    granularity: int = 1
    reason: str = ""


@dataclass(frozen=True, slots=True)
class StepCounters:
    """A stage's work in one run. ``steps``, ``total_ms`` and ``mean_ms`` count
    decode steps only; the prefill (sequence 0) has its own ``prefill_ms``,
    ``prefill_rows`` (rows it computed) and ``kept`` (positions it kept from
    the previous run instead of computing them)."""

    steps: int = 0
    last_ms: float = 0.0
    total_ms: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0
    prefill_ms: float = 0.0
    prefill_rows: int = 0
    kept: int = 0

    @property
    def mean_ms(self) -> float:
        return self.total_ms / self.steps if self.steps else 0.0


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


@dataclass(frozen=True, slots=True)
class ModelInfo(Message):
    request_id: int
    facts: ModelFacts
    pieces: tuple[bytes, ...]  # token id -> bytes, empty unless asked


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
    run_id: int
    stage_index: int
    node_id: str
    held: PrefixHeld = PrefixHeld()  # what it holds of the provision's PrefixOffer


@dataclass(frozen=True, slots=True)
class StageFault(Message):
    run_id: int
    stage_index: int
    node_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class StageStopped(Message):
    run_id: int
    stage_index: int
    node_id: str
    counters: StepCounters


@dataclass(frozen=True, slots=True)
class StageProgress(Message):
    """Optional diagnostics: a stage FSM state change or load progress."""

    run_id: int
    stage_index: int
    state: str
    detail: str
    fraction: float  # 0..1, or -1 when unknown


@dataclass(frozen=True, slots=True)
class StepStats(Message):
    """Optional diagnostics, sent at most a few times a second while running."""

    run_id: int
    stage_index: int
    counters: StepCounters


@dataclass(frozen=True, slots=True)
class Refused(Message):
    """A frame or message the agent refused (spec §10); it is logged, not fatal."""

    what: str
    reason: str


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


@dataclass(frozen=True, slots=True)
class ProvisionStage(Message):
    run_id: int
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
    reuse: PrefixOffer = PrefixOffer()


@dataclass(frozen=True, slots=True)
class StopRun(Message):
    run_id: int
    reason: str


@dataclass(frozen=True, slots=True)
class RewireEdge(Message):
    """A request to point an edge at another peer. Stages always refuse it
    (spec §10): only the orchestrator's provision message wires a stage."""

    run_id: int
    edge_id: int
    peer: str


@dataclass(frozen=True, slots=True)
class Shutdown(Message):
    reason: str


@dataclass(frozen=True, slots=True)
class OpenEdge(Message):
    """Stream setup on the data connection: establishes one edge end of a
    provisioned stage. ``role`` is "inbound" (objects to the stage) or
    "outbound" (objects from it)."""

    run_id: int
    edge_id: int
    role: str


@dataclass(frozen=True, slots=True)
class DataAttach(Message):
    """First frame on a data connection: proves it comes from the orchestrator
    that received the agent's Hello."""

    token: str


# --------------------------------------------------------------------------- #
# Encoding


def to_plain(value: Any, text_bytes: bool = False) -> Any:
    """Dataclasses as maps of their fields and tuples as lists, recursively:
    what msgpack writes on the wire and what the run log writes as JSON. Bytes
    stay bytes on the wire; ``text_bytes`` makes them text (for a log)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name), text_bytes) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [to_plain(v, text_bytes) for v in value]
    if isinstance(value, dict):
        return {k: to_plain(v, text_bytes) for k, v in value.items()}
    if text_bytes and isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return value


_HINTS: dict[type, dict[str, Any]] = {}
T = TypeVar("T")


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = typing.get_type_hints(cls)
        _HINTS[cls] = hints
    return hints


def _from_wire(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        inner = [o for o in options if o is not type(None)]
        return _from_wire(inner[0], value, where)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
        (item_tp, _ellipsis) = typing.get_args(tp)
        return tuple(_from_wire(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, tp):
        return value
    raise ProtocolError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")


def _build(cls: Any, value: Any, where: str) -> Any:
    if not isinstance(value, dict):
        raise ProtocolError(f"{where}: expected a map, got {type(value).__name__}")
    assert isinstance(cls, type)
    hints = _hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(value) - fields
    if unknown:
        raise ProtocolError(f"{where}: unknown field(s) {', '.join(sorted(map(str, unknown)))}")
    kwargs = {}
    for name in fields:
        if name in value:
            kwargs[name] = _from_wire(hints[name], value[name], f"{where}.{name}")
    try:
        return cls(**kwargs)
    except TypeError as error:
        raise ProtocolError(f"{where}: {error}") from None


def encode_message(message: Message) -> bytes:
    """A whole control frame: prefix and msgpack payload."""
    payload = msgpack.packb([message.tag, to_plain(message)], use_bin_type=True)
    return _PREFIX.pack(CONTROL_MAGIC, len(payload)) + payload


def parse_prefix(prefix: bytes) -> int:
    """Check a control frame prefix and return its payload length."""
    magic, length = _PREFIX.unpack(prefix)
    if magic != CONTROL_MAGIC:
        raise ProtocolError(f"bad control frame magic {magic!r}")
    if length > MAX_CONTROL_BYTES:
        raise ProtocolError(f"control frame of {length} bytes exceeds {MAX_CONTROL_BYTES}")
    return length


def decode_payload(payload: bytes) -> Message:
    try:
        tag, body = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as error:
        raise ProtocolError(f"undecodable control message: {error}") from None
    if not isinstance(tag, str) or tag not in _REGISTRY:
        raise ProtocolError(f"unknown control message {tag!r}")
    message: Message = _build(_REGISTRY[tag], body, tag)
    return message


def decode_message(frame: bytes) -> Message:
    """Decode one whole control frame (prefix included)."""
    if len(frame) < CONTROL_PREFIX_SIZE:
        raise ProtocolError("truncated control frame")
    length = parse_prefix(frame[:CONTROL_PREFIX_SIZE])
    if len(frame) != CONTROL_PREFIX_SIZE + length:
        raise ProtocolError(f"control frame says {length} bytes, has {len(frame) - CONTROL_PREFIX_SIZE}")
    return decode_payload(frame[CONTROL_PREFIX_SIZE:])
