"""The run driver with fake stage handles: what it sends, writes and reports
for each turn of the run FSM, in milliseconds and without processes."""

from __future__ import annotations

import asyncio

from ggufpipe_agent.wire.protocol import (
    PrefixHeld,
    PrefixOffer,
    ProvisionStage,
    StageFault,
    StageStopped,
    StepCounters,
    StepStats,
    StopRun,
)
from ggufpipe_tui.core.events import Notice, RunFinished, RunPhaseChanged, StageStats, TokenStreamed
from ggufpipe_tui.core.reuse import ReuseSource
from tests.support.fakes import Rig, settle


def phases(rig: Rig) -> list[str]:
    return [e.phase for e in rig.events if isinstance(e, RunPhaseChanged)]


async def finish(rig: Rig) -> None:
    await settle()
    rig.answer_stops()
    await asyncio.wait_for(rig.driver.done.wait(), 2)


async def test_a_run_from_provision_to_done():
    rig = Rig(stages=2, max_tokens=3)
    rig.start()
    await settle()
    assert [rig.provisioned(i).stage_index for i in range(2)] == [0, 1]
    assert phases(rig) == ["Provisioning", "WaitingReady"]
    rig.make_ready()
    await settle()
    assert rig.edges.opened == [0, 1], "edge ends are set up once a stage has taken its provision"
    assert rig.edges.written == [], "no prompt, no injection: the run waits for it"
    rig.driver.give_prompt([5, 6, 7])
    await settle()
    assert rig.edges.written == [(0, [5, 6, 7])]
    await rig.tokens(9, 10, 11)
    # Each token is fed back as the next decode input, until max_tokens.
    assert rig.edges.written == [(0, [5, 6, 7]), (1, [9]), (2, [10])]
    assert all(isinstance(s.sent[-1], StopRun) for s in rig.stages)
    await finish(rig)
    result = rig.driver.result
    assert result is not None and result.ok and result.stop_reason == "max_tokens"
    assert result.tokens == (9, 10, 11) and result.text == "<9><10><11>"
    assert phases(rig) == ["Provisioning", "WaitingReady", "Running", "Completed", "TearingDown", "Done"]
    streamed = [e.text for e in rig.events if isinstance(e, TokenStreamed)]
    assert streamed == ["<9>", "<10>", "<11>"]
    assert isinstance(rig.events[-1], RunFinished) and not rig.failures


async def test_end_of_generation_stops_without_feeding_it_back():
    rig = Rig(max_tokens=10)
    await rig.prompted()
    await rig.tokens(9, 2)  # then the model's EOS
    await finish(rig)
    assert rig.edges.written == [(0, [5]), (1, [9])]
    assert rig.driver.result is not None and rig.driver.result.stop_reason == "eos"
    assert rig.driver.result.tokens == (9, 2) and rig.driver.result.text == "<9>"


async def test_a_stage_fault_faults_the_run_and_every_stage_is_stopped():
    rig = Rig(stages=3)
    await rig.prompted()
    await rig.tokens(9)
    rig.agent_says(1, StageFault(rig.plan.run_id, 1, "a", "inbound edge 4: reset"))
    await finish(rig)
    result = rig.driver.result
    assert result is not None and result.outcome == "faulted"
    assert result.failure == "stage 1 on fake (local): inbound edge 4: reset"
    assert result.tokens == (9,), "the output so far is kept"
    assert all(isinstance(s.sent[-1], StopRun) for s in rig.stages)
    assert any(isinstance(e, Notice) and "faulted" in e.text for e in rig.events)


async def test_a_failed_engine_step_reports_the_stage_lost():
    """A step that failed in the stage's engine (its agent lives): the stage is
    lost, for recovery to start again (docs/recovery.md); the run faults when
    the pipeline says so, not here."""
    rig = Rig(stages=3)
    await rig.prompted()
    await rig.tokens(9)
    rig.agent_says(1, StageFault(rig.plan.run_id, 1, "a", "step 1: out of memory"))
    await settle()
    assert rig.stages[1].lost == ["its engine failed (step 1: out of memory)"]
    assert rig.driver.result is None
    rig.driver.stop()
    await finish(rig)


async def test_a_full_context_is_the_runs_fault_not_a_lost_stage():
    """A replay would meet the same full context: the run faults, naming it."""
    rig = Rig(stages=3)
    await rig.prompted()
    await rig.tokens(9)
    reason = "step 9: context full: 96 positions used + 1 new > context size 96"
    rig.agent_says(1, StageFault(rig.plan.run_id, 1, "a", reason))
    await finish(rig)
    assert rig.stages[1].lost == []
    result = rig.driver.result
    assert result is not None and result.outcome == "faulted" and "context full" in result.failure


async def test_a_broken_token_in_edge_reports_stage_0_lost():
    rig = Rig()
    rig.edges.fail_writes = True
    await rig.prompted()
    assert rig.stages[0].lost == ["token-in edge: token-in gone"]


async def test_a_provision_that_cannot_be_sent_faults_the_run():
    rig = Rig(stages=2)
    rig.stages[1].fail_sends = True
    rig.start()
    await settle()
    rig.agent_says(0, StageFault(rig.plan.run_id, 0, "a", "ignored later"))
    await settle()
    rig.answer_stops()
    await asyncio.wait_for(rig.driver.done.wait(), 2)
    result = rig.driver.result
    assert result is not None and result.outcome == "faulted"
    assert result.failure == "stage 1 on fake (local): cannot send ProvisionStage (gone)"


async def test_the_step_timeout_names_the_token_it_waited_for():
    rig = Rig(step=0.05)
    await rig.prompted()
    rig.driver.on_token(0, [9])
    await asyncio.sleep(0.2)
    await finish(rig)
    result = rig.driver.result
    assert result is not None and result.failure == "step timeout waiting for token 1"


async def test_a_stop_before_the_prompt_tears_the_run_down():
    rig = Rig()
    await rig.ready()
    rig.driver.stop("no prompt after all")
    await finish(rig)
    result = rig.driver.result
    assert result is not None and result.outcome == "torn down" and result.tokens == ()
    assert rig.edges.written == []


async def test_a_dead_stage_counts_as_stopped_in_teardown():
    rig = Rig(stages=2)
    await rig.prompted()
    rig.stages[1].up = False
    rig.driver.stop()
    await settle()
    assert not any(isinstance(m, StopRun) for m in rig.stages[1].sent), "nothing is sent to a dead agent"
    rig.answer_stops()
    await asyncio.wait_for(rig.driver.done.wait(), 2)
    assert rig.driver.result is not None and rig.driver.result.ok


async def test_step_statistics_reach_the_views_and_the_result():
    rig = Rig(max_tokens=2)
    await rig.prompted()
    counters = StepCounters(steps=4, last_ms=2.0, total_ms=10.0)
    rig.agent_says(1, StepStats(rig.plan.run_id, 1, counters))
    rig.driver.on_token(0, [9])
    rig.driver.on_token(1, [10])
    await settle()
    assert any(isinstance(e, StageStats) and e.counters == counters for e in rig.events)
    final = StepCounters(steps=5, last_ms=2.0, total_ms=15.0)
    rig.agent_says(0, StageStopped(rig.plan.run_id, 0, "a", StepCounters()))
    rig.agent_says(1, StageStopped(rig.plan.run_id, 1, "a", final))  # the final counters win
    await asyncio.wait_for(rig.driver.done.wait(), 2)
    assert rig.driver.result is not None
    assert rig.driver.result.timings.stage_mean_step_ms == (0.0, 3.0)


async def test_a_rejected_plan_faults_before_anything_is_sent():
    rig = Rig()
    rig.start("the pipeline is broken: stage 0 lost")
    await settle()
    assert rig.driver.done.is_set()
    assert not any(isinstance(m, ProvisionStage) for s in rig.stages for m in s.sent)
    assert (
        rig.driver.result is not None and rig.driver.result.failure == "the pipeline is broken: stage 0 lost"
    )


async def test_in_a_token_ring_the_orchestrator_reads_and_never_injects():
    rig = Rig(stages=3, max_tokens=3, feedback="ring")
    await rig.prompted()
    first, middle, last = (rig.provisioned(i).ring for i in range(3))
    assert first is not None and first.consume and not first.produce
    assert middle is None, "only the ends of the chain are on the ring"
    assert last is not None and last.produce and last.max_tokens == 3 and last.eog_token_ids == (2,)
    await rig.tokens(9, 10, 11)
    assert rig.edges.written == [(0, [5])], "the prompt only: the last stage feeds stage 0 itself"
    await finish(rig)
    result = rig.driver.result
    assert result is not None and result.ok and result.stop_reason == "max_tokens"
    assert result.tokens == (9, 10, 11)


async def test_on_the_token_ring_a_run_leaves_every_token_it_read_but_the_last_for_the_next():
    """The last stage fed stage 0 each token but the one it ended on, so the
    stages hold the prompt and those: the next run's prefix offer."""
    rig = Rig(stages=2, max_tokens=3, feedback="ring")
    await rig.prompted([5, 6])
    assert rig.edges.written == [(0, [5, 6])] and rig.edges.positions == [0]
    await rig.tokens(9, 10, 11)
    await finish(rig)
    assert rig.edges.written == [(0, [5, 6])], "nothing fed back by the orchestrator"
    assert rig.driver.next_source() == ReuseSource(rig.plan.run_id, (5, 6, 9, 10))


async def test_a_broken_link_to_a_dead_peer_is_reported_as_the_peer_lost(monkeypatch):
    from ggufpipe_tui.core import run_fsm as fsm
    from ggufpipe_tui.session import driver as driver_module

    monkeypatch.setattr(driver_module, "LINK_GRACE_SECONDS", 0.2)
    monkeypatch.setattr(driver_module, "LOSS_REPORT_SECONDS", 0.2)
    rig = Rig(stages=3, feedback="ring")
    await rig.prompted()
    rig.stages[0].up = False  # its agent was SIGKILLed: the ring write of stage 2 broke
    rig.agent_says(2, StageFault(rig.plan.run_id, 2, "a", "token ring edge 9: broken pipe", link_peer=0))
    await asyncio.sleep(0.1)
    lost = "stage 0 on fake (local): the agent exited (killed by signal 9)"
    rig.driver.feed(fsm.StageLost(0, lost))  # what the pipeline reports of the dead stage
    await asyncio.sleep(0.5)
    await finish(rig)
    assert rig.driver.result is not None and rig.driver.result.failure == lost


async def test_a_broken_link_between_live_stages_is_the_reason(monkeypatch):
    from ggufpipe_tui.session import driver as driver_module

    monkeypatch.setattr(driver_module, "LINK_GRACE_SECONDS", 0.1)
    rig = Rig(stages=2, feedback="ring")
    await rig.prompted()
    rig.agent_says(0, StageFault(rig.plan.run_id, 0, "a", "outbound edge 5: link reset", link_peer=1))
    await asyncio.sleep(0.3)
    await finish(rig)
    result = rig.driver.result
    assert result is not None and result.failure == "stage 0 on fake (local): outbound edge 5: link reset"


async def test_a_run_keeps_what_every_stage_holds_of_the_last_run():
    source = ReuseSource(0x99, (5, 6, 7, 9, 10))  # run 0x99 fed prompt 5, 6, 7 and tokens 9, 10
    rig = Rig(stages=2, max_tokens=3, source=source)
    rig.start()
    await settle()
    assert [rig.provisioned(i).reuse for i in range(2)] == [PrefixOffer(0x99, 5)] * 2
    rig.make_ready([PrefixHeld(0x99, 5), PrefixHeld(0x99, 4, reason="it holds 4")])
    # The next turn: all of run 0x99 and two new tokens.
    rig.driver.give_prompt([5, 6, 7, 9, 10, 11, 12])
    await settle()
    assert rig.edges.written == [(0, [10, 11, 12])] and rig.edges.positions == [4]
    await rig.tokens(20, 21)
    assert rig.edges.positions == [4, 7, 8], "each fed token at the position after the ones before"
    rig.driver.on_token(2, [22])
    await finish(rig)
    result = rig.driver.result
    assert result is not None and result.prompt_reused == 4 and result.prompt_computed == 3
    assert any(
        isinstance(e, Notice)
        and "reused 4 of 7 prompt tokens from run 0000000000000099 (stage 1: it holds 4)" in e.text
        for e in rig.events
    )
    # What the stages now hold: the prompt and every token but the last.
    assert rig.driver.next_source() == ReuseSource(rig.plan.run_id, (5, 6, 7, 9, 10, 11, 12, 20, 21))


async def test_what_a_run_leaves_for_the_next_one():
    source = ReuseSource(0x99, (5, 6))
    torn = Rig(source=source)
    await torn.ready([PrefixHeld(0x99, 2)] * 2)
    torn.driver.stop("no prompt after all")
    await finish(torn)
    assert torn.driver.next_source() == source, "a run that wrote nothing leaves the stages as they were"
    faulted = Rig(source=source)
    await faulted.prompted([5, 6, 7], [PrefixHeld(0x99, 2)] * 2)
    faulted.agent_says(1, StageFault(faulted.plan.run_id, 1, "a", "inbound edge 4: reset"))
    await finish(faulted)
    assert faulted.driver.next_source() is None
    offered_nothing = Rig()
    await offered_nothing.ready()
    offered_nothing.driver.stop("no prompt")
    await finish(offered_nothing)
    assert offered_nothing.driver.next_source() is None


# ------------------------------------------- a peer that reads nothing (14.7)


async def test_a_token_in_edge_that_takes_nothing_blocks_neither_the_step_timeout_nor_stop():
    """Stage 0 stopped reading (SIGSTOP): the prompt's write never completes.
    The run's own step timeout still fires, on time; before, the FSM's loop
    waited inside the write and nothing else happened."""
    rig = Rig(step=0.2)
    rig.start()
    rig.make_ready()
    rig.edges.stalled = True
    rig.driver.give_prompt([5])
    await asyncio.wait_for(rig.timed_out(), 3)
    await finish(rig)
    result = rig.driver.result
    assert result is not None and result.failure == "step timeout waiting for token 0"


async def test_a_stage_that_takes_no_control_frame_does_not_delay_a_stop():
    rig = Rig(stages=2, heartbeat=0.3)
    rig.stages[1].stalled = True  # its ProvisionStage is never taken
    rig.start()
    await settle()
    rig.driver.stop("esc")
    await settle()
    assert isinstance(rig.stages[0].sent[-1], StopRun), "the other stage is stopped at once"
    rig.answer_stops()
    await asyncio.wait_for(rig.driver.done.wait(), 2)  # the stalled send gives up at its deadline
    result = rig.driver.result
    assert result is not None and result.outcome == "torn down"


async def test_a_write_that_stalls_past_its_deadline_is_a_lost_stage():
    rig = Rig(stages=2, heartbeat=0.2)
    rig.start()
    rig.make_ready()
    rig.edges.stalled = True
    rig.driver.give_prompt([5])
    for _ in range(100):  # the write gives up 0.2 s after it began
        if rig.stages[0].lost:
            break
        await asyncio.sleep(0.05)
    assert rig.stages[0].lost == ["token-in edge: the peer took nothing for 0.2s"]


async def test_a_refused_provision_faults_the_run_and_teardown_skips_that_stage():
    """The stage holds no run: StopRun there would only be refused, and the
    teardown would wait for its timeout."""
    rig = Rig(stages=2)
    rig.start()
    await settle()
    rig.driver.provision_refused(1, "stage 1 on fake (local) refused ProvisionStage: bad edge id")
    await settle()
    assert not any(isinstance(m, StopRun) for m in rig.stages[1].sent)
    rig.answer_stops()
    await asyncio.wait_for(rig.driver.done.wait(), 2)
    result = rig.driver.result
    assert result is not None and result.failure.endswith("refused ProvisionStage: bad edge id")
    assert result.notes == ()
