"""The bundled example beside a busy neighbour, against llama.cpp, in one run.

    .venv/bin/python benchmarks/bench_busy.py [--repeats 3] [--no-pinned] [--no-write]

Phases: quiet; one busy loop (``sh -c 'while :; do :; done'``, one process,
not pinned); the same loop pinned to the last core (``taskset``-like
affinity). In each phase, every round samples in turn:

  * llama.cpp: the whole model in one context in this process, threads 1
    and 2 (``threads = cores`` where the machine has more); the better of
    the two is the phase's baseline;
  * ggufpipe: inventory.example.yaml as shipped (three local stages in one
    agent process, ``threads`` left to ggufpipe), with the decode-thread
    governor (ggufpipe_agent/llama/threads.py, the default) and without it
    (``GGUFPIPE_ADAPT_THREADS=0``: every core for every step, as before);
  * ggufpipe, one stage: the whole model as a host's only stage, governor on
    (what a host of its own runs);
  * the bundled example with an agent process per stage (``share_process``
    off), governor on and off: the other stages' agents are the pipeline's
    own work, which the governor must not take for a neighbour's.

Each sample: prefill of a 512-token prompt (ms), then decode tokens/s over
128 tokens (EOS ignored). Medians of --repeats rounds; ratios to the phase's
baseline. Every pipeline is started (and warmed up) once, before the first
phase, with prefix reuse off. Writes docs/bench-busy.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_pipeline import CONTEXT, DECODE, UBATCH, Sample, pipeline_sample, start_pipeline  # noqa: E402
from ggufpipe_agent import aio  # noqa: E402
from ggufpipe_agent.llama.engine import StageEngine, StageShape  # noqa: E402
from ggufpipe_agent.wire.protocol import EngineOptions, SamplingParams  # noqa: E402
from ggufpipe_tui.core.inventory import Inventory, parse_inventory, with_run_options  # noqa: E402
from ggufpipe_tui.session.pipeline import Pipeline  # noqa: E402
from tests.support.common import smollm_path  # noqa: E402
from tests.support.local import long_prompt  # noqa: E402

EXAMPLE = REPO / "inventory.example.yaml"
BUSY_LOOP = ["sh", "-c", "while :; do :; done"]


class Reference:
    """The whole model in one llama.cpp context with ``threads`` threads."""

    def __init__(self, path: Path, threads: int) -> None:
        options = EngineOptions(n_ctx=CONTEXT, n_batch=CONTEXT, n_ubatch=UBATCH, threads=threads)
        self.engine = StageEngine(str(path), StageShape(True, True, 30, 576), options)

    def sample(self, prompts: dict[int, list[int]]) -> Sample:
        engine = self.engine
        engine.reset(SamplingParams())
        started = time.perf_counter()
        engine.step(prompts[512])
        prefill = (time.perf_counter() - started) * 1000
        engine.reset(SamplingParams())
        token = engine.step(prompts[128])
        started = time.perf_counter()
        for _ in range(DECODE):
            token = engine.step([token])  # type: ignore[list-item]
        return Sample(prefill, DECODE / (time.perf_counter() - started), 0.0)

    def close(self) -> None:
        self.engine.close()


def example_inventory() -> Inventory:
    """inventory.example.yaml with the benchmark's run options (its hosts and stages as shipped)."""
    inventory = parse_inventory(EXAMPLE.read_text(), EXAMPLE)
    inventory = with_run_options(inventory, context=CONTEXT, ubatch=UBATCH, chat=False, ignore_eos=True)
    # The references hold this process's event loop for seconds: the idle
    # pipelines' agents must not take that for a frozen orchestrator.
    timeouts = dataclasses.replace(inventory.timeouts, step=120.0, heartbeat=900.0, ready=300.0)
    return dataclasses.replace(inventory, timeouts=timeouts)


def per_stage_processes(inventory: Inventory) -> Inventory:
    """The same without share_process: an agent process per stage."""
    hosts = {name: dataclasses.replace(host, share_process=False) for name, host in inventory.hosts.items()}
    return dataclasses.replace(inventory, hosts=hosts)


def one_stage_inventory() -> Inventory:
    text = (
        f"model: {{path: {smollm_path()}}}\n"
        "hosts:\n  here: {local: true}\n"
        "stages:\n  - {host: here}\n"
        f"run: {{context: {CONTEXT}, ubatch: {UBATCH}, chat: false, ignore_eos: true}}\n"
        "timeouts: {connect: 30, ready: 300, step: 120, teardown: 15, heartbeat: 900}\n"
    )
    return parse_inventory(text, REPO / "benchmarks" / "bench.yaml")


#: name, inventory, the agents' environment
PIPELINES: list[tuple[str, str, dict[str, str]]] = [
    ("ggufpipe, bundled example (governor)", "example", {}),
    (
        "ggufpipe, bundled example, GGUFPIPE_ADAPT_THREADS=0 (before)",
        "example",
        {"GGUFPIPE_ADAPT_THREADS": "0"},
    ),
    ("ggufpipe, one stage, a host of its own (governor)", "one", {}),
    ("ggufpipe, example with a process per stage (governor)", "procs", {}),
    (
        "ggufpipe, example with a process per stage, GGUFPIPE_ADAPT_THREADS=0",
        "procs",
        {"GGUFPIPE_ADAPT_THREADS": "0"},
    ),
]


async def start_with_env(
    inventory: Inventory, env: dict[str, str], prompts: dict[int, list[int]], log_dir: str
) -> Pipeline:
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        return await start_pipeline(inventory, prompts, log_dir)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def start_busy(pinned: bool) -> subprocess.Popen[bytes]:
    core = max(os.sched_getaffinity(0)) if pinned else None

    def pin() -> None:
        if core is not None:
            os.sched_setaffinity(0, {core})

    # A process group of its own, as a program started from another shell or
    # job: the agents count their own group's CPU as the pipeline's.
    return subprocess.Popen(BUSY_LOOP, preexec_fn=pin, process_group=0)  # noqa: PLW1509 (only affinity)


def med(samples: list[Sample], field: str) -> float:
    return statistics.median(getattr(s, field) for s in samples)


def table(results: dict[str, dict[str, list[Sample]]], references: list[str], repeats: int) -> str:
    lines = []
    for phase, rows in results.items():
        best = max(references, key=lambda name: med(rows[name], "decode_tps"))
        base_tps = med(rows[best], "decode_tps")
        best_prefill = min(references, key=lambda name: med(rows[name], "prefill_ms"))
        base_prefill = med(rows[best_prefill], "prefill_ms")
        lines += [
            f"### {phase}",
            "",
            f"Baseline: {best} for decode, {best_prefill} for prefill (the better of llama.cpp's thread counts).",
            "",
            "| configuration | decode tok/s | range | x baseline | prefill 512 (ms) | x baseline (time) |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name, samples in rows.items():
            rates = [s.decode_tps for s in samples]
            tps, prefill = med(samples, "decode_tps"), med(samples, "prefill_ms")
            lines.append(
                f"| {name} | {tps:.1f} | {min(rates):.1f}-{max(rates):.1f} | {tps / base_tps:.2f} "
                f"| {prefill:.0f} | {prefill / base_prefill:.2f} |"
            )
        lines.append("")
    lines.append(f"Medians of {repeats} rounds; decode over {DECODE} tokens, prefill of a 512-token prompt.")
    return "\n".join(lines) + "\n"


async def main_async(args: argparse.Namespace) -> int:
    model = smollm_path()
    prompts = {n: long_prompt(model, n) for n in (128, 512)}
    log_dir = tempfile.mkdtemp(prefix="ggufpipe-bench-busy-")
    os.environ.setdefault("GGUFPIPE_CACHE_DIR", os.path.join(log_dir, "stages"))
    cores = len(os.sched_getaffinity(0))
    thread_counts = sorted({1, 2, cores} if cores > 1 else {1})
    references = {f"llama.cpp, {n} thread{'s' * (n > 1)}": Reference(model, n) for n in thread_counts}
    inventories = {
        "example": example_inventory(),
        "one": one_stage_inventory(),
        "procs": per_stage_processes(example_inventory()),
    }
    pipelines: dict[str, Pipeline] = {}
    phases = ["quiet", "busy loop, not pinned"] + ([] if args.no_pinned else ["busy loop pinned to one core"])
    results: dict[str, dict[str, list[Sample]]] = {
        phase: {name: [] for name in [*references, *(p[0] for p in PIPELINES)]} for phase in phases
    }
    try:
        for name, which, env in PIPELINES:
            print(f"starting {name} ...", flush=True)
            pipelines[name] = await start_with_env(inventories[which], env, prompts, log_dir)
        for phase in phases:
            busy = None if phase == "quiet" else start_busy(pinned="pinned" in phase)
            try:
                await asyncio.sleep(2.0)  # the governor's samples see the new load
                for round_ in range(args.repeats):
                    print(f"{phase}: round {round_ + 1} of {args.repeats}", flush=True)
                    for name, reference in references.items():
                        results[phase][name].append(reference.sample(prompts))
                    for name, which, _ in PIPELINES:
                        sample = await pipeline_sample(pipelines[name], inventories[which], prompts)
                        results[phase][name].append(sample)
                    print("  " + ", ".join(f"{n}: {r[-1].decode_tps:.1f}" for n, r in results[phase].items()))
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait()
    finally:
        for pipeline in pipelines.values():
            await pipeline.close()
        for reference in references.values():
            reference.close()
    report = table(results, list(references), args.repeats)
    print()
    print(report)
    if args.no_write:
        return 0
    command = "python benchmarks/bench_busy.py" + (f" --repeats {args.repeats}" if args.repeats != 3 else "")
    command += " --no-pinned" * args.no_pinned
    machine = f"{platform.machine()}, {cores} cores ({platform.processor() or platform.system()})"
    (REPO / "docs" / "bench-busy.md").write_text(
        "# The bundled example beside a busy neighbour\n\n"
        f"Measured {time.strftime('%Y-%m-%d')} on {machine} with `{command}`"
        f"{' (' + args.note + ')' if args.note else ''}. SmolLM2-135M Q4_1; the busy neighbour is "
        "one `sh -c 'while :; do :; done'`. See docs/performance.md (threads) for what the rows mean.\n\n"
        + report
    )
    print(f"written to {REPO / 'docs' / 'bench-busy.md'}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--no-pinned", action="store_true", help="skip the phase with the loop pinned to a core"
    )
    parser.add_argument("--no-write", action="store_true", help="print the table, leave docs/ alone")
    parser.add_argument(
        "--note", default="", help="a remark on the machine for the doc (e.g. its other load)"
    )
    return aio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
