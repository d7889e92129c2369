"""Where the session's events go: the run log (session/runlog.py), every
subscriber (the views), and a run's events to the handle of the prompt it
runs (session/runs.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from ggufpipe_agent.ids import RunId
from ggufpipe_tui.core.events import Emit, Event, Notice, RunFinished, RunInterrupted, RunResult
from ggufpipe_tui.session.driver import RunDriver
from ggufpipe_tui.session.runlog import RunLog
from ggufpipe_tui.session.runs import RunHandle

log = logging.getLogger("ggufpipe.orchestrator")

#: A run's RunFinished result: what to say instead when the run is to be
#: replayed (recovery repairs the stage it lost), else None.
Interrupts = Callable[[RunResult], RunInterrupted | None]


class Fanout:
    def __init__(self, runlog: RunLog, emit: Emit | None = None) -> None:
        self.runlog = runlog
        self._subscribers: list[Emit] = [emit] if emit is not None else []
        self._handles: dict[int, RunHandle] = {}

    def subscribe(self, callback: Emit) -> Callable[[], None]:
        """``callback(event)`` for every event of the session; returns the unsubscribe."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback)

    def emit(self, event: Event) -> None:
        try:
            self.runlog.write(event)
        except OSError as error:  # a full disk must not stop the run
            self.runlog.disable(f"{error.strerror or error}")
            self.emit(Notice("warning", f"run log disabled: cannot write {self.runlog.path} ({error})"))
        for callback in list(self._subscribers):
            try:
                callback(event)
            except Exception:  # noqa: BLE001 - a view's bug must not break the run
                log.exception("event consumer failed")

    def open_log(self, run_id: RunId) -> None:
        try:
            self.runlog.open(run_id)
        except OSError as error:
            self.emit(Notice("warning", f"run log disabled: cannot write {self.runlog.path} ({error})"))

    def log_path(self, run_id: RunId) -> str:
        return "" if self.runlog.disabled else str(self.runlog.path_of(run_id) or "")

    def assign(self, handle: RunHandle, driver: RunDriver, replaces: int = 0) -> None:
        """``driver`` runs ``handle``'s prompt (instead of run ``replaces``):
        from now on its events also go there."""
        self._handles.pop(replaces, None)
        handle.driver, handle.run_id = driver, driver.plan.run_id
        self._handles[driver.plan.run_id] = handle

    def run_emitter(self, run_id: RunId, interrupts: Interrupts) -> Emit:
        """Run ``run_id``'s events: to the session and its handle; its
        RunFinished closes its log and, unless ``interrupts`` says it is to be
        replayed (the replay's RunFinished ends it), ends it."""

        def emit(event: Event) -> None:
            interrupted = interrupts(event.result) if isinstance(event, RunFinished) else None
            said = interrupted or event
            self.emit(said)
            handle = self._handles.get(run_id)
            if handle is not None:
                handle.push(said)
            if isinstance(event, RunFinished):
                self.runlog.close(run_id)  # a replay has a log of its own
                if interrupted is None:
                    self._handles.pop(run_id, None)

        return emit
