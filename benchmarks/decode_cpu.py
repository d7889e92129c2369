"""Run ggufpipe-tui (any mode, the same arguments) and append one line per run
to $DECODE_CPU_OUT: the orchestrator process's CPU time (all its threads,
user + system) from the run's first streamed token to its last, its decode
tokens/s and the number of tokens, as JSON.

    DECODE_CPU_OUT=cpu.jsonl .venv/bin/python benchmarks/decode_cpu.py INVENTORY [options]

This is what the view costs the stages on a machine whose cores they fill
(benchmarks/tui_terminal.sh): unlike tokens/s, it barely moves with the
machine's other work. The hook reads the process clock once per event.

With ``DECODE_CPU_UPDATES=1`` (the terminal UI), each line also has the CPU
time of every thread over the same window (``threads``, ms) and every screen
update Textual made in it (``updates``: ms after the first token, the
update's CPU ms on the UI thread, and what it redrew: the ids or classes of
the dirty widgets, ``L`` before them for a layout pass of the screen). That
is how a cost that lands in a reply's decode is found (docs/performance.md,
"sixth round").
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ggufpipe_tui.cli import main  # noqa: E402
from ggufpipe_tui.core.events import Event, RunFinished, TokenStreamed  # noqa: E402
from ggufpipe_tui.session.fanout import Fanout  # noqa: E402

OUT = os.environ.get("DECODE_CPU_OUT", "decode_cpu.jsonl")
UPDATES = os.environ.get("DECODE_CPU_UPDATES", "") not in ("", "0")
_first: dict[int, float] = {}
_last: dict[int, float] = {}
_emit = Fanout.emit  # every event of the session, the runs' too, goes out here
_ui_thread = threading.get_ident()  # the Textual loop runs on the main thread
_window: dict[str, Any] = {}  # the run decoding now: its start, threads' clocks, updates


def _thread_clocks() -> dict[str, float]:
    clocks = {}
    for thread in threading.enumerate():
        if thread.ident is not None:
            with contextlib.suppress(OSError, ProcessLookupError):  # a thread that just ended
                clocks[thread.name] = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    return clocks


def _trace_updates() -> None:
    from textual.screen import Screen

    update = Screen._on_timer_update

    def traced(self: Screen[Any]) -> None:
        if not _window or threading.get_ident() != _ui_thread:
            update(self)
            return
        dirty = ",".join(sorted(str(widget.id or type(widget).__name__) for widget in self._dirty_widgets))
        what = ("L " if self._layout_required else "") + dirty
        began, cpu = time.monotonic(), time.thread_time()
        update(self)
        spent = time.thread_time() - cpu
        _window["updates"].append([round((began - _window["wall"]) * 1000), round(spent * 1000, 1), what])

    Screen._on_timer_update = traced  # type: ignore[method-assign]


def emit(self: Fanout, event: Event) -> None:
    if isinstance(event, TokenStreamed):
        now = time.process_time()
        if event.run_id not in _first and UPDATES:
            _window.update(wall=time.monotonic(), clocks=_thread_clocks(), updates=[])
        _first.setdefault(event.run_id, now)
        _last[event.run_id] = now
    _emit(self, event)
    if isinstance(event, RunFinished):
        run = event.result.run_id
        first, last = _first.pop(run, None), _last.pop(run, None)
        if first is not None and last is not None:
            timings = event.result.timings
            line: dict[str, Any] = {
                "cpu_ms": round((last - first) * 1000, 1),
                "decode_tokens_per_s": timings.decode_tokens_per_s,
                "tokens": len(event.result.tokens),
            }
            if _window:
                before = _window["clocks"]
                line["threads"] = {
                    name: round((clock - before.get(name, 0.0)) * 1000, 1)
                    for name, clock in _thread_clocks().items()
                }
                line["updates"] = _window["updates"]
                _window.clear()
            with open(OUT, "a") as out:
                out.write(json.dumps(line) + "\n")


Fanout.emit = emit  # type: ignore[method-assign]
if UPDATES:
    _trace_updates()

if __name__ == "__main__":
    sys.argv[0] = "ggufpipe-tui"
    sys.exit(main())
