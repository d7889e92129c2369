"""Requests that come and go (issue 38, batched decode in a server that keeps running): C
clients each sending R requests one after the other, of different lengths, on a server
of S slots, against the same C requests sent at once, on ggufpipe and on llama.cpp's own
server, in one run.

    .venv/bin/python benchmarks/bench_churn.py [--slots 16] [--clients 8] [--requests 6]
        [--rounds 2] [--out docs/bench-churn.md]

Measures, on this machine, with SmolLM2-135M Q4_1, greedy raw completions (``ignore_eos``,
``cache_prompt: false``), distinct prompts:
  * ggufpipe ``--serve --parallel S`` on 2 stages, layers [0, 15) and [15, 30), 2 local hosts
    with ``threads: 1`` each, 1024 positions per slot, ``GGUFPIPE_BATCH_TRACE`` on: every
    ``llama_decode`` of the last stage is recorded, so the report says how many ranges of
    neighbouring slots its decode batches held (llama.cpp computes a batch of several KV
    streams in one ubatch only where their sequence ids follow one another: a batch of k
    ranges is k graphs);
  * llama.cpp's own server ``-t cores --parallel S -c S x 1024``, the same clients;
  * two loads on each: *burst*, the C requests at once, 64 tokens each (every slot taken
    at once, in order); *churn*, C clients each sending R requests in turn, each of a length
    drawn from 16-128 tokens (seeded: the same on both servers), so runs end and start at
    other runs' steps and take whichever slot is free. Tokens/s: all completion tokens over
    the wall time from the first send to the last answer's end; medians of --rounds rounds,
    the rows interleaved in each round.
Writes --out (replaced) and prints the same text.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
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

from benchmarks.bench_batched import PER_SLOT, PROMPTS  # noqa: E402
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
from ggufpipe_tui.core.slots import ranges  # noqa: E402

CORES = os.cpu_count() or 1
BURST_TOKENS = 64
PIPE, SERVER = "ggufpipe", "llama-server"


def lengths(clients: int, requests: int, seed: int) -> list[list[int]]:
    """Each client's requests' lengths, 16-128 tokens, the same for every server."""
    rnd = random.Random(seed)
    return [[rnd.randint(16, 128) for _ in range(requests)] for _ in range(clients)]


async def burst(url: str, clients: int) -> dict[str, Any]:
    async with session() as http:
        started = time.perf_counter()
        answers = await asyncio.gather(*(stream(http, url, PROMPTS[i], BURST_TOKENS) for i in range(clients)))
    wall = max(a["done"] for a in answers) - started
    return {"tok_s": sum(a["tokens"] for a in answers) / wall}


async def churn(url: str, plan: list[list[int]]) -> dict[str, Any]:
    async with session() as http:

        async def client(number: int, sizes: list[int]) -> list[dict[str, Any]]:
            done = []
            for turn, size in enumerate(sizes):
                prompt = PROMPTS[(number * len(sizes) + turn) % len(PROMPTS)]
                done.append(await stream(http, url, prompt, size))
            return done

        started = time.perf_counter()
        answers = [
            a for each in await asyncio.gather(*(client(i, s) for i, s in enumerate(plan))) for a in each
        ]
    wall = max(a["done"] for a in answers) - started
    return {"tok_s": sum(a["tokens"] for a in answers) / wall}


def batches(trace: Path, since: float, until: float) -> list[list[int]]:
    """The slots of each decode batch of more than one row the last stage computed
    between ``since`` and ``until`` (monotonic s)."""
    if not trace.exists():
        return []
    found = []
    for line in trace.read_text().splitlines():
        record = json.loads(line)
        rows = record["rows"]
        if since <= record["t"] <= until and len(rows) > 1 and all(row[3] == 1 for row in rows):
            found.append([row[1] for row in rows])
    return found


def measure(pipe: Process, server: Process, trace: Path, args: argparse.Namespace) -> dict[str, Any]:
    for url in (pipe.url, server.url):
        asyncio.run(burst(url, 1))  # warm
    rows: dict[tuple[str, str], list[float]] = {}
    shapes: dict[str, list[list[int]]] = {"burst": [], "churn": []}
    for number in range(args.rounds):
        plan = lengths(args.clients, args.requests, seed=38 + number)
        for load in ("burst", "churn"):
            for name, target in ((PIPE, pipe), (SERVER, server)):
                time.sleep(0.5)
                since = time.monotonic()
                done = asyncio.run(
                    burst(target.url, args.clients) if load == "burst" else churn(target.url, plan)
                )
                if name == PIPE:
                    shapes[load] += batches(trace, since, time.monotonic())
                rows.setdefault((name, load), []).append(done["tok_s"])
                print(
                    f"round {number + 1}/{args.rounds} {load} {name}: {done['tok_s']:.1f} tok/s",
                    file=sys.stderr,
                    flush=True,
                )
    return {"tok_s": {key: statistics.median(values) for key, values in rows.items()}, "shapes": shapes}


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    tok_s, shapes = results["tok_s"], results["shapes"]
    lines = [
        "# Requests that come and go",
        "",
        f"`{args.command}` on {machine()}; load average {args.load_start:.2f} at the start, "
        f"{args.load_end:.2f} at the end (a shared machine: numbers are only comparable within one run); "
        f"{args.date}, {args.elapsed:.0f} s in all.",
        "",
        f"SmolLM2-135M Q4_1, greedy raw completions (`ignore_eos: true`, `cache_prompt: false`), distinct "
        f"prompts, servers of {args.slots} slots. *Burst*: {args.clients} requests at once, {BURST_TOKENS} "
        f"tokens each. *Churn*: {args.clients} clients each sending {args.requests} requests in turn, each "
        "16-128 tokens long (seeded, the same on both servers), so runs start and end while others decode. "
        f"Tokens/s: every completion token over the wall time; medians of {args.rounds} rounds, the rows "
        "interleaved.",
        "",
        f"- **ggufpipe**: `--serve --parallel {args.slots}` on 2 stages, layers [0, 15) and [15, 30), 2 local "
        f"hosts with `threads: 1` each, {PER_SLOT} positions per slot.",
        f"- **llama-server**: `-t {CORES} --parallel {args.slots} -c {args.slots} x {PER_SLOT}` (threads = "
        "cores), continuous batching, the same clients.",
        "",
        "| load | ggufpipe tok/s | llama-server tok/s | ggufpipe / llama-server | ggufpipe's decode batches "
        "(last stage, > 1 row) | rows a batch, mean | ranges of neighbouring slots a batch, mean / max |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for load in ("burst", "churn"):
        p, s, found = tok_s[(PIPE, load)], tok_s[(SERVER, load)], shapes[load]
        counted = [ranges(slots) for slots in found] or [0]
        rows = statistics.mean(len(slots) for slots in found) if found else 0.0
        lines.append(
            f"| {load} | {p:.1f} | {s:.1f} | {p / s:.2f} | {len(found)} | {rows:.1f} | "
            f"{statistics.mean(counted):.2f} / {max(counted)} |"
        )
    burst_ratio = tok_s[(PIPE, "burst")] / tok_s[(SERVER, "burst")]
    churn_ratio = tok_s[(PIPE, "churn")] / tok_s[(SERVER, "churn")]
    churned = [ranges(slots) for slots in shapes["churn"]] or [0]
    lines += [
        "",
        "## What the rows show",
        "",
        f"With requests coming and going ggufpipe makes {churn_ratio:.2f} of llama-server, against "
        f"{burst_ratio:.2f} when every request comes at once. A new prompt takes, among the free slots as "
        'good for its prefix, the one next to the slots in flight (docs/worker.md, "Batched decode"), so '
        f"under churn a decode batch of the last stage held {statistics.mean(churned):.2f} ranges of "
        "neighbouring slots on average (1 is one ubatch).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--slots", type=int, default=16, help="slots of each server (16)")
    parser.add_argument("--clients", type=int, default=8, help="clients at once (8)")
    parser.add_argument("--requests", type=int, default=6, help="requests each client sends in turn (6)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds; medians (2)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "bench-churn.md")
    args = parser.parse_args()
    if not 1 <= args.clients <= min(args.slots, len(PROMPTS)) or args.requests < 1 or args.rounds < 1:
        parser.error(f"--clients from 1 to --slots (and {len(PROMPTS)}), --requests and --rounds at least 1")
    args.command = " ".join(["benchmarks/bench_churn.py", *sys.argv[1:]])
    args.load_start = os.getloadavg()[0]
    args.date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the servers' teardown still runs
    began = time.monotonic()
    started: list[Process] = []
    codes: dict[str, int | None] = {}
    with tempfile.TemporaryDirectory(prefix="bench-churn-") as folder:
        workdir = Path(folder)
        traced = workdir / "trace"
        traced.mkdir()
        os.environ["GGUFPIPE_BATCH_TRACE"] = str(traced)  # the local agents inherit it
        try:
            inventory = local_inventory([(0, 15), (15, 30)], PER_SLOT, 128)
            pipe = Ggufpipe(
                f"ggufpipe --parallel {args.slots}", inventory, workdir, "--parallel", str(args.slots)
            )
            started.append(pipe)
            del os.environ["GGUFPIPE_BATCH_TRACE"]
            server = LlamaServer(llama_server_binary(), workdir, CORES, args.slots, PER_SLOT)
            started.append(server)
            results = measure(pipe, server, traced / "stage-1.jsonl", args)
        finally:
            for process in reversed(started):
                codes[process.name] = process.close()
    args.elapsed = time.monotonic() - began
    args.load_end = os.getloadavg()[0]
    text = report(results, args)
    print(text)
    if codes.get(pipe.name) != 0:
        print(
            f"FAILED: {pipe.name} exited {codes.get(pipe.name)} after SIGTERM; {args.out} not written",
            file=sys.stderr,
        )
        raise SystemExit(1)
    args.out.write_text(text)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
