"""Several runs in flight on one stage (docs/architecture.md, "Runs in flight"): each provision names a
slot of the stage's engine; runs on different slots take objects in any
interleaving and step each in its own slot; a slot already in use, or one the
engine does not have, is refused; stopping one run leaves the others alone.
Driven like tests/unit/test_stage_refusals.py: the agent's own runtime and
control session in this process, llama.cpp replaced by a fake engine."""

from __future__ import annotations

import dataclasses

import pytest

from ggufpipe_agent.stage.slots import Held, refusal, replaced
from ggufpipe_agent.wire import objects
from ggufpipe_agent.wire.framing import FrameReader
from ggufpipe_agent.wire.protocol import Refused, StageReady, StageStopped, StopRun
from tests.support.inprocess_agent import FakeEngine, InProcessAgent, provision


def on_slot(run_id: int, model: str, slot: int, parallel: int = 2, edge_base: int = 100):
    message = provision(run_id, model, edge_base=edge_base)
    return dataclasses.replace(
        message, engine=dataclasses.replace(message.engine, parallel=parallel), slot=slot
    )


async def ready(agent: InProcessAgent, message) -> None:
    await agent.send(message)
    await agent.open_edges(message)
    assert (await agent.expect(StageReady)).run_id == message.run_id


async def token_out(agent: InProcessAgent) -> tuple[int, int, int]:
    record = await FrameReader(agent.data_reader).record(1 << 20)
    assert record is not None
    header, payload = record
    return header.run_id, header.sequence, objects.decode_tokens(header, payload)[0]


async def test_two_runs_in_flight_step_each_in_its_own_slot(agent, tiny_model):
    first, second = on_slot(101, str(tiny_model), 0), on_slot(102, str(tiny_model), 1, edge_base=200)
    await ready(agent, first)
    await ready(agent, second)
    assert len(agent.engines.loaded) == 1, "one engine holds both slots"
    engine = agent.engines.loaded[0]
    # Interleaved: a prompt of each, then a decode step of each.
    await agent.send_data(objects.tokens_record(101, first.inbound.edge_id, 0, [1, 2, 3]))
    await agent.send_data(objects.tokens_record(102, second.inbound.edge_id, 0, [4, 5]))
    answers = {await token_out(agent), await token_out(agent)}
    assert answers == {(101, 0, FakeEngine.TOKEN), (102, 0, FakeEngine.TOKEN)}
    await agent.send_data(objects.tokens_record(102, second.inbound.edge_id, 1, [7], position=2))
    await agent.send_data(objects.tokens_record(101, first.inbound.edge_id, 1, [7], position=3))
    answers = {await token_out(agent), await token_out(agent)}
    assert answers == {(101, 1, FakeEngine.TOKEN), (102, 1, FakeEngine.TOKEN)}
    assert engine.past == {0: 4, 1: 3}, "each slot holds its own run's positions"
    # One run stops; the other goes on.
    await agent.send(StopRun(101, "done"))
    assert (await agent.expect(StageStopped)).run_id == 101
    await agent.send_data(objects.tokens_record(102, second.inbound.edge_id, 2, [7], position=3))
    assert await token_out(agent) == (102, 2, FakeEngine.TOKEN)
    await agent.send(StopRun(102, "done"))
    assert (await agent.expect(StageStopped)).run_id == 102


async def test_a_slot_in_use_is_refused_and_free_once_its_run_stops(agent, tiny_model):
    await ready(agent, on_slot(111, str(tiny_model), 0))
    await agent.send(on_slot(112, str(tiny_model), 0, edge_base=200))
    refused = await agent.expect(Refused)
    assert refused.what == "ProvisionStage" and "busy with run 000000000000006f on slot 0" in refused.reason
    await agent.send(StopRun(111, "done"))
    await agent.expect(StageStopped)
    await ready(agent, on_slot(113, str(tiny_model), 0, edge_base=300))
    await agent.send(StopRun(111, "again"))  # its slot was taken: an old run now
    assert "stale run id" in (await agent.expect(Refused)).reason


async def test_a_slot_the_engine_does_not_have_is_refused(agent, tiny_model):
    await agent.send(on_slot(121, str(tiny_model), 2))
    refused = await agent.expect(Refused)
    assert "slot 2 outside 0..1 (parallel 2)" in refused.reason


async def test_a_run_with_other_engine_options_waits_for_the_engine(agent, tiny_model):
    await ready(agent, on_slot(131, str(tiny_model), 0))
    other = on_slot(132, str(tiny_model), 1, parallel=4, edge_base=200)
    await agent.send(other)
    await agent.open_edges(other)
    fault = await agent.expect_state("Faulted")
    assert "in use by run 0000000000000083 with other options" in fault.detail
    assert len(agent.engines.loaded) == 1


# --------------------------------------------------- the slot rules, as a table

SLOT_TABLE = [
    # (held, run id, slot, parallel) -> refusal
    ((), 1, 0, 1, ""),
    ((Held(1, 0),), 2, 1, 2, ""),
    ((Held(1, 0),), 2, 0, 2, "stage is busy with run 0000000000000001 on slot 0 (of 2)"),
    ((Held(1, 0),), 1, 1, 2, "run 0000000000000001 is already provisioned"),
    ((Held(1, 0, stopped=True),), 2, 0, 2, ""),
    ((Held(1, 0, stopped=True), Held(2, 1)), 3, 0, 2, ""),
]


@pytest.mark.parametrize(("held", "run_id", "slot", "parallel", "expected"), SLOT_TABLE)
def test_which_runs_a_stage_takes(held, run_id, slot, parallel, expected):
    got = refusal(held, run_id, slot, parallel)
    assert got.startswith(expected) and (expected or not got)


def test_a_new_run_on_a_slot_forgets_the_stopped_run_there():
    held = [Held(1, 0, stopped=True), Held(2, 1, stopped=True), Held(3, 0)]
    assert replaced(held, 0) == [1]
    assert replaced(held, 1) == [2]
