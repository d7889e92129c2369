"""Recovery of a lost stage, as a pure state machine (docs/recovery.md).

The session (session/pipeline.py) feeds it what happens and does what its
phase says: a stage lost (its agent exited, its control stream broke, its
heartbeat went silent) makes the state Lost; the session then asks to
:class:`Begin` a repair, which is granted (Recovering, one more attempt) while
the inventory's ``recovery.attempts`` and ``recovery.deadline`` allow, else the
state is Broken with one reason that names the first loss and what recovery
tried. A repair that works makes it Ready again; a run that completes after it
(:class:`Settled`) gives the next loss a fresh budget. Broken is final: the
session serves no more.

::

    Ready --Loss--> Lost --Begin--> Recovering --Repaired--> Ready
                      ^                 |  (a Loss meanwhile is recorded)
                      +--RepairFailed---+
    Lost --Begin (no attempt or time left)--> Broken
    Ready --Loss (attempts: 0)--> Broken (the loss itself is the reason)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from ggufpipe_tui.core.events import RunRecovered


class Phase(Enum):
    READY = "Ready"
    LOST = "Lost"
    RECOVERING = "Recovering"
    BROKEN = "Broken"


@dataclass(frozen=True, slots=True)
class Policy:
    attempts: int = 2  # repairs per run (0: recovery off)
    deadline: float = 120.0  # seconds from the first loss


@dataclass(frozen=True, slots=True)
class Loss:
    reason: str
    now: float


@dataclass(frozen=True, slots=True)
class Begin:
    now: float


@dataclass(frozen=True, slots=True)
class Repaired:
    how: str  # what the repair did, e.g. "restarted stage 1 on gpu-b"


@dataclass(frozen=True, slots=True)
class RepairFailed:
    reason: str


@dataclass(frozen=True, slots=True)
class Settled:
    """A run completed on the repaired pipeline: the next loss starts afresh."""


RecoveryEvent = Loss | Begin | Repaired | RepairFailed | Settled


@dataclass(frozen=True, slots=True)
class Recovery:
    phase: Phase = Phase.READY
    attempts: int = 0  # repairs begun since the first loss
    first_loss: str = ""
    first_at: float = 0.0
    tried: tuple[str, ...] = ()  # what each attempt did and how it ended
    reason: str = ""  # Broken: why

    @property
    def active(self) -> bool:
        """A loss is being dealt with: runs wait."""
        return self.phase in (Phase.LOST, Phase.RECOVERING)


def give_up_reason(state: Recovery, why: str) -> str:
    tried = "; ".join(state.tried) if state.tried else "nothing"
    return f"{state.first_loss} (recovery gave up: {why}; tried: {tried})"


def transition(state: Recovery, event: RecoveryEvent, policy: Policy) -> Recovery:
    """The next state; Broken takes nothing more."""
    if state.phase is Phase.BROKEN:
        return state
    if isinstance(event, Loss):
        if policy.attempts <= 0:
            return replace(state, phase=Phase.BROKEN, first_loss=event.reason, reason=event.reason)
        if state.phase is Phase.RECOVERING:
            # A second loss while repairing: the repair will fail, or the
            # replay will lose the stage again; either way it is recorded.
            return replace(state, tried=(*state.tried, f"lost meanwhile: {event.reason}"))
        if state.phase is Phase.LOST:
            return state  # another stage of the same fault: one repair covers both
        if not state.first_loss:
            return replace(state, phase=Phase.LOST, first_loss=event.reason, first_at=event.now)
        return replace(state, phase=Phase.LOST, tried=(*state.tried, f"lost again: {event.reason}"))
    if isinstance(event, Begin):
        if state.phase is not Phase.LOST:
            return state
        if state.attempts >= policy.attempts:
            why = f"{state.attempts} of recovery.attempts {policy.attempts} used"
            return replace(state, phase=Phase.BROKEN, reason=give_up_reason(state, why))
        elapsed = event.now - state.first_at
        if elapsed > policy.deadline:
            why = f"recovery.deadline of {policy.deadline:g} s passed"
            return replace(state, phase=Phase.BROKEN, reason=give_up_reason(state, why))
        return replace(state, phase=Phase.RECOVERING, attempts=state.attempts + 1)
    if isinstance(event, Repaired):
        if state.phase is not Phase.RECOVERING:
            return state
        entry = f"attempt {state.attempts}: {event.how}"
        return replace(state, phase=Phase.READY, tried=(*state.tried, entry))
    if isinstance(event, RepairFailed):
        if state.phase is not Phase.RECOVERING:
            return state
        entry = f"attempt {state.attempts} failed: {event.reason}"
        return replace(state, phase=Phase.LOST, tried=(*state.tried, entry))
    if isinstance(event, Settled):
        return Recovery() if state.phase is Phase.READY else state
    raise TypeError(f"not a recovery event: {event!r}")


@dataclass(frozen=True, slots=True)
class Counts:
    """A session's recoveries so far, counted apart (``GET /health``,
    ``/metrics``): ``stages_lost``, each stage reported lost; ``repairs``,
    each repair that worked (one restarts every stage lost meanwhile);
    ``runs_replayed``, each run in flight at a loss that was replayed and
    went on (one loss with three runs in flight: three)."""

    stages_lost: int = 0
    repairs: int = 0
    runs_replayed: int = 0

    def as_json(self) -> dict[str, int]:
        return {"stages_lost": self.stages_lost, "repairs": self.repairs, "runs_replayed": self.runs_replayed}


def time_left(state: Recovery, policy: Policy, now: float) -> float:
    """Seconds a repair may still take."""
    return max(0.0, policy.deadline - (now - state.first_at)) if state.first_loss else policy.deadline


def recovery_line(event: RunRecovered) -> str:
    """The transcript's line: "stage 1 on gpu-b (...) lost at token 143;
    restarted; replayed 181 tokens in 0.4 s"."""
    return (
        f"{event.stages} lost at token {event.at_token}; {event.how}; "
        f"replayed {event.replayed} tokens in {event.replay_s:.1f} s"
    )


def recovery_parts(event: RunRecovered) -> dict[str, float]:
    """Seconds of each part, loss to the next token (headless --json, docs/bench-recovery.md)."""
    return {
        "teardown_s": round(event.teardown_s, 3),
        "restart_s": round(event.restart_s, 3),
        "load_s": round(event.load_s, 3),
        "replay_s": round(event.replay_s, 3),
    }
