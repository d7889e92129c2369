"""The run event log: one JSON Lines file per run.

Every event of a run (its plan, each state change of the run and of every
stage with a timestamp, agent log lines, faults, the final result) is one
line, so a faulted run's log says exactly what happened. The directory is
``$GGUFPIPE_LOG_DIR`` or ``~/.local/state/ggufpipe/runs``; it keeps the
newest :data:`MAX_RUN_LOGS` logs, within :data:`MAX_RUN_LOG_BYTES`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from pathlib import Path
from typing import IO

from ggufpipe_agent.errors import CacheError
from ggufpipe_agent.ids import RunId
from ggufpipe_agent.private_dirs import private_directory
from ggufpipe_agent.wire.protocol import to_plain
from ggufpipe_tui.core.events import AgentConnected, Event, PlanMade, RunFinished, StageStats, TokenStreamed


def default_log_dir() -> Path:
    explicit = os.environ.get("GGUFPIPE_LOG_DIR")
    if explicit:
        return Path(explicit).expanduser()
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "ggufpipe" / "runs"


#: How many run logs a directory keeps, and how many bytes the older ones
#: may take: a long session (a server's thousands of prompts) rotates them.
MAX_RUN_LOGS = 256
MAX_RUN_LOG_BYTES = 256 << 20
_NAME = re.compile(r"^\d{8}-\d{6}-[0-9a-f]{16}\.jsonl$")


class RunLog:
    """Events before the first run (agents connecting, the model) are kept
    and written at the top of every run's log.

    A log holds prompts and outputs: it is created 0600, in a directory of
    this user's that no one else may write in (made 0700 when it is not;
    refused, and the run goes on without a log, when another user owns it or
    group or others may write in it). Opening a run's log removes the oldest run logs
    of the directory beyond ``keep`` files or ``keep_bytes`` bytes (only
    files named like run logs; the current one never)."""

    def __init__(
        self,
        directory: Path | str | None = None,
        keep: int = MAX_RUN_LOGS,
        keep_bytes: int = MAX_RUN_LOG_BYTES,
    ) -> None:
        self.directory = Path(directory) if directory else default_log_dir()
        self.keep = max(1, keep)
        self.keep_bytes = keep_bytes
        self.path: Path | None = None  # the newest run's log
        self._files: dict[int, tuple[Path, IO[str]]] = {}  # the runs in flight: their logs
        self._session: list[str] = []
        self._opened = False
        self.disabled = ""

    def path_of(self, run_id: RunId) -> Path | None:
        """Run ``run_id``'s log while it is open."""
        opened = self._files.get(run_id)
        return opened[0] if opened is not None else None

    def open(self, run_id: RunId) -> None:
        """Run ``run_id``'s log: its own events go there; events of no run in
        flight (a notice, an agent's log line) go to every open log."""
        self.close(run_id)
        if self.disabled:
            return
        self._opened = True
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.path = path = self.directory / f"{stamp}-{run_id:016x}.jsonl"
        try:
            # Held to the stage cache's rules: this user's, written by no one else.
            private_directory(self.directory, "run-log directory", "--log-dir or $GGUFPIPE_LOG_DIR")
        except CacheError as error:
            self.disable(str(error))
            raise OSError(str(error)) from None
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
            file = os.fdopen(os.open(path, flags, 0o600), "w", encoding="utf-8")
            self._files[run_id] = (path, file)
            for line in self._session:
                file.write(line)
            file.flush()
        except OSError as error:
            self.disable(str(error))
            raise
        self._rotate()

    def _rotate(self) -> None:
        """Remove the oldest run logs past the directory's bounds."""
        logs = []
        current = {path.name for path, _ in self._files.values()}
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.directory):
                if _NAME.match(entry.name) and entry.is_file(follow_symlinks=False):
                    if entry.name in current:
                        continue
                    info = entry.stat(follow_symlinks=False)
                    logs.append((info.st_mtime_ns, entry.name, info.st_size))
        logs.sort()  # oldest first
        count, total = len(logs), sum(size for _, _, size in logs)
        for _, name, size in logs:
            # With the open ones: at most keep.
            if count + len(current) <= self.keep and total <= self.keep_bytes:
                break
            with contextlib.suppress(OSError):
                (self.directory / name).unlink()
            count, total = count - 1, total - size

    def disable(self, reason: str) -> None:
        """Stop logging (a full disk, an unwritable directory); runs go on."""
        self.disabled = reason
        for _, file in self._files.values():
            with contextlib.suppress(OSError):
                file.close()
        self._files.clear()

    def write(self, event: Event) -> None:
        fields = to_plain(event, text_bytes=True)
        record = {"t": round(time.time(), 6), "event": type(event).__name__, **fields}
        if isinstance(event, AgentConnected):
            record["hello"].pop("data_token", None)  # a capability, not for logs
        line = json.dumps(record, ensure_ascii=False, default=str) + "\n"
        if not self._files:
            # Before the first run (agents connecting, the model): kept for the
            # top of every run's log. Between runs: not part of any run.
            if not self._opened and len(self._session) < 10_000:
                self._session.append(line)
            return
        run_id = getattr(event, "run_id", None)
        if run_id is None and isinstance(event, RunFinished):
            run_id = event.result.run_id
        elif run_id is None and isinstance(event, PlanMade):
            run_id = event.plan.run_id
        own = self._files.get(run_id) if isinstance(run_id, int) else None
        for _, file in [own] if own is not None else list(self._files.values()):
            file.write(line)
            if not isinstance(event, TokenStreamed | StageStats):
                # Per-token events wait for the next flush: a syscall per token
                # is on the per-token path; everything else is flushed at once.
                file.flush()

    def close(self, run_id: RunId | None = None) -> None:
        """Close run ``run_id``'s log (None: every open one)."""
        runs = list(self._files) if run_id is None else [run_id]
        for run in runs:
            opened = self._files.pop(run, None)
            if opened is not None:
                opened[1].close()
