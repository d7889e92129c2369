"""Spec §6, the stage FSM, as a table: every (state, event) pair is either the
listed transition or rejected."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from ggufpipe_agent.errors import TransitionError
from ggufpipe_agent.stage_fsm import (
    CancelPrepare,
    EdgeEstablished,
    EmitFault,
    EmitReady,
    EmitStopped,
    ExecuteStep,
    InboundFault,
    ObjectLoaded,
    OutputFault,
    Provision,
    RejectWork,
    ReleaseInput,
    SetupFailed,
    Stage,
    StageState,
    StartPrepare,
    StepCompleted,
    StepFailed,
    StopComplete,
    StopLocal,
    StopRunEvent,
    WorkerBound,
    transition,
)

S = StageState

# A representative stage in each state (Ready/Executing expect sequence 3).
STAGES = {
    S.UNPROVISIONED: Stage(),
    S.PREPARING: Stage(S.PREPARING, run_id=9),
    S.READY: Stage(S.READY, 9, True, True, True, next_sequence=3),
    S.EXECUTING: Stage(S.EXECUTING, 9, True, True, True, next_sequence=3),
    S.FAULTED: Stage(S.FAULTED, 9, fault="boom"),
    S.STOPPING: Stage(S.STOPPING, 9),
    S.STOPPED: Stage(S.STOPPED, 9),
}

EVENTS = {
    "provision": Provision(9),
    "provision-invalid": Provision(9, "bad assignment"),
    "worker-bound": WorkerBound(),
    "inbound-edge": EdgeEstablished("inbound"),
    "outbound-edge": EdgeEstablished("outbound"),
    "setup-failed": SetupFailed("no file"),
    "object-next": ObjectLoaded(3),
    "object-wrong": ObjectLoaded(5),
    "step-completed": StepCompleted(3),
    "step-failed": StepFailed("oom"),
    "output-fault": OutputFault("peer gone"),
    "inbound-fault": InboundFault("bad shape"),
    "stop-run": StopRunEvent("done"),
    "stop-complete": StopComplete(),
}

# (state, event) -> (next state, effect types). Missing pairs must be rejected.
TABLE = {
    (S.UNPROVISIONED, "provision"): (S.PREPARING, [StartPrepare]),
    (S.UNPROVISIONED, "provision-invalid"): (S.FAULTED, [EmitFault]),
    (S.PREPARING, "worker-bound"): (S.PREPARING, []),
    (S.PREPARING, "inbound-edge"): (S.PREPARING, []),
    (S.PREPARING, "outbound-edge"): (S.PREPARING, []),
    (S.PREPARING, "setup-failed"): (S.FAULTED, [EmitFault]),
    (S.PREPARING, "inbound-fault"): (S.FAULTED, [EmitFault]),
    (S.PREPARING, "stop-run"): (S.STOPPING, [CancelPrepare, StopLocal]),
    (S.READY, "object-next"): (S.EXECUTING, [ExecuteStep]),
    (S.READY, "object-wrong"): (S.FAULTED, [EmitFault]),
    (S.READY, "inbound-fault"): (S.FAULTED, [EmitFault]),
    (S.READY, "stop-run"): (S.STOPPING, [StopLocal]),
    (S.EXECUTING, "step-completed"): (S.READY, [ReleaseInput]),
    (S.EXECUTING, "step-failed"): (S.FAULTED, [EmitFault]),
    (S.EXECUTING, "output-fault"): (S.FAULTED, [EmitFault]),
    (S.EXECUTING, "inbound-fault"): (S.FAULTED, [EmitFault]),
    (S.EXECUTING, "stop-run"): (S.STOPPING, [StopLocal]),
    (S.FAULTED, "object-next"): (S.FAULTED, [RejectWork]),
    (S.FAULTED, "object-wrong"): (S.FAULTED, [RejectWork]),
    (S.FAULTED, "inbound-fault"): (S.FAULTED, [RejectWork]),
    (S.FAULTED, "stop-run"): (S.STOPPING, [StopLocal]),
    (S.STOPPING, "stop-complete"): (S.STOPPED, [EmitStopped]),
    (S.STOPPING, "object-next"): (S.STOPPING, [RejectWork]),
    (S.STOPPING, "object-wrong"): (S.STOPPING, [RejectWork]),
    (S.STOPPING, "inbound-fault"): (S.STOPPING, [RejectWork]),
    (S.STOPPING, "stop-run"): (S.STOPPING, []),
    (S.STOPPING, "worker-bound"): (S.STOPPING, []),
    (S.STOPPING, "inbound-edge"): (S.STOPPING, []),
    (S.STOPPING, "outbound-edge"): (S.STOPPING, []),
    (S.STOPPING, "setup-failed"): (S.STOPPING, []),
    (S.STOPPING, "step-completed"): (S.STOPPING, []),
    (S.STOPPING, "step-failed"): (S.STOPPING, []),
    (S.STOPPING, "output-fault"): (S.STOPPING, []),
    (S.STOPPED, "stop-run"): (S.STOPPED, [EmitStopped]),
}


@pytest.mark.parametrize(
    ("state", "event_name"),
    list(itertools.product(STAGES, EVENTS)),
    ids=[f"{s.value}-{e}" for s, e in itertools.product(STAGES, EVENTS)],
)
def test_every_pair(state, event_name):
    stage, event = STAGES[state], EVENTS[event_name]
    expected = TABLE.get((state, event_name))
    if expected is None:
        with pytest.raises(TransitionError):
            transition(stage, event)
        return
    after, effects = transition(stage, event)
    assert after.state is expected[0]
    assert [type(effect) for effect in effects] == expected[1]


def test_ready_only_when_worker_and_both_edges_are_ready():
    stage = Stage(S.PREPARING, run_id=1)
    for event in (EdgeEstablished("outbound"), WorkerBound()):
        stage, effects = transition(stage, event)
        assert stage.state is S.PREPARING and effects == []
    stage, effects = transition(stage, EdgeEstablished("inbound"))
    assert stage.state is S.READY and effects == [EmitReady()]


def test_duplicate_setup_events_are_rejected():
    stage, _ = transition(Stage(S.PREPARING, run_id=1), WorkerBound())
    with pytest.raises(TransitionError):
        transition(stage, WorkerBound())
    stage, _ = transition(stage, EdgeEstablished("inbound"))
    with pytest.raises(TransitionError):
        transition(stage, EdgeEstablished("inbound"))
    with pytest.raises(TransitionError):
        transition(stage, EdgeEstablished("sideways"))


def test_output_sequence_equals_input_and_sequences_increase():
    stage = STAGES[S.READY]
    for sequence in (3, 4, 5):
        stage, effects = transition(stage, ObjectLoaded(sequence))
        assert effects == [ExecuteStep(sequence)]
        with pytest.raises(TransitionError):
            transition(stage, StepCompleted(sequence + 1))
        stage, effects = transition(stage, StepCompleted(sequence))
        assert effects == [ReleaseInput(sequence)] and stage.next_sequence == sequence + 1
    stage, effects = transition(stage, ObjectLoaded(5))  # a repeat is a violation
    assert stage.state is S.FAULTED and "expected object 6, got 5" in stage.fault


def test_fault_reason_is_kept():
    stage, effects = transition(STAGES[S.EXECUTING], StepFailed("out of memory"))
    assert stage.fault == "out of memory" and effects == [EmitFault("out of memory")]
    assert replace(stage, fault="") != stage
