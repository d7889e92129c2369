"""Control messages and object records: round trips, and every corrupt or
oversize frame refused with a ProtocolError (never a crash or a hang)."""

from __future__ import annotations

import asyncio
import dataclasses
import struct
import sys

import msgpack
import numpy as np
import pytest

from ggufpipe_agent.errors import ProtocolError
from ggufpipe_agent.wire import objects, protocol
from ggufpipe_agent.wire.framing import read_message
from ggufpipe_agent.wire.protocol import (
    CONTROL_MAGIC,
    MAX_CONTROL_BYTES,
    ChatMessage,
    Device,
    EngineOptions,
    Hello,
    InboundEdgeProvision,
    ModelInfo,
    ObjectSpec,
    OutboundEdgeProvision,
    PrefixHeld,
    PrefixOffer,
    ProvisionStage,
    RingSpec,
    SamplingParams,
    ShareAttach,
    StageFault,
    StageModelFacts,
    StageReady,
    StageStopped,
    StepCounters,
    StopRun,
    Tokenize,
    decode_message,
    encode_message,
)
from tests.support.model_facts import model_facts

SPEC = ObjectSpec("activation", "float32", 8, 16)
FACTS = model_facts(eog_token_ids=(2, 5))

SAMPLES = [
    Hello(
        1,
        "0.1.0",
        "h",
        7,
        "3.11",
        "0.3.36",
        "cpu",
        False,
        (Device("CUDA0", "H200", 2, 1),),
        5,
        4,
        "unix:/x",
        "t",
        "unix:/x-share",
        "s",
    ),
    ShareAttach("s"),
    ProvisionStage(
        run_id=2**63 - 1,
        stage_index=1,
        stage_count=3,
        node_id="gpu-a",
        gguf_source="/models/m.gguf",
        layer_start=4,
        layer_end_exclusive=9,
        inbound=InboundEdgeProvision(11, "Activation", SPEC, RingSpec(2, 600)),
        outbound=OutboundEdgeProvision(12, "Activation", "gpu-b", SPEC, RingSpec(2, 600)),
        model=StageModelFacts("m", "llama", 30, 8, 100, "float", 4, 16),
        engine=EngineOptions(16, 16, 8, threads=2, gpu_layers=-1),
        sampling=SamplingParams(0.7, 40, 0.9, 3),
        reuse=PrefixOffer(7, 120),
    ),
    StopRun(5, "completed"),
    StageReady(5, 1, "gpu-a", PrefixHeld(7, 96, 32, "only the first 96 ...")),
    StageFault(5, 0, "here", "oom"),
    StageStopped(5, 2, "here", StepCounters(3, 1.5, 4.5, 10, 20, 2.5, 30, 96)),
    ModelInfo(9, FACTS, (b"a", b"\xe2\x82", b"")),
    Tokenize(3, "/m.gguf", "", True, (ChatMessage("user", "Hi"), ChatMessage("assistant", " Hello! "))),
]


@pytest.mark.parametrize("message", SAMPLES, ids=[m.tag for m in SAMPLES])
def test_round_trip(message):
    assert decode_message(encode_message(message)) == message


def test_every_message_type_is_registered_once():
    registry = protocol._REGISTRY
    for tag, cls in registry.items():
        assert getattr(sys.modules[cls.__module__], tag) is cls, f"{tag} is registered as a stale class"
    assert {"ProvisionStage", "StopRun", "StageReady", "StageFault", "StageStopped"} <= set(registry)
    # The delivery and link messages live in their own modules; decoding needs them registered.
    assert {"ReceiveStage", "CacheRequest", "LinkEdge", "LinkListening"} <= set(registry)


def frame(payload: bytes, magic: bytes = CONTROL_MAGIC, length: int | None = None) -> bytes:
    return struct.pack("<4sI", magic, len(payload) if length is None else length) + payload


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (frame(msgpack.packb(["StopRun", {"run_id": 1, "reason": "x"}]), magic=b"NOPE"), "magic"),
        (frame(b"", length=MAX_CONTROL_BYTES + 1), "exceeds"),
        (frame(msgpack.packb(["Launch", {}])), "unknown control message"),
        (frame(msgpack.packb(["StopRun", {"run_id": "1", "reason": "x"}])), "expected int"),
        (frame(msgpack.packb(["StopRun", {"run_id": 1}])), "StopRun"),
        (frame(msgpack.packb(["StopRun", {"run_id": 1, "reason": "x", "extra": 1}])), "unknown field"),
        (frame(b"\xc1\xc1"), "undecodable"),
        (frame(msgpack.packb(["StopRun", {"run_id": 1, "reason": "x"}]))[:-2], "says"),
        (b"GPC", "truncated"),
    ],
)
def test_bad_control_frames_are_refused(data, words):
    with pytest.raises(ProtocolError, match=words):
        decode_message(data)


def test_stream_reader_refuses_without_waiting_for_an_oversize_payload():
    async def scenario():
        reader = asyncio.StreamReader()
        reader.feed_data(frame(b"", length=MAX_CONTROL_BYTES + 1))
        with pytest.raises(ProtocolError):
            await asyncio.wait_for(read_message(reader), 1)
        clean = asyncio.StreamReader()
        clean.feed_eof()
        assert await read_message(clean) is None
        cut = asyncio.StreamReader()
        cut.feed_data(encode_message(StopRun(1, "x"))[:10])
        cut.feed_eof()
        with pytest.raises(ProtocolError, match="ended inside"):
            await read_message(cut)

    asyncio.run(scenario())


# ----------------------------------------------------------- object records


def test_token_record_round_trip():
    record = objects.tokens_record(7, 3, 0, [1, 2, 49151], position=2**32 - 3)
    header = objects.unpack_header(record[: objects.HEADER_SIZE], 1 << 20)
    assert (header.run_id, header.edge_id, header.sequence, header.rows) == (7, 3, 0, 3)
    assert header.position == 2**32 - 3 and objects.HEADER_SIZE == 44 and objects.OBJECT_VERSION == 3
    assert objects.decode_tokens(header, record[objects.HEADER_SIZE :]) == [1, 2, 49151]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_activation_record_round_trip(dtype):
    rows = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    head, body = objects.activation_record(1, 2, 3, rows, dtype, position=140)
    header = objects.unpack_header(head, 1 << 20)
    assert (header.sequence, header.position) == (3, 140)
    assert header.nbytes == len(body) == rows.size * (4 if dtype == "float32" else 2)
    decoded = objects.decode_activation(header, bytes(body))
    assert decoded.dtype == np.float32 and decoded.shape == (5, 8)
    if dtype == "float32":
        assert np.array_equal(decoded, rows)
    else:
        assert np.array_equal(decoded, rows.astype(np.float16).astype(np.float32))
    objects.check_spec(header, dataclasses.replace(SPEC, dtype=dtype))


def test_a_prompt_part_says_more_follow():
    rows = np.zeros((3, 8), dtype=np.float32)
    head, _ = objects.activation_record(1, 2, 0, rows, "float32", position=512, more=True)
    header = objects.unpack_header(head, 1 << 20)
    assert header.more and header.position == 512 and "more follow" in header.describe()
    assert not objects.unpack_header(objects.activation_record(1, 2, 0, rows, "float32")[0], 1 << 20).more


def header_bytes(**changes: int) -> bytes:
    base = dict(kind=2, dtype=2, run_id=1, edge_id=2, sequence=0, rows=2, cols=8, nbytes=64)
    base.update(changes)
    return objects.ObjectHeader(**base).pack()


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"XXXX" + header_bytes()[4:], "bad object magic"),
        (header_bytes()[:4] + struct.pack("<B", 9) + header_bytes()[5:], "version 9"),
        (header_bytes()[:4] + struct.pack("<B", 2) + header_bytes()[5:], "version 2, this side speaks 3"),
        (header_bytes()[:5] + struct.pack("<B", 6) + header_bytes()[6:], "unknown object flags 0x6"),
        (header_bytes(kind=9), "unknown object kind"),
        (header_bytes(dtype=9), "unknown object dtype"),
        (header_bytes(rows=10**6, nbytes=10**6 * 32), "exceeds the limit"),
        (header_bytes(nbytes=63), "payload bytes"),
        (header_bytes()[:20], "truncated"),
    ],
)
def test_bad_object_headers_are_refused(data, words):
    with pytest.raises(ProtocolError, match=words):
        objects.unpack_header(data, 4096)


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        (dict(kind=1, dtype=1, cols=1, nbytes=8), "carries activation"),
        (dict(dtype=3, nbytes=32), "carries float32"),
        (dict(cols=4, nbytes=32), "width 8"),
        (dict(rows=17, nbytes=17 * 32), "rows must be"),
    ],
)
def test_objects_that_do_not_fit_the_edge_are_refused(changes, words):
    header = objects.unpack_header(header_bytes(**changes), 1 << 20)
    with pytest.raises(ProtocolError, match=words):
        objects.check_spec(header, SPEC)


def test_max_extent_is_spec_formula():
    assert SPEC.max_extent == 16 * 8 * 4
    assert ObjectSpec("activation", "float16", 576, 2048).max_extent == 2048 * 576 * 2


# ------------------------------------------------ bounded decoding (item 6)


def array_of_empty_maps(count: int) -> bytes:
    """msgpack: an array32 of ``count`` empty maps, one byte each on the wire
    and a dict of ~64 bytes each once decoded."""
    return b"\xdd" + struct.pack(">I", count) + b"\x80" * count


def raw_frame(tag: str, body: bytes) -> bytes:
    return frame(b"\x92" + msgpack.packb(tag) + body)


def peak_decoding(data: bytes) -> tuple[int, str]:
    """Peak Python memory while decoding ``data``, and the error it raised."""
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError) as caught:
            decode_message(data)
        return tracemalloc.get_traced_memory()[1], str(caught.value)
    finally:
        tracemalloc.stop()


def test_four_mib_of_empty_maps_are_refused_without_expanding():
    """The issue's probe: 4 MiB of empty maps peaked at 291 MiB in the
    decoder before the message's type was even looked at."""
    peak, error = peak_decoding(raw_frame("StopRun", array_of_empty_maps(4 << 20)))
    assert peak < 8 << 20, f"decoding peaked at {peak >> 20} MiB"
    assert "StopRun" in error


def test_even_the_largest_message_bounds_its_containers():
    """ModelInfo may carry a vocabulary of a few hundred thousand pieces, so
    its arrays may be long: a long array of maps instead of pieces is still
    refused before it becomes a million dicts."""
    body = (
        b"\x83"
        + msgpack.packb("request_id")
        + msgpack.packb(1)
        + msgpack.packb("facts")
        + msgpack.packb(protocol.to_plain(FACTS))
        + msgpack.packb("pieces")
        + array_of_empty_maps(1 << 20)
    )
    peak, error = peak_decoding(raw_frame("ModelInfo", body))
    assert peak < 24 << 20, f"decoding peaked at {peak >> 20} MiB"
    assert "ModelInfo" in error


def test_bounds_are_per_message_type():
    big_vocabulary = ModelInfo(1, FACTS, tuple(b"piece%d" % i for i in range(300_000)))
    assert decode_message(encode_message(big_vocabulary)) == big_vocabulary
    long_reason = StopRun(1, "x" * (2 << 20))
    with pytest.raises(ProtocolError, match="StopRun"):
        decode_message(encode_message(long_reason))
    many_devices = dataclasses.replace(SAMPLES[0], devices=(Device("d", "", 1, 1),) * 5000)
    with pytest.raises(ProtocolError, match="Hello"):
        decode_message(encode_message(many_devices))


def test_a_long_conversation_is_one_tokenize():
    """A chat request carries its whole history, one map per message: a few
    thousand turns decode (the bound is on containers, not on being a chat)."""
    turns = tuple(ChatMessage("user" if i % 2 == 0 else "assistant", f"turn {i}") for i in range(5000))
    long_chat = Tokenize(7, "/m.gguf", "", True, turns)
    assert decode_message(encode_message(long_chat)) == long_chat


async def test_a_write_on_a_closed_transport_is_a_lost_stream():
    """asyncio raises RuntimeError ("the handler is closed") for a write on a
    transport another writer's failure closed: the writer says
    ConnectionError, which the stage takes as an output fault naming its
    peer (a run in flight beside the one that found the peer dead)."""
    from ggufpipe_agent.wire.framing import FrameWriter

    class Closed:
        def write(self, data: bytes) -> None:
            raise RuntimeError(
                "unable to perform operation on <UnixTransport closed=True>; the handler is closed"
            )

        async def drain(self) -> None:
            raise AssertionError("not reached")

    with pytest.raises(ConnectionError, match="the link to stage 1 is closed"):
        await FrameWriter(Closed(), what="link to stage 1").write(b"frame")
