"""Follow-up benchmark: time to first token of a conversation's next turn, with
the stages' KV cache kept (prefix reuse) against a cold run of the same turn.

    .venv/bin/python benchmarks/bench_followup.py [--repeats 5] [--ubatch 32 512]

A conversation on three local stages of SmolLM2-135M: a first turn of about
FIRST prompt tokens that generates REPLY tokens, then a follow-up of FOLLOW_UP
new tokens (the second turn's prompt is the whole conversation so far). Each
repeat measures, on one warm pipeline:

  * cold follow-up: the second turn's prompt with reuse off (every stage
    starts from an empty cache and prefills all of it);
  * warm follow-up: the second turn right after the first, reuse on (the
    stages keep what they hold of the first turn and prefill the rest);
  * same rows, cold: a prompt as long as what the warm follow-up computed,
    reuse off: what a prefill "in proportion to its new tokens" costs;

and, in this process and in the same repeat, llama.cpp itself (llama-cpp-python's
Llama, the whole model, threads = cores) doing the same three prefills on the
same tokens: the baseline. Medians of --repeats;
TTFT is prompt given -> first token (provisioning of the run included, no
loading), prefill is prompt object written -> first token.

The target: the warm follow-up prefills only its new tokens, in proportion to
them: against a cold prefill of as many rows it costs no more than
PROPORTION_SLACK times what llama.cpp itself pays for the same (the new rows
attend to the whole context, in llama.cpp as in the stages).
Writes docs/bench-followup.md.
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

# The in-process baseline runs llama.cpp with the agents' OpenMP policy
# (ggufpipe_agent/cli.py): set before llama.cpp's OpenMP runtime loads.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import llama_cpp  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ggufpipe_tui.core.events import Event, StageStats  # noqa: E402
from ggufpipe_tui.core.inventory import parse_inventory, with_run_options  # noqa: E402
from ggufpipe_tui.session.pipeline import Pipeline  # noqa: E402
from tests.support.common import smollm_path  # noqa: E402
from tests.support.local import long_prompt, tokenize  # noqa: E402

CONTEXT = 2048
FIRST = 600  # first turn's prompt tokens
REPLY = 32  # tokens the first turn generates
FOLLOW_UP = " Thank you. Now tell me, in two short sentences, which of them built the most."
PROPORTION_SLACK = 1.25


@dataclasses.dataclass
class Arm:
    ttft_ms: list[float] = dataclasses.field(default_factory=list)
    prefill_ms: list[float] = dataclasses.field(default_factory=list)
    kept: int = 0
    rows: int = 0


def tokens_of(path: Path) -> tuple[list[int], list[int]]:
    return long_prompt(path, FIRST), tokenize(path, FOLLOW_UP, bos=False)


# ------------------------------------------------------------------ baseline


class Baseline:
    """llama.cpp itself for the whole model (llama-cpp-python's ``Llama``,
    threads = cores, flash attention on as in the stages), in this process:
    the same tokens as the pipeline's repeat, the follow-up cold, warm (the
    first turn's positions kept up to the pipeline's K: ``n_tokens = K``
    then ``eval``, which is how llama-cpp-python itself reuses a prefix) and
    as a prompt of as many rows from an empty cache."""

    def __init__(self, path: Path, ubatch: int) -> None:
        cores = os.cpu_count() or 1
        self.llm = llama_cpp.Llama(
            str(path),
            n_ctx=CONTEXT,
            n_batch=CONTEXT,
            n_ubatch=ubatch,
            n_threads=cores,
            n_threads_batch=cores,
            flash_attn=True,
            verbose=False,
        )
        self.arms = {"cold": Arm(), "warm": Arm(), "same rows, cold": Arm()}

    def prefill(self, tokens: list[int], arm: str, kept: int = 0) -> None:
        started = time.perf_counter()
        self.llm.eval(tokens)
        self.arms[arm].prefill_ms.append((time.perf_counter() - started) * 1000)
        self.arms[arm].kept, self.arms[arm].rows = kept, len(tokens)

    def repeat(self, fed: list[int], second: list[int], kept: int) -> None:
        """``fed``: what the pipeline's first turn wrote (its prompt and every
        generated token but the last); ``kept``: what its follow-up kept."""
        llm = self.llm
        llm.reset()
        llm.eval(fed)
        llm.n_tokens = kept  # the next eval drops the cache from here
        self.prefill(second[kept:], "warm", kept)
        llm.reset()
        self.prefill(second, "cold")
        llm.reset()
        self.prefill(second[kept:], "same rows, cold")

    def close(self) -> None:
        self.llm.close()


# ------------------------------------------------------------------ pipeline


def inventory_text(model: Path, ubatch: int) -> str:
    return (
        f"model: {{path: {model}}}\n"
        "hosts:\n  here: {local: true}\n"
        "stages:\n" + "  - {host: here}\n" * 3 + "run: {"
        f"context: {CONTEXT}, ubatch: {ubatch}, chat: false, ignore_eos: true"
        "}\n"
        "timeouts: {connect: 30, ready: 300, step: 120, teardown: 15}\n"
    )


async def measure(
    model: Path, first: list[int], follow: list[int], ubatch: int, repeats: int, log_dir: str
) -> tuple[dict[str, Arm], dict[str, Arm]]:
    """Each repeat: the pipeline's arms, then the baseline's (interleaved, so
    the machine's load drifts through both alike)."""
    inventory = parse_inventory(inventory_text(model, ubatch), REPO / "benchmarks" / "bench.yaml")
    stats: list[StageStats] = []

    def keep(event: Event) -> None:
        if isinstance(event, StageStats):
            stats.append(event)

    pipeline = Pipeline(inventory, keep, log_dir=log_dir)
    arms = {"cold": Arm(), "warm": Arm(), "same rows, cold": Arm()}

    async def run(tokens: list[int], reuse: bool, max_tokens: int, arm: str | None) -> list[int]:
        pipeline.prefix_reuse = reuse
        pipeline.inventory = with_run_options(inventory, max_tokens=max_tokens)
        result = await pipeline.generate_tokens(tokens)
        assert result.ok, result.failure
        if arm is not None:
            counters = [s.counters for s in stats if s.run_id == result.run_id]
            assert counters and all(c.kept == result.prompt_reused for c in counters)
            arms[arm].ttft_ms.append(result.timings.ttft_ms)
            arms[arm].prefill_ms.append(result.timings.prefill_ms)
            arms[arm].kept, arms[arm].rows = result.prompt_reused, result.prompt_computed
        return list(result.tokens)

    base = Baseline(model, ubatch)
    try:
        await pipeline.start()
        # Warm-up: loads every stage, then keeps a prefix once, which probes
        # each stage's kernels (docs/worker.md) outside the measurements.
        await run(first[:40], False, 2, None)
        await run(first[:60], True, 1, None)
        for _ in range(repeats):
            reply = await run(first, False, REPLY, None)  # the first turn, from an empty cache
            second = first + reply + follow
            await run(second, True, 1, "warm")  # the follow-up, right after it
            await run(second, False, 1, "cold")
            await run(second[-arms["warm"].rows :], False, 1, "same rows, cold")
            base.repeat(first + reply[:-1], second, arms["warm"].kept)
    finally:
        await pipeline.close()
        base.close()
    return arms, base.arms


# ------------------------------------------------------------------- output


def median(values: list[float]) -> float:
    return statistics.median(values)


def table(results: dict[int, tuple[dict[str, Arm], dict[str, Arm]]], repeats: int) -> tuple[str, list[str]]:
    lines = [
        "| ubatch | configuration | kept | computed rows | TTFT ms | prefill ms | vs cold | vs same rows, cold |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    verdicts = []
    for ubatch, (pipeline, base) in results.items():
        for label, arms in (("3 stages", pipeline), ("one llama.cpp process", base)):
            cold, same = median(arms["cold"].prefill_ms), median(arms["same rows, cold"].prefill_ms)
            for name, arm in arms.items():
                prefill = median(arm.prefill_ms)
                ttft = f"{median(arm.ttft_ms):.1f}" if arm.ttft_ms else ""
                lines.append(
                    f"| {ubatch} | {label}, {name} follow-up | {arm.kept} | {arm.rows} | {ttft} "
                    f"| {prefill:.1f} | {prefill / cold:.3f} | {prefill / same:.3f} |"
                )
        warm, same = median(pipeline["warm"].prefill_ms), median(pipeline["same rows, cold"].prefill_ms)
        cold = median(pipeline["cold"].prefill_ms)
        base_warm = median(base["warm"].prefill_ms)
        base_ratio = base_warm / median(base["same rows, cold"].prefill_ms)
        ttft_warm, ttft_cold = median(pipeline["warm"].ttft_ms), median(pipeline["cold"].ttft_ms)
        new = len(FOLLOW_UP_TOKENS) + 1  # the follow-up's tokens and the reply's last token
        rows, total = pipeline["warm"].rows, pipeline["cold"].rows
        only_new = rows == new
        met = warm / same <= PROPORTION_SLACK * base_ratio
        verdicts.append(
            f"- ubatch {ubatch}: the warm follow-up computed {rows} of {total} prompt rows "
            f"({'only the new tokens' if only_new else 'the new tokens and more'}: {new} are new, "
            f"{rows / total:.1%} of the prompt) in {warm:.1f} ms, {warm / cold:.1%} of the cold "
            f"prefill ({cold:.1f} ms); first token after {ttft_warm:.0f} ms instead of {ttft_cold:.0f} ms "
            f"({ttft_cold / ttft_warm:.1f}x sooner). Against a cold prompt of as many rows it costs "
            f"{warm / same:.2f}x (attending to the {total}-token context); llama.cpp itself pays "
            f"{base_ratio:.2f}x for the same, and {base_warm:.1f} ms for the same warm prefill "
            f"(3 stages: {warm / base_warm:.2f}x). Target (prefill in proportion to "
            f"{'its new tokens only' if only_new else 'the rows it computes'}: within "
            f"{PROPORTION_SLACK}x of llama.cpp's own ratio): "
            f"{'met' if met and only_new else 'met for the rows it computes' if met else 'not met'}."
        )
    header = (
        f"SmolLM2-135M-Instruct Q4_1, 3 local stages (blocks split evenly, agent threads: all cores each), "
        f"context {CONTEXT}; a first turn of {FIRST} prompt tokens generating {REPLY} (EOS ignored), then a "
        f"follow-up of {len(FOLLOW_UP_TOKENS)} new tokens; median of {repeats} repeats; "
        f"{os.cpu_count()} cores ({platform.machine()}), llama-cpp-python {llama_cpp.__version__}, "
        f"load average {LOAD[0]:.1f} at the start and {LOAD[-1]:.1f} at the end (the machine is shared; "
        "each repeat measures the pipeline and the baseline one after the other, so compare rows "
        "within this table). TTFT: prompt given -> first token (run provisioning included, no "
        "loading); prefill: prompt object written -> first token (the baseline: llama-cpp-python's "
        "Llama.eval alone, threads = cores, with the agents' GOMP_SPINCOUNT)."
    )
    return header + "\n\n" + "\n".join(lines) + "\n", verdicts


FOLLOW_UP_TOKENS: list[int] = []
LOAD: list[float] = []


async def main_async(args: argparse.Namespace) -> int:
    model = smollm_path()
    first, follow = tokens_of(model)
    FOLLOW_UP_TOKENS[:] = follow
    LOAD.append(os.getloadavg()[0])
    log_dir = tempfile.mkdtemp(prefix="ggufpipe-bench-")
    os.environ.setdefault("GGUFPIPE_CACHE_DIR", os.path.join(log_dir, "stages"))
    results = {}
    for ubatch in args.ubatch:
        print(f"measuring ubatch {ubatch} ...", flush=True)
        results[ubatch] = await measure(model, first, follow, ubatch, args.repeats, log_dir)
    LOAD.append(os.getloadavg()[0])
    report, verdicts = table(results, args.repeats)
    print()
    print(report)
    print("\n".join(verdicts))
    command = "python benchmarks/bench_followup.py" + (f" --repeats {args.repeats}" if args.repeats != 5 else "")
    if args.ubatch != [32, 512]:
        command += " --ubatch " + " ".join(map(str, args.ubatch))
    path = REPO / "docs" / "bench-followup.md"
    path.write_text(
        "# Follow-up benchmark: prefix reuse\n\n"
        f"Measured {time.strftime('%Y-%m-%d')} with `{command}`.\n\n"
        + report
        + "\n"
        + "\n".join(verdicts)
        + "\n\n"
        + NOTES
    )
    print(f"written to {path}")
    return 0


NOTES = """What the rows show. With ubatch 32 every SmolLM2 stage computes a row bit
for bit alike in any batch (the stages' probe says so at load), so a stage
keeps every position it holds and the follow-up prefills only the reply's last
token (never fed back) and the new words. With ubatch 512, llama.cpp's CPU
kernels for a 512-row batch differ from a one-row step in the last bits, so a
stage keeps only what it prefilled in whole 512-row ubatches (what a cold run
computes alike): the follow-up keeps 512 positions and computes the rest,
exactly, in proportion to what it computes rather than to its new tokens.
The price of the small ubatch is the cold prefill (compare the cold rows of
the two ubatches): on a CPU, keep the small one for chat, where most turns
are follow-ups. The baseline rows are llama.cpp itself doing the same
prefills on the same tokens (its warm row keeps as many positions as the
stages did); its ratio to a cold prompt of as many rows is what attending to
the longer context costs. See docs/worker.md, "Prefix reuse".
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ubatch", type=int, nargs="+", default=[32, 512])
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
