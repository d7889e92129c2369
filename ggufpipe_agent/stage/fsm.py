"""The stage FSM (docs/design.md, "Stage state machine"), as a pure function.

``transition(state, event) -> (state, effects)`` does no I/O; the agent
runtime (:mod:`ggufpipe_agent.process.runtime`) performs the effects and feeds the
resulting events back. An event the table does not allow in a state raises
:class:`TransitionError`.

Beyond the plain table: StopRun is authoritative for the active run in every
non-terminal state (docs/design.md, "Stage state machine" and "Security
model"), so it
also cancels a stage that is still Preparing and ends one that is Executing
(the runtime lets the running step finish or aborts a long prefill).

The token ring (direct stage-to-stage token feedback, docs/design.md, "Deferred, and where it went",
docs/rings.md): in a ring run, stage 0 has a third edge end (``ring-in``: its
inputs after the prompt come from the last stage) and the last stage has one
(``ring-out``); neither is Ready before it. The last stage decides, from its
provision, whether a sampled token goes round again (``FeedToken``) or ends
the generation (``EndGeneration`` at EOS/EOG or ``max_tokens``), so no step
runs past the stop, and it takes no object after that end.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from ggufpipe_agent.errors import TransitionError
from ggufpipe_agent.ids import NO_RUN, RunId


class StageState(Enum):
    UNPROVISIONED = "Unprovisioned"
    PREPARING = "Preparing"
    READY = "Ready"
    EXECUTING = "Executing"
    FAULTED = "Faulted"
    STOPPING = "Stopping"
    STOPPED = "Stopped"


# ----------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class Provision:
    """ProvisionStage arrived; ``problem`` is set when validation failed."""

    run_id: RunId
    problem: str = ""
    ring_in: bool = False  # stage 0 of a token ring
    ring_out: bool = False  # the last stage of a token ring
    eog: frozenset[int] = frozenset()  # ring_out: tokens that end the generation
    max_tokens: int = 0  # ring_out: tokens to generate at most


@dataclass(frozen=True, slots=True)
class WorkerBound:
    """Worker configured and the stage's GGUF range loaded."""


@dataclass(frozen=True, slots=True)
class EdgeEstablished:
    role: str  # "inbound", "outbound", "ring-in" or "ring-out"


@dataclass(frozen=True, slots=True)
class SetupFailed:
    reason: str


@dataclass(frozen=True, slots=True)
class ObjectLoaded:
    sequence: int


@dataclass(frozen=True, slots=True)
class StepCompleted:
    """A step of object ``sequence`` is done; ``more``: it was a part of the
    sequence that another part follows (a prompt's chunk), so the next
    object is still ``sequence``."""

    sequence: int
    more: bool = False


@dataclass(frozen=True, slots=True)
class TokenSampled:
    """The last stage of a token ring sampled ``token`` for ``sequence``
    (before its outputs are written)."""

    sequence: int
    token: int


@dataclass(frozen=True, slots=True)
class StepFailed:
    reason: str


@dataclass(frozen=True, slots=True)
class OutputFault:
    reason: str


@dataclass(frozen=True, slots=True)
class InboundFault:
    """An inbound object that does not fit the edge (shape, dtype, size, run)."""

    reason: str


@dataclass(frozen=True, slots=True)
class StopRunEvent:
    reason: str = ""


@dataclass(frozen=True, slots=True)
class StopComplete:
    """Local edges stopped and per-run device objects released."""


StageEvent = (
    Provision
    | WorkerBound
    | EdgeEstablished
    | SetupFailed
    | ObjectLoaded
    | StepCompleted
    | TokenSampled
    | StepFailed
    | OutputFault
    | InboundFault
    | StopRunEvent
    | StopComplete
)

# ---------------------------------------------------------------- effects


@dataclass(frozen=True, slots=True)
class StartPrepare:
    """Configure the worker and load/bind the range; await both edge ends."""


@dataclass(frozen=True, slots=True)
class CancelPrepare:
    pass


@dataclass(frozen=True, slots=True)
class EmitReady:
    pass


@dataclass(frozen=True, slots=True)
class EmitFault:
    reason: str


@dataclass(frozen=True, slots=True)
class ExecuteStep:
    sequence: int


@dataclass(frozen=True, slots=True)
class FeedToken:
    """Write ``token`` on the ring as stage 0's object ``sequence``."""

    sequence: int
    token: int


@dataclass(frozen=True, slots=True)
class EndGeneration:
    """The ring stops here: ``reason`` is "eos" or "max_tokens"."""

    reason: str


@dataclass(frozen=True, slots=True)
class ReleaseInput:
    sequence: int


@dataclass(frozen=True, slots=True)
class RejectWork:
    reason: str


@dataclass(frozen=True, slots=True)
class StopLocal:
    """Stop local edges, release per-run device objects, reset the worker."""


@dataclass(frozen=True, slots=True)
class EmitStopped:
    pass


StageEffect = (
    StartPrepare
    | CancelPrepare
    | EmitReady
    | EmitFault
    | ExecuteStep
    | FeedToken
    | EndGeneration
    | ReleaseInput
    | RejectWork
    | StopLocal
    | EmitStopped
)


@dataclass(frozen=True, slots=True)
class Stage:
    state: StageState = StageState.UNPROVISIONED
    run_id: RunId = NO_RUN
    worker_bound: bool = False
    inbound_ready: bool = False
    outbound_ready: bool = False
    next_sequence: int = 0
    fault: str = ""
    ring_in: bool = False  # a ring run's stage 0: needs its ring-in end
    ring_out: bool = False  # a ring run's last stage: needs its ring-out end, decides the stop
    ring_in_ready: bool = False
    ring_out_ready: bool = False
    eog: frozenset[int] = frozenset()
    max_tokens: int = 0
    ended: str = ""  # the ring's end ("eos", "max_tokens") once the last stage decided it

    @property
    def setup_complete(self) -> bool:
        ring = (self.ring_in_ready or not self.ring_in) and (self.ring_out_ready or not self.ring_out)
        return self.worker_bound and self.inbound_ready and self.outbound_ready and ring


def _reject(stage: Stage, event: object) -> TransitionError:
    return TransitionError(f"stage in {stage.state.value} does not accept {type(event).__name__}")


def _faulted(stage: Stage, reason: str) -> tuple[Stage, list[StageEffect]]:
    return replace(stage, state=StageState.FAULTED, fault=reason), [EmitFault(reason)]


def _stopping(stage: Stage, *first: StageEffect) -> tuple[Stage, list[StageEffect]]:
    return replace(stage, state=StageState.STOPPING), [*first, StopLocal()]


def transition(stage: Stage, event: StageEvent) -> tuple[Stage, list[StageEffect]]:
    S = StageState
    state = stage.state

    if state is S.UNPROVISIONED:
        if isinstance(event, Provision):
            provisioned = replace(
                stage,
                run_id=event.run_id,
                ring_in=event.ring_in,
                ring_out=event.ring_out,
                eog=event.eog,
                max_tokens=event.max_tokens,
            )
            if event.problem:
                return _faulted(provisioned, event.problem)
            return replace(provisioned, state=S.PREPARING), [StartPrepare()]
        raise _reject(stage, event)

    if state is S.PREPARING:
        if isinstance(event, WorkerBound | EdgeEstablished):
            if isinstance(event, WorkerBound):
                if stage.worker_bound:
                    raise _reject(stage, event)
                stage = replace(stage, worker_bound=True)
            elif event.role == "inbound" and not stage.inbound_ready:
                stage = replace(stage, inbound_ready=True)
            elif event.role == "outbound" and not stage.outbound_ready:
                stage = replace(stage, outbound_ready=True)
            elif event.role == "ring-in" and stage.ring_in and not stage.ring_in_ready:
                stage = replace(stage, ring_in_ready=True)
            elif event.role == "ring-out" and stage.ring_out and not stage.ring_out_ready:
                stage = replace(stage, ring_out_ready=True)
            else:
                raise _reject(stage, event)
            if stage.setup_complete:
                return replace(stage, state=S.READY), [EmitReady()]
            return stage, []
        if isinstance(event, SetupFailed | InboundFault):
            return _faulted(stage, event.reason)
        if isinstance(event, StopRunEvent):
            return _stopping(stage, CancelPrepare())
        raise _reject(stage, event)

    if state is S.READY:
        if isinstance(event, ObjectLoaded):
            if stage.ended:
                return _faulted(
                    stage, f"object {event.sequence} after the end of the generation ({stage.ended})"
                )
            if event.sequence != stage.next_sequence:
                return _faulted(
                    stage,
                    f"sequence violation: expected object {stage.next_sequence}, got {event.sequence}",
                )
            return replace(stage, state=S.EXECUTING), [ExecuteStep(event.sequence)]
        if isinstance(event, InboundFault):
            return _faulted(stage, event.reason)
        if isinstance(event, StopRunEvent):
            return _stopping(stage)
        raise _reject(stage, event)

    if state is S.EXECUTING:
        if isinstance(event, StepCompleted):
            if event.sequence != stage.next_sequence:
                raise _reject(stage, event)
            following = event.sequence if event.more else event.sequence + 1
            return (
                replace(stage, state=S.READY, next_sequence=following),
                [ReleaseInput(event.sequence)],
            )
        if isinstance(event, TokenSampled):
            if not stage.ring_out or stage.ended or event.sequence != stage.next_sequence:
                raise _reject(stage, event)
            generated = event.sequence + 1
            if event.token in stage.eog:
                return replace(stage, ended="eos"), [EndGeneration("eos")]
            if generated >= stage.max_tokens:
                return replace(stage, ended="max_tokens"), [EndGeneration("max_tokens")]
            return stage, [FeedToken(generated, event.token)]
        if isinstance(event, StepFailed | OutputFault | InboundFault):
            return _faulted(stage, event.reason)
        if isinstance(event, StopRunEvent):
            return _stopping(stage)
        raise _reject(stage, event)

    if state is S.FAULTED:
        if isinstance(event, ObjectLoaded | InboundFault):
            return stage, [RejectWork(f"stage is faulted ({stage.fault})")]
        if isinstance(event, StopRunEvent):
            return _stopping(stage)
        raise _reject(stage, event)

    if state is S.STOPPING:
        if isinstance(event, StopComplete):
            return replace(stage, state=S.STOPPED), [EmitStopped()]
        if isinstance(event, ObjectLoaded | InboundFault):
            return stage, [RejectWork("stage is stopping")]
        if isinstance(event, StopRunEvent | WorkerBound | EdgeEstablished | SetupFailed):
            return stage, []  # a late setup result or a repeated StopRun changes nothing
        if isinstance(event, StepCompleted | TokenSampled | StepFailed | OutputFault):
            return stage, []  # the step that was running when StopRun came
        raise _reject(stage, event)

    # STOPPED is terminal for this run; a repeated StopRun is answered again.
    if isinstance(event, StopRunEvent):
        return stage, [EmitStopped()]
    raise _reject(stage, event)
