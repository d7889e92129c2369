"""Batched decode benchmark (issue 38, "Batched decode across runs in flight"): K requests
at once on ggufpipe's 2 stages against llama.cpp's own server with ``--parallel K`` and
against one llama.cpp context decoding the K sequences batched, in one run.

    .venv/bin/python benchmarks/bench_batched.py [--ks 1 2 4 8 16 32] [--max-tokens 64]
        [--rounds 3] [--quick] [--out docs/bench-batched.md]

Measures, on this machine, with SmolLM2-135M Q4_1, greedy raw completions of exactly
--max-tokens tokens each (``ignore_eos: true``), distinct prompts, every prompt computed
cold (``cache_prompt: false``):
  * ggufpipe ``--serve --parallel 32`` (max K) on 2 stages, layers [0, 15) and [15, 30), on
    2 local hosts with ``threads: 1`` each (each stage its own core here), 1024 positions
    per slot; one server for every K: K requests sent at once, tokens/s = their completion
    tokens over the wall time from the first send to the last answer's end; time to first
    token client side (send to first text chunk), median and max over the K requests;
  * llama.cpp's own server (scripts/build-llama-server), one per K, ``-t 2 --parallel K
    -c K x 1024`` (threads = cores: llama.cpp at its best here), the same client;
  * one llama.cpp context in this process (benchmarks/llama_batched.py), ``n_seq_max = K``,
    2 threads, the K prompts prefilled in one batch and then one ``llama_decode`` of K rows
    per step: what batching the runs in flight reaches on these cores, no HTTP; its time
    to first token is the batched prefill's;
  * whether each of ggufpipe's concurrent texts equals the same prompt's text alone on the
    same server (reported, not enforced: a batched step may round differently; issue 38
    item 4 says when a run must equal itself alone).
Rounds interleave every K and every row (round r: each K, each row in turn), so the
machine's load drifts over all of them alike; medians of --rounds rounds. Issue 38's
target: at K = 8, ggufpipe at least 0.85 of the batched llama.cpp context. Writes --out
(replaced) and prints the same text. bench_parallel.py (docs/bench-parallel.md) keeps its
own question (does a second stage fill, 0.8 x min(K, N)); this one asks how far batching
the runs in flight gets, against two references that batch.
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

from benchmarks.bench_parallel import PROMPTS as FIRST_PROMPTS  # noqa: E402
from benchmarks.llama_batched import BatchedContext  # noqa: E402
from benchmarks.serving import (  # noqa: E402
    Ggufpipe,
    LlamaServer,
    Process,
    llama_server_binary,
    local_inventory,
    machine,
    session,
    stream,
    tokenize,
)
from tests.support.common import smollm_path  # noqa: E402

PER_SLOT = 1024  # positions per slot, on the stages, in llama-server and in the batched context
CORES = os.cpu_count() or 1
TARGET_K, TARGET = 8, 0.85
PIPE = "ggufpipe"

#: 32 distinct prompts, no two starting alike: bench_parallel's 16 and 16 more.
PROMPTS = [
    *FIRST_PROMPTS,
    "Lighthouses were built on rocky coasts so that",
    "A good night's sleep improves",
    "The first bicycles had no pedals, so riders",
    "Coffee beans are roasted until",
    "Penguins survive the Antarctic winter by",
    "Mountains form where tectonic plates",
    "Libraries in ancient Alexandria held",
    "Wind turbines generate electricity when",
    "Children learn to read faster if",
    "Glaciers move slowly because",
    "Honey never spoils, which explains why",
    "The Roman road network allowed",
    "Submarines dive by filling tanks with",
    "Spiders spin webs from silk that",
    "Early maps of the world showed",
    "Sourdough bread rises because",
]


async def one_round(url: str, k: int, max_tokens: int) -> dict[str, Any]:
    async with session() as http:
        started = time.perf_counter()
        answers = await asyncio.gather(*(stream(http, url, PROMPTS[i], max_tokens) for i in range(k)))
    wall = max(a["done"] for a in answers) - started
    tokens = sum(a["tokens"] for a in answers)
    return {"tok_s": tokens / wall, "wall_s": wall, "answers": answers}


async def alone(url: str, k: int, max_tokens: int) -> list[str]:
    async with session() as http:
        await stream(http, url, "Hello", 4)  # warm
        return [(await stream(http, url, PROMPTS[i], max_tokens))["text"] for i in range(k)]


def measure(
    pipe: Process, servers: dict[int, Process], contexts: dict[int, BatchedContext], args: argparse.Namespace
) -> dict[str, Any]:
    top = max(args.ks)
    references = asyncio.run(alone(pipe.url, top, args.max_tokens))
    for server in servers.values():
        asyncio.run(alone(server.url, 1, 4))
    prompts = [tokenize(p) for p in PROMPTS[:top]]
    for context in contexts.values():
        context.run(prompts[:1], 4)  # warm
    rows: dict[str, dict[int, list[dict[str, Any]]]] = {
        name: {k: [] for k in args.ks} for name in (PIPE, "llama-server", "batched")
    }
    for number in range(args.rounds):
        for k in args.ks:
            for name in rows:
                time.sleep(args.pause)  # a server's work after the last round is done
                if name == "batched":
                    done = contexts[k].run(prompts[:k], args.max_tokens)
                else:
                    done = asyncio.run(
                        one_round((pipe if name == PIPE else servers[k]).url, k, args.max_tokens)
                    )
                rows[name][k].append(done)
                print(
                    f"round {number + 1}/{args.rounds} K={k} {name}: {done['tok_s']:.1f} tok/s",
                    file=sys.stderr,
                    flush=True,
                )
    return {"rows": rows, "references": references}


def summarise(rounds: list[dict[str, Any]], references: list[str] | None) -> dict[str, Any]:
    row: dict[str, Any] = {"tok_s": statistics.median(r["tok_s"] for r in rounds)}
    if "answers" in rounds[0]:
        answers = [(i, a) for r in rounds for i, a in enumerate(r["answers"])]
        ttfts = [a["ttft_ms"] for _, a in answers]
        row.update(ttft_median=statistics.median(ttfts), ttft_max=max(ttfts))
        row["tokens"] = sorted({a["tokens"] for _, a in answers})
        if references is not None:
            row["equal"] = sum(a["text"] == references[i] for i, a in answers)
            row["requests"] = len(answers)
    else:
        row.update(ttft_median=statistics.median(r["ttft_ms"] for r in rounds))
        row["decode_tok_s"] = statistics.median(r["decode_tok_s"] for r in rounds)
    return row


def threads_note(threads: int) -> str:
    if threads == CORES:
        return "threads = cores: llama.cpp at its best on a quiet machine"
    return (
        f"`--threads {threads}`, not the {CORES} cores: on a machine this busy llama.cpp's {CORES} threads wait "
        f"for each other at every op (its OpenMP team spins while a thread is off its core) and fall far "
        f"below one thread"
    )


def report(summary: dict[str, dict[int, dict[str, Any]]], args: argparse.Namespace) -> str:
    pipe, server, batched = summary[PIPE], summary["llama-server"], summary["batched"]
    lines = [
        "# Batched decode benchmark",
        "",
        f"`{args.command}` on {machine()}; load average {args.load_start:.2f} at the start, "
        f"{args.load_end:.2f} at the end (a shared machine: numbers are only comparable within one run); "
        f"{args.date}, {args.elapsed:.0f} s in all.",
        "",
        f"SmolLM2-135M Q4_1, raw completions of exactly {args.max_tokens} tokens (`ignore_eos: true`), greedy, "
        "every prompt computed cold (`cache_prompt: false`); K requests at once, distinct prompts; medians of "
        f"{args.rounds} round{'s' if args.rounds > 1 else ''}, each round every K on every row in turn. Tokens/s: "
        "all K answers' tokens over the wall time from the first send to the last answer's end. Time to first "
        "token (TTFT): client side, from a request's send to its first streamed chunk, median / max over the "
        "K requests of all rounds.",
        "",
        f"- **ggufpipe**: `--serve --parallel {max(args.ks)}` on 2 stages, layers [0, 15) and [15, 30), 2 local "
        f"hosts with `threads: 1` each (each stage its own core here), {PER_SLOT} positions per slot; one "
        "server for every K.",
        f"- **llama-server**: llama.cpp's own server, one per K: `-t {args.threads} --parallel K -c K x "
        f"{PER_SLOT}` ({threads_note(args.threads)}; continuous batching), the same client.",
        f"- **batched context**: one llama.cpp context in the benchmark's process (benchmarks/llama_batched.py), "
        f"`n_seq_max = K`, {args.threads} thread{'s' if args.threads > 1 else ''}, {PER_SLOT} positions per sequence (`kv_unified` off); the K "
        "prompts prefilled in one batch, then one `llama_decode` of K rows per step, greedy; no HTTP. Its TTFT "
        "is the batched prefill's (every sequence's first token at once).",
        "",
        "| K | ggufpipe tok/s | TTFT median / max ms | llama-server tok/s | TTFT median / max ms | "
        "batched context tok/s | its TTFT ms | ggufpipe / llama-server | ggufpipe / batched | "
        "ggufpipe texts equal alone |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for k in args.ks:
        p, s, b = pipe[k], server[k], batched[k]
        lines.append(
            f"| {k} | {p['tok_s']:.1f} | {p['ttft_median']:.0f} / {p['ttft_max']:.0f} | {s['tok_s']:.1f} | "
            f"{s['ttft_median']:.0f} / {s['ttft_max']:.0f} | {b['tok_s']:.1f} | {b['ttft_median']:.0f} | "
            f"{p['tok_s'] / s['tok_s']:.2f} | {p['tok_s'] / b['tok_s']:.2f} | {p['equal']} of {p['requests']} |"
        )
    lines += ["", "## What the rows show", "", shown(summary, args)]
    return "\n".join(lines) + "\n"


def shown(summary: dict[str, dict[int, dict[str, Any]]], args: argparse.Namespace) -> str:
    pipe, server, batched = summary[PIPE], summary["llama-server"], summary["batched"]
    parts = []
    if TARGET_K in args.ks:
        ratio = pipe[TARGET_K]["tok_s"] / batched[TARGET_K]["tok_s"]
        parts.append(
            f"At K = {TARGET_K} ggufpipe makes {pipe[TARGET_K]['tok_s']:.1f} tok/s, {ratio:.2f} of the batched "
            f"context's {batched[TARGET_K]['tok_s']:.1f} (issue 38's target {TARGET}: "
            f"{'met' if ratio >= TARGET else 'not met'})."
        )
    one, top = min(args.ks), max(args.ks)
    parts.append(
        f"From K = {one} to {top}: ggufpipe {pipe[one]['tok_s']:.1f} to {pipe[top]['tok_s']:.1f} tok/s "
        f"({pipe[top]['tok_s'] / pipe[one]['tok_s']:.2f}x), llama-server {server[one]['tok_s']:.1f} to "
        f"{server[top]['tok_s']:.1f} ({server[top]['tok_s'] / server[one]['tok_s']:.2f}x), the batched context "
        f"{batched[one]['tok_s']:.1f} to {batched[top]['tok_s']:.1f} "
        f"({batched[top]['tok_s'] / batched[one]['tok_s']:.2f}x)."
    )
    best = max(args.ks, key=lambda k: pipe[k]["tok_s"])
    two = min((k for k in args.ks if k >= 2), default=one)
    flat = pipe[top]["tok_s"] < 1.3 * pipe[two]["tok_s"]
    parts.append(
        f"ggufpipe's most is {pipe[best]['tok_s']:.1f} tok/s at K = {best}"
        + (
            ": each run in flight is stepped alone, one row per `llama_decode`, so past one run per stage "
            "more runs only queue for the stages' cores."
            if flat and top > two
            else "."
        )
    )
    parts.append(
        f"Time to first token at K = {top}: ggufpipe {pipe[top]['ttft_median']:.0f} ms median "
        f"({pipe[top]['ttft_max']:.0f} max), llama-server {server[top]['ttft_median']:.0f} "
        f"({server[top]['ttft_max']:.0f}), the batched context {batched[top]['ttft_median']:.0f}."
    )
    equal = sum(r["equal"] for r in pipe.values())
    total = sum(r["requests"] for r in pipe.values())
    parts.append(f"ggufpipe's concurrent texts equal its texts alone in {equal} of {total} requests.")
    return " ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32], help="requests at once")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens of each completion (64)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; medians (3)")
    parser.add_argument("--pause", type=float, default=0.5, help="seconds between samples (0.5)")
    parser.add_argument(
        "--threads",
        type=int,
        default=CORES,
        help=f"llama.cpp's threads, both references ({CORES}: the cores)",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: K = 1 and 8, 16 tokens, 1 round")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "bench-batched.md")
    args = parser.parse_args()
    if args.quick:
        args.ks, args.max_tokens, args.rounds = [1, 8], 16, 1
    args.ks = sorted(set(args.ks))
    if (
        args.threads < 1
        or args.ks[0] < 1
        or args.ks[-1] > len(PROMPTS)
        or args.rounds < 1
        or args.max_tokens < 2
    ):
        parser.error(f"K from 1 to {len(PROMPTS)}, --rounds at least 1, --max-tokens at least 2")
    args.command = " ".join(["benchmarks/bench_batched.py", *sys.argv[1:]])
    args.load_start = os.getloadavg()[0]
    args.date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the servers' teardown still runs
    began = time.monotonic()
    binary = llama_server_binary()
    top = max(args.ks)
    started: list[Process] = []
    contexts: dict[int, BatchedContext] = {}
    codes: dict[str, int | None] = {}
    with tempfile.TemporaryDirectory(prefix="bench-batched-") as folder:
        workdir = Path(folder)
        try:
            inventory = local_inventory([(0, 15), (15, 30)], PER_SLOT, args.max_tokens)
            pipe = Ggufpipe(f"ggufpipe --parallel {top}", inventory, workdir, "--parallel", str(top))
            started.append(pipe)
            servers: dict[int, Process] = {}
            for k in args.ks:
                servers[k] = LlamaServer(binary, workdir, args.threads, k, PER_SLOT)
                started.append(servers[k])
                contexts[k] = BatchedContext(smollm_path(), args.threads, k, PER_SLOT)
            print("started every server and context", file=sys.stderr, flush=True)
            results = measure(pipe, servers, contexts, args)
        finally:
            for server in reversed(started):
                codes[server.name] = server.close()
            for context in contexts.values():
                context.close()
    args.elapsed = time.monotonic() - began
    args.load_end = os.getloadavg()[0]
    rows = results["rows"]
    summary = {
        name: {k: summarise(r, results["references"] if name == PIPE else None) for k, r in by_k.items()}
        for name, by_k in rows.items()
    }
    text = report(summary, args)
    print(text)
    short = [
        f"{name} K={k}: {row['tokens']}"
        for name, by_k in summary.items()
        for k, row in by_k.items()
        if row.get("tokens", [args.max_tokens]) != [args.max_tokens]
    ]
    if short:
        print("warning: answers not of exactly --max-tokens tokens: " + "; ".join(short), file=sys.stderr)
    failed = [
        f"{name} exited {code} after SIGTERM"
        for name, code in codes.items()
        if name.startswith("ggufpipe") and code != 0
    ]
    if failed:
        print("FAILED: " + "; ".join(failed) + f"; {args.out} not written", file=sys.stderr)
        raise SystemExit(1)
    args.out.write_text(text)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
