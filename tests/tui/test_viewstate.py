"""The TUI's reducer without Textual: events in, view state out."""

from __future__ import annotations

import dataclasses

from ggufpipe_tui.core.events import (
    PlanMade,
    PromptAssigned,
    RunFinished,
    RunPhaseChanged,
    RunResult,
    StageStateChanged,
    Timings,
    TokenStreamed,
)
from ggufpipe_tui.views.viewstate import ViewState
from tests.support.fakes import inventory, plan_for

RUN = 0x101


def result(outcome: str = "completed", failure: str = "") -> RunResult:
    return RunResult(
        run_id=RUN,
        outcome=outcome,
        stop_reason="max_tokens" if outcome == "completed" else "",
        failure=failure,
        prompt_tokens=(1,),
        tokens=(9, 10),
        text="ab",
        timings=Timings(ttft_ms=12.0, decode_tokens_per_s=50.0),
    )


def planned_state() -> ViewState:
    state = ViewState(inventory(stages=2))
    state.apply(PlanMade(plan_for(inventory(stages=2), RUN), ("a", "a")), 0.0)
    return state


def test_a_plan_fills_the_rows_and_leaves_the_session_phase():
    state = planned_state()
    assert state.session_phase is None and state.run_phase == "Planning" and state.run_id == RUN
    assert [row.layers for row in state.rows] == [(0, 2), (2, 4)]
    assert all(row.estimated_bytes > 0 for row in state.rows)
    lines = [line.plain for _, line in state.log]
    assert lines[0] == f"[·] run {RUN:016x}: plan"
    assert lines[1].startswith("[0]   stage 0: layers [0, 2) on a, ~")


def test_a_submitted_prompt_shows_at_once_when_nothing_runs_and_streams_under_itself():
    state = planned_state()
    view = state.submitted("hello")
    assert view.shown and state.mount == [view]
    state.tickets[7] = view
    state.apply(PromptAssigned(RUN, "hello", 7), 1.0)
    assert view.run_id == RUN and state.exchanges[RUN] is view and state.prompt_active
    state.apply(RunPhaseChanged(RUN, "Running"), 1.0)
    state.apply(TokenStreamed(RUN, 0, 9, "a"), 1.1)
    state.apply(TokenStreamed(RUN, 1, 10, "b"), 1.2)
    assert view.parts == ["a", "b"] and id(view) in state.touched
    assert state.latest is not None and state.latest.tokens == 2
    state.apply(RunFinished(result()), 1.3)
    assert view.finished and view.summary is not None
    assert view.summary.plain == "max tokens · 2 tokens · first after 12 ms · 50.0 tok/s"
    assert not state.prompt_active and state.results[-1].ok


def test_a_prompt_behind_a_running_one_waits_to_be_shown():
    state = planned_state()
    state.prompt_active = True
    view = state.submitted("later")
    assert not view.shown and state.mount == []


def test_a_faulted_run_faults_the_session_and_a_row_can_be_marked_lost():
    state = planned_state()
    for index in range(2):
        state.rows[index].connected = True
    state.apply(StageStateChanged(RUN, 1, "Faulted", "out of memory"), 0.5)
    assert state.rows[1].fault == "out of memory"
    state.apply(RunFinished(result("faulted", "stage 1 on a (local): out of memory")), 1.0)
    assert state.session_phase == "Faulted" and state.fault.startswith("stage 1")
    state.mark_lost(0, "(killed by signal 9)")
    assert state.rows[0].state == "Lost" and state.rows[0].fault == "agent gone (killed by signal 9)"
    assert state.hint(2.0) == "the pipeline stopped"


def test_a_new_session_resets_the_rows_but_keeps_the_transcript():
    state = planned_state()
    state.apply(StageStateChanged(RUN, 0, "Ready"), 0.5)
    state.results.append(result())
    state.new_session(3.0)
    assert state.session == 1 and state.session_phase == "Connecting"
    assert all(row.state == "Unprovisioned" and not row.history for row in state.rows)
    assert state.results, "finished runs stay on screen"
    assert state.hint(4.0) == "0/2 agents up · 1.0 s"


def test_a_run_that_kept_a_prefix_says_how_much():
    state = planned_state()
    view = state.submitted("and then?")
    state.tickets[8] = view
    state.apply(PromptAssigned(RUN, "and then?", 8), 1.0)
    kept = dataclasses.replace(result(), prompt_tokens=(1, 2, 3, 4, 5, 6, 7), prompt_reused=5)
    state.apply(RunFinished(kept), 1.3)
    assert view.summary is not None
    assert view.summary.plain == (
        "max tokens · 2 tokens · first after 12 ms · 50.0 tok/s · reused 5 of 7 prompt tokens"
    )


def test_a_long_session_keeps_a_bounded_transcript_and_history():
    """A thousand prompts: older exchanges scroll out (the app unmounts their
    widgets), run records and stage histories are bounded (a long session stays the same size)."""
    from dataclasses import replace

    from ggufpipe_tui.views import viewstate

    state = planned_state()
    dropped = []
    for number in range(1000):
        run_id = 0x1000 + number
        view = state.submitted(f"prompt {number}")
        state.tickets[number + 1] = view
        state.apply(PromptAssigned(run_id, view.prompt, number + 1), float(number))
        state.apply(RunPhaseChanged(run_id, "Running"), float(number))
        for index in range(2):
            state.apply(StageStateChanged(run_id, index, "Preparing"), float(number))
            state.apply(StageStateChanged(run_id, index, "Ready"), float(number))
        state.apply(TokenStreamed(run_id, 0, 9, "a"), number + 0.1)
        state.apply(RunFinished(replace(result(), run_id=run_id)), number + 0.2)
        dropped += state.unmount
        state.unmount.clear()
        state.mount.clear()
        state.touched.clear()
    assert len(state.exchanges) == viewstate.MAX_EXCHANGES
    assert min(state.exchanges) == 0x1000 + 1000 - viewstate.MAX_EXCHANGES, "the newest are kept"
    assert len(dropped) == 1000 - viewstate.MAX_EXCHANGES and all(view.finished for view in dropped)
    assert len(state.runs) <= viewstate.MAX_RUNS and len(state.results) <= viewstate.MAX_RUNS
    assert state.results[-1].run_id == 0x1000 + 999
    assert all(len(row.history) <= viewstate.MAX_HISTORY for row in state.rows)
    assert not state.tickets, "every ticket was claimed"


async def test_the_app_unmounts_exchanges_that_scrolled_out(monkeypatch):
    """The transcript's widgets follow the view state: after more runs than
    it keeps, the oldest exchanges are gone from the screen too."""
    from dataclasses import replace

    from ggufpipe_tui.views import viewstate
    from ggufpipe_tui.views.app import GgufpipeApp
    from ggufpipe_tui.views.drawing import PipelineEvent
    from ggufpipe_tui.views.transcript import Transcript

    monkeypatch.setattr(viewstate, "MAX_EXCHANGES", 5)
    app = GgufpipeApp(inventory(stages=2), script=[])
    async with app.run_test(size=(80, 24)) as pilot:
        for number in range(12):
            run_id = 0x2000 + number
            for event in (
                PromptAssigned(run_id, f"prompt {number}", 0),
                RunPhaseChanged(run_id, "Running"),
                TokenStreamed(run_id, 0, 9, "a"),
                RunFinished(replace(result(), run_id=run_id)),
            ):
                app.post_message(PipelineEvent(event, app.state.session))
            await pilot.pause()
        shown = [exchange.run_id for exchange in app.query_one(Transcript).exchanges]
    assert shown == [0x2000 + number for number in range(7, 12)], shown


def test_a_host_being_set_up_shows_in_its_row_and_the_log() -> None:
    from ggufpipe_tui.core.events import AgentSetup

    state = planned_state()
    state.apply(AgentSetup(1, "gpu-b", "setting up", "installing the wheels sent (no index)"), 1.0)
    row = state.rows[1]
    assert row.state == "Setting up" and row.load_detail == "installing the wheels sent (no index)"
    state.apply(AgentSetup(1, "gpu-b", "done", "", "pushed", 11.25, 60 << 20), 2.0)
    assert row.state == "Unprovisioned" and row.load_detail == ""
    lines = [text.plain for _, text in state.log]
    assert lines[-2].endswith("stage 1 on gpu-b: installing the wheels sent (no index)")
    assert lines[-1].endswith("stage 1 on gpu-b: agent pushed in 11.2 s, 60.0 MiB sent")
