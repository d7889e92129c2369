"""The orchestrator's run FSM (docs/design.md, "Run state machine"), as a pure function.

``transition(run, event) -> (run, effects)``; the orchestrator performs the
effects (sending messages, writing token objects, timers) and feeds events
back. Completed and Faulted are passed through on the way to TearingDown: the
orchestrator feeds :class:`Advance` right after their effects ran.

Beyond the plain table (docs/design.md, "Run state machine"):

* WaitingReady also waits for the prompt (the token-in producer is ready when
  it has a prompt to inject), so the interactive UI can provision and load
  every stage before the user has typed anything.
* A user's stop while Running completes the run with what it has; before
  Running it tears the run down ("torn down" is the third outcome: docs/design.md, "Correctness guarantees").
* A stage whose connection is lost counts as stopped during teardown.
* The token ring (``Run.ring``, direct token feedback, docs/design.md, "Deferred, and where it went"):
  the last stage feeds each token to stage 0 itself and stops at EOS/EOG or
  ``max_tokens`` from its provision, so in Running a consumed token is
  accepted (and may complete the run) but never injected. The orchestrator
  still checks the sequence, applies the same stop and can stop the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

from ggufpipe_agent.errors import TransitionError


class RunPhase(Enum):
    PLANNING = "Planning"
    PROVISIONING = "Provisioning"
    WAITING_READY = "WaitingReady"
    RUNNING = "Running"
    COMPLETED = "Completed"
    FAULTED = "Faulted"
    TEARING_DOWN = "TearingDown"
    DONE = "Done"


# ----------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class PlanValidated:
    stage_count: int


@dataclass(frozen=True, slots=True)
class PlanRejected:
    reason: str


@dataclass(frozen=True, slots=True)
class ProvisionsSent:
    pass


@dataclass(frozen=True, slots=True)
class ProvisionFailed:
    stage: int
    reason: str


@dataclass(frozen=True, slots=True)
class PromptGiven:
    """The prompt is there; ``max_tokens`` (when > 0) is this prompt's limit,
    so a run prepared before its prompt was known still stops where it must."""

    max_tokens: int = 0


@dataclass(frozen=True, slots=True)
class StageReadyEvent:
    stage: int


@dataclass(frozen=True, slots=True)
class StageFaultEvent:
    stage: int
    reason: str


@dataclass(frozen=True, slots=True)
class StageLost:
    """The stage's process or connection ended without StageStopped."""

    stage: int
    reason: str


@dataclass(frozen=True, slots=True)
class EdgeFault:
    reason: str


@dataclass(frozen=True, slots=True)
class TokenConsumed:
    sequence: int
    token: int


@dataclass(frozen=True, slots=True)
class StopRequested:
    reason: str = "stopped by the user"


@dataclass(frozen=True, slots=True)
class Timeout:
    kind: str  # "ready", "step" or "teardown"


@dataclass(frozen=True, slots=True)
class StageStoppedEvent:
    stage: int


@dataclass(frozen=True, slots=True)
class Advance:
    """Leave Completed or Faulted for TearingDown."""


RunEvent = (
    PlanValidated
    | PlanRejected
    | ProvisionsSent
    | ProvisionFailed
    | PromptGiven
    | StageReadyEvent
    | StageFaultEvent
    | StageLost
    | EdgeFault
    | TokenConsumed
    | StopRequested
    | Timeout
    | StageStoppedEvent
    | Advance
)

# ---------------------------------------------------------------- effects


@dataclass(frozen=True, slots=True)
class SendProvision:
    stage: int


@dataclass(frozen=True, slots=True)
class OpenTokenEndpoints:
    pass


@dataclass(frozen=True, slots=True)
class StartTimer:
    kind: str


@dataclass(frozen=True, slots=True)
class CancelTimer:
    kind: str


@dataclass(frozen=True, slots=True)
class InjectPrompt:
    """Write the prompt token object, sequence 0."""


@dataclass(frozen=True, slots=True)
class AcceptToken:
    sequence: int
    token: int


@dataclass(frozen=True, slots=True)
class InjectToken:
    sequence: int
    token: int


@dataclass(frozen=True, slots=True)
class FinalizeOutput:
    pass


@dataclass(frozen=True, slots=True)
class RecordFailure:
    reason: str


@dataclass(frozen=True, slots=True)
class SendStopRun:
    stage: int


@dataclass(frozen=True, slots=True)
class CloseTokenEndpoints:
    pass


@dataclass(frozen=True, slots=True)
class Note:
    """Something to log that changes nothing (a late or repeated event)."""

    text: str


@dataclass(frozen=True, slots=True)
class Finish:
    pass


RunEffect = (
    SendProvision
    | OpenTokenEndpoints
    | StartTimer
    | CancelTimer
    | InjectPrompt
    | AcceptToken
    | InjectToken
    | FinalizeOutput
    | RecordFailure
    | SendStopRun
    | CloseTokenEndpoints
    | Note
    | Finish
)


@dataclass(frozen=True, slots=True)
class Run:
    max_tokens: int
    eog: frozenset[int] = frozenset()
    phase: RunPhase = RunPhase.PLANNING
    stage_count: int = 0
    provisioned: frozenset[int] = frozenset()
    ready: frozenset[int] = frozenset()
    stopped: frozenset[int] = frozenset()
    prompt_given: bool = False
    consumed: int = 0  # token objects consumed; the next expected sequence
    outcome: str = ""  # "completed", "faulted" or "torn down"
    stop_reason: str = ""  # "eos", "max_tokens", "stopped" (completed runs)
    failure: str = ""
    notes: tuple[str, ...] = field(default=())
    ring: bool = False  # the last stage feeds tokens back itself (the token ring)

    @property
    def all_ready(self) -> bool:
        return self.stage_count > 0 and len(self.ready) == self.stage_count


def _reject(run: Run, event: object) -> TransitionError:
    return TransitionError(f"run in {run.phase.value} does not accept {type(event).__name__}")


def _fault(run: Run, reason: str, *cancel: str) -> tuple[Run, list[RunEffect]]:
    effects: list[RunEffect] = [CancelTimer(kind) for kind in cancel]
    effects.append(RecordFailure(reason))
    return replace(run, phase=RunPhase.FAULTED, outcome="faulted", failure=reason), effects


def _complete(run: Run, stop_reason: str, effects: list[RunEffect]) -> tuple[Run, list[RunEffect]]:
    """The run ends well (the end of its text, its max_tokens, or stopped)."""
    completed = replace(run, phase=RunPhase.COMPLETED, outcome="completed", stop_reason=stop_reason)
    return completed, [*effects, FinalizeOutput()]


def _maybe_start(run: Run, became_ready: bool) -> tuple[Run, list[RunEffect]]:
    if run.all_ready and run.prompt_given:
        effects: list[RunEffect] = [CancelTimer("ready")] if became_ready else []
        return replace(run, phase=RunPhase.RUNNING), [*effects, InjectPrompt(), StartTimer("step")]
    if run.all_ready and became_ready:
        # The readiness barrier is met; only the prompt is missing, and the
        # readiness timeout must not bound how long a user takes to type it.
        return run, [CancelTimer("ready")]
    return run, []


def _teardown(run: Run) -> tuple[Run, list[RunEffect]]:
    effects: list[RunEffect] = [SendStopRun(index) for index in sorted(run.provisioned)]
    effects.append(CloseTokenEndpoints())
    if run.provisioned - run.stopped:
        effects.append(StartTimer("teardown"))
        return replace(run, phase=RunPhase.TEARING_DOWN), effects
    effects.append(Finish())
    return replace(run, phase=RunPhase.DONE), effects


#: The timer a stage's fault cancels in each phase where it faults the run.
_TIMER_OF: dict[RunPhase, tuple[str, ...]] = {
    RunPhase.PROVISIONING: (),
    RunPhase.WAITING_READY: ("ready",),
    RunPhase.RUNNING: ("step",),
}


def transition(run: Run, event: RunEvent) -> tuple[Run, list[RunEffect]]:
    P = RunPhase
    phase = run.phase

    if isinstance(event, PromptGiven) and phase in (P.PLANNING, P.PROVISIONING, P.WAITING_READY):
        if run.prompt_given:
            raise _reject(run, event)
        run = replace(run, prompt_given=True, max_tokens=event.max_tokens or run.max_tokens)
        return _maybe_start(run, became_ready=False) if phase is P.WAITING_READY else (run, [])

    if isinstance(event, StopRequested) and phase in (P.PLANNING, P.PROVISIONING, P.WAITING_READY):
        return _teardown(replace(run, outcome="torn down", failure=event.reason))

    if isinstance(event, StageFaultEvent | StageLost | EdgeFault) and phase in _TIMER_OF:
        return _fault(run, event.reason, *_TIMER_OF[phase])

    if phase is P.PLANNING:
        if isinstance(event, PlanValidated):
            everyone = frozenset(range(event.stage_count))
            effects: list[RunEffect] = [SendProvision(index) for index in range(event.stage_count)]
            effects.append(OpenTokenEndpoints())
            return (
                replace(run, phase=P.PROVISIONING, stage_count=event.stage_count, provisioned=everyone),
                effects,
            )
        if isinstance(event, PlanRejected):
            return _fault(run, event.reason)
        raise _reject(run, event)

    if phase is P.PROVISIONING:
        if isinstance(event, ProvisionsSent):
            return replace(run, phase=P.WAITING_READY), [StartTimer("ready")]
        if isinstance(event, ProvisionFailed):
            return _fault(replace(run, provisioned=run.provisioned - {event.stage}), event.reason)
        if isinstance(event, StageReadyEvent):
            return replace(run, ready=run.ready | {event.stage}), []
        raise _reject(run, event)

    if phase is P.WAITING_READY:
        if isinstance(event, StageReadyEvent):
            if event.stage in run.ready or event.stage >= run.stage_count:
                raise _reject(run, event)
            return _maybe_start(replace(run, ready=run.ready | {event.stage}), became_ready=True)
        if isinstance(event, Timeout) and event.kind == "ready":
            waiting = sorted(set(range(run.stage_count)) - run.ready)
            return _fault(
                run, f"readiness timeout: stage(s) {', '.join(map(str, waiting))} never became ready"
            )
        raise _reject(run, event)

    if phase is P.RUNNING:
        if isinstance(event, TokenConsumed):
            if event.sequence != run.consumed:
                return _fault(
                    run,
                    f"token sequence violation: expected {run.consumed}, got {event.sequence}",
                    "step",
                )
            run = replace(run, consumed=run.consumed + 1)
            accepted: list[RunEffect] = [CancelTimer("step"), AcceptToken(event.sequence, event.token)]
            if event.token in run.eog:
                return _complete(run, "eos", accepted)
            if run.consumed >= run.max_tokens:
                return _complete(run, "max_tokens", accepted)
            if run.ring:  # the last stage has fed it to stage 0 already
                return run, [*accepted, StartTimer("step")]
            return run, [*accepted, InjectToken(run.consumed, event.token), StartTimer("step")]
        if isinstance(event, StopRequested):
            return _complete(run, "stopped", [CancelTimer("step")])
        if isinstance(event, StageStoppedEvent):
            return _fault(run, f"stage {event.stage} stopped during the run", "step")
        if isinstance(event, Timeout) and event.kind == "step":
            return _fault(run, f"step timeout waiting for token {run.consumed}")
        raise _reject(run, event)

    if phase in (P.COMPLETED, P.FAULTED):
        if isinstance(event, Advance):
            return _teardown(run)
        raise _reject(run, event)

    if phase is P.TEARING_DOWN:
        if isinstance(event, StageStoppedEvent | StageLost):
            if event.stage not in run.provisioned:
                return run, [Note(f"stage {event.stage} was not provisioned")]
            run = replace(run, stopped=run.stopped | {event.stage})
            if run.provisioned <= run.stopped:
                return replace(run, phase=P.DONE), [CancelTimer("teardown"), Finish()]
            return run, []
        if isinstance(event, Timeout) and event.kind == "teardown":
            missing = sorted(run.provisioned - run.stopped)
            note = f"teardown timeout: no StageStopped from stage(s) {', '.join(map(str, missing))}"
            return replace(run, phase=P.DONE, notes=(*run.notes, note)), [Note(note), Finish()]
        if isinstance(event, StageFaultEvent):
            return run, [Note(f"stage {event.stage} faulted during teardown: {event.reason}")]
        if isinstance(event, TokenConsumed | StageReadyEvent | EdgeFault | StopRequested):
            return run, [Note(f"ignored {type(event).__name__} during teardown")]
        raise _reject(run, event)

    raise _reject(run, event)  # DONE is terminal
