"""Pipeline benchmark: ggufpipe against one llama.cpp process, in one run.

    .venv/bin/python benchmarks/bench_pipeline.py [--repeats 5] [--quick]

Measures, on this machine:
  * the whole model in one llama.cpp context in this process (the baseline);
  * ggufpipe with 1, 2 and 3 stages over the local transport and over SSH (a
    real OpenSSH server on loopback, started here), with float32 and float16
    activations;
and for each: prefill time of a 128- and a 512-token prompt, decode tokens/s
over 128 generated tokens (EOS ignored), time to first token (a warm pipeline:
provisioning of the run included, loading not) and the per-token overhead in ms
(pipeline minus baseline). Medians of --repeats runs; ratios against the
baseline. Where the time goes: the stages' mean step time beside the
per-token time (the rest is transport, relay and orchestrator).

Writes docs/bench-pipeline.md and docs/bench-pipeline.png.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import llama_cpp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ggufpipe_agent.engine import StageEngine, StageShape  # noqa: E402
from ggufpipe_agent.protocol import EngineOptions  # noqa: E402
from ggufpipe_tui.core.inventory import parse_inventory, with_run_options  # noqa: E402
from ggufpipe_tui.session.pipeline import Pipeline  # noqa: E402
from tests.conftest import LONG_PROMPT, smollm_path  # noqa: E402

CONTEXT = 1024
UBATCH = 512
DECODE = 128
PROMPTS = (128, 512)


@dataclasses.dataclass
class Sample:
    prefill_ms: dict[int, float]
    decode_tps: float
    ttft_ms: float
    step_ms: tuple[float, ...] = ()


def prompt_tokens(path: Path, length: int) -> list[int]:
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    tokens = llm.tokenize(LONG_PROMPT.encode(), add_bos=True)
    llm.close()
    return (tokens * (length // len(tokens) + 1))[:length]


# ------------------------------------------------------------------ baseline


def baseline(path: Path, prompts: dict[int, list[int]], repeats: int) -> list[Sample]:
    engine = StageEngine(
        str(path),
        StageShape(True, True, 30, 576),
        EngineOptions(n_ctx=CONTEXT, n_batch=CONTEXT, n_ubatch=UBATCH),
    )
    samples = []
    try:
        for _ in range(repeats):
            prefill = {}
            for length, tokens in prompts.items():
                engine.reset(engine_sampling())
                started = time.perf_counter()
                token = engine.step(tokens)
                prefill[length] = (time.perf_counter() - started) * 1000
            engine.reset(engine_sampling())
            started = time.perf_counter()
            token = engine.step(prompts[128])
            ttft = (time.perf_counter() - started) * 1000
            started = time.perf_counter()
            for _ in range(DECODE):
                token = engine.step([token])
            samples.append(Sample(prefill, DECODE / (time.perf_counter() - started), ttft))
    finally:
        engine.close()
    return samples


def engine_sampling() -> Any:
    from ggufpipe_agent.protocol import SamplingParams

    return SamplingParams()


# ------------------------------------------------------------------ pipeline


def inventory_text(model: Path, hosts: str, stage_host: str, stages: int, dtype: str) -> str:
    return (
        f"model: {{path: {model}}}\n"
        f"hosts:\n{hosts}"
        "stages:\n" + "".join(f"  - {{host: {stage_host}}}\n" for _ in range(stages)) + "run: {"
        f"context: {CONTEXT}, ubatch: {UBATCH}, activation_dtype: {dtype}, chat: false, ignore_eos: true"
        "}\n"
        "timeouts: {connect: 30, ready: 300, step: 120, teardown: 15}\n"
    )


async def pipeline_samples(
    text: str, prompts: dict[int, list[int]], repeats: int, log_dir: str
) -> list[Sample]:
    inventory = parse_inventory(text, REPO / "benchmarks" / "bench.yaml")
    pipeline = Pipeline(inventory, lambda event: None, log_dir=log_dir)
    samples = []
    try:
        await pipeline.start()
        pipeline.inventory = with_run_options(inventory, max_tokens=4)
        await pipeline.generate_tokens(prompts[128][:32])  # warm-up: loads every stage
        for _ in range(repeats):
            prefill = {}
            for length, tokens in prompts.items():
                pipeline.inventory = with_run_options(inventory, max_tokens=1)
                result = await pipeline.generate_tokens(tokens)
                assert result.ok, result.failure
                prefill[length] = result.timings.prefill_ms
            pipeline.inventory = with_run_options(inventory, max_tokens=DECODE + 1)
            result = await pipeline.generate_tokens(prompts[128])
            assert result.ok and len(result.tokens) == DECODE + 1, result.failure
            timings = result.timings
            samples.append(
                Sample(prefill, timings.decode_tokens_per_s, timings.ttft_ms, timings.stage_mean_step_ms)
            )
    finally:
        await pipeline.close()
    return samples


def median(samples: list[Sample], field: str, key: int | None = None) -> float:
    values = [getattr(s, field)[key] if key is not None else getattr(s, field) for s in samples]
    return statistics.median(values)


# ------------------------------------------------------------------- output


def table(results: dict[str, list[Sample]], base: list[Sample], repeats: int, threads: str) -> str:
    base_prefill = {n: median(base, "prefill_ms", n) for n in PROMPTS}
    base_tps = median(base, "decode_tps")
    lines = [
        "| configuration | prefill 128 ms | ratio | prefill 512 ms | ratio | TTFT ms | decode tok/s | ratio "
        "| overhead ms/token | stage step ms (mean) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        f"| single llama.cpp process | {base_prefill[128]:.1f} | 1.000 | {base_prefill[512]:.1f} | 1.000 "
        f"| {median(base, 'ttft_ms'):.1f} | {base_tps:.1f} | 1.000 | 0.00 | {1000 / base_tps:.2f} (whole model) |",
    ]
    for name, samples in results.items():
        prefill = {n: median(samples, "prefill_ms", n) for n in PROMPTS}
        tps = median(samples, "decode_tps")
        steps = [statistics.median(s.step_ms[i] for s in samples) for i in range(len(samples[0].step_ms))]
        lines.append(
            f"| {name} | {prefill[128]:.1f} | {prefill[128] / base_prefill[128]:.3f} | {prefill[512]:.1f} "
            f"| {prefill[512] / base_prefill[512]:.3f} | {median(samples, 'ttft_ms'):.1f} | {tps:.1f} "
            f"| {tps / base_tps:.3f} | {1000 / tps - 1000 / base_tps:.2f} "
            f"| {' + '.join(f'{ms:.2f}' for ms in steps)} = {sum(steps):.2f} of {1000 / tps:.2f} |"
        )
    header = (
        f"SmolLM2-135M-Instruct Q4_1 (30 blocks, hidden 576), context {CONTEXT}, ubatch {UBATCH}, "
        f"{DECODE} decode tokens with EOS ignored, median of {repeats} repeats, "
        f"{os.cpu_count()} cores ({platform.machine()}), llama-cpp-python {llama_cpp.__version__}, "
        f"agent threads: {threads}. Stages split the blocks evenly. Ratios: prefill above 1 is slower, "
        "decode below 1 is slower. Overhead = pipeline ms/token - single process ms/token. The last "
        "column compares the stages' own step time with the whole per-token time; the difference is "
        "transport, relay and orchestrator."
    )
    return header + "\n\n" + "\n".join(lines) + "\n"


def plot(results: dict[str, list[Sample]], base: list[Sample], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    base_tps = median(base, "decode_tps")
    tps = [median(results[n], "decode_tps") for n in names]
    prefill = [median(results[n], "prefill_ms", 512) / median(base, "prefill_ms", 512) for n in names]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.5))
    left.barh(names, [t / base_tps for t in tps], color="#4c78a8")
    left.axvline(1.0, color="black", linewidth=1)
    left.axvline(0.90, color="#e45756", linestyle="--", linewidth=1, label="target 0.90 (local)")
    left.axvline(0.85, color="#f58518", linestyle=":", linewidth=1, label="target 0.85 (SSH)")
    left.set_xlabel("decode tokens/s, ratio to one llama.cpp process")
    left.legend(loc="lower right", fontsize=8)
    left.invert_yaxis()
    right.barh(names, prefill, color="#72b7b2")
    right.axvline(1.0, color="black", linewidth=1)
    right.axvline(1.15, color="#e45756", linestyle="--", linewidth=1, label="target 1.15")
    right.set_xlabel("prefill time of a 512-token prompt, ratio to one process")
    right.set_yticklabels([])
    right.legend(loc="lower right", fontsize=8)
    right.invert_yaxis()
    fig.suptitle(f"ggufpipe vs one llama.cpp process: SmolLM2-135M on {os.cpu_count()} CPU cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main_async(args: argparse.Namespace) -> int:
    model = smollm_path()
    prompts = {n: prompt_tokens(model, n) for n in PROMPTS}
    log_dir = tempfile.mkdtemp(prefix="ggufpipe-bench-")
    os.environ.setdefault("GGUFPIPE_CACHE_DIR", os.path.join(log_dir, "stages"))
    threads = f"threads: {args.threads}" if args.threads else "all cores each"
    thread_key = f", threads: {args.threads}" if args.threads else ""
    stage_counts = (1, 3) if args.quick else (1, 2, 3)
    dtypes = ("float32",) if args.quick else ("float32", "float16")
    transports = ["local"] if args.no_ssh else ["local", "ssh"]

    sshd = None
    hosts = {"local": f"  here: {{local: true{thread_key}}}\n"}
    if "ssh" in transports:
        from tests.sshd import Sshd, sshd_missing

        missing = sshd_missing()
        if missing:
            print(f"SSH rows skipped: {missing}")
            transports.remove("ssh")
        else:
            sshd = Sshd(Path(tempfile.mkdtemp(prefix="ggufpipe-bench-sshd-"))).start()
            agent = f"{sys.executable} -m ggufpipe_agent"
            hosts["ssh"] = (
                f"  gpu: {{address: 127.0.0.1, port: {sshd.port}, user: {sshd.user}, identity: {sshd.client_key}, "
                f"known_hosts: {sshd.known_hosts}, agent: '{agent}', cache_dir: {os.environ['GGUFPIPE_CACHE_DIR']}"
                f"{thread_key}}}\n"
            )
    host_name = {"local": "here", "ssh": "gpu"}
    base = baseline(model, prompts, args.repeats)
    results: dict[str, list[Sample]] = {}
    try:
        for transport in transports:
            for stages in stage_counts:
                for dtype in dtypes:
                    name = f"{stages} stage{'s' if stages > 1 else ''}, {transport}, {dtype}"
                    text = inventory_text(model, hosts[transport], host_name[transport], stages, dtype)
                    print(f"measuring {name} ...", flush=True)
                    results[name] = await pipeline_samples(text, prompts, args.repeats, log_dir)
        base += baseline(model, prompts, args.repeats)  # before and after: drift shows in the median
    finally:
        if sshd is not None:
            sshd.stop()
    report = table(results, base, args.repeats, threads)
    print()
    print(report)
    docs = REPO / "docs"
    command = "python benchmarks/bench_pipeline.py" + (
        f" --repeats {args.repeats}" if args.repeats != 5 else ""
    )
    (docs / "bench-pipeline.md").write_text(
        "# Pipeline benchmark\n\n"
        f"Measured {time.strftime('%Y-%m-%d')} with `{command}` ([plot](bench-pipeline.png)).\n\n" + report
    )
    plot(results, base, docs / "bench-pipeline.png")
    print(f"written to {docs / 'bench-pipeline.md'} and {docs / 'bench-pipeline.png'}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="threads per agent (0: all cores)")
    parser.add_argument("--quick", action="store_true", help="1 and 3 stages, float32 only")
    parser.add_argument("--no-ssh", action="store_true", help="skip the SSH rows")
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
