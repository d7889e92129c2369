"""Interleave benchmark (issue 38, "A new prompt does not stall the others"): K streams
running while a long prompt arrives, on ggufpipe's 2 stages beside llama.cpp's own
server, in one run.

    .venv/bin/python benchmarks/bench_interleave.py [--streams 4] [--prompt 2000]
        [--max-tokens 1024] [--after 32] [--rounds 3] [--quick] [--out docs/bench-interleave.md]

Measures, on this machine, with SmolLM2-135M Q4_1, greedy raw completions
(``ignore_eos: true``, ``cache_prompt: false``), from the client-side time of every
streamed chunk:
  * ggufpipe ``--serve --parallel K+1`` on 2 stages, layers [0, 15) and [15, 30), on 2
    local hosts with ``threads: 1`` each, 2560 positions per slot; llama.cpp's own server
    ``-t 2 --parallel K+1 -c (K+1) x 2560`` (its defaults otherwise: ``-b 2048 -ub 512``)
    beside it, the same client;
  * each round, on each server: K streams of --max-tokens tokens (distinct short prompts)
    alone (quiet: what the gaps are without a long prompt), then the same K streams with a
    --prompt-token prompt (token ids) sent once every stream has had --after chunks;
  * per stream: its largest gap between consecutive chunks over its median gap (the
    first chunk's wait not counted); the worst stream of each round; issue 38's target: at
    most 3x with the long prompt arriving. Also the long prompt's time to first token, and
    whether every stream was still running when the long prompt's first token came (if
    not, --max-tokens is too small to see the whole stall and the doc says so).
Rounds interleave the servers; medians of --rounds rounds. Writes --out (replaced) and
prints the same text.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_batched import PROMPTS  # noqa: E402
from benchmarks.serving import (  # noqa: E402
    Ggufpipe,
    LlamaServer,
    Process,
    llama_server_binary,
    local_inventory,
    machine,
    session,
    stream,
)
from tests.support.common import smollm_path  # noqa: E402
from tests.support.local import long_prompt  # noqa: E402

PER_SLOT = 2560  # positions per slot: the long prompt and the streams fit
CORES = os.cpu_count() or 1
TARGET = 3.0


def gaps(chunks: list[float]) -> list[float]:
    return [(b - a) * 1000.0 for a, b in zip(chunks, chunks[1:], strict=False)]


async def one_round(url: str, args: argparse.Namespace, prompt: list[int] | None) -> dict[str, Any]:
    """K streams, and with ``prompt`` that prompt sent once every stream has had
    ``args.after`` chunks."""
    async with session() as http:
        progress: list[list[float]] = [[] for _ in range(args.streams)]
        tasks = [
            asyncio.create_task(stream(http, url, PROMPTS[i], args.max_tokens, progress[i]))
            for i in range(args.streams)
        ]
        long: dict[str, Any] | None = None
        if prompt is not None:
            while min(len(p) for p in progress) < args.after:
                if any(t.done() for t in tasks):
                    break  # one failed or ended early: its error comes from gather
                await asyncio.sleep(0.01)
            sent = time.perf_counter()
            long = await stream(http, url, prompt, 4)
            long["sent"] = sent
        answers = await asyncio.gather(*tasks)
    streams = []
    for answer in answers:
        g = gaps(answer["chunks"])
        worst = max(g) if g else 0.0
        middle = statistics.median(g) if g else 0.0
        streams.append(
            {
                "ratio": worst / middle if middle else 0.0,
                "max_ms": worst,
                "median_ms": middle,
                "tokens": answer["tokens"],
                "first": answer["chunks"][0] if answer["chunks"] else 0.0,
                "last": answer["chunks"][-1] if answer["chunks"] else 0.0,
            }
        )
    result: dict[str, Any] = {"streams": streams, "worst": max(s["ratio"] for s in streams)}
    if long is not None:
        first = long["chunks"][0] if long["chunks"] else long["done"]
        result["long_ttft_ms"] = long["ttft_ms"]
        # Every stream had its first chunk before the long prompt was sent and its
        # last after the long prompt's first token: the whole prefill fell inside it.
        result["covered"] = all(s["first"] < long["sent"] and s["last"] > first for s in streams)
    return result


def measure(servers: list[Process], args: argparse.Namespace) -> dict[str, dict[str, list[dict[str, Any]]]]:
    prompt = long_prompt(smollm_path(), args.prompt)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        s.name: {"quiet": [], "loaded": []} for s in servers
    }

    async def warm(url: str) -> None:
        async with session() as http:
            await stream(http, url, "Hello", 4)

    for server in servers:
        asyncio.run(warm(server.url))
    for number in range(args.rounds):
        for server in servers:
            for kind in ("quiet", "loaded"):
                time.sleep(args.pause)
                done = asyncio.run(one_round(server.url, args, prompt if kind == "loaded" else None))
                results[server.name][kind].append(done)
                extra = f", long prompt's TTFT {done['long_ttft_ms']:.0f} ms" if kind == "loaded" else ""
                print(
                    f"round {number + 1}/{args.rounds} {server.name} {kind}: worst stream's largest gap "
                    f"{done['worst']:.1f}x its median{extra}",
                    file=sys.stderr,
                    flush=True,
                )
    return results


def report(results: dict[str, dict[str, list[dict[str, Any]]]], args: argparse.Namespace) -> str:
    lines = [
        "# Interleave benchmark",
        "",
        f"`{args.command}` on {machine()}; load average {args.load_start:.2f} at the start, "
        f"{args.load_end:.2f} at the end (a shared machine: numbers are only comparable within one run); "
        f"{args.date}, {args.elapsed:.0f} s in all.",
        "",
        f"SmolLM2-135M Q4_1. Each round, on each server: {args.streams} streams of {args.max_tokens} tokens "
        "(greedy raw completions, `ignore_eos: true`, distinct short prompts) alone (**quiet**), then the same "
        f"streams with a {args.prompt:,}-token prompt (token ids, `cache_prompt: false`, 4 tokens) sent once "
        f"every stream has had {args.after} chunks (**loaded**). Per stream, from the client-side time of "
        "every streamed chunk: its largest gap between consecutive chunks over its median gap (its first "
        "chunk's wait not counted); per round the worst stream; medians (and the largest) over "
        f"{args.rounds} round{'s' if args.rounds > 1 else ''}. Issue 38's target, loaded: at most {TARGET:.0f}x.",
        "",
        f"- **ggufpipe**: `--serve --parallel {args.streams + 1}` on 2 stages, layers [0, 15) and [15, 30), 2 "
        f"local hosts with `threads: 1` each (each stage its own core here), {PER_SLOT} positions per slot.",
        f"- **llama-server**: llama.cpp's own server, `-t {args.threads} --parallel {args.streams + 1} -c "
        f"{(args.streams + 1) * PER_SLOT}`, its defaults otherwise (`-b 2048 -ub 512`: a prompt of up to "
        "2,048 tokens goes into one `llama_decode` beside the streams' rows).",
        "",
        "| server | quiet: worst stream's max / median gap | median gap ms | loaded: worst stream's max / median "
        "gap (largest) | median gap ms | largest gap ms | long prompt's TTFT ms | target met | streams ran "
        "through the prefill |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for name, kinds in results.items():
        quiet, loaded = kinds["quiet"], kinds["loaded"]
        q = statistics.median(r["worst"] for r in quiet)
        q_gap = statistics.median(s["median_ms"] for r in quiet for s in r["streams"])
        worst = [r["worst"] for r in loaded]
        gap = statistics.median(s["median_ms"] for r in loaded for s in r["streams"])
        largest = statistics.median(max(s["max_ms"] for s in r["streams"]) for r in loaded)
        ttft = statistics.median(r["long_ttft_ms"] for r in loaded)
        met = "yes" if statistics.median(worst) <= TARGET else "no"
        covered = sum(r["covered"] for r in loaded)
        lines.append(
            f"| {name} | {q:.1f}x | {q_gap:.0f} | {statistics.median(worst):.1f}x ({max(worst):.1f}x) | {gap:.0f} | "
            f"{largest:.0f} | {ttft:.0f} | {met} | {covered} of {len(loaded)} rounds |"
        )
    lines += ["", "## What the rows show", "", shown(results, args)]
    return "\n".join(lines) + "\n"


def shown(results: dict[str, dict[str, list[dict[str, Any]]]], args: argparse.Namespace) -> str:
    parts = []
    for name, kinds in results.items():
        loaded = kinds["loaded"]
        worst = statistics.median(r["worst"] for r in loaded)
        largest = statistics.median(max(s["max_ms"] for s in r["streams"]) for r in loaded)
        ttft = statistics.median(r["long_ttft_ms"] for r in loaded)
        parts.append(
            f"{name}: with the {args.prompt:,}-token prompt arriving, the worst stream's largest gap is "
            f"{worst:.1f}x its median gap ({largest:.0f} ms against a long prompt's time to first token of "
            f"{ttft:.0f} ms; target {TARGET:.0f}x: {'met' if worst <= TARGET else 'not met'})."
        )
        if not all(r["covered"] for r in loaded):
            parts.append(
                f"In some of {name}'s rounds a stream ended before the long prompt's first token: "
                "raise --max-tokens to see the whole stall."
            )
    parts.append(
        "A largest gap near the long prompt's time to first token means the streams stood still for the "
        "whole prefill, as llama-server's do: it puts a prompt of up to `-b` (2,048) tokens into one "
        "`llama_decode` beside the streams' rows. ggufpipe's stage 0 cuts a prompt that arrives beside "
        "streaming runs into chunks of about one decode batch's time (one row at least; docs/worker.md, "
        '"A new prompt beside the streams"), and every stage lets a waiting decode batch go before the '
        "prompt's next chunk, so the streams' steps go between the chunks, at the cost of the long prompt's "
        "own time to first token (the streams and the prompt share each stage about evenly, and a chunk of "
        "a row or two costs a whole step of its own). The quiet column is the machine's own noise floor: a "
        "target of 3x can only be told apart from noise where quiet is well below it."
    )
    return " ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=4, help="streams running (4)")
    parser.add_argument("--prompt", type=int, default=2000, help="tokens of the prompt that arrives (2000)")
    parser.add_argument(
        "--max-tokens", type=int, default=1024, help="tokens of each stream (1024: they run through the prefill)"
    )
    parser.add_argument(
        "--after", type=int, default=32, help="chunks every stream has had when the prompt is sent (32)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds; medians (3)")
    parser.add_argument("--pause", type=float, default=0.5, help="seconds between samples (0.5)")
    parser.add_argument(
        "--threads", type=int, default=CORES, help=f"llama-server's threads ({CORES}: the cores)"
    )
    parser.add_argument("--no-baseline", action="store_true", help="leave out llama-server")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 streams, 1,000 tokens, 1 round")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "bench-interleave.md")
    args = parser.parse_args()
    if args.quick:
        args.streams, args.prompt, args.max_tokens, args.rounds = 2, 1000, 160, 1
    if not 1 <= args.streams < len(PROMPTS) or args.rounds < 1 or args.max_tokens < 8:
        parser.error(f"--streams from 1 to {len(PROMPTS) - 1}, --rounds at least 1, --max-tokens at least 8")
    if args.prompt + 4 > PER_SLOT or args.max_tokens + 32 > PER_SLOT:
        parser.error(f"--prompt and --max-tokens must fit {PER_SLOT} positions")
    args.command = " ".join(["benchmarks/bench_interleave.py", *sys.argv[1:]])
    args.load_start = os.getloadavg()[0]
    args.date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the servers' teardown still runs
    began = time.monotonic()
    binary = "" if args.no_baseline else llama_server_binary()
    slots = args.streams + 1
    started: list[Process] = []
    codes: dict[str, int | None] = {}
    with tempfile.TemporaryDirectory(prefix="bench-interleave-") as folder:
        workdir = Path(folder)
        try:
            inventory = local_inventory([(0, 15), (15, 30)], PER_SLOT, args.max_tokens)
            started.append(
                Ggufpipe(f"ggufpipe --parallel {slots}", inventory, workdir, "--parallel", str(slots))
            )
            if binary:
                started.append(LlamaServer(binary, workdir, args.threads, slots, PER_SLOT))
            print("started the servers", file=sys.stderr, flush=True)
            results = measure(started, args)
        finally:
            for server in reversed(started):
                codes[server.name] = server.close()
    args.elapsed = time.monotonic() - began
    args.load_end = os.getloadavg()[0]
    text = report(results, args)
    print(text)
    failed = [
        f"{n} exited {c} after SIGTERM" for n, c in codes.items() if n.startswith("ggufpipe") and c != 0
    ]
    if failed:
        print("FAILED: " + "; ".join(failed) + f"; {args.out} not written", file=sys.stderr)
        raise SystemExit(1)
    args.out.write_text(text)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
