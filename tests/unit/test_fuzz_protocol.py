"""Property-based fuzzing of the control-message decoder (Hypothesis; no
model, no agent process).

What a peer sends is only ever decoded by :func:`protocol.decode_message`
(a whole frame), :func:`protocol.parse_prefix` (the 8-byte frame prefix) and
:func:`protocol.decode_payload` (the msgpack payload), which build messages
with :mod:`ggufpipe_agent.wire.codec`. Each property and its budget
(``max_examples``; the whole file takes about 7 s on two cores):

* ``test_any_bytes_are_a_message_or_a_refusal`` (400): any bytes, as a
  payload (bytes, bytearray or memoryview) and as a whole frame, decode to a
  message or raise ProtocolError, never another exception, and quickly.
* ``test_any_prefix_is_a_length_or_a_refusal`` (300): any 8-byte prefix and
  limit give a length within the limit or a ProtocolError.
* ``test_structured_fields_are_a_message_or_a_refusal`` (500): valid msgpack
  ``[tag, fields]`` with a real tag (or a near miss) and field values that
  are right, wrong or absurd (wrong types, 64-bit extremes, NaN and
  infinities, nested containers, ext types, bytes sent as strings that are
  not UTF-8, unknown and non-string keys): a message or a ProtocolError; a
  message that comes out re-encodes to the very same frame.
* ``test_corrupted_frames_are_a_message_or_a_refusal`` (300): a valid frame
  of any message type with bytes flipped, cut, inserted or its length
  changed: a message or a ProtocolError.
* ``test_container_bombs_are_refused`` (50): thousands of empty maps or lists
  (cheap on the wire, dear in memory) are refused by the container count.
* ``test_every_message_type_round_trips`` (400): a message of any
  registered type built from valid random field values (types read from the
  dataclasses' own annotations) encodes and decodes to an equal message.
* ``test_chosen_messages_round_trip`` (100 each): the same for Tokenize,
  ProvisionStage and StageFault, which matter most.
"""

from __future__ import annotations

import dataclasses
import struct
import time
import types
import typing
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from ggufpipe_agent.errors import ProtocolError
from ggufpipe_agent.wire import protocol
from ggufpipe_agent.wire.codec import REGISTRY, _hints
from ggufpipe_agent.wire.protocol import (
    CONTROL_MAGIC,
    CONTROL_PREFIX_SIZE,
    Message,
    ProvisionStage,
    StageFault,
    Tokenize,
    decode_message,
    decode_payload,
    encode_message,
    parse_prefix,
)

TAGS = sorted(REGISTRY)
#: A decode of at most a few KiB that takes longer than this is a hang.
SLOW_S = 2.0
INT_MIN, UINT_MAX = -(1 << 63), (1 << 64) - 1  # what msgpack's integers hold


def decodes_or_refuses(decode: Any, data: Any) -> Message | None:
    """``decode(data)``: a Message, or None when it raised ProtocolError; any
    other exception fails the test, and so does a decode that takes long."""
    started = time.perf_counter()
    try:
        message = decode(data)
    except ProtocolError as error:
        assert str(error), "a refusal says why"
        message = None
    else:
        assert isinstance(message, Message)
    elapsed = time.perf_counter() - started
    assert elapsed < SLOW_S, f"decoding {len(data)} bytes took {elapsed:.2f} s"
    return message


def frame(payload: bytes) -> bytes:
    return struct.pack("<4sI", CONTROL_MAGIC, len(payload)) + payload


# --------------------------------------------------------------- strategies

#: Text msgpack can carry (no lone surrogates: UTF-8 cannot encode them).
wire_text = st.text(st.characters(exclude_categories=["Cs"]), max_size=24)


def valid_value(tp: Any) -> st.SearchStrategy[Any]:
    """Valid values of a field's annotated type, recursively."""
    tp = getattr(tp, "__supertype__", tp)  # an id (typing.NewType): its int
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [o for o in typing.get_args(tp) if o is not type(None)]
        inner = st.one_of(*(valid_value(o) for o in options))
        return st.none() | inner if len(options) < len(typing.get_args(tp)) else inner
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) != 2 or args[1] is not Ellipsis:  # fixed length: a (token, bias) pair
            return st.tuples(*(valid_value(a) for a in args))
        return st.lists(valid_value(args[0]), max_size=4).map(tuple)
    if dataclasses.is_dataclass(tp):
        return valid_record(tp)
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.integers(INT_MIN, UINT_MAX)
    if tp is float:
        return st.floats(allow_nan=False)
    if tp is str:
        return wire_text
    if tp is bytes:
        return st.binary(max_size=24)
    raise AssertionError(f"no strategy for {tp!r}: teach valid_value this type")


def valid_record(cls: Any) -> st.SearchStrategy[Any]:
    hints = _hints(cls)
    required = {f.name: valid_value(hints[f.name]) for f in dataclasses.fields(cls) if _required(f)}
    optional = {f.name: valid_value(hints[f.name]) for f in dataclasses.fields(cls) if not _required(f)}
    return st.fixed_dictionaries(required, optional=optional).map(lambda kwargs: cls(**kwargs))


def _required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


any_message = st.sampled_from(TAGS).flatmap(lambda tag: valid_record(REGISTRY[tag]))

#: Everything msgpack can write, valid for no field in particular.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(INT_MIN, UINT_MAX),
    st.sampled_from([INT_MIN, -1, 0, 1, (1 << 31) - 1, 1 << 31, (1 << 63) - 1, 1 << 63, UINT_MAX]),
    st.floats(),  # NaN and the infinities included
    st.text(max_size=16),
    st.binary(max_size=16),
    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8)),
)
keys = st.one_of(st.text(max_size=12), st.binary(max_size=6), st.integers(-3, 3))
junk = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(keys, inner, max_size=5),
    max_leaves=24,
)


@st.composite
def structured_payload(draw: st.DrawFn) -> bytes:
    """msgpack ``[tag, fields]``: a real tag (mostly), and each real field
    left out, valid, or junk, plus unknown keys now and then."""
    tag = draw(st.sampled_from(TAGS))
    cls = REGISTRY[tag]
    hints = _hints(cls)
    fields: dict[Any, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]  # a Message subclass is a dataclass
        choice = draw(st.sampled_from(["valid", "valid", "junk", "absent"]))
        if choice == "valid":
            fields[f.name] = protocol.to_plain(draw(valid_value(hints[f.name])))
        elif choice == "junk":
            fields[f.name] = draw(junk)
    if draw(st.integers(0, 9)) == 0:
        fields[draw(keys)] = draw(junk)
    body: Any = fields if draw(st.integers(0, 19)) else draw(junk)
    wire_tag: Any = tag
    if draw(st.integers(0, 19)) == 0:
        wire_tag = draw(st.sampled_from([tag.lower(), tag + "\x00", tag.encode(), "", "A" * 65]) | junk)
    shape: Any = [wire_tag, body]
    if draw(st.integers(0, 29)) == 0:
        shape = draw(st.sampled_from([[wire_tag], [wire_tag, body, None], {"tag": wire_tag}, (wire_tag,)]))
    # With use_bin_type=False, bytes go out as msgpack strings: not UTF-8.
    bin_type, single = draw(st.booleans()), draw(st.booleans())
    try:
        return msgpack.packb(shape, use_bin_type=bin_type, use_single_float=single)
    except OverflowError:  # a double too large for float32
        return msgpack.packb(shape, use_bin_type=bin_type)


# ----------------------------------------------------------------- refusals


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=512), kind=st.sampled_from([bytes, bytearray, memoryview]))
@example(data=b"", kind=bytes)
@example(data=b"\x92\xa5Hello\xc0", kind=bytes)  # fields nil
@example(data=b"\x92\xa9Tokenized\x81\xa6tokens\xdd\xff\xff\xff\xff", kind=bytes)  # 4G tokens claimed
@example(data=b"\x92\xa9Tokenized\x81\xa6tokens\xdd\x00\x40\x00\x00", kind=bytes)  # 4M claimed, none sent
@example(data=b"\x92\xa5Hello" + b"\x91" * 3000 + b"\xc0", kind=bytes)  # deep nesting
@example(data=b"\xdc\xff\xff", kind=memoryview)
def test_any_bytes_are_a_message_or_a_refusal(data: bytes, kind: type) -> None:
    decodes_or_refuses(decode_payload, kind(data))
    decodes_or_refuses(decode_message, data)  # too short, or a prefix that is not GPCM
    decodes_or_refuses(decode_message, frame(data))
    decodes_or_refuses(decode_message, CONTROL_MAGIC + data)


@settings(max_examples=300, deadline=None)
@given(
    prefix=st.binary(min_size=CONTROL_PREFIX_SIZE, max_size=CONTROL_PREFIX_SIZE)
    | st.binary(min_size=4, max_size=4).map(lambda tail: CONTROL_MAGIC + tail),
    limit=st.none() | st.integers(0, (1 << 32) + 1),
)
def test_any_prefix_is_a_length_or_a_refusal(prefix: bytes, limit: int | None) -> None:
    bound = protocol.MAX_CONTROL_BYTES if limit is None else limit
    try:
        length = parse_prefix(prefix) if limit is None else parse_prefix(prefix, limit)
    except ProtocolError:
        assert prefix[:4] != CONTROL_MAGIC or struct.unpack("<I", prefix[4:])[0] > bound
    else:
        assert prefix[:4] == CONTROL_MAGIC
        assert 0 <= length <= bound


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=structured_payload())
def test_structured_fields_are_a_message_or_a_refusal(payload: bytes) -> None:
    message = decodes_or_refuses(decode_payload, payload)
    event("decoded" if message is not None else "refused")
    if message is not None:
        # What the decoder lets through is a message this side can write
        # again, to the same bytes (NaN included: compared as bytes).
        again = encode_message(message)
        assert encode_message(decode_message(again)) == again


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(message=any_message, data=st.data())
def test_corrupted_frames_are_a_message_or_a_refusal(message: Message, data: st.DataObject) -> None:
    wire = bytearray(encode_message(message))
    for _ in range(data.draw(st.integers(1, 4), label="mutations")):
        how = data.draw(st.sampled_from(["flip", "cut", "insert", "length", "byte"]), label="how")
        at = data.draw(st.integers(0, max(len(wire) - 1, 0)), label="at")
        if how == "flip" and wire:
            wire[at] ^= 1 << data.draw(st.integers(0, 7))
        elif how == "byte" and wire:
            wire[at] = data.draw(st.integers(0, 255))
        elif how == "cut":
            del wire[at : at + data.draw(st.integers(1, 16))]
        elif how == "insert":
            wire[at:at] = data.draw(st.binary(min_size=1, max_size=8))
        elif how == "length" and len(wire) >= CONTROL_PREFIX_SIZE:
            wire[4:8] = struct.pack(
                "<I", max(0, len(wire) - CONTROL_PREFIX_SIZE + data.draw(st.integers(-8, 8)))
            )
    decodes_or_refuses(decode_message, bytes(wire))
    decodes_or_refuses(decode_payload, bytes(wire[CONTROL_PREFIX_SIZE:]))


@settings(max_examples=50, deadline=None)
@given(
    tag=st.sampled_from(TAGS),
    count=st.integers(300, 70_000),
    empty=st.sampled_from([{}, []]),
)
def test_container_bombs_are_refused(tag: str, count: int, empty: Any) -> None:
    field = dataclasses.fields(REGISTRY[tag])[0].name  # type: ignore[arg-type]
    payload = msgpack.packb([tag, {field: [empty] * count}], use_bin_type=True)
    with pytest.raises(ProtocolError):
        decodes_or_refuses_strictly(payload)


def decodes_or_refuses_strictly(payload: bytes) -> None:
    started = time.perf_counter()
    try:
        decode_payload(payload)
    finally:
        assert time.perf_counter() - started < SLOW_S


# --------------------------------------------------------------- round trips


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(message=any_message)
def test_every_message_type_round_trips(message: Message) -> None:
    decoded = decode_message(encode_message(message))
    assert type(decoded) is type(message)
    assert decoded == message


@pytest.mark.parametrize("cls", [Tokenize, ProvisionStage, StageFault], ids=lambda c: c.__name__)
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_chosen_messages_round_trip(cls: type[Message], data: st.DataObject) -> None:
    message = data.draw(valid_record(cls), label=cls.__name__)
    assert decode_payload(encode_message(message)[CONTROL_PREFIX_SIZE:]) == message
