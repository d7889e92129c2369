"""docs/design.md, "Security model": every rejection a stage owes, driven by a test client speaking the
protocol to the agent's own runtime and control session, in this process,
with llama.cpp replaced by a fake engine (tests/support/inprocess_agent.py).
Each is a Refused message or a StageFault, logged, never a crash: the agent
answers the next request and its session ends cleanly.

None of these refusals depends on what llama.cpp computes, so none needs the
real model: they were tests/model/test_agent_rejections.py's."""

from __future__ import annotations

import asyncio
import dataclasses
import struct

import numpy as np

from ggufpipe_agent.wire import objects
from ggufpipe_agent.wire.framing import FrameReader, FrameWriter
from ggufpipe_agent.wire.link_messages import (
    LinkAttach,
    LinkCredentials,
    LinkDown,
    LinkEdge,
    LinkListen,
    LinkListening,
)
from ggufpipe_agent.wire.protocol import (
    CONTROL_MAGIC,
    Inspect,
    ModelInfo,
    ObjectSpec,
    OpenEdge,
    PrefixOffer,
    Refused,
    RewireEdge,
    RingSpec,
    StageFault,
    StageReady,
    StageStopped,
    StopRun,
    TokenRingProvision,
)
from tests.support.agent_client import AgentClient
from tests.support.inprocess_agent import (
    BLOCKS,
    HIDDEN,
    FakeEngine,
    InProcessAgent,
    no_crash,
    provision,
)

#: The middle of the synthetic model: stage 1 of 2.
SECOND_HALF = (3, BLOCKS)


async def ready_run(agent: InProcessAgent, model_path, run_id: int, **kwargs):
    message = provision(run_id, str(model_path), **kwargs)
    await agent.send(message)
    await agent.open_edges(message)
    await agent.expect(StageReady)
    return message


async def still_answers(agent: InProcessAgent, model_path) -> None:
    await agent.send(Inspect(1, str(model_path), False))
    assert (await agent.expect(ModelInfo)).facts.block_count == BLOCKS


async def test_unknown_run_id(agent, tiny_model):
    await agent.send(StopRun(0xDEAD, "x"))
    refused = await agent.expect(Refused)
    assert refused.what == "StopRun" and "unknown run id" in refused.reason
    await agent.send_data(objects.tokens_record(0xBEEF, 100, 0, [1, 2]))
    refused = await agent.expect(Refused)
    assert refused.what == "object" and "unknown run id 000000000000beef" in refused.reason
    await still_answers(agent, tiny_model)


async def test_stale_run_id(agent, tiny_model):
    await ready_run(agent, tiny_model, 11)
    await agent.send(StopRun(11, "done"))
    await agent.expect(StageStopped)
    await agent.send(provision(11, str(tiny_model)))
    assert "stale run id" in (await agent.expect(Refused)).reason
    await agent.send_data(objects.tokens_record(11, 100, 0, [1]))
    assert "stale run id" in (await agent.expect(Refused)).reason
    await agent.send(StopRun(11, "again"))  # a retried teardown is answered again
    assert (await agent.expect(StageStopped)).run_id == 11
    # A new run id is accepted, and the loaded stage is reused.
    await ready_run(agent, tiny_model, 12)
    assert len(agent.engines.loaded) == 1


async def test_duplicate_provisioning_of_an_active_run(agent, tiny_model):
    message = await ready_run(agent, tiny_model, 21)
    await agent.send(message)
    assert "already provisioned" in (await agent.expect(Refused)).reason
    await agent.send(provision(22, str(tiny_model)))
    assert "busy with run" in (await agent.expect(Refused)).reason
    # ...unless explicitly stopped first.
    await agent.send(StopRun(21, "stop"))
    await agent.expect(StageStopped)
    await ready_run(agent, tiny_model, 22)


async def test_edge_ids_not_in_the_provision_message(agent, tiny_model):
    message = provision(31, str(tiny_model))
    await agent.send(message)
    await agent.expect_state("Preparing")
    await agent.send_data(OpenEdge(31, 999, "inbound"))
    refused = await agent.expect(Refused)
    assert (
        refused.what == "OpenEdge" and "edge 999 (inbound) is not in the provision message" in refused.reason
    )
    await agent.send_data(OpenEdge(31, message.inbound.edge_id, "inbound"))
    await agent.send_data(OpenEdge(31, message.outbound.edge_id, "outbound"))
    await agent.expect(StageReady)
    await agent.send_data(objects.tokens_record(31, 555, 0, [1]))
    assert "edge 555 is not this stage's inbound edge" in (await agent.expect(Refused)).reason
    # The run is unharmed: a real object still runs.
    await agent.send_data(objects.tokens_record(31, message.inbound.edge_id, 0, [1, 2, 3]))
    record = await FrameReader(agent.data_reader).record(1 << 20)
    assert record is not None
    header, payload = record
    assert header.sequence == 0 and header.edge_id == message.outbound.edge_id
    assert objects.decode_tokens(header, payload) == [FakeEngine.TOKEN]
    assert agent.engines.loaded[0].steps() == [("step", 3, 0)], "the refused object never reached the engine"


async def test_link_setup_is_the_orchestrators_and_a_link_sets_up_only_consumer_ends(agent, tiny_model):
    message = provision(51, str(tiny_model))
    await agent.send(message)
    await agent.expect_state("Preparing")
    await agent.send(LinkEdge(51, 999, "outbound"))
    assert "is not this stage's to link" in (await agent.expect(Refused)).reason
    await agent.send(LinkEdge(51, message.outbound.edge_id, "outbound"))
    assert "has no link" in (await agent.expect(Refused)).reason
    # A link from a would-be producer: without the token it is closed unheard.
    await agent.send(LinkListen(7, "unix", 3, "the-token", LinkCredentials(), 30.0))
    listening = await agent.expect(LinkListening)
    path = listening.endpoint.removeprefix("unix:")
    reader, writer = await asyncio.open_unix_connection(path)
    await FrameWriter(writer).send(LinkAttach("a-guess"))
    assert await reader.read() == b"", "closed without an answer"
    writer.close()
    reader, writer = await asyncio.open_unix_connection(path)
    await FrameWriter(writer).send(LinkAttach("the-token"))
    assert await FrameReader(reader).message() == LinkAttach("the-token")
    # The producer may open the consumer's ends only, never make it write back.
    await FrameWriter(writer).send(OpenEdge(51, message.outbound.edge_id, "outbound"))
    refused = await agent.expect(Refused)
    assert refused.what == "OpenEdge" and "is not in the provision message" in refused.reason
    writer.close()
    down = await agent.expect(LinkDown)
    assert down.peer == 3 and "ended" in down.reason
    await writer.wait_closed()
    await still_answers(agent, tiny_model)


async def test_rewiring_requests_are_refused(agent, tiny_model):
    message = await ready_run(agent, tiny_model, 41)
    await agent.send(RewireEdge(41, message.outbound.edge_id, "evil-peer"))
    refused = await agent.expect(Refused)
    assert refused.what == "RewireEdge" and "peer rewiring is refused" in refused.reason
    await still_answers(agent, tiny_model)


async def test_object_out_of_sequence(agent, tiny_model):
    message = await ready_run(agent, tiny_model, 51)
    await agent.send_data(objects.tokens_record(51, message.inbound.edge_id, 1, [1, 2]))
    fault = await agent.expect(StageFault)
    assert "sequence violation: expected object 0, got 1" in fault.reason
    # Faulted rejects new work and waits for StopRun.
    await agent.send_data(objects.tokens_record(51, message.inbound.edge_id, 0, [1]))
    assert "faulted" in (await agent.expect(Refused)).reason
    await agent.send(StopRun(51, "teardown"))
    await agent.expect(StageStopped)
    assert agent.engines.loaded[0].steps() == [], "no refused object reached the engine"


async def test_object_larger_than_max_extent(agent, tiny_model):
    message = await ready_run(agent, tiny_model, 61)
    too_many = list(range(message.inbound.object_spec.max_rows + 1))
    await agent.send_data(objects.tokens_record(61, message.inbound.edge_id, 0, too_many))
    refused = await agent.expect(Refused)
    assert refused.what == "data frame" and "exceeds the limit" in refused.reason
    fault = await agent.expect(StageFault)
    assert "malformed frame on the inbound edge" in fault.reason
    await still_answers(agent, tiny_model)


async def test_malformed_and_truncated_frames(agent, tiny_model):
    await ready_run(agent, tiny_model, 71)
    await agent.send_data(b"JUNK" + b"\x00" * 40)
    assert "bad frame magic" in (await agent.expect(Refused)).reason
    await agent.expect(StageFault)
    await agent.send(StopRun(71, "teardown"))
    await agent.expect(StageStopped)
    # A new data connection, a new run, and a frame cut short.
    agent.data_writer.close()
    await agent.attach_data()
    message = await ready_run(agent, tiny_model, 72)
    record = objects.tokens_record(72, message.inbound.edge_id, 0, [1, 2, 3])
    await agent.send_data(record[:30])
    agent.data_writer.close()
    assert "truncated" in (await agent.expect(Refused)).reason
    assert "malformed frame" in (await agent.expect(StageFault)).reason
    await agent.data_writer.wait_closed()
    agent.data_writer = None
    await still_answers(agent, tiny_model)


async def test_activation_shape_or_dtype_mismatch(agent, tiny_model):
    message = await ready_run(agent, tiny_model, 81, stage_index=1, stage_count=2, layers=SECOND_HALF)
    head, body = objects.activation_record(
        81, message.inbound.edge_id, 0, np.zeros((2, 100), np.float32), "float32"
    )
    await agent.send_data(head + bytes(body))
    assert f"width {HIDDEN}" in (await agent.expect(StageFault)).reason
    await agent.send(StopRun(81, "x"))
    await agent.expect(StageStopped)
    message = await ready_run(agent, tiny_model, 82, stage_index=1, stage_count=2, layers=SECOND_HALF)
    head, body = objects.activation_record(
        82, message.inbound.edge_id, 0, np.zeros((2, HIDDEN), np.float32), "float16"
    )
    await agent.send_data(head + bytes(body))
    assert "edge carries float32" in (await agent.expect(StageFault)).reason
    assert agent.engines.loaded[0].steps() == [], "no refused object reached the engine"


async def test_data_connection_without_the_token_is_closed(agent, tiny_model):
    other = AgentClient()  # only its data connection: no process is started
    other.hello = agent.hello
    await other.attach_data(token="not-the-token")
    assert await asyncio.wait_for(other.data_reader.read(), 10) == b""
    other.data_writer.close()
    await still_answers(agent, tiny_model)
    await other.data_writer.wait_closed()


async def test_corrupt_control_frame_ends_the_session_cleanly(tmp_path, caplog):
    """The session's half of tests/model/test_agent_rejections.py's test of
    the same name (which checks the agent process's exit status)."""
    client = InProcessAgent(tmp_path / "stages")
    await client.start()
    await client.send_raw(struct.pack("<4sI", CONTROL_MAGIC, 5) + b"\xc1\xc1\xc1\xc1\xc1")
    refused = await client.expect(Refused)
    assert refused.what == "control frame" and "undecodable" in refused.reason
    assert (await client.ended()).startswith("corrupt control stream")
    await client.close()
    no_crash(caplog)


def _with(message, **changes):
    """``message`` with nested fields replaced: ``outbound__edge_id=...``."""
    for key, value in changes.items():
        if "__" in key:
            outer, inner = key.split("__")
            value = dataclasses.replace(getattr(message, outer), **{inner: value})
            key = outer
        message = dataclasses.replace(message, **{key: value})
    return message


def _spec(message, side: str, **changes):
    edge = getattr(message, side)
    return dataclasses.replace(edge, object_spec=dataclasses.replace(edge.object_spec, **changes))


BAD_PROVISIONS = {
    "outbound edge id past u32": (lambda m: _with(m, outbound__edge_id=2**32 + 5), "edge id"),
    "negative inbound edge id": (lambda m: _with(m, inbound__edge_id=-1), "edge id"),
    "run id past u64": (lambda m: _with(m, run_id=-7), "run id"),
    "negative max_rows": (lambda m: _with(m, inbound=_spec(m, "inbound", max_rows=-1)), "max_rows"),
    "huge max_rows": (lambda m: _with(m, inbound=_spec(m, "inbound", max_rows=2**40)), "max_rows"),
    "zero width": (lambda m: _with(m, outbound=_spec(m, "outbound", width=0)), "width"),
    "ring of a billion slots": (
        lambda m: _with(m, inbound=dataclasses.replace(m.inbound, ring_spec=RingSpec(10**9, 1))),
        "ring",
    ),
    "negative layer": (lambda m: _with(m, layer_start=-3), "layers"),
    "huge stage count": (lambda m: _with(m, stage_count=2**40), "stage"),
    "context past u32": (lambda m: _with(m, engine__n_ctx=2**33), "context"),
    "negative ubatch": (lambda m: _with(m, engine__n_ubatch=-1), "ubatch"),
    "negative threads": (lambda m: _with(m, engine__threads=-2), "threads"),
    "not-a-number temperature": (lambda m: _with(m, sampling__temperature=float("nan")), "temperature"),
    "top_k past i32": (lambda m: _with(m, sampling__top_k=2**40), "top_k"),
    "zero hidden dim": (lambda m: _with(m, model__hidden_dim=0), "hidden"),
    # The token ring's end (a one-stage pipeline is both of its ends).
    "ring edge id past u32": (lambda m: _with(m, ring=_ring(m, edge_id=2**32 + 1)), "token ring edge id"),
    "ring on the inbound edge id": (lambda m: _with(m, ring=_ring(m, edge_id=m.inbound.edge_id)), "shares"),
    "ring end of the wrong stage": (lambda m: _with(m, ring=_ring(m, produce=False)), "that end"),
    "ring of activations": (
        lambda m: _with(m, ring=_ring(m, object_spec=ObjectSpec("activation", "float32", 8, 8))),
        "int32 tokens",
    ),
    "ring without a stop": (lambda m: _with(m, ring=_ring(m, max_tokens=0)), "max_tokens"),
    "ring stop outside the vocabulary": (
        lambda m: _with(m, ring=_ring(m, eog_token_ids=(2, 10**9))),
        "vocabulary",
    ),
    "prefix offer past the context": (lambda m: _with(m, reuse=PrefixOffer(7, 10**6)), "prefix offer"),
    "prefix offer of a negative run": (lambda m: _with(m, reuse=PrefixOffer(-7, 3)), "prefix offer"),
    "a prefix of its own run": (lambda m: _with(m, reuse=PrefixOffer(m.run_id, 3)), "a prefix of its own"),
}


def _ring(message, **changes):
    """A sound token-ring end for a one-stage ``message``, then ``changes``."""
    ring = TokenRingProvision(
        message.outbound.edge_id + 1, True, True, ObjectSpec("tokens", "int32", 1, 1), (2,), 8
    )
    return dataclasses.replace(ring, **changes)


async def test_a_provision_the_wire_cannot_carry_is_refused(agent, tiny_model):
    """Every field the wire can set is checked before the stage takes the
    provision (docs/protocol.md, "What a stage refuses"): an edge id past u32 used to be accepted and
    fault the first step with a struct.error."""
    run_id = 900
    for name, (spoil, words) in BAD_PROVISIONS.items():
        run_id += 1
        message = spoil(provision(run_id, str(tiny_model)))
        await agent.send(message)
        refused = await agent.expect(Refused)
        assert refused.what == "ProvisionStage" and words in refused.reason, (name, refused.reason)
    # None of them left the stage busy: a sound provision is taken at once.
    await ready_run(agent, tiny_model, run_id + 1)
    assert len(agent.engines.loaded) == 1, "only the sound provision prepared a stage"


async def test_an_object_for_no_run_is_refused_at_its_header(agent, tiny_model):
    """An object of an unknown or stale run, or on an edge the stage does not
    have, is refused as soon as its header is read, and its payload is
    skipped in bounded chunks (never held whole): the data connection stays
    usable (docs/protocol.md, "What a stage refuses")."""
    claimed = 32 << 20  # 32 MiB of tokens, no run to take them
    header = objects.ObjectHeader(objects.KIND_TOKENS, 1, 0xBEEF, 100, 0, claimed // 4, 1, claimed)
    await agent.send_data(header.pack())
    refused = await agent.expect(Refused, timeout=10)  # not one payload byte sent yet
    assert refused.what == "object" and "unknown run id 000000000000beef" in refused.reason
    await agent.send_data(bytes(claimed))
    message = await ready_run(agent, tiny_model, 96)  # the same data connection goes on
    wrong_edge = objects.ObjectHeader(objects.KIND_TOKENS, 1, 96, 555, 0, 4, 1, 16)
    await agent.send_data(wrong_edge.pack())
    assert "not this stage's inbound edge" in (await agent.expect(Refused, timeout=10)).reason
    await agent.send_data(bytes(16))
    await agent.send_data(objects.tokens_record(96, message.inbound.edge_id, 0, [1, 2, 3]))
    record = await FrameReader(agent.data_reader).record(1 << 20)
    assert record is not None and record[0].sequence == 0


def test_the_run_ids_an_agent_remembers_are_bounded():
    from ggufpipe_agent.process.control import SeenRuns

    seen = SeenRuns()
    for run_id in range(SeenRuns.keep + 10):
        seen.add(run_id)
    assert len(seen) == SeenRuns.keep and 9 not in seen and 10 in seen and SeenRuns.keep + 9 in seen
