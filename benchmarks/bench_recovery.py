"""Recovery benchmark: from a lost stage to the next token, against the cold
start of the same pipeline (docs/recovery.md).

    .venv/bin/python benchmarks/bench_recovery.py [--repeats 3] [--kill-at 32] [--no-write]

Three local stages of SmolLM2-135M (models/SmolLM2-135M-Instruct.Q4_1.gguf),
greedy, the token ring. Each repeat, in one process:

* cold start: ``Pipeline.start()`` (three agents, the model read, the data
  plane) and the first run to its first token (provision, load, prefill);
* then a run of ``--max-tokens`` whose stage 1 agent is SIGKILLed when token
  ``--kill-at`` streams: the time from the kill to the next new token, in
  parts: detect (kill to the loss report), teardown (the interrupted run torn
  down), restart (the agent started again, the model checked, a new data
  plane), load (the replay run provisioned and stage files loaded) and replay
  (the prompt and the tokens streamed computed again, one token a step), and
  the rest (to the next new token).

Medians of ``--repeats``. Results go to docs/bench-recovery.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ggufpipe_tui.core.events import RunRecovered, StageRecovery, TokenStreamed  # noqa: E402
from ggufpipe_tui.core.inventory import load_inventory  # noqa: E402
from ggufpipe_tui.session.pipeline import Pipeline  # noqa: E402
from tests.support.common import LONG_PROMPT, smollm_path  # noqa: E402

PARTS = ("detect", "teardown", "restart", "load", "replay", "next")


def write_inventory(directory: Path, max_tokens: int) -> Path:
    path = directory / "inventory.yaml"
    ranges = [(0, 7), (7, 23), (23, 30)]
    stages = "".join(f"  - {{host: here, layers: [{a}, {b}]}}\n" for a, b in ranges)
    path.write_text(
        f"model: {{path: {smollm_path()}}}\n"
        "hosts:\n  here: {local: true}\n"
        f"stages:\n{stages}"
        f"run: {{context: 1024, ubatch: 32, max_tokens: {max_tokens}, ignore_eos: true, chat: false}}\n"
        "timeouts: {connect: 30, ready: 60, step: 30, teardown: 5}\n"
        "recovery: {attempts: 2, deadline: 120}\n"
    )
    return path


async def one(inventory: Path, kill_at: int, log_dir: str) -> dict[str, float]:
    events: list[tuple[float, Any]] = []
    kill = {"at": 0.0}
    pipeline: Pipeline | None = None

    def seen(event: Any) -> None:
        now = time.perf_counter()
        events.append((now, event))
        if (
            isinstance(event, TokenStreamed)
            and event.sequence == kill_at
            and not kill["at"]
            and pipeline is not None
            # the long run, not the cold start's
            and any(len(driver.prompt) > 16 for driver in pipeline.live_drivers())
        ):
            hello = pipeline.links[1].hello
            assert hello is not None
            kill["at"] = time.perf_counter()
            os.kill(hello.pid, signal.SIGKILL)

    pipeline = Pipeline(load_inventory(inventory), seen, log_dir=log_dir)
    started = time.perf_counter()
    try:
        await pipeline.start()
        first = pipeline.submit(pipeline_prompt("Once upon a time"), stream=False)
        first_token = 0.0
        while not first_token:
            await asyncio.sleep(0.001)
            first_token = next((t for t, e in events if isinstance(e, TokenStreamed) and e.sequence == 0), 0.0)
        cold = first_token - started
        await first.result()
        result = await pipeline.generate(LONG_PROMPT, chat=False)
        assert result.ok, result.failure
    finally:
        await pipeline.close()
    (recovered,) = [e for _, e in events if isinstance(e, RunRecovered)]
    lost = next(t for t, e in events if isinstance(e, StageRecovery) and e.state == "Lost")
    after = next(
        t for t, e in events if isinstance(e, TokenStreamed) and t > lost and e.sequence >= recovered.at_token
    )
    decode = result.timings.decode_tokens_per_s
    return {
        "cold": cold,
        "total": after - kill["at"],
        "detect": recovered.lost_at - kill["at"],
        "teardown": recovered.teardown_s,
        "restart": recovered.restart_s,
        "load": recovered.load_s,
        "replay": recovered.replay_s,
        # The rest: the first new token's step and the moments between parts.
        "next": (after - kill["at"])
        - (recovered.lost_at - kill["at"])
        - recovered.teardown_s
        - recovered.restart_s
        - recovered.load_s
        - recovered.replay_s,
        "replayed": recovered.replayed,
        "at_token": recovered.at_token,
        "lost_seen": lost - kill["at"],
        "tokens_per_s": decode,
    }


def pipeline_prompt(text: str) -> Any:
    from ggufpipe_tui.session.runs import Prompt

    return Prompt(text=text, chat=False)


def table(rows: list[dict[str, float]]) -> str:
    def median(key: str) -> float:
        return statistics.median(row[key] for row in rows)

    total = median("total")
    lines = [
        "| part | median (s) | share |",
        "|---|---:|---:|",
    ]
    words = {
        "detect": "detect (SIGKILL to the loss report: the agent's exit read)",
        "teardown": "teardown (the interrupted run's survivors stopped)",
        "restart": "restart (agent started, model checked, new data plane)",
        "load": "load (the replay run provisioned, stage files loaded)",
        "replay": f"replay ({int(median('replayed'))} tokens: prompt and streamed, one a step)",
        "next": "the rest (the next token's step, the moments between parts)",
    }
    for part in PARTS:
        lines.append(f"| {words[part]} | {median(part):.3f} | {median(part) / total:.0%} |")
    lines.append(f"| **loss to the next token** | **{total:.3f}** | 100% |")
    lines.append(f"| cold start to the first token (same pipeline) | {median('cold'):.3f} | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        inventory = write_inventory(Path(directory), args.max_tokens)
        for repeat in range(args.repeats):
            row = asyncio.run(one(inventory, args.kill_at, str(Path(directory) / "runs")))
            rows.append(row)
            print(
                f"repeat {repeat + 1}: loss to next token {row['total']:.3f} s (cold start {row['cold']:.3f} s); "
                + ", ".join(f"{part} {row[part]:.3f}" for part in PARTS),
                flush=True,
            )
    text = table(rows)
    print(text)
    if args.no_write:
        return
    rate = statistics.median(row["tokens_per_s"] for row in rows)
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs (shared), Python {platform.python_version()}"
    doc = f"""# Recovery: from a lost stage to the next token

`benchmarks/bench_recovery.py` (`.venv/bin/python benchmarks/bench_recovery.py --repeats {args.repeats}`),
{time.strftime("%Y-%m-%d")}, {machine}. Three local stages of SmolLM2-135M Q4_1 (layers 0-7, 7-23,
23-30), greedy on the token ring, the prompt of tests/support/common.py `LONG_PROMPT` ({int(rows[0]['replayed']) - int(rows[0]['at_token'])} tokens), ubatch 32,
{args.max_tokens} tokens a reply at {rate:.0f} tokens/s; stage 1's agent SIGKILLed when token {args.kill_at} streams.
Medians of {args.repeats} repeats, each in one process: the cold start of the
pipeline (`Pipeline.start()` and its first run to the first token) is measured in
the same repeat, before the loss.

{text}

How to read it (docs/recovery.md):

* **detect** is what the orchestrator needs to know the agent is gone: its
  control stream ends at once with the process (a SIGSTOPped agent or a
  silent network is detected by the heartbeat instead: `timeouts.heartbeat`,
  30 s by default).
* **restart** is a new agent process (Python and llama.cpp imported), its
  model checked against stage 0's and the data plane set up again (new link
  ids and credentials for every pair).
* **load** and **replay** are a cold run: the replay regenerates the prompt
  and every token already streamed through the same batches (the prefill in
  ubatch chunks, then one token a step), which is what makes the continuation
  token-identical; its cost grows with the tokens streamed before the loss, at
  the decode rate. A faster replay (the surviving stages keep their KV cache,
  only the new stage is fed) is a later optimisation.
"""
    (REPO / "docs" / "bench-recovery.md").write_text(doc)
    print("wrote docs/bench-recovery.md")


if __name__ == "__main__":
    main()
