"""What the terminal UI shows, as plain state, and the reducer that keeps it.

:meth:`ViewState.apply` takes one session event and updates the state with
one small function per event type; it never touches a widget. What changed
for the screen (log lines to append, exchanges to mount or to update, whether
the stage table or the status line need drawing) is queued in the state and
drained by the app when it renders, so the app can coalesce many events into
one frame.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from rich.text import Text

from ggufpipe_agent.ids import RunId
from ggufpipe_tui.core import events as ev
from ggufpipe_tui.core import format as fmt
from ggufpipe_tui.core.inventory import Inventory
from ggufpipe_tui.core.recovery import recovery_line
from ggufpipe_tui.core.run_fsm import RunPhase
from ggufpipe_tui.views.rows import PHASE_STYLES, STAGE_STYLES, ExchangeView, RunStats, StageRow

#: What a long session keeps: the newest exchanges in the transcript (older
#: ones scroll out, their widgets unmounted), run records, and each stage's
#: state history. The log pane keeps its own last lines (widgets.LogPane).
MAX_EXCHANGES = 200
MAX_RUNS = 200
MAX_HISTORY = 64


class ViewState:
    def __init__(self, inventory: Inventory) -> None:
        hosts = inventory.hosts
        self.rows = [
            StageRow(index, stage.host, hosts[stage.host].where, stage.layers)
            for index, stage in enumerate(inventory.stages)
        ]
        self.session = 0
        self.session_phase: str | None = "Connecting"  # overrides the run phase when set
        self.session_started = 0.0
        self.run_id: RunId | None = None
        self.run_phase: str | None = None
        self.model_line = ""
        self.fault = ""
        self.prompt_active = False  # a prompt has been given to the current run
        self.queued = 0  # prompts waiting behind the current one
        self.exchanges: dict[int, ExchangeView] = {}  # by run id
        self.tickets: dict[int, ExchangeView] = {}  # submitted, by the session's ticket
        self.runs: dict[int, RunStats] = {}
        self.results: deque[ev.RunResult] = deque(maxlen=MAX_RUNS)
        self.shown: deque[ExchangeView] = deque()  # in the transcript, oldest first
        self.latest: RunStats | None = None
        self.agent_pids: dict[int, int] = {}
        self._load_detail: dict[int, str] = {}
        # What the screen has to catch up with (drained by the app).
        self.log: deque[tuple[int | None, Text]] = deque()
        self.mount: list[ExchangeView] = []
        self.unmount: list[ExchangeView] = []  # scrolled out of a long session
        self.touched: dict[int, ExchangeView] = {}
        self.dirty = True  # the stage table and the status line
        self._handlers: dict[type, Callable[[Any, float], None]] = {
            ev.AgentLog: self._agent_log,
            ev.TokenStreamed: self._token,
            ev.AgentConnected: self._connected,
            ev.AgentSetup: self._setup,
            ev.ModelInspected: self._model,
            ev.PlanMade: self._plan,
            ev.RunPhaseChanged: self._phase,
            ev.StageStateChanged: self._stage_state,
            ev.StageLoadProgress: self._load,
            ev.StageDelivery: self._delivery,
            ev.StageStats: self._stats,
            ev.RunFinished: self._finished,
            ev.Notice: self._notice,
            ev.PromptAssigned: self._prompt,
            ev.DataPath: self._data_path,
            ev.StageRecovery: self._recovery,
            ev.RunInterrupted: self._interrupted,
            ev.RunReplaying: self._replaying,
            ev.RunRecovered: self._recovered,
        }

    @property
    def running(self) -> bool:
        """A run is decoding: tokens stream, the frames keep to their budget."""
        return self.run_phase == RunPhase.RUNNING.value

    def apply(self, event: ev.Event, now: float) -> None:
        handler = self._handlers.get(type(event))
        if handler is not None:
            handler(event, now)

    def note(self, stage: int | None, line: Text) -> None:
        prefix = Text(f"[{stage}] " if stage is not None else "[·] ", style="bold dodger_blue1")
        self.log.append((stage, prefix + line))

    # ---------------------------------------------------- session (the app's)

    def new_session(self, now: float) -> None:
        self.session += 1
        self.session_phase = "Connecting"
        self.session_started = now
        self.fault = ""
        self.run_id, self.run_phase = None, None
        for row in self.rows:
            row.state, row.connected, row.fault, row.load_fraction = "Unprovisioned", False, "", None
            row.counters, row.activity, row.delivery = None, 0, None
            row.history.clear()
        self.agent_pids.clear()
        self.dirty = True

    def end_session(self, reason: str) -> None:
        self.session_phase = "Faulted"
        self.fault = reason
        self.prompt_active = False
        self.note(None, Text(f"session {self.session} stopped: {reason}", style="bold red"))
        self.note(None, Text("ctrl+r closes this pipeline and starts a fresh one", style="red"))
        self.dirty = True

    def mark_lost(self, stage: int, status: str) -> None:
        """A stage whose agent is gone (it cannot say so itself)."""
        row = self.rows[stage]
        if row.connected and row.state != "Lost":
            row.state, row.fault = "Lost", f"agent gone {status}".strip()
            self._record(row, "Lost")
            self.dirty = True

    def submitted(self, text: str) -> ExchangeView:
        """A prompt the user gave; it shows at once when it runs next, else
        when its turn comes (so each reply streams under its own prompt)."""
        view = ExchangeView(text)
        if not self.prompt_active and not self.queued:
            self.show(view)
        return view

    def show(self, view: ExchangeView) -> None:
        if not view.shown:
            view.shown = True
            self.mount.append(view)
            self.shown.append(view)
            self._scroll_out()

    def _scroll_out(self) -> None:
        """Past MAX_EXCHANGES, the oldest finished exchanges leave the
        transcript (and the state): a long session stays the same size."""
        excess = len(self.shown) - MAX_EXCHANGES
        if excess <= 0:
            return
        kept: deque[ExchangeView] = deque()
        for old in self.shown:
            if excess <= 0 or not old.finished:  # one still running (or waiting) stays
                kept.append(old)
                continue
            excess -= 1
            if old.run_id is not None and self.exchanges.get(old.run_id) is old:
                del self.exchanges[old.run_id]
            self.touched.pop(id(old), None)
            if old in self.mount:
                self.mount.remove(old)  # never drawn: nothing to unmount
            else:
                self.unmount.append(old)
        self.shown = kept

    @staticmethod
    def _record(row: StageRow, state: str) -> None:
        row.history.append(state)
        if len(row.history) > MAX_HISTORY:
            del row.history[: len(row.history) - MAX_HISTORY]

    # ------------------------------------------------------------- events

    def _agent_log(self, event: ev.AgentLog, now: float) -> None:
        self.note(event.stage, Text(event.line))

    def _token(self, event: ev.TokenStreamed, now: float) -> None:
        view = self.exchanges.get(event.run_id)
        if view is not None and event.text:
            view.parts.append(event.text)
            view.appended_at.append(time.monotonic())
            self.touched[id(view)] = view
        stats = self.runs.get(event.run_id)
        if stats is not None and event.sequence >= 0:
            stats.tokens += 1
            if stats.first_token is None:
                stats.first_token = now
            stats.last_token = now

    def _data_path(self, event: ev.DataPath, now: float) -> None:
        style = "yellow" if event.data == "relay" else "grey70"
        self.note(event.producer, Text(fmt.data_path_line(event), style=style))

    def _connected(self, event: ev.AgentConnected, now: float) -> None:
        row = self.rows[event.stage]
        # A stage recovery moved to a spare host is on that host now.
        row.connected, row.host, row.where = True, event.host, event.where
        row.device = fmt.device_name(event.hello)
        self.agent_pids[event.stage] = event.hello.pid
        self.note(event.stage, Text(fmt.agent_line(event), style="bold"))
        self.dirty = True

    def _model(self, event: ev.ModelInspected, now: float) -> None:
        hosts = len({row.host for row in self.rows})
        self.model_line = fmt.model_line(event.facts, len(self.rows), hosts)
        self.note(None, Text(f"model {self.model_line}", style="bold"))
        self.dirty = True

    def _plan(self, event: ev.PlanMade, now: float) -> None:
        self.run_id = event.plan.run_id
        self.session_phase = None
        self.run_phase = "Planning"
        self.note(None, Text(f"run {self.run_id:016x}: plan", style="bold"))
        for stage, row in zip(event.plan.stages, self.rows, strict=False):
            row.layers = (stage.layer_start, stage.layer_end_exclusive)
            row.estimated_bytes = stage.estimated_bytes
            row.available_bytes = stage.available_bytes
            row.state, row.fault, row.load_fraction = "Unprovisioned", "", None
            self.note(row.index, Text(f"  {fmt.stage_plan_line(stage)}"))
        self.dirty = True

    def _phase(self, event: ev.RunPhaseChanged, now: float) -> None:
        self.run_id, self.run_phase = event.run_id, event.phase
        if self.running:
            stats = RunStats(event.run_id, started=now)
            self.runs[event.run_id] = self.latest = stats
            while len(self.runs) > MAX_RUNS:
                del self.runs[next(iter(self.runs))]
            for row in self.rows:
                row.counters, row.activity = None, 0
        line = Text(f"run {event.run_id:016x} → ")
        line.append(f" {event.phase} ", style=PHASE_STYLES.get(event.phase, ""))
        if event.detail:
            line.append(f" {event.detail}")
        self.note(None, line)
        self.dirty = True

    def _stage_state(self, event: ev.StageStateChanged, now: float) -> None:
        row = self.rows[event.stage]
        row.state = event.state
        self._record(row, event.state)
        if event.state == "Preparing":
            row.load_fraction, row.fault = None, ""
            self._load_detail.pop(event.stage, None)
        if event.state == "Faulted":
            row.fault = event.detail
        self.note(event.stage, _state_line(f"stage {event.stage}", event.state, event.detail))
        self.dirty = True

    def _load(self, event: ev.StageLoadProgress, now: float) -> None:
        row = self.rows[event.stage]
        row.load_detail, row.load_fraction = event.detail, event.fraction
        if self._load_detail.get(event.stage) != event.detail:
            self._load_detail[event.stage] = event.detail
            self.note(event.stage, Text(f"stage {event.stage}: {event.detail}", style="grey70"))
        self.dirty = True

    def _setup(self, event: ev.AgentSetup, now: float) -> None:
        """A host being given its agent: the row says so, the log each step."""
        row = self.rows[event.stage]
        row.state = "Setting up" if event.state != "done" else "Unprovisioned"
        row.load_detail = event.detail if event.state != "done" else ""
        line = f"stage {event.stage} on {event.host}: {fmt.setup_line(event)}"
        self.note(event.stage, Text(line, style="bold" if event.state == "done" else "grey70"))
        self.dirty = True

    def _delivery(self, event: ev.StageDelivery, now: float) -> None:
        row = self.rows[event.stage]
        before = row.delivery
        row.delivery = event
        if before is None or before.state != event.state:  # the log gets each step, not each update
            line = f"stage {event.stage}: {event.name}: {fmt.delivery_line(event)}"
            self.note(event.stage, Text(line, style="bold" if event.state == "done" else "grey70"))
        self.dirty = True

    def _stats(self, event: ev.StageStats, now: float) -> None:
        row = self.rows[event.stage]
        row.counters = event.counters
        if self.running:
            row.activity += 1
        self.dirty = True

    def _notice(self, event: ev.Notice, now: float) -> None:
        style = {"error": "bold red", "warning": "yellow"}.get(event.level, "grey70")
        self.note(None, Text(f"{event.level}: {event.text}", style=style))

    def _prompt(self, event: ev.PromptAssigned, now: float) -> None:
        self.prompt_active = True
        view = self.tickets.pop(event.ticket, None) if event.ticket else None
        if view is None:  # a scripted prompt, or one submitted elsewhere
            view = ExchangeView(event.text)
        view.run_id = event.run_id
        self.show(view)
        self.touched[id(view)] = view
        self.exchanges[event.run_id] = view
        self.note(None, Text(f"run {event.run_id:016x}: prompt {event.text!r}", style="bold"))
        self.dirty = True

    def _recovery(self, event: ev.StageRecovery, now: float) -> None:
        """A lost stage: its row goes Lost -> Recovering -> Ready (or Broken)."""
        row = self.rows[event.stage]
        row.state = event.state
        row.fault = event.detail if event.state in ("Lost", "Broken") else ""
        self._record(row, event.state)
        self.note(event.stage, _state_line(f"stage {event.stage} on {event.host}", event.state, event.detail))
        self.dirty = True

    def _interrupted(self, event: ev.RunInterrupted, now: float) -> None:
        line = f"run {event.run_id:016x} interrupted after {event.tokens} tokens: {event.reason}"
        self.note(None, Text(line, style="bold yellow"))

    def _replaying(self, event: ev.RunReplaying, now: float) -> None:
        """The replay carries the interrupted run's exchange on."""
        view = self.exchanges.pop(event.interrupted, None)
        if view is not None:
            view.run_id = event.run_id
            self.exchanges[event.run_id] = view
        self.note(None, Text(f"run {event.run_id:016x} replays run {event.interrupted:016x}", style="bold"))

    def _recovered(self, event: ev.RunRecovered, now: float) -> None:
        line = recovery_line(event)
        view = self.exchanges.get(event.run_id)
        if view is not None:  # a line under the reply, which goes on
            view.recovered.append(line)
            view.summary = Text("; ".join(view.recovered), style="yellow")
            self.touched[id(view)] = view
        self.note(None, Text(line, style="bold yellow"))
        self.dirty = True

    def _finished(self, event: ev.RunFinished, now: float) -> None:
        result = event.result
        self.results.append(result)
        self.prompt_active = False
        stats = self.runs.get(result.run_id)
        if stats is not None:
            stats.ended, stats.result = now, result
        style = "bold red" if result.outcome == "faulted" else "grey58"
        summary = Text(fmt.result_summary(result), style=style)
        view = self.exchanges.get(result.run_id)
        if view is not None:
            if view.recovered:
                summary.append("\n" + "\n".join(view.recovered), style="yellow")
            view.finished, view.summary = True, summary
            self.touched[id(view)] = view
            self._scroll_out()
        line = Text(f"run {result.run_id:016x} {result.outcome}", style=style)
        self.note(None, line + Text(f": {result.failure}" if result.failure else f": {summary.plain}"))
        if result.log_path:
            self.note(None, Text(f"run log {result.log_path}", style="grey58"))
        if result.outcome == "faulted":  # the session stops here; the session loop agrees
            self.session_phase = "Faulted"
            self.fault = result.failure
        self.dirty = True

    # ----------------------------------------------------------- the header

    def hint(self, now: float) -> str:
        n = len(self.rows)
        if self.session_phase == "Connecting":
            sending = [row.delivery for row in self.rows if row.delivery is not None]
            if sending and any(d.state != "done" for d in sending):
                done, size = sum(d.done for d in sending), sum(d.size for d in sending)
                return f"sending stage files · {fmt.format_bytes(done)} of {fmt.format_bytes(size)}"
            connected = sum(row.connected for row in self.rows)
            return f"{connected}/{n} agents up · {fmt.format_seconds(now - self.session_started)}"
        if self.session_phase == "Closing":
            return "stopping every stage…"
        if self.session_phase == "Faulted":
            return "the pipeline stopped"
        ready = sum(row.state == "Ready" for row in self.rows)
        if self.run_phase in ("Planning", "Provisioning", "WaitingReady"):
            if ready < n:
                return f"loading: {ready}/{n} stages ready"
            return "starting…" if self.prompt_active else "ready for a prompt"
        if self.running:
            return "generating · esc stops" + (f" · {self.queued} queued" if self.queued else "")
        return ""


def _state_line(head: str, state: str, detail: str) -> Text:
    """A log line of a stage entering ``state``: ``stage 1 → Faulted: why``."""
    line = Text(f"{head} → ")
    line.append(state, style=STAGE_STYLES.get(state, ""))
    if detail:
        line.append(f": {detail}")
    return line
