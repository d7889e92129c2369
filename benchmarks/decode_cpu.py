"""Run ggufpipe-tui (any mode, the same arguments) and append one line per run
to $DECODE_CPU_OUT: the orchestrator process's CPU time (all its threads,
user + system) from the run's first streamed token to its last, its decode
tokens/s and the number of tokens, as JSON.

    DECODE_CPU_OUT=cpu.jsonl .venv/bin/python benchmarks/decode_cpu.py INVENTORY [options]

This is what the view costs the stages on a machine whose cores they fill
(benchmarks/tui_terminal.sh): unlike tokens/s, it barely moves with the
machine's other work. The hook reads the process clock once per event.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ggufpipe_tui.cli import main  # noqa: E402
from ggufpipe_tui.core.events import Event, RunFinished, TokenStreamed  # noqa: E402
from ggufpipe_tui.session.pipeline import Pipeline  # noqa: E402

OUT = os.environ.get("DECODE_CPU_OUT", "decode_cpu.jsonl")
_first: dict[int, float] = {}
_last: dict[int, float] = {}
_emit = Pipeline.emit


def emit(self: Pipeline, event: Event) -> None:
    if isinstance(event, TokenStreamed):
        now = time.process_time()
        _first.setdefault(event.run_id, now)
        _last[event.run_id] = now
    _emit(self, event)
    if isinstance(event, RunFinished):
        run = event.result.run_id
        first, last = _first.pop(run, None), _last.pop(run, None)
        if first is not None and last is not None:
            timings = event.result.timings
            line = {
                "cpu_ms": round((last - first) * 1000, 1),
                "decode_tokens_per_s": timings.decode_tokens_per_s,
                "tokens": len(event.result.tokens),
            }
            with open(OUT, "a") as out:
                out.write(json.dumps(line) + "\n")


Pipeline.emit = emit  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.argv[0] = "ggufpipe-tui"
    sys.exit(main())
