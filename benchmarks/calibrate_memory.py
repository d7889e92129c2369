"""Calibrate the memory estimate against what llama.cpp allocates.

Loads stages of the real models (SmolLM2-135M, Gemma 3 270M) and of synthetic
GGUFs whose shapes make each phase of the compute graph the widest (a tiny
vocabulary with a wide feed-forward, wide attention, long contexts), reads
the buffers llama.cpp logs (model, KV cache, output, compute), and compares
each with :func:`ggufpipe_agent.gguf.memory.estimate_stage`. Then measures what
the output buffer of a non-last stage grows to after a full-batch prefill
(llama.cpp does not log that reallocation): the process's anonymous memory
before and after.

    .venv/bin/python benchmarks/calibrate_memory.py        # writes docs/memory-calibration.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import llama_cpp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tests.support.synthetic as synthetic  # noqa: E402
from ggufpipe_agent.gguf.facts import read_model_facts  # noqa: E402
from ggufpipe_agent.gguf.memory import MIB, estimate_stage, memory_facts_of  # noqa: E402
from ggufpipe_tui.core.inventory import RunOptions  # noqa: E402
from ggufpipe_tui.core.plan import engine_options  # noqa: E402
from tests.support.common import REPO, smollm_path  # noqa: E402
from tests.support.llama_buffers import load_and_report, resident_anonymous  # noqa: E402
from tests.support.stage_chain import even_splits  # noqa: E402

GEMMA = REPO / "models" / "gemma-3-270m-q4_k_m.gguf"
#: (name, architecture, hidden, heads, kv heads, feed-forward): which phase peaks.
SHAPES = [
    ("tiny", "llama", 64, 4, 2, 128),
    ("wide-ffn", "llama", 256, 4, 2, 2048),
    ("wider-ffn", "llama", 256, 8, 2, 8192),
    ("wide-attn", "llama", 512, 8, 8, 512),
    ("gemma3-ffn", "gemma3", 256, 4, 2, 2048),
    ("gemma3-attn", "gemma3", 512, 8, 8, 512),
]
SIZES = [(512, 64), (512, 512), (4096, 512), (16384, 64), (16384, 512)]  # (context, ubatch)


def ratio(estimate: int, reported: int) -> float:
    return estimate / reported if reported else float("nan")


def real_rows(cache: Path) -> list[str]:
    rows = []
    for path in (smollm_path(), GEMMA):
        if not path.exists():
            continue
        facts = read_model_facts(path)
        memory = memory_facts_of(facts)
        for context, ubatch in ((512, 32), (2048, 512), (8192, 512)):
            options = engine_options(RunOptions(context=context, ubatch=ubatch), facts)
            for splits in ([(0, facts.block_count)], even_splits(facts.block_count, 3)):
                for start, end in splits:
                    reported, engine = load_and_report(path, start, end, options, cache)
                    engine.close()
                    host = estimate_stage(memory, start, end, options).host
                    created = memory.n_vocab * 4  # the output buffer as made (one row)
                    total = host.weights + host.kv + host.compute + created
                    rows.append(
                        f"| {path.stem} | {context} | {ubatch} | [{start}, {end}) "
                        f"| {reported.model / MIB:.1f} | {ratio(host.weights, reported.model):.3f} "
                        f"| {reported.kv / MIB:.1f} | {ratio(host.kv, reported.kv):.3f} "
                        f"| {reported.compute / MIB:.1f} | {ratio(host.compute, reported.compute):.3f} "
                        f"| {ratio(total, reported.total):.3f} |"
                    )
                    print(rows[-1], flush=True)
    return rows


def synthetic_rows(cache: Path) -> tuple[list[str], list[float]]:
    rows, ratios = [], []
    saved = (synthetic.HIDDEN, synthetic.HEADS, synthetic.KV_HEADS, synthetic.HEAD_DIM, synthetic.FFN)
    try:
        for name, arch, hidden, heads, kv_heads, ffn in SHAPES:
            synthetic.HIDDEN, synthetic.HEADS, synthetic.KV_HEADS = hidden, heads, kv_heads
            synthetic.HEAD_DIM, synthetic.FFN, synthetic.CONTEXT = hidden // heads, ffn, 32768
            path = synthetic.write_model(cache / f"{name}.gguf", arch)
            facts = read_model_facts(path)
            memory = memory_facts_of(facts)
            for context, ubatch in SIZES:
                options = engine_options(RunOptions(context=context, ubatch=ubatch), facts)
                reported, engine = load_and_report(path, 0, facts.block_count, options, cache)
                engine.close()
                estimate = estimate_stage(memory, 0, facts.block_count, options).host.compute
                ratios.append(ratio(estimate, reported.compute))
                rows.append(
                    f"| {name} | {hidden} | {heads}/{kv_heads} | {ffn} | {context} | {ubatch} "
                    f"| {reported.compute / MIB:.2f} | {estimate / MIB:.2f} | {ratios[-1]:.3f} |"
                )
                print(rows[-1], flush=True)
    finally:
        synthetic.HIDDEN, synthetic.HEADS, synthetic.KV_HEADS, synthetic.HEAD_DIM, synthetic.FFN = saved
    return rows, ratios


def output_rows(cache: Path) -> list[str]:
    """A non-last stage's output buffer after a prefill of a whole batch."""
    rows = []
    for path, context in ((smollm_path(), 1024), (GEMMA, 512)):
        if not path.exists():
            continue
        facts = read_model_facts(path)
        options = engine_options(RunOptions(context=context, ubatch=512), facts)
        end = facts.block_count // 3
        _, engine = load_and_report(path, 0, end, options, cache)
        before = resident_anonymous()
        engine.step(list(range(10, 10 + options.n_batch)))
        grown = resident_anonymous() - before
        engine.close()
        estimate = estimate_stage(memory_facts_of(facts), 0, end, options).host.outputs
        rows.append(
            f"| {path.stem} | [0, {end}) | {options.n_batch} | {grown / MIB:.1f} | {estimate / MIB:.1f} "
            f"| {ratio(estimate, grown):.3f} |"
        )
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "memory-calibration.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        cache = Path(directory)
        real = real_rows(cache)
        shaped, ratios = synthetic_rows(cache)
        outputs = output_rows(cache)
    text = [
        "# Memory estimate against llama.cpp",
        "",
        "Written by `benchmarks/calibrate_memory.py` "
        f"(llama-cpp-python {getattr(llama_cpp, '__version__', '?')}, {platform.machine()}, CPU). "
        "Each figure is what llama.cpp logged for the buffer, and the ratio estimate / logged; "
        "docs/planning.md explains the estimate.",
        "",
        "## Real models, whole and in three stages",
        "",
        "The model ratio is below 1 where llama.cpp repacks some Q4_K tensors for the CPU "
        "(`CPU_REPACK`): its mapped buffer still spans them, so they are logged twice.",
        "",
        "| model | context | ubatch | stage | model MiB | ratio | KV MiB | ratio | compute MiB | ratio "
        "| total ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *real,
        "",
        "## Compute buffer: synthetic shapes",
        "",
        "A tiny vocabulary, so the blocks' phases peak (feed-forward or attention, and the masks "
        f"of long contexts). Median ratio {statistics.median(ratios):.3f}, range "
        f"{min(ratios):.3f} to {max(ratios):.3f}.",
        "",
        "| shape | hidden | heads/kv | ffn | context | ubatch | logged MiB | estimate MiB | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
        *shaped,
        "",
        "## Output buffer of a non-last stage after a full-batch prefill",
        "",
        "Anonymous resident memory grown by one prefill of `n_batch` tokens through the stage "
        "(every row is an output, so llama.cpp sizes its logits buffer for all of them).",
        "",
        "| model | stage | rows | grown MiB | estimate MiB | ratio |",
        "|---|---|---|---|---|---|",
        *outputs,
        "",
    ]
    args.out.write_text("\n".join(text))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
