"""The recovery state machine (core/recovery.py), as tables."""

from __future__ import annotations

import pytest

from ggufpipe_tui.core.recovery import (
    Begin,
    Loss,
    Phase,
    Policy,
    Recovery,
    RecoveryEvent,
    Repaired,
    RepairFailed,
    Settled,
    time_left,
    transition,
)

TWO = Policy(attempts=2, deadline=120)


def run(events: list[RecoveryEvent], policy: Policy = TWO) -> Recovery:
    state = Recovery()
    for event in events:
        state = transition(state, event, policy)
    return state


LOSS = Loss("stage 1 on b: the agent exited (killed by signal 9)", 10.0)


@pytest.mark.parametrize(
    ("events", "phase", "attempts"),
    [
        ([], Phase.READY, 0),
        ([LOSS], Phase.LOST, 0),
        ([LOSS, Begin(10.0)], Phase.RECOVERING, 1),
        ([LOSS, Begin(10.0), Repaired("restarted stage 1 on b")], Phase.READY, 1),
        ([LOSS, Begin(10.0), RepairFailed("no answer"), Begin(11.0)], Phase.RECOVERING, 2),
        ([LOSS, Begin(10.0), Repaired("r"), Loss("again", 20.0), Begin(20.0)], Phase.RECOVERING, 2),
        (
            [
                LOSS,
                Begin(10.0),
                Repaired("r"),
                Loss("again", 20),
                Begin(20),
                Repaired("r"),
                Loss("3", 30),
                Begin(30),
            ],
            Phase.BROKEN,
            2,
        ),
        ([LOSS, Begin(10.0), RepairFailed("x"), Begin(11), RepairFailed("y"), Begin(12)], Phase.BROKEN, 2),
        # A completed run gives the next loss the whole budget again.
        (
            [LOSS, Begin(10.0), Repaired("r"), Settled(), Loss("again", 20.0), Begin(20.0)],
            Phase.RECOVERING,
            1,
        ),
        # Settled while a repair is under way changes nothing.
        ([LOSS, Begin(10.0), Settled()], Phase.RECOVERING, 1),
        # Past the deadline, no attempt is begun.
        ([LOSS, Begin(10.0), RepairFailed("slow"), Begin(131.0)], Phase.BROKEN, 1),
        # A second stage lost of the same fault: one repair.
        ([LOSS, Loss("stage 2", 10.1), Begin(10.2)], Phase.RECOVERING, 1),
        # Lost while repairing: recorded, the repair's outcome decides.
        ([LOSS, Begin(10.0), Loss("stage 2", 11)], Phase.RECOVERING, 1),
    ],
)
def test_phases(events, phase, attempts):
    state = run(events)
    assert (state.phase, state.attempts) == (phase, attempts)


def test_recovery_off_is_the_loss_itself():
    state = run([LOSS, Begin(10.0)], Policy(attempts=0))
    assert state.phase is Phase.BROKEN and state.reason == LOSS.reason


def test_the_reason_names_the_first_loss_and_what_was_tried():
    state = run(
        [
            LOSS,
            Begin(10),
            Repaired("restarted stage 1 on b"),
            Loss("stage 2 lost", 20),
            Begin(20),
            RepairFailed("no answer from b"),
            Begin(21),
        ],
        Policy(attempts=2),
    )
    assert state.phase is Phase.BROKEN
    assert state.reason == (
        "stage 1 on b: the agent exited (killed by signal 9) (recovery gave up: 2 of recovery.attempts 2 used; "
        "tried: attempt 1: restarted stage 1 on b; lost again: stage 2 lost; attempt 2 failed: no answer from b)"
    )


def test_deadline_reason_and_time_left():
    state = run([LOSS, Begin(10.0)], Policy(attempts=5, deadline=30))
    assert time_left(state, Policy(attempts=5, deadline=30), 25.0) == 15.0
    state = transition(state, RepairFailed("slow"), Policy(attempts=5, deadline=30))
    state = transition(state, Begin(41.0), Policy(attempts=5, deadline=30))
    assert state.phase is Phase.BROKEN and "recovery.deadline of 30 s passed" in state.reason


def test_broken_is_final():
    state = run([LOSS, Begin(10)], Policy(attempts=0))
    for event in (Begin(11), Repaired("r"), Settled(), Loss("x", 12)):
        assert transition(state, event, TWO) is state
