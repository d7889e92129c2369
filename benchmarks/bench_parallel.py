"""Parallel requests benchmark (docs/architecture.md, "Runs in flight"): K requests at once through
``--serve --parallel`` on 2 stages, against llama.cpp's own server with
``--parallel K``, in one run.

    .venv/bin/python benchmarks/bench_parallel.py [--ks 1 2 4 8] [--max-tokens 64] [--rounds 3]
        [--no-baseline] [--baseline-t1] [--no-default-check] [--out docs/bench-parallel.md]

Measures, on this machine, with SmolLM2-135M, greedy, raw completions
(/v1/completions, streamed) of exactly --max-tokens tokens each
(``ignore_eos: true``), every prompt computed cold (``cache_prompt: false``):
  * ggufpipe --serve on 2 stages, layers [0, 15) and [15, 30), on 2 local
    hosts with one thread each (each stage its own core here), one server
    started with --parallel max(K): for each K, K requests sent at once
    (distinct prompts, no shared prefix); aggregate tokens/s = the completion
    tokens of the K answers / the wall time from the first send to the last
    answer's end; its ratio against K = 1 in the same run, and the issue's
    target 0.8 x min(K, N) with N = 2 stages; time to first token under load
    (client side: from a request's send to its first text chunk), median and
    max over the K requests;
  * that each concurrent request's text equals the text of the same request
    made alone on the same server (greedy: a run on its own slot must not
    see the others); exits 1 if any differs;
  * the same requests, with the same client code, against llama.cpp's own
    server (``llama-server``, the same llama.cpp as llama-cpp-python, built by
    scripts/build-llama-server) in one process, ``-t 2`` (threads = cores:
    llama.cpp at its best here), ``--parallel max(K)``, ``-c max(K) x 1024``
    (1024 positions per slot, as the stages hold), continuous batching;
    with --baseline-t1 also one with ``-t 1`` (one core, as each stage has);
  * with the default --parallel (one slot per stage here: each has a
    thread of its own) a second ggufpipe server at K = 1 and 2: that the
    spare slots of the first one change nothing at K <= 2
    (--no-default-check leaves it out);
  * the same two stages without ``threads:`` (each uses every core, the
    host's default), ``--parallel 2``, at K = 1 and 2: two runs in flight on
    shared cores, why the default --parallel counts a machine once unless its
    stages have threads of their own (--no-shared-check leaves it out).
The servers are started once and the rounds interleaved (round r: each K,
each server in turn), so a shared machine's load drifts over all of them
alike. Medians over --rounds rounds. Writes --out (docs/bench-parallel.md)
and prints the same text; a smoke run should give --out /tmp/....
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_server import Server, median  # noqa: E402
from tests.support.common import smollm_path  # noqa: E402
from tests.support.sshd import free_port  # noqa: E402

STAGES = 2
CONTEXT = 1024  # positions per slot, on the stages and in llama-server
GPU_NOTE = "GPU: no device machine was lent to this task; not measured."

#: Distinct prompts, no two starting alike (after the BOS token): request i
#: of a round of K sends PROMPTS[i].
PROMPTS = [
    "The history of the printing press begins",
    "Apples grow best in climates where",
    "Quantum computers differ from classical ones because",
    "My grandmother's favourite recipe was",
    "In 1969, astronauts landed on",
    "Rivers carve canyons over millions of years by",
    "Good software documentation should explain",
    "Photosynthesis turns sunlight into",
    "Every chess opening aims to",
    "Volcanoes erupt when pressure",
    "Bees communicate with each other using",
    "Learning a second language helps",
    "Trains replaced canals in Britain after",
    "Jazz music started in New Orleans, where",
    "Deserts are cold at night since",
    "Octopuses can change colour to",
]


class Process:
    """A server this benchmark started, in its own process group (the
    agents a ggufpipe server starts with it): closed with SIGTERM, waited
    for, and only then, if anything of its group is left, killed."""

    name = ""
    url = ""
    process: subprocess.Popen[str]

    def close(self) -> int | None:
        if self.process.poll() is None:
            self.process.terminate()
        try:
            code = self.process.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            code = None
        # What the server started in its group (its agents) goes with it.
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                os.killpg(self.process.pid, 0)
            except ProcessLookupError:
                return code
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
            time.sleep(2)
            os.killpg(self.process.pid, signal.SIGKILL)
        return code


class Ggufpipe(Process):
    """ggufpipe-tui INVENTORY --serve on 2 stages of 2 local hosts, one thread each."""

    def __init__(self, workdir: Path, max_tokens: int, parallel: int | None, shared: bool = False) -> None:
        self.parallel = parallel or STAGES
        self.name = f"ggufpipe --parallel {parallel}" if parallel else "ggufpipe (default --parallel)"
        if shared:
            self.name += ", stages on every core"
        folder = workdir / f"ggufpipe-{parallel or 'default'}{'-shared' if shared else ''}"
        folder.mkdir()
        inventory = folder / "inventory.yaml"
        threads = "" if shared else ", threads: 1"
        inventory.write_text(
            f"model: {{path: '{smollm_path()}'}}\n"
            f"hosts:\n  a: {{local: true{threads}}}\n  b: {{local: true{threads}}}\n"
            "stages:\n  - {host: a, layers: [0, 15]}\n  - {host: b, layers: [15, 30]}\n"
            f"run: {{context: {CONTEXT}, max_tokens: {max_tokens}, temperature: 0.0}}\n"
        )
        options = ["--parallel", str(parallel)] if parallel else []
        server = Server(inventory, folder, *options, new_session=True)  # bench_server's
        self.process, self.url = server.process, server.url


class LlamaServer(Process):
    """llama.cpp's own server on the whole model, one process."""

    def __init__(self, binary: str, workdir: Path, threads: int, parallel: int) -> None:
        self.name = f"llama-server -t {threads} --parallel {parallel}"
        port = free_port()
        self.log = workdir / f"llama-server-t{threads}.log"
        command = [
            binary, "-m", str(smollm_path()), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "--parallel", str(parallel), "-c", str(parallel * CONTEXT),
        ]  # fmt: skip
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, text=True,
                start_new_session=True,
            )  # fmt: skip
        self.url = f"http://127.0.0.1:{port}/v1"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                    if json.loads(answer.read()).get("status") == "ok":
                        return
            except (OSError, urllib.error.URLError, ValueError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} did not start:\n" + self.log.read_text()[-4000:])


def llama_server_binary() -> str:
    """scripts/build-llama-server: the path at once when it is built (and of
    the right commit and flags), else it builds it first (minutes)."""
    built = subprocess.run(
        [str(REPO / "scripts" / "build-llama-server")], cwd=REPO, capture_output=True, text=True
    )
    if built.returncode != 0:
        raise SystemExit("scripts/build-llama-server failed:\n" + built.stderr[-4000:])
    return built.stdout.strip().splitlines()[-1]


# ------------------------------------------------------------------- client


async def ask(http: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streamed completion: its text, completion tokens, time to first
    text chunk and its end (perf_counter)."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "cache_prompt": False,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first = 0.0
    text, chunks, tokens = "", 0, 0
    async with http.post(f"{url}/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: {response.status} {await response.text()}")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"{url}: {event['error']}")
            for choice in event.get("choices") or []:
                if choice.get("text"):
                    first = first or time.perf_counter()
                    text += choice["text"]
                    chunks += 1
            usage = event.get("usage") or {}
            timings = event.get("timings") or {}
            tokens = usage.get("completion_tokens") or timings.get("predicted_n") or tokens
    done = time.perf_counter()
    return {
        "text": text,
        "tokens": tokens or chunks,
        "ttft_ms": (first - started) * 1000.0,
        "started": started,
        "done": done,
    }


async def one_round(http: aiohttp.ClientSession, url: str, k: int, max_tokens: int) -> dict[str, Any]:
    started = time.perf_counter()
    answers = await asyncio.gather(*(ask(http, url, PROMPTS[i], max_tokens) for i in range(k)))
    wall = max(a["done"] for a in answers) - started
    tokens = sum(a["tokens"] for a in answers)
    return {"tok_s": tokens / wall, "wall_s": wall, "tokens": tokens, "answers": answers}


async def measure(servers: list[tuple[Process, list[int]]], args: argparse.Namespace) -> dict[str, Any]:
    """Each server: one request to warm it, each prompt alone (the reference
    texts), then the rounds, interleaved over K and the servers."""
    results: dict[str, Any] = {}
    timeout = aiohttp.ClientTimeout(total=900)
    # A connection per request: a server may close one after a streamed
    # answer, and a kept one reused then fails.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        for server, ks in servers:
            await ask(http, server.url, "Hello", args.max_tokens)
            alone = [(await ask(http, server.url, PROMPTS[i], args.max_tokens)) for i in range(max(ks))]
            results[server.name] = {"alone": alone, "rounds": {k: [] for k in ks}}
        for number in range(args.rounds):
            for k in args.ks:
                for server, ks in servers:
                    if k not in ks:
                        continue
                    await asyncio.sleep(args.pause)  # a server's work after the last round is done
                    done = await one_round(http, server.url, k, args.max_tokens)
                    results[server.name]["rounds"][k].append(done)
                    print(
                        f"round {number + 1}/{args.rounds} K={k} {server.name}: {done['tok_s']:.1f} tok/s, "
                        f"{done['tokens']} tokens in {done['wall_s']:.2f} s",
                        file=sys.stderr,
                        flush=True,
                    )
    return results


def summarise(result: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Per K: median tokens/s, time to first token median and max over all
    its requests, and how many requests' texts equal the same prompt's alone."""
    alone = [a["text"] for a in result["alone"]]
    rows = {}
    for k, rounds in result["rounds"].items():
        answers = [(i, a) for r in rounds for i, a in enumerate(r["answers"])]
        ttfts = [a["ttft_ms"] for _, a in answers]
        rows[k] = {
            "tok_s": median([r["tok_s"] for r in rounds]),
            "ttft_median": median(ttfts),
            "ttft_max": max(ttfts) if ttfts else 0.0,
            "equal": sum(a["text"] == alone[i] for i, a in answers),
            "requests": len(answers),
            "differing": sorted({i for i, a in answers if a["text"] != alone[i]}),
            "tokens": sorted({a["tokens"] for _, a in answers}),
        }
    return rows


# ------------------------------------------------------------------- report


def report(
    summaries: dict[str, dict[int, dict[str, Any]]], names: dict[str, str], args: argparse.Namespace
) -> str:
    ks = args.ks
    pipe = summaries[names["ggufpipe"]]
    base = summaries.get(names.get("llama", ""), {})
    t1 = summaries.get(names.get("llama_t1", ""), {})
    default = summaries.get(names.get("default", ""), {})
    machine = (
        f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform(terse=True)}, "
        f"Python {platform.python_version()}"
    )
    lines = [
        "# Parallel requests benchmark",
        "",
        f"`{args.command}` on {machine}; load average {args.load_start:.2f} at the start, "
        f"{args.load_end:.2f} at the end (a shared machine: numbers are only comparable within one run); "
        f"{args.date}, {args.elapsed:.0f} s in all.",
        "",
        f"SmolLM2-135M Q4_1, raw completions of exactly {args.max_tokens} tokens (`ignore_eos: true`), greedy, "
        f"streamed, every prompt computed cold (`cache_prompt: false`); K requests sent at once, distinct prompts; "
        f"medians of {args.rounds} round{'s' if args.rounds > 1 else ''}. Tokens/s: the K answers' completion tokens over the wall time from the "
        "first send to the last answer's end. Time to first token: client side, from a request's send to its "
        "first text chunk, median and max over the K requests of all rounds.",
        "",
        f"ggufpipe: `--serve --parallel {max(ks)}` on {STAGES} stages, layers [0, 15) and [15, 30), on 2 local "
        f"hosts with `threads: 1` each (each stage its own core here), {CONTEXT} positions per slot. One server "
        "for every K, started once, so every K runs on the same processes (only runs in flight step through the "
        "stages: a free slot is not stepped, it only keeps a run provisioned for the next request)"
        + (
            "; the line under the table runs K = 1 and 2 on a server with the default `--parallel` (one slot "
            "per stage) as well, which shows what the spare slots cost at K <= 2."
            if "default" in names
            else "."
        ),
    ]
    if base:
        lines += [
            "",
            f"llama-server: llama.cpp's own server (the same llama.cpp as llama-cpp-python, "
            "scripts/build-llama-server) on the whole model in one process, "
            f"`-t {os.cpu_count()} --parallel {max(ks)} -c {max(ks) * CONTEXT}` (threads = cores: llama.cpp at "
            f"its best here; {CONTEXT} positions per slot; continuous batching), one server for every K as well. "
            "The servers run side by side and the rounds are interleaved (each round: each K, each server in "
            "turn), so the machine's load drifts over all of them alike.",
        ]
    header = "| K | ggufpipe tok/s | vs K=1 | target 0.8·min(K,2) | met? | TTFT median / max ms |"
    rule = "|---:|---:|---:|---:|---|---:|"
    if base:
        header += (
            " llama-server tok/s | vs its K=1 | llama-server TTFT median / max ms | ggufpipe / llama-server |"
        )
        rule += "---:|---:|---:|---:|"
    lines += ["", header + " outputs equal alone |", rule + "---|"]
    one = pipe[1]["tok_s"]
    base_one = base[1]["tok_s"] if base else 0.0
    for k in ks:
        row = pipe[k]
        ratio = row["tok_s"] / one
        target = 0.8 * min(k, STAGES)
        equal = "yes" if row["equal"] == row["requests"] else f"no ({row['equal']}/{row['requests']})"
        cells = [
            f"{k}",
            f"{row['tok_s']:.1f}",
            f"{ratio:.2f}x",
            f"{target:.1f}x",
            "yes" if ratio >= target else "no",
            f"{row['ttft_median']:.0f} / {row['ttft_max']:.0f}",
        ]
        if base:
            b = base[k]
            cells += [
                f"{b['tok_s']:.1f}",
                f"{b['tok_s'] / base_one:.2f}x",
                f"{b['ttft_median']:.0f} / {b['ttft_max']:.0f}",
                f"{row['tok_s'] / b['tok_s']:.2f}x",
            ]
        cells.append(equal)
        lines.append("| " + " | ".join(cells) + " |")
    if default:
        d1, d2 = default[1]["tok_s"], default[2]["tok_s"]
        alike = all(r["equal"] == r["requests"] for r in default.values())
        met = "met" if d2 / d1 >= 0.8 * STAGES else "not met"
        lines += [
            "",
            f"ggufpipe with the default `--parallel` ({STAGES}, one slot per stage): {d1:.1f} tok/s at K = 1, "
            f"{d2:.1f} at K = 2, {d2 / d1:.2f}x (target {0.8 * STAGES:.1f}x: {met}); time to first token at "
            f"K = 2 {default[2]['ttft_median']:.0f} / {default[2]['ttft_max']:.0f} ms; outputs equal alone: "
            f"{'yes' if alike else 'no'}. The `--parallel {max(ks)}` server made {pipe[1]['tok_s']:.1f} and "
            f"{pipe[2]['tok_s']:.1f} tok/s at K = 1 and 2 ({pipe[2]['tok_s'] / d2:.2f}x this one's at K = 2).",
        ]
    shared = summaries.get(names.get("shared", ""), {})
    if shared:
        s1, s2 = shared[1]["tok_s"], shared[2]["tok_s"]
        lines += [
            "",
            f"The same two stages with no `threads:` (each stage's steps use all {os.cpu_count()} cores, the "
            f"default), `--parallel 2`: {s1:.1f} tok/s at K = 1, {s2:.1f} at K = 2 ({s2 / s1:.2f}x): two runs in "
            "flight on the same cores make llama.cpp's thread teams wait for each other. This is why, "
            "without --parallel or run.parallel, the server keeps one run in flight per machine, and one "
            "per stage only on this machine where each stage has `threads:` of its own "
            "(`default_parallel` in ggufpipe_tui/core/inventory_policy.py).",
        ]
    if t1:
        t1_one = t1[1]["tok_s"]
        lines += [
            "",
            f"llama-server `-t 1 --parallel {max(ks)}` (one core, as each stage has):",
            "",
            "| K | tok/s | vs its K=1 | TTFT median / max ms | ggufpipe / it |",
            "|---:|---:|---:|---:|---:|",
        ]
        for k in ks:
            lines.append(
                f"| {k} | {t1[k]['tok_s']:.1f} | {t1[k]['tok_s'] / t1_one:.2f}x | "
                f"{t1[k]['ttft_median']:.0f} / {t1[k]['ttft_max']:.0f} | {pipe[k]['tok_s'] / t1[k]['tok_s']:.2f}x |"
            )
    lines += ["", "## What the rows show", "", shown(pipe, base, ks, args.load_start)]
    lines += ["", args.gpu_note]
    return "\n".join(lines) + "\n"


def shown(
    pipe: dict[int, dict[str, Any]], base: dict[int, dict[str, Any]], ks: list[int], load: float
) -> str:
    """The paragraph under the table, from the numbers."""
    one = pipe[1]["tok_s"]
    top = max(ks)
    best = max(ks, key=lambda k: pipe[k]["tok_s"])
    met = [k for k in ks if k > 1 and pipe[k]["tok_s"] / one >= 0.8 * min(k, STAGES)]
    missed = [k for k in ks if k > 1 and k not in met]
    parts = []
    if 2 in pipe:
        ratio = pipe[2]["tok_s"] / one
        parts.append(
            f"Two requests at once give ggufpipe {ratio:.2f}x the tokens/s of one "
            f"({'meeting' if ratio >= 0.8 * STAGES else 'short of'} the {0.8 * STAGES:.1f}x target)."
        )
    if met or missed:
        parts.append(
            f"The target 0.8 x min(K, {STAGES}) is "
            + (f"met at K = {', '.join(map(str, met))}" if met else "met at no K above 1")
            + (f" and missed at K = {', '.join(map(str, missed))}." if missed and met else ".")
        )
    beyond = [k for k in ks if k > STAGES]
    if beyond:
        parts.append(
            f"Beyond K = {STAGES} there is no idle stage left to fill: "
            + ", ".join(f"K = {k} gives {pipe[k]['tok_s'] / one:.2f}x" for k in beyond)
            + f" (the most, {pipe[best]['tok_s'] / one:.2f}x, at K = {best})."
        )
    parts.append(
        f"ggufpipe's time to first token: a median of {pipe[1]['ttft_median']:.0f} ms at K = 1, "
        f"{pipe[top]['ttft_median']:.0f} ms (max {pipe[top]['ttft_max']:.0f} ms) at K = {top}."
    )
    if base:
        base_one = base[1]["tok_s"]
        parts.append(
            f"llama-server, one process with {os.cpu_count()} threads batching its slots, goes from "
            f"{base_one:.1f} tok/s at K = 1 to {base[top]['tok_s']:.1f} at K = {top} "
            f"({base[top]['tok_s'] / base_one:.2f}x); ggufpipe makes {one / base_one:.2f}x its tokens/s at K = 1 "
            f"and {pipe[top]['tok_s'] / base[top]['tok_s']:.2f}x at K = {top}. llama-server's time to first token at "
            f"K = {top}: a median of {base[top]['ttft_median']:.0f} ms (max {base[top]['ttft_max']:.0f} ms)."
        )
        equal = sum(r["equal"] for r in base.values())
        total = sum(r["requests"] for r in base.values())
        parts.append(
            f"llama-server's concurrent texts equal its texts alone in {equal} of {total} requests"
            + (
                " (a batch of several sequences may round differently from one alone)."
                if equal < total
                else "."
            )
        )
    equal = sum(r["equal"] for r in pipe.values())
    total = sum(r["requests"] for r in pipe.values())
    parts.append(
        f"ggufpipe's concurrent texts equal its texts alone in {equal} of {total} requests"
        + (" (each run on its own slot, stepped alone)." if equal == total else ".")
    )
    if load >= 0.5:
        parts.append(
            f"The machine was not idle at the start (load average {load:.2f} on {os.cpu_count()} cores): other "
            "work competing for the cores the stages need can lower the ratios at K >= 2 most, as then every "
            "stage wants its core at once."
        )
    return " ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8], help="requests at once (1 2 4 8)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens of each completion (64)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per K and server; medians (3)")
    parser.add_argument("--pause", type=float, default=0.5, help="seconds between rounds (0.5)")
    parser.add_argument("--no-baseline", action="store_true", help="leave out llama-server")
    parser.add_argument("--baseline-t1", action="store_true", help="also llama-server -t 1 (one core)")
    parser.add_argument(
        "--no-default-check", action="store_true", help="leave out the default --parallel server at K = 1, 2"
    )
    parser.add_argument(
        "--no-shared-check", action="store_true", help="leave out the stages sharing every core at K = 1, 2"
    )
    parser.add_argument("--gpu-note", default=GPU_NOTE, help="the doc's line about the GPU")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "bench-parallel.md")
    args = parser.parse_args()
    args.ks = sorted(set(args.ks) | {1})
    if args.ks[-1] > len(PROMPTS) or args.rounds < 1 or args.max_tokens < 1:
        parser.error(f"K from 1 to {len(PROMPTS)}, --rounds and --max-tokens at least 1")
    args.command = " ".join(["benchmarks/bench_parallel.py", *sys.argv[1:]])
    args.load_start = os.getloadavg()[0]
    args.date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the servers' teardown still runs
    began = time.monotonic()
    binary = "" if args.no_baseline else llama_server_binary()
    top = max(args.ks)
    started: list[tuple[Process, list[int]]] = []
    names: dict[str, str] = {}
    codes: dict[str, int | None] = {}
    with tempfile.TemporaryDirectory(prefix="bench-parallel-") as folder:
        workdir = Path(folder)

        def start(key: str, ks: list[int], make: Any) -> None:
            began = time.monotonic()
            server = make()
            started.append((server, ks))
            names[key] = server.name
            print(f"started {server.name} in {time.monotonic() - began:.1f} s", file=sys.stderr, flush=True)

        try:
            start("ggufpipe", args.ks, lambda: Ggufpipe(workdir, args.max_tokens, top))
            if binary:
                start("llama", args.ks, lambda: LlamaServer(binary, workdir, os.cpu_count() or 1, top))
                if args.baseline_t1:
                    start("llama_t1", args.ks, lambda: LlamaServer(binary, workdir, 1, top))
            if not args.no_default_check and 2 in args.ks and top != STAGES:
                start("default", [1, 2], lambda: Ggufpipe(workdir, args.max_tokens, None))
            if not args.no_shared_check and 2 in args.ks:
                start("shared", [1, 2], lambda: Ggufpipe(workdir, args.max_tokens, 2, shared=True))
            results = asyncio.run(measure(started, args))
        finally:
            for server, _ in reversed(started):
                codes[server.name] = server.close()
    args.elapsed = time.monotonic() - began
    args.load_end = os.getloadavg()[0]
    summaries = {name: summarise(result) for name, result in results.items()}
    text = report(summaries, names, args)
    print(text)
    short = [
        f"{name} K={k}: {sorted(row['tokens'])}"
        for name, rows in summaries.items()
        for k, row in rows.items()
        if row["tokens"] != [args.max_tokens]
    ]
    if short:
        print("warning: answers not of exactly --max-tokens tokens: " + "; ".join(short), file=sys.stderr)
    differing = [
        f"{name} K={k}: prompts {row['differing']}"
        for name, rows in summaries.items()
        if name.startswith("ggufpipe")
        for k, row in rows.items()
        if row["differing"]
    ]
    failures = [f"concurrent texts differ from the same requests alone: {'; '.join(differing)}"] * bool(
        differing
    )
    failures += [
        f"{name} exited {code} after SIGTERM"
        for name, code in codes.items()
        if name.startswith("ggufpipe") and code != 0
    ]
    if failures:
        print("FAILED: " + "; ".join(failures), file=sys.stderr)
        print(f"{args.out} not written", file=sys.stderr)
        raise SystemExit(1)
    args.out.write_text(text)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
