"""Headless mode: the same orchestrator with a printing consumer.

Generated text streams to stdout as it comes; progress and agent logs go to
stderr; the exit status says whether the run completed. On a fault the text
produced so far stays on stdout and the run's one failure reason is the last
line on stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from typing import IO

from ggufpipe_agent.errors import GgufpipeError
from ggufpipe_tui.core import format as fmt
from ggufpipe_tui.core.events import DataPath, RunResult
from ggufpipe_tui.core.inventory import Inventory
from ggufpipe_tui.core.printer import EXIT_FAULTED, EXIT_OK, EXIT_SETUP, Printer
from ggufpipe_tui.session.pipeline import Pipeline
from ggufpipe_tui.session.runs import Prompt, RunHandle


def path_json(path: DataPath) -> dict[str, object]:
    """One link of the session: how stage ``producer``'s objects reach ``consumer``."""
    entry: dict[str, object] = {
        "producer": path.producer,
        "consumer": path.consumer,
        "carries": "tokens" if path.ring else "activations",
        "data": path.data,
        "transport": path.transport,
    }
    if path.data == "direct" and path.transport != "self":
        entry["round_trip_ms"] = round(path.round_trip_ms, 3)
    if path.reason:
        entry["reason"] = path.reason
    return entry


def result_json(result: RunResult, paths: tuple[DataPath, ...] = (), feedback: str = "") -> dict[str, object]:
    """The --json object; ``paths``: the session's links (one "data" entry per
    edge), ``feedback``: who fed tokens back ("ring" or "orchestrator")."""
    t = result.timings
    return {
        "run_id": f"{result.run_id:016x}",
        "model": result.model,
        "architecture": result.architecture,
        "outcome": result.outcome,
        "stop_reason": result.stop_reason,
        "failure": result.failure,
        "prompt_tokens": list(result.prompt_tokens),
        "prompt_reused": result.prompt_reused,
        "tokens": list(result.tokens),
        "text": result.text,
        "timings": {
            "ttft_ms": round(t.ttft_ms, 3),
            "prefill_ms": round(t.prefill_ms, 3),
            "decode_ms": round(t.decode_ms, 3),
            "decode_tokens_per_s": round(t.decode_tokens_per_s, 3),
            "stage_mean_step_ms": [round(ms, 3) for ms in t.stage_mean_step_ms],
        },
        "log": result.log_path,
        "feedback": feedback,
        "edges": [path_json(path) for path in paths],
    }


async def run_headless(
    inventory: Inventory,
    prompt: str,
    *,
    as_json: bool = False,
    verbose: bool = False,
    quiet: bool = False,
    log_dir: str | None = None,
    out: IO[str] = sys.stdout,
    err: IO[str] = sys.stderr,
) -> int:
    printer = Printer(inventory, out, err, as_json, verbose, quiet)
    pipeline = Pipeline(inventory, printer, log_dir=log_dir)
    loop = asyncio.get_running_loop()
    handle: RunHandle | None = None
    interrupted = False

    def interrupt() -> None:
        nonlocal interrupted
        if handle is not None and not interrupted:
            interrupted = True
            handle.stop("interrupted (Ctrl-C)")
        else:
            raise KeyboardInterrupt

    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGINT, interrupt)
    try:
        await pipeline.start()
        handle = pipeline.submit(Prompt(text=prompt))
        result = await handle.result()
    except GgufpipeError as error:
        print(f"ggufpipe: error: {error}", file=err, flush=True)
        return EXIT_SETUP
    finally:
        await pipeline.close()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(signal.SIGINT)
    if as_json:
        report = result_json(result, tuple(printer.paths), inventory.run.feedback)
        report["setup"] = printer.setup_json()  # hosts given an agent by this run; [] for none
        report["delivery"] = printer.delivery_json()  # model send: true; [] when hosts hold the model
        report["processes"] = printer.processes_json()  # stages sharing an agent process: one entry
        report["recoveries"] = printer.recoveries_json()  # lost stages recovered; [] for none
        print(json.dumps(report, ensure_ascii=False), file=out, flush=True)
    elif printer.wrote_text:
        print(file=out, flush=True)
    if result.ok:
        printer.progress(f"{fmt.result_summary(result)}; run log {result.log_path}")
        return EXIT_OK
    print(f"ggufpipe: run log {result.log_path}", file=err, flush=True)
    print(f"ggufpipe: run {result.outcome}: {result.failure}", file=err, flush=True)
    return EXIT_FAULTED
