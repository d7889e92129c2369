"""The terminal UI against headless on the same pipeline: decode tokens/s and
what the orchestrator's process spends per token.

    .venv/bin/python benchmarks/bench_tui.py [--repeats 3] [--tokens 256] [--data direct] [--feedback ring]

Three local stages of SmolLM2-135M; each round runs the same chat prompt
headless (a Pipeline with no view) and in the app (Textual's run_test, a
120x40 screen composed and rendered at its frame rate, not written to a
terminal), alternately. While the measured run streams, the harness waits
with a plain sleep: Textual's ``Pilot.pause`` forces a screen update and
walks every widget each time it is called, which no terminal does to the
app. Besides tokens/s (which the machine's other work moves), it reports
the orchestrator process's CPU time per generated token (user + system,
from getrusage), which does not depend on what else runs: on a machine with fewer cores than processes, every millisecond the view
spends is taken from the stages.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ggufpipe_agent import aio  # noqa: E402
from ggufpipe_tui.core.events import RunResult  # noqa: E402
from ggufpipe_tui.core.inventory import Inventory, parse_inventory, with_run_options  # noqa: E402
from ggufpipe_tui.session.pipeline import Pipeline  # noqa: E402
from tests.support.common import smollm_path  # noqa: E402

PROMPT = "Count slowly from one to one thousand, one number per line."


async def settle(condition: Callable[[], object], timeout: float, what: str) -> None:
    """Wait for ``condition`` without touching the app (see the module's doc)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0.05)


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def inventory(tokens: int, data: str, feedback: str) -> Inventory:
    text = (
        f"model: {{path: {smollm_path()}}}\n"
        "hosts: {here: {local: true}}\n"
        "stages: [{host: here}, {host: here}, {host: here}]\n"
        f"run: {{context: 2048, max_tokens: {tokens + 1}, ignore_eos: true, feedback: {feedback}}}\n"
        f"data: {data}\n"
    )
    return parse_inventory(text, REPO / "benchmarks" / "bench.yaml")


async def headless(inv: Inventory, log_dir: str) -> tuple[RunResult, float, float]:
    pipeline = Pipeline(inv, lambda event: None, log_dir=log_dir)
    try:
        await pipeline.start()
        warm = with_run_options(inv, max_tokens=4)
        pipeline.inventory = warm
        await pipeline.generate(PROMPT)
        pipeline.inventory = inv
        before, started = cpu(), time.perf_counter()
        result = await pipeline.generate(PROMPT)
        return result, cpu() - before, time.perf_counter() - started
    finally:
        await pipeline.close()


async def tui(inv: Inventory, log_dir: str) -> tuple[RunResult, float, float]:
    from ggufpipe_tui.views.app import GgufpipeApp
    from tests.support.app import ready_for_prompt, wait_for

    app = GgufpipeApp(inv, log_dir=log_dir)

    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: ready_for_prompt(app), 300, "the stages to load")
        await pilot.press(*PROMPT, "enter")  # a warm-up run, as headless has
        await wait_for(pilot, lambda: len(app.results) == 1, 300, "the warm-up run")
        await wait_for(pilot, lambda: ready_for_prompt(app), 300, "the stages to load")
        await pilot.press(*PROMPT)
        before, started = cpu(), time.perf_counter()
        await pilot.press("enter")
        await settle(lambda: len(app.results) == 2, 300, "the measured run")
        spent, elapsed = cpu() - before, time.perf_counter() - started
        result = app.results[1]
        await pilot.press("ctrl+q")
        await wait_for(pilot, lambda: app.return_code is not None, 60, "the app to quit")
    return result, spent, elapsed


async def synthetic(rate: float, seconds: float) -> tuple[float, int]:
    """The app alone, no pipeline: tokens (and step statistics, four a second
    per stage) posted at ``rate`` a second as the pipeline would; returns the
    process's CPU seconds per second of streaming and the tokens drawn."""
    from ggufpipe_agent.wire.protocol import StepCounters
    from ggufpipe_tui.core.events import StageStats, TokenStreamed
    from ggufpipe_tui.views.app import GgufpipeApp
    from tests.support.app import RUN_ID, inventory, running

    inv = inventory()
    app = GgufpipeApp(inv, script=running(inv))
    async with app.run_test(size=(120, 40)):
        await asyncio.sleep(0.5)
        emit = app._subscriber(app.session)  # the way a pipeline's events come in
        started, before = time.perf_counter(), cpu()
        sequence = 100
        stats_every = max(1, round(rate / 4))
        while time.perf_counter() - started < seconds:
            text = f" {sequence}" if sequence % 8 else f" {sequence},\n"
            emit(TokenStreamed(RUN_ID, sequence, sequence, text))
            if sequence % stats_every == 0:
                for stage in range(3):
                    counters = StepCounters(sequence, 3.1, 3.1 * sequence, 100 * sequence, 100 * sequence)
                    emit(StageStats(RUN_ID, stage, counters))
            sequence += 1
            await asyncio.sleep(max(0.0, started + (sequence - 100) / rate - time.perf_counter()))
        elapsed = time.perf_counter() - started
        spent = cpu() - before
        await asyncio.sleep(0.5)  # the last frame, before the app goes
    return spent / elapsed, sequence - 100


async def main_async(args: argparse.Namespace) -> int:
    if args.synthetic:
        load, tokens = await synthetic(args.synthetic, args.seconds)
        print(f"the app alone at {args.synthetic:g} tokens/s: {load * 100:.1f}% of a core "
              f"({load / args.synthetic * 1000:.2f} ms CPU per token, {tokens} tokens)")
        return 0
    log_dir = tempfile.mkdtemp(prefix="ggufpipe-bench-tui-")
    inv = inventory(args.tokens, args.data, args.feedback)
    # Per token and per second: the view's frames cost by the second, so its
    # CPU per token grows when the stages are slowed by other work.
    rows: dict[str, list[tuple[float, float, float]]] = {"headless": [], "TUI": []}
    for round_ in range(args.repeats):
        for name, run in (("headless", headless), ("TUI", tui)):
            result, spent, elapsed = await run(inv, log_dir)
            assert result.ok, result.failure
            rate = result.timings.decode_tokens_per_s
            per_token = spent / len(result.tokens) * 1000
            rows[name].append((rate, per_token, spent / elapsed))
            print(
                f"round {round_ + 1}: {name}: {rate:.1f} tok/s, orchestrator {per_token:.2f} ms CPU/token, "
                f"{spent / elapsed * 100:.1f}% of a core",
                flush=True,
            )
    load = os.getloadavg()[0]
    print(f"\n{args.data} data, {args.feedback} feedback, {args.tokens} tokens, load {load:.1f}")
    base = statistics.median(r for r, _, _ in rows["headless"])
    for name, samples in rows.items():
        rate = statistics.median(r for r, _, _ in samples)
        spent = statistics.median(c for _, c, _ in samples)
        core = statistics.median(f for _, _, f in samples)
        print(
            f"{name:8s} {rate:6.1f} tok/s ({rate / base:.3f} of headless), {spent:.2f} ms CPU per token, "
            f"{core * 100:.1f}% of a core"
        )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--data", default="direct")
    parser.add_argument("--feedback", default="ring")
    parser.add_argument(
        "--synthetic", type=float, default=0, metavar="RATE", help="the app alone, fed RATE tokens a second"
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="how long --synthetic streams")
    return aio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
