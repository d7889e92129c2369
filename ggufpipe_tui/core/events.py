"""What the orchestrator reports to its views (the Textual app, headless mode,
the run log). Plain frozen dataclasses: the core knows nothing of Textual."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ggufpipe_agent.ids import RunId
from ggufpipe_agent.wire.protocol import Hello, ModelFacts, StepCounters


@dataclass(frozen=True, slots=True)
class AgentLog:
    """A line an agent wrote on stderr, or a line about it."""

    stage: int
    host: str
    line: str


@dataclass(frozen=True, slots=True)
class Notice:
    level: str  # "info", "warning", "error"
    text: str


@dataclass(frozen=True, slots=True)
class AgentConnected:
    stage: int
    host: str
    where: str
    hello: Hello


@dataclass(frozen=True, slots=True)
class AgentSetup:
    """Setting up stage ``stage``'s host with this orchestrator's agent (an
    SSH host whose entry names no agent:). ``state``: "setting up" (``detail``
    the step), then "done" (``how``: "pushed", "built there", "set up by
    another", "ready"; ``seconds``)."""

    stage: int
    host: str
    state: str
    detail: str = ""
    how: str = ""
    seconds: float = 0.0
    bytes_sent: int = 0


@dataclass(frozen=True, slots=True)
class ModelInspected:
    facts: ModelFacts


@dataclass(frozen=True, slots=True)
class DataPath:
    """How objects from stage ``producer`` reach stage ``consumer`` in this
    session: activations of edge producer -> producer + 1, or the token ring
    (the last stage -> stage 0). Decided once, when the data plane opens."""

    producer: int
    consumer: int
    data: str  # "direct" or "relay"
    transport: str  # "unix", "tls", "self" (a one-stage ring), "relay"
    endpoint: str = ""
    round_trip_ms: float = 0.0  # the probe's attach round trip
    reason: str = ""  # why it is relayed

    @property
    def ring(self) -> bool:
        return self.consumer <= self.producer


@dataclass(frozen=True, slots=True)
class PlanMade:
    plan: Any  # RunPlan (kept Any to avoid an import cycle with plan.py)
    hosts: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PromptAssigned:
    """The session gave a submitted prompt (its ``ticket``) to run ``run_id``."""

    run_id: RunId
    text: str
    ticket: int = 0


@dataclass(frozen=True, slots=True)
class RunPhaseChanged:
    run_id: RunId
    phase: str
    detail: str = ""


@dataclass(frozen=True, slots=True)
class StageStateChanged:
    run_id: RunId
    stage: int
    state: str
    detail: str = ""


@dataclass(frozen=True, slots=True)
class StageLoadProgress:
    run_id: RunId
    stage: int
    detail: str
    fraction: float


@dataclass(frozen=True, slots=True)
class StageDelivery:
    """Where sending stage ``stage``'s file to its host stands (model send:
    true). ``state``: "checking" (asking the host what it has, or computing
    the digest of what would be sent), "waiting" (another transfer is writing
    the same file there), "sending", "done". At most a few a second."""

    stage: int
    host: str
    state: str
    name: str  # the stage file's name in the host's cache
    size: int  # bytes of the whole stage file
    done: int  # bytes the host holds of it: what it had (a resume) and what was sent
    sent: int  # bytes sent to it by this session
    seconds: float  # since this stage's delivery began
    rate: float = 0.0  # bytes per second over the last few seconds (0 while not sending)
    outcome: str = ""  # once done: "sent", "resumed" (the host had a verified part) or "cached"

    @property
    def eta(self) -> float | None:
        """Seconds left at the current rate; None when unknown."""
        if self.state != "sending" or self.rate <= 0:
            return None
        return max(0.0, (self.size - self.done) / self.rate)


@dataclass(frozen=True, slots=True)
class StageStats:
    run_id: RunId
    stage: int
    counters: StepCounters


@dataclass(frozen=True, slots=True)
class TokenStreamed:
    run_id: RunId
    sequence: int
    token: int
    text: str
    #: (the token's logprob, ((id, logprob), ...) the likeliest) when the run
    #: asked for logprobs.
    logprobs: tuple[float, tuple[tuple[int, float], ...]] | None = None


@dataclass(frozen=True, slots=True)
class Timings:
    ttft_ms: float = 0.0  # prompt submitted -> first token consumed
    prefill_ms: float = 0.0  # prompt object injected -> token 0 consumed
    decode_ms: float = 0.0  # token 0 consumed -> last token consumed
    decode_tokens_per_s: float = 0.0
    stage_mean_step_ms: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class RunResult:
    run_id: RunId
    outcome: str  # "completed", "faulted", "torn down"
    stop_reason: str  # "eos", "max_tokens", "stopped" or ""
    failure: str
    prompt_tokens: tuple[int, ...]
    tokens: tuple[int, ...]
    text: str
    timings: Timings
    architecture: str = ""
    model: str = ""
    log_path: str = ""
    notes: tuple[str, ...] = field(default=())
    prompt_reused: int = 0  # leading prompt tokens kept from the previous run, not computed

    @property
    def prompt_computed(self) -> int:
        """Prompt tokens the stages computed (the prefill)."""
        return len(self.prompt_tokens) - self.prompt_reused

    @property
    def ok(self) -> bool:
        return self.outcome == "completed"


@dataclass(frozen=True, slots=True)
class RunFinished:
    result: RunResult


@dataclass(frozen=True, slots=True)
class StageRecovery:
    """A stage lost and its recovery (docs/recovery.md): ``state`` is "Lost",
    "Recovering", "Ready" (repaired: ``detail`` says how) or "Broken" (the
    session cannot go on: ``detail`` is the one reason)."""

    stage: int
    host: str
    state: str
    detail: str = ""
    at_token: int = -1  # tokens the run in flight had streamed at the loss (-1: no run)


@dataclass(frozen=True, slots=True)
class RunInterrupted:
    """A run that lost a stage and that recovery replays: it ends without a
    RunFinished; its replay (:class:`RunReplaying`) carries its prompt on."""

    run_id: RunId
    reason: str
    tokens: int  # tokens it streamed before the loss


@dataclass(frozen=True, slots=True)
class RunReplaying:
    """``run_id`` replays ``interrupted``: the first ``tokens`` it generates are
    checked against what was streamed and not streamed again."""

    run_id: RunId
    interrupted: int
    tokens: int


@dataclass(frozen=True, slots=True)
class RunRecovered:
    """The replay caught up: the next token streamed is a new one. Seconds
    of each part, from the loss report (``lost_at``, time.perf_counter())."""

    run_id: RunId
    interrupted: int
    stages: str  # who was lost: "stage 1 on gpu-b"
    how: str  # what the repair did: "restarted"
    at_token: int  # tokens streamed before the loss
    replayed: int  # positions computed again: the prompt and the tokens streamed (carried on in
    # proportion: the rebuilt stage's, and the step that goes on)
    lost_at: float
    teardown_s: float  # the interrupted run's teardown
    restart_s: float  # agents started again, model checked, data plane open
    load_s: float  # the replay run provisioned and its stages loaded
    replay_s: float  # the prompt injected to the last replayed token (carried on: to the next one)


Event = (
    AgentLog
    | Notice
    | AgentConnected
    | AgentSetup
    | ModelInspected
    | DataPath
    | PlanMade
    | PromptAssigned
    | RunPhaseChanged
    | StageStateChanged
    | StageLoadProgress
    | StageDelivery
    | StageStats
    | TokenStreamed
    | RunFinished
    | StageRecovery
    | RunInterrupted
    | RunReplaying
    | RunRecovered
)
Emit = Callable[[Event], None]
