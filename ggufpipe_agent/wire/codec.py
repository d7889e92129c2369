"""What the control protocol's decoder builds messages with, apart from
msgpack itself (which only :mod:`ggufpipe_agent.wire.protocol` calls): the
:class:`Message` base and its registry of tags, frozen dataclasses to plain
maps and lists and back, checked field by field, and the bounds each message
type is decoded under. The base is here, below both modules that define
messages (:mod:`ggufpipe_agent.wire.protocol`, :mod:`ggufpipe_agent.wire.delivery_messages`)."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

from ggufpipe_agent.errors import ProtocolError
from ggufpipe_agent.wire.records import GRAMMAR_MAX, HISTORY_MAX, LOGIT_BIAS_MAX

#: Every control message type by its tag (its class name).
REGISTRY: dict[str, type[Message]] = {}


class Message:
    """Base of every control message; subclasses register under their class name."""

    __slots__ = ()
    tag: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.tag = cls.__name__
        existing = REGISTRY.get(cls.tag)
        # dataclass(slots=True) builds the class a second time; that is no clash.
        if existing is not None and existing.__qualname__ != cls.__qualname__:
            raise TypeError(f"duplicate control message tag {cls.tag}")
        REGISTRY[cls.tag] = cls


def text_problem(text: str) -> str:
    """Why ``text`` cannot travel as a msgpack string ('' when it can): JSON
    and Python strings may hold lone surrogates (U+D800-U+DFFF, and the bytes
    a non-UTF-8 argument decodes to), which are not Unicode text and which
    UTF-8 cannot encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        where = error.start
        code = ord(text[where])
        if 0xDC80 <= code <= 0xDCFF:  # a byte of a non-UTF-8 argument (surrogateescape)
            return f"byte 0x{code - 0xDC00:02x} at character {where} is not UTF-8"
        return f"a lone surrogate U+{code:04X} at character {where} is not Unicode text"
    return ""


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


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = typing.get_type_hints(cls)
        _HINTS[cls] = hints
    return hints


def _from_wire(tp: Any, value: Any, where: str) -> Any:
    tp = getattr(tp, "__supertype__", tp)  # an id (typing.NewType) is an int on the wire
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
        args = typing.get_args(tp)
        if len(args) != 2 or args[1] is not Ellipsis:  # a fixed-length tuple: a (token, bias) pair
            if len(value) != len(args):
                raise ProtocolError(f"{where}: expected {len(args)} items, got {len(value)}")
            pairs = enumerate(zip(args, value, strict=True))
            return tuple(_from_wire(t, v, f"{where}[{i}]") for i, (t, v) in pairs)
        item_tp = args[0]
        # A vocabulary or a prompt: hundreds of thousands of plain items,
        # checked in one pass (bool is an int to Python, not to the wire).
        if item_tp in (int, bytes, str) and all(type(v) is item_tp for v in value):
            return tuple(value)
        return tuple(_from_wire(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        return build(tp, value, where)
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, tp):
        return value
    raise ProtocolError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")


def build(cls: Any, value: Any, where: str) -> Any:
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


@dataclass(frozen=True, slots=True)
class Bounds:
    """What one message type may hold once decoded: msgpack's own per-item
    limits, and a count of containers (an empty map is one byte on the wire
    and about 64 in memory, so a frame of them expands ~70x: the count, not
    the frame size, bounds that)."""

    str_len: int = 1 << 20
    bin_len: int = 4096
    array_len: int = 4096
    map_len: int = 64
    containers: int = 256


#: The most tokens a Tokenized reply carries: an agent refuses to tokenize a
#: longer prompt (RequestFailed) instead of sending what its peer would take
#: for a corrupt stream. Far above any context a stage holds.
MAX_PROMPT_TOKENS = 1 << 22
#: The most turns, and the most UTF-8 bytes of text, a Tokenize carries: the
#: orchestrator refuses a prompt past either before it is sent.
MAX_PROMPT_TURNS = 1 << 16
MAX_PROMPT_BYTES = 32 << 20

#: Every message is small but these: a vocabulary of a few hundred thousand
#: pieces and a chat template (ModelInfo), a prompt's text, tokens and turns.
SMALL = Bounds()
BOUNDS: dict[str, Bounds] = {
    # The model identity (ModelInfo.identity) is a map per metadata key and a
    # map and a shape list per tensor: 1 << 16 holds ~30,000 tensors (the
    # largest models have ~2,000), and is ~4 MiB of dicts at most.
    "ModelInfo": Bounds(str_len=16 << 20, bin_len=1 << 16, array_len=1 << 21, containers=1 << 16),
    # A host's stage cache, one map per entry (ggufpipe-tui cache).
    "CacheReport": Bounds(array_len=1 << 16, containers=(1 << 16) + 8),
    # A conversation: one map per message (a long chat or an API client's
    # history of thousands of turns is still far below 1 MiB per thousand).
    "Tokenize": Bounds(str_len=MAX_PROMPT_BYTES, array_len=MAX_PROMPT_TURNS, containers=MAX_PROMPT_TURNS + 8),
    "Tokenized": Bounds(str_len=32 << 20, array_len=MAX_PROMPT_TOKENS),
    # A provision's sampling may carry a grammar, the prompt's tokens (the
    # penalties' history) and a logit bias per token (records.SamplingParams).
    "ProvisionStage": Bounds(
        str_len=GRAMMAR_MAX + 64, array_len=HISTORY_MAX, containers=LOGIT_BIAS_MAX + 256
    ),
}
HEAD_LIMITS = {"max_str_len": 64, "max_bin_len": 0, "max_array_len": 2, "max_map_len": 0, "max_ext_len": 0}


class ContainerCount:
    """msgpack hooks that count maps and arrays as they are built and stop the
    decoder past the message type's bound."""

    def __init__(self, tag: str, limit: int) -> None:
        self.tag, self.left = tag, limit

    def _one(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise ProtocolError(f"{self.tag}: more nested maps and arrays than such a message holds")

    def map(self, pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
        self._one()
        return dict(pairs)

    def array(self, items: list[Any]) -> list[Any]:
        self._one()
        return items
