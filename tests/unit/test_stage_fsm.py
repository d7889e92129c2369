"""docs/design.md, "Stage state machine", the stage FSM, as a table: every (state, event) pair is either the
listed transition or rejected."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ggufpipe_agent.errors import TransitionError
from ggufpipe_agent.stage.fsm import (
    CancelPrepare,
    EdgeEstablished,
    EmitFault,
    EmitReady,
    EmitStopped,
    EndGeneration,
    ExecuteStep,
    FeedToken,
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
    TokenSampled,
    WorkerBound,
    transition,
)
from tests.support.fsm_table import check_pair, every_pair

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
    "provision-ring": Provision(9, ring_out=True, eog=frozenset({2}), max_tokens=9),
    "ring-in-edge": EdgeEstablished("ring-in"),
    "ring-out-edge": EdgeEstablished("ring-out"),
    "sampled": TokenSampled(3, 7),
    "sampled-eos": TokenSampled(3, 2),
    "sampled-wrong": TokenSampled(5, 7),
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
    (S.UNPROVISIONED, "provision-ring"): (S.PREPARING, [StartPrepare]),
    (S.STOPPING, "ring-in-edge"): (S.STOPPING, []),
    (S.STOPPING, "ring-out-edge"): (S.STOPPING, []),
    (S.STOPPING, "sampled"): (S.STOPPING, []),
    (S.STOPPING, "sampled-eos"): (S.STOPPING, []),
    (S.STOPPING, "sampled-wrong"): (S.STOPPING, []),
}

# The token ring: stage 0 and the last stage of a ring run (docs/rings.md).
RING = {"ring_out": True, "ring_out_ready": True, "eog": frozenset({2})}
STAGES.update(
    {
        "Preparing-ring-first": Stage(S.PREPARING, run_id=9, ring_in=True),
        "Preparing-ring-last": Stage(S.PREPARING, run_id=9, ring_out=True),
        "Executing-ring-last": Stage(S.EXECUTING, 9, True, True, True, 3, max_tokens=9, **RING),
        "Executing-ring-full": Stage(S.EXECUTING, 9, True, True, True, 3, max_tokens=4, **RING),
        "Ready-ring-ended": Stage(S.READY, 9, True, True, True, 4, max_tokens=4, ended="max_tokens", **RING),
    }
)


def like(state: S, *names: str) -> None:
    """These representatives take every event ``state`` takes, the same way."""
    for name in names:
        TABLE.update({(name, event): v for (s, event), v in list(TABLE.items()) if s is state})


like(S.PREPARING, "Preparing-ring-first", "Preparing-ring-last")
like(S.EXECUTING, "Executing-ring-last", "Executing-ring-full")
like(S.READY, "Ready-ring-ended")
TABLE.update(
    {
        ("Preparing-ring-first", "ring-in-edge"): (S.PREPARING, []),
        ("Preparing-ring-last", "ring-out-edge"): (S.PREPARING, []),
        ("Executing-ring-last", "sampled"): (S.EXECUTING, [FeedToken]),
        ("Executing-ring-last", "sampled-eos"): (S.EXECUTING, [EndGeneration]),
        ("Executing-ring-full", "sampled"): (S.EXECUTING, [EndGeneration]),
        ("Executing-ring-full", "sampled-eos"): (S.EXECUTING, [EndGeneration]),
        # Nothing comes after the end of the generation: a stray object is a fault.
        ("Ready-ring-ended", "object-next"): (S.FAULTED, [EmitFault]),
    }
)


@every_pair(("state", "event_name"), STAGES, EVENTS)
def test_every_pair(state, event_name):
    check_pair(
        transition,
        STAGES[state],
        EVENTS[event_name],
        TABLE.get((state, event_name)),
        lambda after: after.state,
    )


def test_a_ring_stage_is_ready_only_with_its_ring_end():
    stage, _ = transition(Stage(), Provision(1, ring_in=True))
    for event in (WorkerBound(), EdgeEstablished("inbound"), EdgeEstablished("outbound")):
        stage, effects = transition(stage, event)
    assert stage.state is S.PREPARING and effects == [], "the ring-in end is missing"
    stage, effects = transition(stage, EdgeEstablished("ring-in"))
    assert stage.state is S.READY and effects == [EmitReady()]


def test_the_last_stage_feeds_the_ring_until_eos_or_max_tokens():
    stage, _ = transition(Stage(), Provision(1, ring_out=True, eog=frozenset({2}), max_tokens=3))
    for event in (WorkerBound(), EdgeEstablished("inbound"), EdgeEstablished("outbound")):
        stage, _ = transition(stage, event)
    stage, _ = transition(stage, EdgeEstablished("ring-out"))
    fed = []
    for sequence in range(3):
        stage, _ = transition(stage, ObjectLoaded(sequence))
        stage, effects = transition(stage, TokenSampled(sequence, 10 + sequence))
        fed += effects
        stage, _ = transition(stage, StepCompleted(sequence))
    assert fed == [FeedToken(1, 10), FeedToken(2, 11), EndGeneration("max_tokens")]
    assert stage.ended == "max_tokens", "token 3 of 3: no step runs past the stop"
    eos, _ = transition(Stage(), Provision(1, ring_out=True, eog=frozenset({2}), max_tokens=9))
    eos = replace(eos, state=S.EXECUTING, worker_bound=True, inbound_ready=True, outbound_ready=True)
    eos, effects = transition(eos, TokenSampled(0, 2))
    assert effects == [EndGeneration("eos")] and eos.ended == "eos"


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


def test_a_prompt_in_parts_is_one_sequence():
    stage = replace(STAGES[S.READY], next_sequence=0)
    for more in (True, True, False):
        stage, effects = transition(stage, ObjectLoaded(0))
        assert effects == [ExecuteStep(0)]
        stage, effects = transition(stage, StepCompleted(0, more=more))
        assert stage.state is S.READY and effects == [ReleaseInput(0)]
        assert stage.next_sequence == (0 if more else 1)
    stage, _ = transition(stage, ObjectLoaded(0))  # a part after the last one is a violation
    assert stage.state is S.FAULTED and "expected object 1, got 0" in stage.fault


def test_fault_reason_is_kept():
    stage, effects = transition(STAGES[S.EXECUTING], StepFailed("out of memory"))
    assert stage.fault == "out of memory" and effects == [EmitFault("out of memory")]
    assert replace(stage, fault="") != stage
