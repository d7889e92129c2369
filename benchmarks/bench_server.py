"""Server benchmark: requests to ``--serve`` against llama.cpp's own chat
completion in one process, in one run.

    .venv/bin/python benchmarks/bench_server.py [--requests 8] [--stages 3]

Measures, on this machine, with SmolLM2-135M, greedy, a reply of at most
--max-tokens tokens:
  * the baseline: llama-cpp-python's ``create_chat_completion`` (stream=True)
    on the whole model in this process, threads = cores: time to first token
    and the whole reply;
  * ggufpipe --serve with --stages local stages, driven over HTTP (aiohttp's
    client, streamed chat completions): the client's time to first token and
    the whole request, one request at a time; the server's own time to first
    token of each run (its log line), so the rest is HTTP, JSON and queueing;
  * throughput with 4 clients at once (the server's default --parallel: its
    stages share this machine's cores, so one request in flight, the rest
    queue: docs/bench-parallel.md measures runs in flight, a core per stage);
  * one conversation of 10 turns over the API: each turn's prompt is the whole
    conversation; the stages keep the prefix it shares with the last request
    (run.reuse: cache, the default: every position they hold), and each turn
    says how many prompt tokens were reused
    (usage.prompt_tokens_details.cached_tokens) and computed, with its time to
    first token against llama.cpp's own Llama keeping its cache between the
    same turns (create_chat_completion on one object: it keeps the longest
    common prefix, as llama-server does with cache_prompt).
Medians; ratios against the baseline. Writes docs/bench-server.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import llama_cpp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.common import first_line, serve, smollm_path  # noqa: E402

QUESTIONS = [
    "Why is the sky blue?",
    "What is the capital of France?",
    "Name three fruits.",
    "What is two plus two?",
]
TURNS = [
    "My favourite colour is green.",
    "Why might that be?",
    "Name a green fruit.",
    "And a red one?",
    "Which of the two is sweeter?",
    "Give me a recipe with it, in one line.",
    "How long does that take to cook?",
    "What would you drink with it?",
    "Summarise our conversation in one sentence.",
    "Thank you. Say goodbye in French.",
]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def baseline(path: Path, max_tokens: int, repeats: int) -> dict[str, float]:
    llm = llama_cpp.Llama(str(path), n_ctx=2048, n_threads=os.cpu_count(), verbose=False, flash_attn=True)
    ttft, total, tokens = [], [], []
    for index in range(repeats):
        question = QUESTIONS[index % len(QUESTIONS)]
        started = time.perf_counter()
        first = 0.0
        count = 0
        for part in llm.create_chat_completion(
            [{"role": "user", "content": question}], max_tokens=max_tokens, temperature=0.0, stream=True
        ):
            delta = part["choices"][0]["delta"]  # type: ignore[index]
            if delta.get("content"):
                first = first or time.perf_counter()
                count += 1
        ttft.append((first - started) * 1000.0)
        total.append((time.perf_counter() - started) * 1000.0)
        tokens.append(count)
    llm.close()
    return {"ttft_ms": median(ttft), "total_ms": median(total), "tokens": median(tokens)}


def baseline_turns(path: Path, conversations: list[list[dict[str, str]]], max_tokens: int) -> list[float]:
    """Time to first token of each turn in ONE llama.cpp object that keeps its
    cache between turns (each turn: the same messages the server was sent)."""
    llm = llama_cpp.Llama(str(path), n_ctx=2048, n_threads=os.cpu_count(), verbose=False, flash_attn=True)
    times = []
    for messages in conversations:
        started, first = time.perf_counter(), 0.0
        for part in llm.create_chat_completion(messages, max_tokens=max_tokens, temperature=0.0, stream=True):
            if part["choices"][0]["delta"].get("content"):  # type: ignore[index]
                first = first or time.perf_counter()
        times.append((first - started) * 1000.0)
    llm.close()
    return times


class Server:
    """``ggufpipe-tui INVENTORY --serve`` started here (``args``: more of its
    options; ``new_session``: its own process group, its agents with it),
    ready once it says so; its stderr lines are kept."""

    def __init__(self, inventory: Path, workdir: Path, *args: str, new_session: bool = False) -> None:
        self.process, self.lines = serve(inventory, workdir / "runs", *args, start_new_session=new_session)
        listening = self.wait(lambda line: "listening on" in line)
        self.url = re.search(r"http://[^ ]+/v1", listening).group(0)  # type: ignore[union-attr]
        self.wait(lambda line: line.startswith("ggufpipe: ready:"))

    def wait(self, predicate: Any, timeout: float = 300.0) -> str:
        line = first_line(self.lines, self.process, predicate, timeout)
        if line is not None:
            return line
        raise RuntimeError("the server did not start:\n" + "".join(self.lines))

    @classmethod
    def local(cls, stages: int, workdir: Path) -> Server:
        """``stages`` local stages of SmolLM2 on one host, split by the planner."""
        inventory = workdir / "inventory.yaml"
        split = "".join("  - {host: here}\n" for _ in range(stages))
        inventory.write_text(
            f"model: {{path: '{smollm_path()}'}}\nhosts: {{here: {{local: true}}}}\nstages:\n{split}"
            "run: {context: 2048}\n"
        )
        return cls(inventory, workdir)

    def run_ttft(self, run: str) -> float:
        """The server's own time to first token of a run, from its log line."""
        line = self.wait(lambda line: f"run {run}" in line, 30)
        found = re.search(r"first token (\d+) ms", line)
        return float(found.group(1)) if found else 0.0

    def close(self) -> int:
        self.process.terminate()
        return self.process.wait(60)


async def ask(http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first = 0.0
    text, usage = "", {}
    async with http.post(f"{url}/chat/completions", json=body) as response:
        run = response.headers["X-Ggufpipe-Run"]
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = first or time.perf_counter()
                text += chunk["choices"][0]["delta"]["content"]
            usage = chunk.get("usage") or usage
    done = time.perf_counter()
    return {
        "ttft_ms": (first - started) * 1000.0,
        "total_ms": (done - started) * 1000.0,
        "started": started,
        "done": done,
        "run": run,
        "text": text,
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "completion_tokens": usage.get("completion_tokens", 0),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
    }


async def measure(server: Server, requests: int, max_tokens: int) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        await ask(http, server.url, [{"role": "user", "content": "Hi"}], 4)  # warm
        async with http.get(server.url.removesuffix("/v1") + "/health") as health:
            slots = int((await health.json())["slots"])
        sequential = []
        for index in range(requests):
            question = QUESTIONS[index % len(QUESTIONS)]
            sequential.append(await ask(http, server.url, [{"role": "user", "content": question}], max_tokens))
        started = time.perf_counter()
        clients = [
            ask(http, server.url, [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], max_tokens)
            for i in range(4 * max(1, requests // 4))
        ]
        concurrent = await asyncio.gather(*clients)
        wall = time.perf_counter() - started
        conversation: list[dict[str, str]] = []
        turns = []
        sent = []
        for turn in TURNS:
            conversation.append({"role": "user", "content": turn})
            sent.append(list(conversation))
            answer = await ask(http, server.url, conversation, max_tokens)
            conversation.append({"role": "assistant", "content": answer["text"]})
            turns.append(answer)
    for answer in sequential + turns:
        answer["run_ttft_ms"] = server.run_ttft(answer["run"])
    tokens = sum(a["completion_tokens"] for a in concurrent)
    return {
        "sequential": sequential,
        "concurrent": {"requests": len(concurrent), "wall_s": wall, "tokens": tokens,
                       "latency_ms": median([a["total_ms"] for a in concurrent])},
        "turns": turns,
        "sent": sent,
        "slots": slots,
    }


def report(base: dict[str, float], served: dict[str, Any], args: argparse.Namespace) -> str:
    seq = served["sequential"]
    ttft = median([a["ttft_ms"] for a in seq])
    total = median([a["total_ms"] for a in seq])
    run_ttft = median([a["run_ttft_ms"] for a in seq])
    decode = median([(a["completion_tokens"] - 1) / ((a["total_ms"] - a["ttft_ms"]) / 1000.0)
                     for a in seq if a["completion_tokens"] > 1 and a["total_ms"] > a["ttft_ms"]])
    base_decode = (base["tokens"] - 1) / ((base["total_ms"] - base["ttft_ms"]) / 1000.0)
    conc = served["concurrent"]
    lines = [
        "# Server benchmark",
        "",
        f"`benchmarks/bench_server.py --requests {args.requests} --stages {args.stages} "
        f"--max-tokens {args.max_tokens}` on {platform.machine()}, {os.cpu_count()} cores "
        f"({platform.python_version()}), load average {args.load:.1f} at the start (a shared machine: "
        "numbers are only comparable within one run), SmolLM2-135M Q4_1, greedy, streamed chat completions.",
        "Medians. The baseline is llama-cpp-python's own `create_chat_completion` on the whole model in",
        "one process (threads = cores); ggufpipe is `--serve` with local stages, asked over HTTP.",
        "",
        "| | time to first token ms | whole reply ms | decode tok/s |",
        "|---|---:|---:|---:|",
        f"| llama.cpp, one process | {base['ttft_ms']:.0f} | {base['total_ms']:.0f} | {base_decode:.1f} |",
        f"| ggufpipe --serve, {args.stages} stages (client) | {ttft:.0f} ({ttft / base['ttft_ms']:.2f}x) | "
        f"{total:.0f} ({total / base['total_ms']:.2f}x) | {decode:.1f} ({decode / base_decode:.2f}x) |",
        f"| of which the run (server's first token) | {run_ttft:.0f} | | |",
        "",
        f"HTTP, JSON and the queue add {ttft - run_ttft:.0f} ms to the first token (client minus the",
        "run's own time to first token, which counts from the request's arrival: tokenizing and",
        "provisioning included).",
        "",
        f"Four clients at once ({conc['requests']} requests): {conc['requests'] / conc['wall_s']:.2f} requests/s, "
        f"{conc['tokens'] / conc['wall_s']:.1f} generated tokens/s, median latency {conc['latency_ms']:.0f} ms "
        f"(the server's default --parallel here: {served['slots']} in flight at once, the rest queued; "
        "its stages share this machine's cores, one machine: docs/bench-parallel.md measures runs in "
        "flight with a core per stage).",
        "",
        "One conversation over the API, each turn's prompt the whole conversation so far",
        "(the stages keep what they can of the last request's prefix: the reused column):",
        "",
        "| turn | prompt tokens | reused | computed | reply tokens | first token ms (client) "
        "| first token ms (run) | llama.cpp keeping its cache, ms | ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for index, (turn, base_ms) in enumerate(zip(served["turns"], served["baseline_turns"], strict=True), 1):
        lines.append(
            f"| {index} | {turn['prompt_tokens']} | {turn['cached_tokens']} | "
            f"{turn['prompt_tokens'] - turn['cached_tokens']} | {turn['completion_tokens']} | "
            f"{turn['ttft_ms']:.0f} | {turn['run_ttft_ms']:.0f} | {base_ms:.0f} | {turn['ttft_ms'] / base_ms:.2f}x |"
        )
    later = served["turns"][1:]
    if later:
        first_half = median([t["ttft_ms"] for t in later[: len(later) // 2]])
        second_half = median([t["ttft_ms"] for t in later[len(later) // 2 :]])
        lines += [
            "",
            f"Follow-up turns compute only their new tokens: the median first token of turns 2-"
            f"{1 + len(later) // 2} is {first_half:.0f} ms, of the later turns {second_half:.0f} ms, while the "
            f"prompt grows from {later[0]['prompt_tokens']} to {later[-1]['prompt_tokens']} tokens.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    args.load = os.getloadavg()[0]
    path = smollm_path()
    base = baseline(path, args.max_tokens, args.requests)
    with tempfile.TemporaryDirectory() as workdir:
        server = Server.local(args.stages, Path(workdir))
        try:
            served = asyncio.run(measure(server, args.requests, args.max_tokens))
        finally:
            code = server.close()
    if code != 0:
        raise SystemExit(f"the server exited {code}:\n" + "".join(server.lines))
    served["baseline_turns"] = baseline_turns(path, served["sent"], args.max_tokens)
    text = report(base, served, args)
    print(text)
    (REPO / "docs" / "bench-server.md").write_text(text)


if __name__ == "__main__":
    main()
