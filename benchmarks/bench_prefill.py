"""Prefill benchmark (issue 38, "Chunked prefill through the chain"): time to first token
of a long prompt on ggufpipe's stages against one llama.cpp process with one thread, by
prompt length, in one run.

    .venv/bin/python benchmarks/bench_prefill.py [--lengths 512 1024 1800 4096 8184]
        [--rounds 3] [--long-rounds N] [--tokens 8] [--no-ssh] [--ssh-lengths ...] [--quick] [--out docs/bench-prefill.md]

Measures, on this machine, with SmolLM2-135M Q4_1, a raw completion (token ids, so both
sides are fed the same tokens) of --tokens greedy tokens after a prompt of each length,
every prompt computed cold:
  * ggufpipe ``--serve --parallel 1`` on 2 local stages, layers [0, 15) and [15, 30), on
    2 local hosts with ``threads: 1`` each (each stage its own core here), context 8192,
    ubatch 512, prefix reuse off (``cache_prompt: false``: the stages keep nothing of a
    prompt, so every prompt is computed whole); time to first token client side (send to
    first text chunk) and the server's own ``timings.prompt_ms``;
  * the same on 3 stages, layers [0, 10), [10, 20), [20, 30), each on an SSH host of its own
    (a loopback OpenSSH server, the SSH tests' fixture: tests/support/sshd.py; ``threads: 1``
    each, mutual-TLS direct links between the stages, as on separate machines; 3 threads on
    this machine's cores), at --ssh-lengths (default: those up to 1800), unless --no-ssh or
    no sshd here;
  * llama.cpp itself: llama-cpp-python's ``Llama`` on the whole model in this process, one
    thread, n_ctx 8192, n_batch = n_ubatch = --ubatch, flash attention on (what llama.cpp's
    ``auto`` picks on a CPU, as the stages get), its cache cleared before each prompt: the
    prompt's ``eval`` and the first greedy token (argmax of the last row's logits), then
    --tokens - 1 more, one at a time; with an --ubatch other than 512, llama.cpp at 512 as
    well (its default), and the ratios are against the faster of the two (its best);
  * that the greedy tokens after the prompt are the same text on every side.
Rounds interleave every length and every row (the order rotated each round), so the
machine's load drifts over all of them alike; medians of --rounds rounds (prompts above 2,048
tokens: --long-rounds of them, for a machine too busy for 3 of those); ratios
ggufpipe / llama.cpp of the medians (issue 38's target at ~1,800 tokens on 2 stages: at most
0.65, ideally 0.5). Writes --out (replaced, not appended) and prints the same text; exits 1,
writing nothing, when a row's tokens differ from llama.cpp's.
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

import llama_cpp
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.serving import (  # noqa: E402
    Ggufpipe,
    Process,
    SshHosts,
    detokenize,
    local_inventory,
    machine,
    session,
    stream,
)
from tests.support.common import smollm_path  # noqa: E402
from tests.support.local import long_prompt  # noqa: E402

CONTEXT = 8192  # SmolLM2's trained context: the server caps run.context there
#: The ubatch of both sides (--ubatch): a stage's prompt chunk, llama.cpp's n_batch = n_ubatch.
UBATCH = [512]
LOCAL = "ggufpipe, 2 local stages"
SSH = "ggufpipe, 3 stages over SSH"
LLAMA = "llama.cpp, 1 thread"
#: llama.cpp at its own default ubatch, beside the stages' (--ubatch other than 512).
LLAMA_512 = "llama.cpp, 1 thread, ubatch 512"
TARGET, IDEAL = 0.65, 0.5
LONG = 2048  # prompts above this many tokens run in --long-rounds of the rounds


class OneThread:
    """The whole model in one llama.cpp context in this process, one thread."""

    def __init__(self, ubatch: int) -> None:
        self.llm = llama_cpp.Llama(
            str(smollm_path()), n_ctx=CONTEXT, n_batch=ubatch, n_ubatch=ubatch, n_threads=1,
            n_threads_batch=1, flash_attn=True, verbose=False,
        )  # fmt: skip
        self.vocab = self.llm.n_vocab()

    def _argmax(self) -> int:
        logits = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.ctypeslib.as_array(logits, shape=(self.vocab,)).argmax())

    def sample(self, prompt: list[int], tokens: int) -> dict[str, Any]:
        llm = self.llm
        llm.reset()
        llm._ctx.kv_cache_clear()  # cold: nothing of the last prompt kept
        started = time.perf_counter()
        llm.eval(prompt)
        prompt_ms = (time.perf_counter() - started) * 1000.0
        out = [self._argmax()]
        ttft = (time.perf_counter() - started) * 1000.0
        while len(out) < tokens:
            llm.eval([out[-1]])
            out.append(self._argmax())
        return {"ttft_ms": ttft, "prompt_ms": prompt_ms, "text": detokenize(out)}

    def close(self) -> None:
        self.llm.close()


async def pipeline_sample(server: Process, prompt: list[int], tokens: int) -> dict[str, Any]:
    async with session() as http:
        answer = await stream(http, server.url, prompt, tokens)
    if answer["tokens"] != tokens:
        raise RuntimeError(f"{server.name}: {answer['tokens']} tokens, not {tokens}")
    prompt_ms = float(answer["timings"].get("prompt_ms", 0.0))
    return {"ttft_ms": answer["ttft_ms"], "prompt_ms": prompt_ms, "text": answer["text"]}


def measure(
    servers: dict[str, Process], ssh_lengths: list[int], args: argparse.Namespace
) -> dict[str, dict[int, list[dict[str, Any]]]]:
    prompts = {n: long_prompt(smollm_path(), n) for n in args.lengths}
    baselines = {LLAMA: OneThread(UBATCH[0])}
    if UBATCH[0] != 512:
        baselines[LLAMA_512] = OneThread(512)
    rows = [*servers, *baselines]
    results: dict[str, dict[int, list[dict[str, Any]]]] = {row: {n: [] for n in args.lengths} for row in rows}
    try:
        for server in servers.values():  # warm: every stage loaded and run once
            asyncio.run(pipeline_sample(server, prompts[args.lengths[0]][:64], args.tokens))
        for baseline in baselines.values():
            baseline.sample(prompts[args.lengths[0]][:64], args.tokens)
        for number in range(args.rounds):
            order = rows[number % len(rows) :] + rows[: number % len(rows)]
            for n in args.lengths:
                for row in order:
                    if (row == SSH and n not in ssh_lengths) or (n > LONG and number >= args.long_rounds):
                        continue
                    time.sleep(args.pause)
                    if row in baselines:
                        done = baselines[row].sample(prompts[n], args.tokens)
                    else:
                        done = asyncio.run(pipeline_sample(servers[row], prompts[n], args.tokens))
                    results[row][n].append(done)
                    print(
                        f"round {number + 1}/{args.rounds} {n} tokens, {row}: time to first token "
                        f"{done['ttft_ms']:.0f} ms, prompt {done['prompt_ms']:.0f} ms",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        for baseline in baselines.values():
            baseline.close()
    return results


def best(results: dict[str, dict[int, list[dict[str, Any]]]], n: int) -> float:
    """llama.cpp's median time to first token at ``n`` tokens, at its best:
    the faster of its ubatches measured."""
    return min(med(results[row][n], "ttft_ms") for row in (LLAMA, LLAMA_512) if row in results)


def med(samples: list[dict[str, Any]], field: str) -> float:
    return statistics.median(s[field] for s in samples) if samples else 0.0


def report(results: dict[str, dict[int, list[dict[str, Any]]]], args: argparse.Namespace) -> str:
    base = results[LLAMA]
    rows = [row for row in (LOCAL, SSH) if row in results]
    lines = [
        "# Prefill benchmark",
        "",
        f"`{args.command}` on {machine()}; load average {args.load_start:.2f} at the start, "
        f"{args.load_end:.2f} at the end (a shared machine: numbers are only comparable within one run); "
        f"{args.date}, {args.elapsed:.0f} s in all.",
        "",
        "SmolLM2-135M Q4_1; a raw completion of "
        f"{args.tokens} greedy tokens after a prompt of each length (`long_prompt` of tests/support/local.py, "
        "sent as token ids, so every side is fed the same tokens), every prompt computed cold. "
        f"Medians of {args.rounds} round{'s' if args.rounds > 1 else ''}"
        + (
            f" ({args.long_rounds} for the prompts above {LONG:,} tokens: `--long-rounds`)"
            if args.long_rounds < args.rounds and args.lengths[-1] > LONG
            else ""
        )
        + "; each round runs every length on every "
        "row, the rows' order rotated from round to round, so the machine's load drifts over all of them alike.",
        "",
        f"- **{LLAMA}**: llama-cpp-python's `Llama` on the whole model in the benchmark's process, "
        f"`n_threads = 1`, n_ctx {CONTEXT}, n_batch = n_ubatch = {UBATCH[0]}, flash attention on (what "
        "llama.cpp's `auto` picks on a CPU, as the stages get), its cache cleared before every prompt. Time to "
        "first token: the prompt's `eval` and the argmax of the last row's logits."
        + (
            f" **{LLAMA_512}**: the same at llama.cpp's default ubatch, n_batch = n_ubatch = 512."
            if LLAMA_512 in results
            else ""
        ),
        f"- **{LOCAL}**: `ggufpipe-tui INVENTORY --serve --parallel 1`, layers [0, 15) and [15, 30) on 2 "
        f"local hosts with `threads: 1` each (each stage its own core here), context {CONTEXT}, ubatch "
        f"{UBATCH[0]}; `cache_prompt: false` on every request (the stages keep nothing of it: prefix reuse off). "
        "Time to first token client side (the request's send to its first streamed chunk); the server's own "
        "`timings.prompt_ms` beside it.",
    ]
    if SSH in results:
        lines.append(
            f"- **{SSH}**: the same server on 3 stages, layers [0, 10), [10, 20), [20, 30), each on an SSH "
            "host of its own on a loopback OpenSSH server (tests/support/sshd.py, the SSH tests' fixture), "
            "`threads: 1` each, mutual-TLS direct links between the stages as between machines (3 stage "
            f"threads on these {os.cpu_count()} cores); at {', '.join(f'{n:,}' for n in args.ssh_lengths)} "
            "tokens."
        )
    elif args.ssh_note:
        lines.append(f"- {args.ssh_note}")
    lines += [
        "",
        "Ratio: ggufpipe's median time to first token over llama.cpp's"
        + (f" at its best (the faster of ubatch {UBATCH[0]} and 512)" if LLAMA_512 in results else "")
        + " (below 1: ggufpipe is faster). Issue "
        f"38's target on 2 stages at ~1,800 tokens: at most {TARGET} (ideal {IDEAL}: both stages busy all "
        "the time). Tokens equal: the greedy text after the prompt equals llama.cpp's, in how many of the "
        "rounds.",
        "",
    ]
    header = ["prompt tokens", f"{LLAMA} TTFT ms", "its prompt tok/s"]
    align = ["---:", "---:", "---:"]
    if LLAMA_512 in results:
        header.append(f"{LLAMA_512}: TTFT ms")
        align.append("---:")
    for row in rows:
        header += [f"{row}: TTFT ms", "server prompt ms", "ratio", "tokens equal"]
        align += ["---:", "---:", "---:", "---"]
    lines += ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    for n in args.lengths:
        b = best(results, n)
        cells = [f"{n:,}", f"{med(base[n], 'ttft_ms'):.0f}", f"{n / med(base[n], 'prompt_ms') * 1000:.0f}"]
        if LLAMA_512 in results:
            cells.append(f"{med(results[LLAMA_512][n], 'ttft_ms'):.0f}")
        for row in rows:
            samples = results[row][n]
            if not samples:
                cells += ["", "", "", ""]
                continue
            t = med(samples, "ttft_ms")
            equal = sum(s["text"] == base[n][0]["text"] for s in samples)
            cells += [
                f"{t:.0f}",
                f"{med(samples, 'prompt_ms'):.0f}",
                f"{t / b:.2f}",
                f"{equal} of {len(samples)}",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## What the rows show", "", shown(results, args)]
    return "\n".join(lines) + "\n"


def shown(results: dict[str, dict[int, list[dict[str, Any]]]], args: argparse.Namespace) -> str:
    base = results[LLAMA]
    near = min(args.lengths, key=lambda n: abs(n - 1800))
    ratio = med(results[LOCAL][near], "ttft_ms") / best(results, near)
    verdict = "met" if ratio <= TARGET else "not met"
    parts = [
        f"At {near:,} tokens the 2 local stages take {ratio:.2f} of llama.cpp's time to first token "
        f"(target {TARGET}: {verdict}; ideal {IDEAL})."
    ]
    ratios = [med(results[LOCAL][n], "ttft_ms") / best(results, n) for n in args.lengths]
    parts.append(
        "By length: " + ", ".join(f"{n:,}: {r:.2f}" for n, r in zip(args.lengths, ratios, strict=True)) + "."
    )
    parts.append(
        f"The stages compute a prompt in chunks of the ubatch ({UBATCH[0]}), each stage starting on a chunk "
        "while the one before computes the next: the last stage ends one chunk after the first, and the "
        "chunks late in a prompt cost more (attention over more positions), so a prompt of a few chunks "
        "stays above the ideal and smaller chunks (`--ubatch`, the inventory's `run.ubatch`) come closer"
        + (
            f" (here {UBATCH[0]}; llama.cpp at 512 beside it)."
            if UBATCH[0] != 512
            else ": docs/bench-prefill-ubatch128.md."
        )
    )
    if ratio > 0.8:
        parts.append(
            "Near 1 means the stages work one after the other: stage 0 computes the whole prompt, then "
            "sends its rows, and stage 1 starts only then, so a second stage buys nothing for a prompt."
        )
    if SSH in results:
        ssh = [n for n in args.ssh_lengths if results[SSH][n]]
        parts.append(
            "3 stages over SSH: "
            + ", ".join(f"{n:,}: {med(results[SSH][n], 'ttft_ms') / best(results, n):.2f}" for n in ssh)
            + " of llama.cpp's time to first token."
        )
    equal = all(
        s["text"] == base[n][0]["text"]
        for row in results
        if row != LLAMA_512
        for n in args.lengths
        for s in results[row][n]
    )
    parts.append(
        f"The {args.tokens} greedy tokens after the prompt are the same on every row at every length."
        if equal
        else "Some rows' greedy tokens differ from llama.cpp's (the table says where)."
    )
    return " ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=[512, 1024, 1800, 4096, 8184],
        help=f"prompt lengths in tokens (512 1024 1800 4096 8184: {CONTEXT} less the checked tokens)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="rounds; medians (3)")
    parser.add_argument(
        "--long-rounds", type=int, help=f"rounds of the prompts above {LONG} tokens (default: --rounds)"
    )
    parser.add_argument("--tokens", type=int, default=8, help="greedy tokens after the prompt, checked (8)")
    parser.add_argument("--pause", type=float, default=0.5, help="seconds between samples (0.5)")
    parser.add_argument("--no-ssh", action="store_true", help="leave out the 3 stages over SSH")
    parser.add_argument(
        "--ssh-lengths",
        type=int,
        nargs="+",
        help="prompt lengths of the SSH rows (default: those up to 1800)",
    )
    parser.add_argument(
        "--ubatch",
        type=int,
        default=512,
        help="the stages' run.ubatch and llama.cpp's n_batch = n_ubatch (512); another value "
        "measures llama.cpp at 512 too, and the ratios are against the faster of the two",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: 512 and 1024 tokens, 1 round")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "bench-prefill.md")
    args = parser.parse_args()
    UBATCH[0] = args.ubatch
    if args.quick:
        args.lengths, args.rounds = [512, 1024], 1
    args.lengths = sorted(set(args.lengths))
    args.long_rounds = min(args.rounds, args.long_rounds or args.rounds)
    if args.lengths[-1] + args.tokens > CONTEXT or args.lengths[0] < 64 or args.rounds < 1 or args.tokens < 1:
        parser.error(f"lengths from 64 to {CONTEXT} - --tokens; --rounds and --tokens at least 1")
    args.ssh_lengths = sorted(
        set(args.ssh_lengths or [n for n in args.lengths if n <= 1800]) & set(args.lengths)
    )
    args.command = " ".join(["benchmarks/bench_prefill.py", *sys.argv[1:]])
    args.load_start = os.getloadavg()[0]
    args.date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    args.ssh_note = ""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the servers' teardown still runs
    began = time.monotonic()
    servers: dict[str, Process] = {}
    ssh: SshHosts | None = None
    codes: dict[str, int | None] = {}
    with tempfile.TemporaryDirectory(prefix="bench-prefill-") as folder:
        workdir = Path(folder)
        try:
            inventory = local_inventory([(0, 15), (15, 30)], CONTEXT, args.tokens, ubatch=UBATCH[0])
            servers[LOCAL] = Ggufpipe(LOCAL, inventory, workdir, "--parallel", "1")
            print(f"started {LOCAL}", file=sys.stderr, flush=True)
            if args.no_ssh:
                args.ssh_note = "3 stages over SSH: left out (--no-ssh)."
            elif args.ssh_lengths:
                ssh = SshHosts()
                if ssh.why_not:
                    args.ssh_note = f"3 stages over SSH: not measured, no sshd here ({ssh.why_not})."
                else:
                    inventory = ssh.inventory([(0, 10), (10, 20), (20, 30)], CONTEXT, args.tokens, UBATCH[0])
                    servers[SSH] = Ggufpipe(SSH, inventory, workdir, "--parallel", "1")
                    print(f"started {SSH}", file=sys.stderr, flush=True)
            results = measure(servers, args.ssh_lengths, args)
        finally:
            for name, server in reversed(servers.items()):
                codes[name] = server.close()
            if ssh is not None:
                ssh.close()
    args.elapsed = time.monotonic() - began
    args.load_end = os.getloadavg()[0]
    text = report(results, args)
    print(text)
    base = results[LLAMA]
    differing = [
        f"{row} at {n}"
        for row in results
        if row != LLAMA_512
        for n in args.lengths
        if any(s["text"] != base[n][0]["text"] for s in results[row][n])
    ]
    failures = [f"greedy tokens differ from llama.cpp's: {', '.join(differing)}"] * bool(differing)
    failures += [f"{name} exited {code} after SIGTERM" for name, code in codes.items() if code != 0]
    if failures:
        print("FAILED: " + "; ".join(failures), file=sys.stderr)
        print(f"{args.out} not written", file=sys.stderr)
        raise SystemExit(1)
    args.out.write_text(text)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
