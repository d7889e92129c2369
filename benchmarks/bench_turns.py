"""A multi-turn chat in the terminal UI, turn by turn, against llama.cpp
keeping its cache between the same turns, in one run.

    .venv/bin/python benchmarks/bench_turns.py [--turns 10] [--max-tokens 32] [--out docs/bench-turns.md]

The TUI half of the multi-turn benchmark (the ``--serve`` half is
benchmarks/bench_server.py's conversation, whose turns ``TURNS`` this one
types). The real app (Textual's ``run_test``, a 120x40 screen, as
benchmarks/bench_tui.py drives it) on a real pipeline: three local stages of
SmolLM2-135M, one agent process each, as in bench_tui.py (or ``--inventory``),
greedy, a reply of at most --max-tokens tokens. A warm-up prompt, ``ctrl+n``
(a new conversation), then each turn is typed and sent with Enter once the
stages are loaded and ready for it; the app sends the whole conversation so
far, and the stages keep what the previous run left (run.reuse: cache, the
default). While a turn runs the harness waits with plain sleeps, not
``Pilot.pause`` (see bench_tui.py's doc). Per turn, from the run's
``RunResult``: prompt tokens, kept (``prompt_reused``), computed, reply
tokens, and the run's time to first token (``timings.ttft_ms``: from the
app's Enter, the exchange's ``submitted``, to the first token consumed by the
orchestrator); and from the app: when the first token reached the app's view
state, and when the frame that draws it into the transcript ran.

The baseline, after the app has quit: llama-cpp-python's
``create_chat_completion`` on ONE ``Llama`` object that keeps its cache from
turn to turn (it keeps the longest common prefix, as llama-server does with
cache_prompt; bench_server.py's ``baseline_turns``), fed the same messages
the app sent, after the same warm-up. Writes a table and what it shows to
--out.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_server import TURNS, baseline_turns  # noqa: E402
from benchmarks.bench_tui import settle  # noqa: E402
from ggufpipe_agent import aio  # noqa: E402
from ggufpipe_tui.core.events import RunResult  # noqa: E402
from ggufpipe_tui.core.inventory import Inventory, load_inventory, parse_inventory, with_run_options  # noqa: E402
from tests.support.common import smollm_path  # noqa: E402

WARM_UP = "Hi"
RUN_TIMEOUT = 300.0


def inventory(args: argparse.Namespace) -> tuple[Inventory, Path, str]:
    """The inventory, the model's path (for the baseline) and a line saying what it is."""
    if args.inventory:
        inv = load_inventory(args.inventory)
        model = Path(inv.model_path)
        if not model.is_absolute():
            model = Path(inv.path).resolve().parent / model
        inv = with_run_options(inv, max_tokens=args.max_tokens, temperature=0.0, reuse="cache")
        split = ", ".join(f"{s.host}" + (f" {list(s.layers)}" if s.layers else "") for s in inv.stages)
        said = f"the inventory `{args.inventory}` ({len(inv.stages)} stages: {split})"
        return inv, model, said
    model = smollm_path()
    text = (
        f"model: {{path: '{model}'}}\n"
        "hosts: {here: {local: true}}\n"
        "stages: [{host: here}, {host: here}, {host: here}]\n"
        f"run: {{context: 2048, max_tokens: {args.max_tokens}, temperature: 0.0, reuse: cache}}\n"
    )
    said = (
        "three local stages as in benchmarks/bench_tui.py (one agent process each, layers split by "
        "the planner, data direct, feedback ring)"
    )
    return parse_inventory(text, REPO / "benchmarks" / "bench.yaml"), model, said


async def chat(inv: Inventory, turns: list[str], log_dir: str) -> list[dict[str, Any]]:
    """Each turn typed into the app; what its run and the app said of it."""
    from textual.widgets import Input

    from ggufpipe_tui.views.app import GgufpipeApp
    from tests.support.app import ready_for_prompt, wait_for

    app = GgufpipeApp(inv, log_dir=log_dir)
    drawn: dict[int, float] = {}  # id(exchange view) -> when a frame first drew its reply's text
    draw_text = app._draw_text

    def timed_draw_text() -> None:
        fresh = [view for view in app.state.touched.values() if view.parts and id(view) not in drawn]
        draw_text()
        now = time.perf_counter()
        for view in fresh:
            drawn[id(view)] = now

    app._draw_text = timed_draw_text  # type: ignore[method-assign]

    async def turn(text: str, after_run: int | None) -> tuple[RunResult, Any]:
        await wait_for(pilot, lambda: ready_for_prompt(app, after_run), RUN_TIMEOUT, "the stages to be ready")
        await pilot.press(*text)
        assert app.query_one("#prompt", Input).value == text
        count = len(app.results)
        await pilot.press("enter")
        await settle(lambda: len(app.results) > count, RUN_TIMEOUT, f"the run of {text!r}")
        result = app.results[count]
        assert result.ok, result.failure
        view = app.state.exchanges[result.run_id]
        return result, view

    rows = []
    async with app.run_test(size=(120, 40)) as pilot:
        warm, _ = await turn(WARM_UP, None)
        await pilot.press("ctrl+n")  # the turns are a conversation of their own
        last = warm.run_id
        for text in turns:
            result, view = await turn(text, last)
            last = result.run_id
            app_ms = (view.appended_at[0] - view.submitted) * 1000.0 if view.appended_at else 0.0
            screen_ms = (drawn[id(view)] - view.submitted) * 1000.0 if id(view) in drawn else 0.0
            rows.append(
                {
                    "text": text,
                    "reply": result.text,
                    "prompt_tokens": len(result.prompt_tokens),
                    "kept": result.prompt_reused,
                    "computed": result.prompt_computed,
                    "reply_tokens": len(result.tokens),
                    "stop": result.stop_reason,
                    "ttft_ms": result.timings.ttft_ms,
                    "app_ms": app_ms,
                    "screen_ms": screen_ms,
                }
            )
            print(
                f"turn {len(rows)}: {rows[-1]['prompt_tokens']} prompt tokens, {result.prompt_reused} kept, "
                f"{len(result.tokens)} reply tokens, first token {result.timings.ttft_ms:.0f} ms "
                f"(on screen {screen_ms:.0f} ms)",
                flush=True,
            )
        await pilot.press("ctrl+q")
        await wait_for(pilot, lambda: app.return_code is not None, 60, "the app to quit")
    return rows


def conversations(rows: list[dict[str, Any]]) -> list[list[dict[str, str]]]:
    """The messages the app sent at each turn (every kept turn, then the new one)."""
    sent, kept = [], []
    for row in rows:
        sent.append([*kept, {"role": "user", "content": row["text"]}])
        kept += [{"role": "user", "content": row["text"]}, {"role": "assistant", "content": row["reply"]}]
    return sent


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def halves(values: list[float]) -> tuple[float, float]:
    """Medians of the follow-up turns' first and second halves (turns 2-5 and 6-10 of 10)."""
    later = values[1:]
    return median(later[: len(later) // 2]), median(later[len(later) // 2 :])


def slope(rows: list[dict[str, Any]], values: list[float]) -> float:
    """Least squares: ms of first token per 100 more prompt tokens, over the follow-up turns."""
    x = [float(row["prompt_tokens"]) for row in rows[1:]]
    y = values[1:]
    if len(x) < 2 or len(set(x)) < 2:
        return 0.0
    return statistics.linear_regression(x, y).slope * 100.0


def verdict(ratio: float) -> str:
    return "flat" if ratio <= 1.2 else "growing"


def report(rows: list[dict[str, Any]], base: list[float], args: argparse.Namespace) -> str:
    n = len(rows)
    mid = 1 + (n - 1) // 2
    span = f"turns 2-{mid}" if mid > 2 else "turn 2"
    later = f"turns {mid + 1}-{n}" if n > mid + 1 else f"turn {n}"
    ttft = [row["ttft_ms"] for row in rows]
    screen = [row["screen_ms"] for row in rows]
    lines = [
        "# Multi-turn benchmark: the terminal UI",
        "",
        f"`{args.command}` on {platform.machine()}, {os.cpu_count()} cores (Python {platform.python_version()}), "
        f"{args.date}, load average {args.load_start:.2f} at the start and {args.load_end:.2f} at the end "
        "(a shared machine: numbers are only comparable within one run). SmolLM2-135M Q4_1, greedy, "
        f"replies of at most {args.max_tokens} tokens, {args.said}.",
        "",
        "One conversation of "
        f"{n} turns typed into the app (Textual's `run_test`, the real app on a real pipeline, after a "
        "warm-up prompt and `ctrl+n`), each sent with Enter once the stages are ready for it: the app sends "
        "the whole conversation, and the stages keep what the previous run left (run.reuse: cache). "
        "*First token (run)* is the run's own time to first token (`RunResult.timings.ttft_ms`: from the "
        "app's Enter to the first token consumed by the orchestrator); *on screen* is from the same Enter to "
        "the frame that draws it into the transcript. The baseline is llama-cpp-python's "
        "`create_chat_completion` on one `Llama` object keeping its cache between the same turns (the same "
        "messages, the same warm-up first), threads = cores. The ratio is first token (run) over the baseline.",
        "",
        "| turn | prompt tokens | kept | computed | reply tokens | first token ms (TUI run) "
        "| first token ms (on screen) | llama.cpp keeping its cache, ms | ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for index, (row, base_ms) in enumerate(zip(rows, base, strict=True), 1):
        ratio = f"{row['ttft_ms'] / base_ms:.2f}x" if base_ms else "-"
        lines.append(
            f"| {index} | {row['prompt_tokens']} | {row['kept']} | {row['computed']} | {row['reply_tokens']} | "
            f"{row['ttft_ms']:.0f} | {row['screen_ms']:.0f} | {base_ms:.0f} | {ratio} |"
        )
    lines += ["", "## What the rows show", ""]
    if n < 3:
        lines.append("Fewer than 3 turns: no follow-up turns to compare.")
        return "\n".join(lines) + "\n"
    follow = rows[1:]
    computed = [row["computed"] for row in follow]
    early, late = halves(ttft)
    early_screen, late_screen = halves(screen)
    base_early, base_late = halves(base)
    flat = late / early if early else 0.0
    base_flat = base_late / base_early if base_early else 0.0
    screen_flat = late_screen / early_screen if early_screen else 0.0
    lag = median([row["screen_ms"] - row["ttft_ms"] for row in rows])
    in_app = median([row["app_ms"] - row["ttft_ms"] for row in rows])
    drawn = median([row["screen_ms"] - row["app_ms"] for row in rows])
    but = f"{min(computed)}" if min(computed) == max(computed) else f"{min(computed)}-{max(computed)}"
    ratio = median([row["ttft_ms"] / b for row, b in zip(rows[1:], base[1:], strict=True) if b])
    growth = follow[-1]["prompt_tokens"] / follow[0]["prompt_tokens"] if follow[0]["prompt_tokens"] else 0.0
    lines += [
        f"The prompt grows from {follow[0]['prompt_tokens']} tokens at turn 2 to {follow[-1]['prompt_tokens']} "
        f"at turn {n} ({growth:.1f}x); each follow-up keeps all but {but} of them "
        f"and computes only those (median {median([float(c) for c in computed]):.0f}).",
        "",
        f"First token, median of {span} against {later}: the TUI's run {early:.0f} -> {late:.0f} ms "
        f"({flat:.2f}x), on screen {early_screen:.0f} -> {late_screen:.0f} ms ({screen_flat:.2f}x), llama.cpp "
        f"keeping its cache {base_early:.0f} -> {base_late:.0f} ms ({base_flat:.2f}x). Fitted over the "
        f"follow-up turns, the first token moves {slope(rows, ttft):+.1f} ms per 100 more prompt tokens "
        f"in the TUI and {slope(rows, base):+.1f} ms in llama.cpp. By the ratio of medians (within 1.2x "
        f"counts as flat; the prompt grows {growth:.1f}x) the TUI's first token is "
        f"{verdict(flat)} in the conversation's length, and llama.cpp's is {verdict(base_flat)}.",
        "",
        f"Over the follow-up turns the TUI's first token is a median {ratio:.2f}x llama.cpp's in one process. "
        f"On screen the first token comes a median {lag:.0f} ms after the run has it: it reaches the app's "
        f"view state {in_app:.0f} ms after the run and is drawn {drawn:.0f} ms after that (medians). A token "
        "that comes while a frame is due waits for that frame, in the pipeline's thread, and frames are at "
        "least views/drawing.py's FRAME_SECONDS (0.2 s) apart.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", default="docs/bench-turns.md")
    parser.add_argument(
        "--inventory", help="an inventory instead of three local stages (its model is the baseline's)"
    )
    args = parser.parse_args()
    args.command = shlex.join([".venv/bin/python", "benchmarks/bench_turns.py", *sys.argv[1:]])
    args.date = time.strftime("%Y-%m-%d %H:%M %Z")
    args.load_start = os.getloadavg()[0]
    inv, model, args.said = inventory(args)
    turns = [TURNS[index % len(TURNS)] for index in range(args.turns)]
    log_dir = tempfile.mkdtemp(prefix="ggufpipe-bench-turns-")
    started = time.perf_counter()
    rows = aio.run(chat(inv, turns, log_dir))
    warm = [{"role": "user", "content": WARM_UP}]
    base = baseline_turns(model, [warm, *conversations(rows)], args.max_tokens)[1:]
    args.load_end = os.getloadavg()[0]
    text = report(rows, base, args)
    print(text)
    print(f"({time.perf_counter() - started:.0f} s)")
    out = Path(args.out)
    if not out.is_absolute():
        out = REPO / out
    out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
