"""Stage engine benchmark: the whole model against in-process stage chains.

    .venv/bin/python benchmarks/bench_engine.py [--repeats 5] [--tokens 128]

Prints one table and writes it to docs/bench-engine.md: prefill time and decode
tokens/s of the whole model in one llama.cpp context beside chains of 2 and 3
stage engines in the same process (no agents, no transport), as ratios. This
isolates what splitting costs inside llama.cpp (the eval callback, the extra
contexts) from what the wire costs (benchmarks/bench_pipeline.py).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import llama_cpp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ggufpipe_agent.wire.protocol import EngineOptions  # noqa: E402
from tests.support.common import smollm_path  # noqa: E402
from tests.support.local import long_prompt  # noqa: E402
from tests.support.stage_chain import Chain  # noqa: E402

CONFIGS = {
    "whole model (1 context)": [(0, 30)],
    "2 stages [0,15) [15,30)": [(0, 15), (15, 30)],
    "3 stages [0,8) [8,21) [21,30)": [(0, 8), (8, 21), (21, 30)],
}


def measure(chain: Chain, prompt: list[int], tokens: int) -> tuple[float, float]:
    chain.reset()
    started = time.perf_counter()
    token = chain.step(0, prompt)
    prefill = time.perf_counter() - started
    started = time.perf_counter()
    for sequence in range(1, tokens + 1):
        token = chain.step(sequence, [token])
    decode = time.perf_counter() - started
    return prefill * 1000.0, tokens / decode


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128, help="decode steps per repeat")
    parser.add_argument("--prompt", type=int, default=512, help="prompt length in tokens")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "bench-engine.md")
    args = parser.parse_args()

    path = smollm_path()
    prompt = long_prompt(path, args.prompt)
    options = EngineOptions(n_ctx=1024, n_batch=1024, n_ubatch=512, threads=args.threads)
    chains = {name: Chain(path, splits, options) for name, splits in CONFIGS.items()}
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in CONFIGS}
    for chain in chains.values():
        measure(chain, prompt[:32], 8)  # warm-up
    # Interleave configurations so machine noise hits them alike.
    for _ in range(args.repeats):
        for name, chain in chains.items():
            samples[name].append(measure(chain, prompt, args.tokens))
    for chain in chains.values():
        chain.close()

    base_prefill = statistics.median(s[0] for s in samples["whole model (1 context)"])
    base_decode = statistics.median(s[1] for s in samples["whole model (1 context)"])
    lines = [
        f"Stage engine benchmark: SmolLM2-135M-Instruct Q4_1, prompt {args.prompt} tokens, "
        f"{args.tokens} decode steps, median of {args.repeats} interleaved repeats, "
        f"{os.cpu_count()} CPU cores ({platform.machine()}), llama-cpp-python {llama_cpp.__version__}.",
        "",
        "| configuration | prefill ms | prefill ratio | decode tokens/s | decode ratio |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in CONFIGS:
        prefill = statistics.median(s[0] for s in samples[name])
        decode = statistics.median(s[1] for s in samples[name])
        lines.append(
            f"| {name} | {prefill:.1f} | {prefill / base_prefill:.3f} | {decode:.1f} | {decode / base_decode:.3f} |"
        )
    lines += [
        "",
        "Ratios are against the whole model: prefill ratio above 1 is slower, decode ratio below 1 is slower.",
        f"Measured {time.strftime('%Y-%m-%d')} with `python benchmarks/bench_engine.py --repeats {args.repeats}`.",
    ]
    table = "\n".join(lines) + "\n"
    print(table)
    args.out.write_text("# Stage engine benchmark\n\n" + table)
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
