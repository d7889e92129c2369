"""docs/design.md, "Run state machine", the orchestrator's run FSM, as a table: every (phase, event) pair
is either the listed transition or rejected."""

from __future__ import annotations

import itertools

import pytest

from ggufpipe_agent.errors import TransitionError
from ggufpipe_tui.core import run_fsm as f
from ggufpipe_tui.core.run_fsm import Run, RunPhase, transition

P = RunPhase
ALL = frozenset({0, 1, 2})

# A representative run in each phase: 3 stages, max 4 tokens, EOG {2}.
RUNS = {
    P.PLANNING: Run(max_tokens=4, eog=frozenset({2})),
    P.PROVISIONING: Run(4, frozenset({2}), P.PROVISIONING, 3, ALL),
    P.WAITING_READY: Run(4, frozenset({2}), P.WAITING_READY, 3, ALL, ready=frozenset({0, 1})),
    P.RUNNING: Run(4, frozenset({2}), P.RUNNING, 3, ALL, ALL, prompt_given=True, consumed=1),
    P.COMPLETED: Run(4, frozenset({2}), P.COMPLETED, 3, ALL, ALL, outcome="completed"),
    P.FAULTED: Run(4, frozenset({2}), P.FAULTED, 3, ALL, ALL, outcome="faulted", failure="x"),
    P.TEARING_DOWN: Run(4, frozenset({2}), P.TEARING_DOWN, 3, ALL, ALL, stopped=frozenset({0})),
    P.DONE: Run(4, frozenset({2}), P.DONE, 3, ALL, ALL, stopped=ALL),
}

EVENTS = {
    "plan-validated": f.PlanValidated(3),
    "plan-rejected": f.PlanRejected("overlap"),
    "provisions-sent": f.ProvisionsSent(),
    "provision-failed": f.ProvisionFailed(1, "broken pipe"),
    "prompt": f.PromptGiven(),
    "stage-ready-2": f.StageReadyEvent(2),
    "stage-fault": f.StageFaultEvent(1, "oom"),
    "stage-lost": f.StageLost(1, "exited"),
    "edge-fault": f.EdgeFault("bad frame"),
    "token-next": f.TokenConsumed(1, 7),
    "token-wrong": f.TokenConsumed(3, 7),
    "token-eos": f.TokenConsumed(1, 2),
    "stop": f.StopRequested(),
    "timeout-ready": f.Timeout("ready"),
    "timeout-step": f.Timeout("step"),
    "timeout-teardown": f.Timeout("teardown"),
    "stage-stopped-1": f.StageStoppedEvent(1),
    "advance": f.Advance(),
}

TEARDOWN = [f.SendStopRun, f.SendStopRun, f.SendStopRun, f.CloseTokenEndpoints, f.StartTimer]
NOTE = (P.TEARING_DOWN, [f.Note])

TABLE = {
    (P.PLANNING, "plan-validated"): (P.PROVISIONING, [f.SendProvision] * 3 + [f.OpenTokenEndpoints]),
    (P.PLANNING, "plan-rejected"): (P.FAULTED, [f.RecordFailure]),
    (P.PLANNING, "prompt"): (P.PLANNING, []),
    (P.PLANNING, "stop"): (P.DONE, [f.CloseTokenEndpoints, f.Finish]),
    (P.PROVISIONING, "provisions-sent"): (P.WAITING_READY, [f.StartTimer]),
    (P.PROVISIONING, "provision-failed"): (P.FAULTED, [f.RecordFailure]),
    (P.PROVISIONING, "prompt"): (P.PROVISIONING, []),
    (P.PROVISIONING, "stage-ready-2"): (P.PROVISIONING, []),
    (P.PROVISIONING, "stage-fault"): (P.FAULTED, [f.RecordFailure]),
    (P.PROVISIONING, "stage-lost"): (P.FAULTED, [f.RecordFailure]),
    (P.PROVISIONING, "edge-fault"): (P.FAULTED, [f.RecordFailure]),
    (P.PROVISIONING, "stop"): (P.TEARING_DOWN, TEARDOWN),
    (P.WAITING_READY, "prompt"): (P.WAITING_READY, []),
    (P.WAITING_READY, "stage-ready-2"): (P.WAITING_READY, [f.CancelTimer]),
    (P.WAITING_READY, "stage-fault"): (P.FAULTED, [f.CancelTimer, f.RecordFailure]),
    (P.WAITING_READY, "stage-lost"): (P.FAULTED, [f.CancelTimer, f.RecordFailure]),
    (P.WAITING_READY, "edge-fault"): (P.FAULTED, [f.CancelTimer, f.RecordFailure]),
    (P.WAITING_READY, "timeout-ready"): (P.FAULTED, [f.RecordFailure]),
    (P.WAITING_READY, "stop"): (P.TEARING_DOWN, TEARDOWN),
    (P.RUNNING, "token-next"): (P.RUNNING, [f.CancelTimer, f.AcceptToken, f.InjectToken, f.StartTimer]),
    (P.RUNNING, "token-wrong"): (P.FAULTED, [f.CancelTimer, f.RecordFailure]),
    (P.RUNNING, "token-eos"): (P.COMPLETED, [f.CancelTimer, f.AcceptToken, f.FinalizeOutput]),
    (P.RUNNING, "stop"): (P.COMPLETED, [f.CancelTimer, f.FinalizeOutput]),
    (P.RUNNING, "stage-fault"): (P.FAULTED, [f.CancelTimer, f.RecordFailure]),
    (P.RUNNING, "stage-lost"): (P.FAULTED, [f.CancelTimer, f.RecordFailure]),
    (P.RUNNING, "edge-fault"): (P.FAULTED, [f.CancelTimer, f.RecordFailure]),
    (P.RUNNING, "timeout-step"): (P.FAULTED, [f.RecordFailure]),
    (P.RUNNING, "stage-stopped-1"): (P.FAULTED, [f.CancelTimer, f.RecordFailure]),
    (P.COMPLETED, "advance"): (P.TEARING_DOWN, TEARDOWN),
    (P.FAULTED, "advance"): (P.TEARING_DOWN, TEARDOWN),
    (P.TEARING_DOWN, "stage-stopped-1"): (P.TEARING_DOWN, []),
    (P.TEARING_DOWN, "stage-lost"): (P.TEARING_DOWN, []),
    (P.TEARING_DOWN, "timeout-teardown"): (P.DONE, [f.Note, f.Finish]),
    (P.TEARING_DOWN, "stage-fault"): NOTE,
    (P.TEARING_DOWN, "token-next"): NOTE,
    (P.TEARING_DOWN, "token-wrong"): NOTE,
    (P.TEARING_DOWN, "token-eos"): NOTE,
    (P.TEARING_DOWN, "stage-ready-2"): NOTE,
    (P.TEARING_DOWN, "edge-fault"): NOTE,
    (P.TEARING_DOWN, "stop"): NOTE,
}

# The token ring: the last stage feeds tokens back itself; the orchestrator
# accepts each one (and applies the same stop) but never injects.
RUNS["Running-ring"] = Run(
    4, frozenset({2}), P.RUNNING, 3, ALL, ALL, prompt_given=True, consumed=1, ring=True
)
TABLE.update({("Running-ring", event): v for (phase, event), v in list(TABLE.items()) if phase is P.RUNNING})
TABLE[("Running-ring", "token-next")] = (P.RUNNING, [f.CancelTimer, f.AcceptToken, f.StartTimer])


def label(phase: P | str) -> str:
    return phase.value if isinstance(phase, P) else phase


@pytest.mark.parametrize(
    ("phase", "event_name"),
    list(itertools.product(RUNS, EVENTS)),
    ids=[f"{label(p)}-{e}" for p, e in itertools.product(RUNS, EVENTS)],
)
def test_every_pair(phase, event_name):
    run, event = RUNS[phase], EVENTS[event_name]
    expected = TABLE.get((phase, event_name))
    if expected is None:
        with pytest.raises(TransitionError):
            transition(run, event)
        return
    after, effects = transition(run, event)
    assert after.phase is expected[0]
    assert [type(effect) for effect in effects] == expected[1]


def drive(run: Run, *events: f.RunEvent) -> tuple[Run, list[f.RunEffect]]:
    effects: list[f.RunEffect] = []
    for event in events:
        run, more = transition(run, event)
        effects += more
        if run.phase in (P.COMPLETED, P.FAULTED):
            run, more = transition(run, f.Advance())
            effects += more
    return run, effects


def test_a_whole_run_to_max_tokens():
    run, effects = drive(
        Run(max_tokens=3),
        f.PlanValidated(2),
        f.ProvisionsSent(),
        f.StageReadyEvent(0),
        f.StageReadyEvent(1),
    )
    assert run.phase is P.WAITING_READY and not any(isinstance(e, f.InjectPrompt) for e in effects)
    assert f.CancelTimer("ready") in effects, "a met barrier stops the readiness timeout"
    run, effects = drive(run, f.PromptGiven())
    assert run.phase is P.RUNNING and f.InjectPrompt() in effects
    run, effects = drive(run, f.TokenConsumed(0, 5))
    assert f.InjectToken(1, 5) in effects
    run, effects = drive(run, f.TokenConsumed(1, 6), f.TokenConsumed(2, 7))
    assert run.outcome == "completed" and run.stop_reason == "max_tokens"
    assert not any(isinstance(e, f.InjectToken) and e.sequence == 3 for e in effects)
    assert [e for e in effects if isinstance(e, f.SendStopRun)] == [f.SendStopRun(0), f.SendStopRun(1)]
    run, effects = drive(run, f.StageStoppedEvent(0), f.StageStoppedEvent(1))
    assert run.phase is P.DONE and f.Finish() in effects


def test_the_prompt_sets_its_own_max_tokens():
    """A run prepared ahead with the inventory's limit stops at its prompt's."""
    run, _ = drive(Run(max_tokens=9), f.PlanValidated(1), f.ProvisionsSent(), f.StageReadyEvent(0))
    run, _ = drive(run, f.PromptGiven(max_tokens=2))
    assert run.max_tokens == 2
    run, _ = drive(run, f.TokenConsumed(0, 5), f.TokenConsumed(1, 6))
    assert run.outcome == "completed" and run.stop_reason == "max_tokens"
    assert drive(Run(max_tokens=9), f.PromptGiven())[0].max_tokens == 9, "0 keeps the plan's"


def test_no_prompt_before_every_stage_is_ready():
    run, _ = drive(Run(max_tokens=3), f.PromptGiven(), f.PlanValidated(3), f.ProvisionsSent())
    for stage in (2, 0):
        run, effects = drive(run, f.StageReadyEvent(stage))
        assert f.InjectPrompt() not in effects
    run, effects = drive(run, f.StageReadyEvent(1))
    assert f.InjectPrompt() in effects


def test_a_fault_stops_injection_and_tears_down_every_provisioned_stage():
    run, _ = drive(Run(max_tokens=9), f.PlanValidated(3), f.ProvisionsSent(), f.PromptGiven())
    run, _ = drive(run, *(f.StageReadyEvent(i) for i in range(3)))
    run, effects = drive(run, f.TokenConsumed(0, 4), f.StageFaultEvent(1, "stage 1: oom"))
    assert run.outcome == "faulted" and run.failure == "stage 1: oom"
    assert run.phase is P.TEARING_DOWN
    stops = [e.stage for e in effects if isinstance(e, f.SendStopRun)]
    assert stops == [0, 1, 2]
    run, effects = drive(run, f.TokenConsumed(1, 4))  # in flight: ignored, not injected
    assert not any(isinstance(e, f.InjectToken) for e in effects)
    run, effects = drive(run, f.Timeout("teardown"))
    assert run.phase is P.DONE and "no StageStopped from stage(s) 0, 1, 2" in run.notes[0]


def test_one_terminal_outcome_each():
    faulted, _ = drive(Run(max_tokens=2), f.PlanRejected("gap"))
    assert faulted.outcome == "faulted" and faulted.phase is P.DONE
    torn, _ = drive(Run(max_tokens=2), f.PlanValidated(1), f.StopRequested())
    assert torn.outcome == "torn down"


def test_a_ring_run_completes_at_max_tokens_without_injecting():
    run, _ = drive(Run(max_tokens=2, ring=True), f.PlanValidated(2), f.ProvisionsSent(), f.PromptGiven())
    run, effects = drive(run, f.StageReadyEvent(0), f.StageReadyEvent(1))
    assert f.InjectPrompt() in effects, "the prompt still comes from the orchestrator"
    run, effects = drive(run, f.TokenConsumed(0, 5), f.TokenConsumed(1, 6))
    assert not any(isinstance(e, f.InjectToken) for e in effects)
    assert run.outcome == "completed" and run.stop_reason == "max_tokens" and run.phase is P.TEARING_DOWN
