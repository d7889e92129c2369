"""The plain rows of what the terminal UI shows (kept by the reducer,
:mod:`ggufpipe_tui.views.viewstate`, drawn by the widgets): a stage's row, an
exchange of a prompt and its reply, a run's figures, and the styles of the
stages' states and the run's phases."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rich.text import Text

from ggufpipe_agent.ids import RunId
from ggufpipe_agent.wire.protocol import StepCounters
from ggufpipe_tui.core.events import RunResult, StageDelivery

STAGE_STYLES = {
    "Unprovisioned": "grey58",
    "Preparing": "bold yellow",
    "Ready": "bold green",
    "Executing": "bold cyan",
    "Faulted": "bold white on red3",
    "Stopping": "magenta",
    "Stopped": "grey58",
    "Lost": "bold white on red3",  # not an FSM state: the agent process is gone
    "Recovering": "bold black on yellow",  # not an FSM state: its agent is being started again
    "Broken": "bold white on red3",  # not an FSM state: recovery gave up
    "Setting up": "bold yellow",  # not an FSM state: its host is being given an agent
}
PHASE_STYLES = {
    "Connecting": "bold black on yellow",
    "Planning": "bold black on yellow",
    "Provisioning": "bold black on yellow",
    "WaitingReady": "bold black on dodger_blue1",
    "Running": "bold black on green3",
    "Completed": "bold black on green3",
    "Faulted": "bold white on red3",
    "TearingDown": "bold black on magenta",
    "Done": "bold black on grey62",
    "Closing": "bold black on magenta",
}


@dataclass
class StageRow:
    """What the table shows of one stage."""

    index: int
    host: str
    where: str = ""
    layers: tuple[int, int] | None = None
    estimated_bytes: int = 0  # what the stage needs where its layers go (the plan's estimate)
    available_bytes: int = 0  # what the plan may use there, shared by the host's stages; 0: unknown
    device: str = ""
    state: str = "Unprovisioned"
    connected: bool = False
    fault: str = ""
    load_detail: str = ""
    load_fraction: float | None = None
    counters: StepCounters | None = None
    delivery: StageDelivery | None = None  # sending its stage file (model send: true)
    activity: int = 0  # StageStats received while the run is running
    history: list[str] = field(default_factory=list)  # every state it passed through


@dataclass(eq=False)
class ExchangeView:
    """One prompt, its reply as it streamed in, and how its run ended."""

    prompt: str
    run_id: RunId | None = None
    parts: list[str] = field(default_factory=list)
    appended_at: list[float] = field(default_factory=list)  # time.monotonic() of each piece
    finished: bool = False
    summary: Text | None = None
    shown: bool = False  # in the output pane yet
    submitted: float = field(default_factory=time.perf_counter)  # for the time to first token
    recovered: list[str] = field(default_factory=list)  # a line per recovery of its run

    @property
    def text(self) -> str:
        return "".join(self.parts)


@dataclass
class RunStats:
    """One run as the header shows it: elapsed time and tokens per second."""

    run_id: RunId
    started: float
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    ended: float | None = None
    result: RunResult | None = None

    def elapsed(self, now: float) -> float:
        return (self.ended if self.ended is not None else now) - self.started

    def rate(self) -> float | None:
        if self.result is not None and self.result.timings.decode_tokens_per_s:
            return self.result.timings.decode_tokens_per_s
        first, last = self.first_token, self.last_token
        if first is not None and last is not None and last > first:
            return (self.tokens - 1) / (last - first)
        return None
