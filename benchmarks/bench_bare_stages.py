"""What two stages of one thread can reach with nothing but llama.cpp on the cores (issue 38,
"Batched decode across runs in flight"): the bound that ggufpipe's batched decode is measured
against, beside the batched context that bench_batched.py compares it with, in one run.

    .venv/bin/python benchmarks/bench_bare_stages.py [--cuts 15 19] [--seconds 6] [--rounds 2]
        [--out docs/bench-bare-stages.md]

Measures, on this machine, with SmolLM2-135M Q4_1 (30 blocks) cut at each of --cuts into
[0, cut) and [cut, 30):
  * each stage's engine (ggufpipe_agent.llama.engine.StageEngine, as an agent loads it, one
    thread) stepping batches of 4 rows (one per slot, 4 slots) for --seconds, in a process of
    its own: alone, then both stages' processes at once, side by side (each with a core);
    the median ms of a step. No agent, no event loop, no links: only the stages' compute;
  * one llama.cpp context of the whole model decoding 8 sequences batched on 2 threads
    (benchmarks/llama_batched.py): the reference of bench_batched.py, its decode tokens/s.
With 8 runs in flight on 2 stages the runs form two groups of 4, and while stage 1 computes
one group stage 0 computes the other; a group's cycle is both stages' steps, so 8 rows take
max(2 x the slower step, the sum of both steps) side by side: the bound, in tokens/s, and
its ratio to the batched context. Issue 38's target is 0.85 of the batched context; what
the pipeline loses against the bound is the orchestration's (bench_batched.py measures the
pipeline). Writes --out (replaced) and prints the same text.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.serving import machine, tokenize  # noqa: E402

BLOCKS, ROWS, GROUPS = 30, 4, 2
PROMPT = "The quick brown fox jumps over the lazy dog because"


def step_stage(stage: int, cut: int, seconds: float) -> float:
    """This process: one stage of the cut stepping ROWS-row batches; the median ms of a step."""
    import numpy as np

    from ggufpipe_agent.gguf.facts import read_model_facts
    from ggufpipe_agent.llama.engine import StageEngine, StageShape
    from ggufpipe_agent.stagefiles.build import ensure_stage_file
    from ggufpipe_agent.wire.protocol import EngineOptions, SamplingParams
    from tests.support.common import smollm_path

    path = smollm_path()
    hidden = read_model_facts(path).hidden_dim
    start, end = [(0, cut), (cut, BLOCKS)][stage]
    shape = StageShape(stage == 0, stage == 1, end - start, hidden)
    options = EngineOptions(n_ctx=1024, n_batch=512, n_ubatch=512, threads=1, parallel=ROWS)
    engine = StageEngine(str(ensure_stage_file(path, start, end, None)), shape, options)
    rows = np.random.default_rng(stage).standard_normal((ROWS, 12, hidden)).astype(np.float32)
    prompt = tokenize(PROMPT)[:12]
    for slot in range(ROWS):
        engine.use(slot)
        engine.reset(SamplingParams())
        engine.step(prompt if stage == 0 else rows[slot], 0)

    def one(slot: int) -> Any:
        return [prompt[slot]] if stage == 0 else rows[slot, :1]

    times: list[float] = []
    ends = time.monotonic() + seconds
    while time.monotonic() < ends and len(times) < 900:  # 12 + 900 positions fit the slots
        began = time.perf_counter()
        engine.step_batch([(slot, one(slot)) for slot in range(ROWS)])
        times.append((time.perf_counter() - began) * 1000.0)
    engine.close()
    return statistics.median(times[3:])


def stages(cut: int, which: list[int], seconds: float) -> dict[int, float]:
    """The stages in ``which``, each in a process of its own, at once; their median ms."""
    command = [sys.executable, __file__, "--cut", str(cut), "--seconds", str(seconds), "--stage"]
    running = {
        stage: subprocess.Popen([*command, str(stage)], stdout=subprocess.PIPE, text=True) for stage in which
    }
    out = {}
    for stage, process in running.items():
        text, _ = process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"stage {stage} of cut {cut} failed ({process.returncode})")
        out[stage] = json.loads(text.strip().splitlines()[-1])["ms"]
    return out


def batched_reference(rounds: int) -> float:
    """The batched context's decode tokens/s, 8 sequences on 2 threads (median of ``rounds``)."""
    from benchmarks.bench_batched import PROMPTS
    from benchmarks.llama_batched import BatchedContext
    from tests.support.common import smollm_path

    context = BatchedContext(smollm_path(), 2, GROUPS * ROWS, 1024)
    try:
        prompts = [tokenize(text) for text in PROMPTS[: GROUPS * ROWS]]
        context.run(prompts[:1], 4)
        return statistics.median(context.run(prompts, 64)["decode_tok_s"] for _ in range(rounds))
    finally:
        context.close()


def bound(t0: float, t1: float) -> float:
    """Tokens/s of two groups of ROWS rows in flight on two stages of these step times."""
    return GROUPS * ROWS / (max(2 * max(t0, t1), t0 + t1) / 1000.0)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cuts", type=int, nargs="+", default=[15, 19], help="where the stages meet (15 19)")
    parser.add_argument("--seconds", type=float, default=6.0, help="seconds of steps per sample (6)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds; medians (2)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "bench-bare-stages.md")
    parser.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cut", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage is not None:
        print(json.dumps({"ms": step_stage(args.stage, args.cut, args.seconds)}))
        return
    if any(not 0 < cut < BLOCKS for cut in args.cuts) or args.rounds < 1 or args.seconds <= 0:
        parser.error(f"cuts between 1 and {BLOCKS - 1}, --rounds at least 1, --seconds above 0")
    began, load = time.monotonic(), os.getloadavg()[0]
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    samples: dict[tuple[int, str], list[dict[int, float]]] = {}
    references = []
    for number in range(args.rounds):
        for cut in args.cuts:
            for mode, which in (("alone", [0]), ("alone", [1]), ("side by side", [0, 1])):
                samples.setdefault((cut, mode), []).append(stages(cut, which, args.seconds))
        references.append(batched_reference(1))
        print(f"round {number + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    reference = statistics.median(references)

    def median(cut: int, mode: str, stage: int) -> float:
        return statistics.median(s[stage] for s in samples[(cut, mode)] if stage in s)

    lines = [
        "# Bare stages: what two stages of one thread reach with nothing else on the cores",
        "",
        f"`{' '.join(['benchmarks/bench_bare_stages.py', *sys.argv[1:]])}` on {machine()}; load average {load:.2f} at the start, "
        f"{os.getloadavg()[0]:.2f} at the end (a shared machine: compare within one run); {date}, "
        f"{time.monotonic() - began:.0f} s in all.",
        "",
        f"SmolLM2-135M Q4_1. Each stage's engine (as an agent loads it, `threads: 1`) steps batches of "
        f"{ROWS} rows, one per slot, in a process of its own, for {args.seconds:g} s: alone, then both stages "
        f"side by side (each with a core); median ms of a step, medians of {args.rounds} rounds. No agent, "
        f"event loop or link. The bound: {GROUPS * ROWS} runs in flight form {GROUPS} groups of {ROWS}, one on "
        "each stage at a time, so 8 rows take max(2 x the slower step, both steps) side by side. The batched "
        f"context: the whole model, one llama.cpp context decoding {GROUPS * ROWS} sequences batched on 2 "
        f"threads (bench_batched.py's reference), decode tokens/s: **{reference:.1f}** in this run.",
        "",
        "| stages | stage 0 alone ms | stage 1 alone ms | side by side ms (stage 0 / 1) | bound tok/s | "
        "bound / batched context |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for cut in args.cuts:
        side = (median(cut, "side by side", 0), median(cut, "side by side", 1))
        most = bound(*side)
        lines.append(
            f"| [0, {cut}) / [{cut}, {BLOCKS}) | {median(cut, 'alone', 0):.1f} | {median(cut, 'alone', 1):.1f} | "
            f"{side[0]:.1f} / {side[1]:.1f} | {most:.0f} | {most / reference:.2f} |"
        )
    lines += [
        "",
        "The last stage also computes the output head, so an even cut leaves it the slower; a cut that "
        "balances the steps reaches the most. Issue 38 asks ggufpipe for 0.85 of the batched context: on "
        "this machine that is about the bound itself, before any orchestration (the agents' event loops, "
        'the links, the server) takes its share of the same two cores. docs/performance.md, "The full '
        "pipeline on two cores\", compares it with the pipeline's own steps.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
