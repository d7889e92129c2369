"""Agent requests benchmark: what an agent sends (a prompt with 30 tools, a
reply held to a JSON schema) through ``--serve``, against llama.cpp's own
llama-server, in one run.

    .venv/bin/python benchmarks/bench_agents.py [--repeats 5] [--max-tokens 48] [--out docs/bench-agents.md]

Measures, on this machine, with SmolLM2-135M, greedy, streamed chat
completions, every prompt computed cold (``cache_prompt: false``), three
requests:
  * agent: a system prompt, a user turn and 30 made-up function tools,
    ``tool_choice: auto`` (the prompt carries every tool's schema; the reply
    is parsed for calls as it streams);
  * schema: a ``response_format`` ``json_schema`` (grammar-constrained
    sampling in the last stage);
  * plain: the same user turn, no tools, no schema;
each --repeats times, against
  * ggufpipe --serve on 2 local stages, layers [0, 15) and [15, 30), on 2
    local hosts with ``threads: 1`` each (each stage its own core here);
  * llama-server (scripts/build-llama-server: the llama.cpp our
    llama-cpp-python vendors) on the whole model, ``-t 2`` (threads = cores:
    llama.cpp at its best here), ``--parallel 1``;
both with the same ``--chat-template-file``: a small Hermes-style template
of our own that knows tools (tests/support/tool_templates.py HERMES), so the
prompt is the same text on both sides (prompt tokens in the table). The two
servers run one after the other, never at once. Time to first token: client
side, from the send to the first chunk with text or a tool call. Decode
tokens/s: the reply's tokens after the first over the time from the first
chunk to the end (llama-server counts the end-of-generation token it stopped
at, ggufpipe does not: one less is taken from its count when it stopped).
Medians; ratios ggufpipe / llama-server. Writes --out and prints the same text.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
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

from benchmarks.bench_parallel import llama_server_binary  # noqa: E402
from benchmarks.bench_server import Server, median  # noqa: E402
from tests.support.common import smollm_path  # noqa: E402
from tests.support.sshd import free_port  # noqa: E402
from tests.support.tool_templates import HERMES  # noqa: E402

CONTEXT = 8192
SYSTEM = "You are a helpful assistant for a small shop. Use a tool when it helps."
QUESTION = "What is the weather in Paris today? Then tell me what to wear."
PERSON = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "temperature_c": {"type": "integer"},
        "clothes": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["city", "temperature_c", "clothes"],
    "additionalProperties": False,
}
KINDS = ("agent", "schema", "plain")

_NOUNS = [
    "order",
    "customer",
    "invoice",
    "product",
    "shipment",
    "ticket",
    "refund",
    "coupon",
    "review",
    "stock",
]
_VERBS = ["get", "create", "cancel"]


def tools() -> list[dict[str, Any]]:
    """30 made-up functions, as an agent framework sends them."""
    made = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The current weather in a city.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "description": "The city's name"},
                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    },
                    "required": ["city"],
                },
            },
        }
    ]
    for noun in _NOUNS:
        for verb in _VERBS:
            if len(made) == 30:
                break
            made.append(
                {
                    "type": "function",
                    "function": {
                        "name": f"{verb}_{noun}",
                        "description": f"{verb.capitalize()} a {noun} of the shop by its id.",
                        "parameters": {
                            "type": "object",
                            "properties": {f"{noun}_id": {"type": "string"}, "limit": {"type": "integer"}},
                            "required": [f"{noun}_id"],
                        },
                    },
                }
            )
    return made


def body(kind: str, max_tokens: int) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    request: dict[str, Any] = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "cache_prompt": False,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if kind == "agent":
        request |= {"tools": tools(), "tool_choice": "auto"}
    elif kind == "schema":
        request["response_format"] = {"type": "json_schema", "json_schema": {"name": "w", "schema": PERSON}}
    return request


# ------------------------------------------------------------------ servers


class LlamaServer:
    """llama.cpp's own server on the whole model, ``-t threads``."""

    def __init__(self, binary: str, workdir: Path, template: Path, threads: int) -> None:
        port = free_port()
        self.log = workdir / "llama-server.log"
        command = [
            binary, "-m", str(smollm_path()), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "--parallel", "1", "-c", str(CONTEXT), "--jinja", "--chat-template-file", str(template), "--no-webui",
        ]  # fmt: skip
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, text=True
            )  # fmt: skip
        self.url = f"http://127.0.0.1:{port}/v1"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                    if json.loads(answer.read()).get("status") == "ok":
                        return
            except (OSError, urllib.error.URLError, ValueError):
                pass
            time.sleep(0.2)
        raise RuntimeError("llama-server did not start:\n" + self.log.read_text()[-4000:])

    def close(self) -> int:
        self.process.terminate()
        return self.process.wait(60)


def ggufpipe(workdir: Path, template: Path) -> Server:
    inventory = workdir / "inventory.yaml"
    inventory.write_text(
        f"model: {{path: '{smollm_path()}'}}\n"
        "hosts:\n  a: {local: true, threads: 1}\n  b: {local: true, threads: 1}\n"
        "stages:\n  - {host: a, layers: [0, 15]}\n  - {host: b, layers: [15, 30]}\n"
        f"run: {{context: {CONTEXT}}}\n"
    )
    return Server(inventory, workdir, "--chat-template-file", str(template))


# ------------------------------------------------------------------- client


async def ask(http: aiohttp.ClientSession, url: str, request: dict[str, Any]) -> dict[str, Any]:
    """One streamed chat completion: time to its first text or call chunk,
    the whole request, its usage, text, calls and finish reason."""
    started = time.perf_counter()
    first = 0.0
    text, calls, finish = "", 0, ""
    usage: dict[str, Any] = {}
    async with http.post(f"{url}/chat/completions", json=request) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: {response.status} {await response.text()}")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content") or delta.get("tool_calls"):
                    first = first or time.perf_counter()
                text += delta.get("content") or ""
                calls += sum(1 for call in delta.get("tool_calls") or [] if call.get("id"))
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
    done = time.perf_counter()
    first = first or done
    return {
        "ttft_ms": (first - started) * 1000.0,
        "total_ms": (done - started) * 1000.0,
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "completion_tokens": usage.get("completion_tokens", 0),
        "text": text,
        "calls": calls,
        "finish": finish,
    }


async def measure(
    servers: dict[str, tuple[str, bool]], repeats: int, max_tokens: int
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """``servers``: name -> (url, whether its completion tokens count the
    end-of-generation token). Each repeat sends each request to each server
    in turn, one request in flight at a time: the machine's load drifts over
    all of them alike."""
    results: dict[str, dict[str, list[dict[str, Any]]]] = {name: {k: [] for k in KINDS} for name in servers}
    # A fresh connection per request: llama-server closes a streamed one after the reply.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as http:
        for url, _ in servers.values():
            await ask(http, url, body("plain", 4))  # warm
        for _ in range(repeats):
            for kind in KINDS:
                for name, (url, eog_counted) in servers.items():
                    answer = await ask(http, url, body(kind, max_tokens))
                    tokens = answer["completion_tokens"] - (eog_counted and answer["finish"] != "length")
                    decode_s = (answer["total_ms"] - answer["ttft_ms"]) / 1000.0
                    answer["decode_tok_s"] = (tokens - 1) / decode_s if tokens > 1 and decode_s > 0 else 0.0
                    answer["tokens"] = tokens
                    results[name][kind].append(answer)
    return results


# ------------------------------------------------------------------- report


def summary(answers: list[dict[str, Any]]) -> dict[str, Any]:
    last = answers[-1]
    rates = [a["decode_tok_s"] for a in answers if a["decode_tok_s"] > 0]
    return {
        "ttft_ms": median([a["ttft_ms"] for a in answers]),
        "decode_tok_s": median(rates),
        "prompt_tokens": last["prompt_tokens"],
        "tokens": median([a["tokens"] for a in answers]),
        "reply": f"{last['calls']} call(s)" if last["calls"] else last["text"],
        "finish": last["finish"],
    }


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


NAMES = {
    "agent": "agent: 30 tools, tool_choice auto",
    "schema": "response_format json_schema",
    "plain": "plain chat",
}


def report(summaries: dict[str, dict[str, dict[str, Any]]], args: argparse.Namespace) -> str:
    machine = (
        f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform(terse=True)}, "
        f"Python {platform.python_version()}"
    )
    ours = summaries["ggufpipe"]
    bases = [name for name in summaries if name != "ggufpipe"]
    lines = [
        "# Agent requests benchmark",
        "",
        "What an agent sends, through `--serve` and through llama.cpp's own llama-server on the same model: "
        "a chat request carrying 30 function tools (made-up schemas, `tool_choice: auto`), one whose reply is "
        "held to a JSON schema (`response_format: json_schema`, grammar-constrained sampling in the last stage), "
        "and a plain one. Time to first token (TTFT: client side, from the send to the first chunk with text or "
        "a tool call) and decode tokens/s (the reply's tokens after the first over the time from the first chunk "
        "to the end; llama-server's count less the end-of-generation token it stopped at).",
        "",
        f"`{args.command}` on {machine}; load average {args.load_start:.2f} at the start, "
        f"{args.load_end:.2f} at the end (a shared machine: numbers are only comparable within one run); "
        f"{args.date}, {args.elapsed:.0f} s in all. Re-run: `.venv/bin/python benchmarks/bench_agents.py` "
        "(scripts/build-llama-server builds llama-server first if it is not built: minutes).",
        "",
        f"SmolLM2-135M Q4_1, greedy, streamed chat completions of at most {args.max_tokens} tokens, every "
        f"prompt computed cold (`cache_prompt: false`), medians of {args.repeats} repeats. Both servers render "
        "the prompt with the same `--chat-template-file`, a small Hermes-style template of our own that knows "
        "tools (tests/support/tool_templates.py). ggufpipe: `--serve` on 2 stages, layers [0, 15) and [15, 30), "
        "on 2 local hosts with `threads: 1` each (a core per stage). llama-server: the whole model in one "
        f"process, `-t {args.threads} --parallel 1 --jinja` (threads = cores: llama.cpp at its best on an idle "
        "machine)"
        + (", and `-t 1` (one core, as each stage has)" if len(bases) > 1 else "")
        + ". All servers are started at once and asked in turn, one request in flight at a time (each repeat: "
        "each request, each server), so the machine's load drifts over all of them alike. ggufpipe / it: "
        "ggufpipe's figure over that server's (TTFT: above 1 is ggufpipe slower; decode: above 1 is ggufpipe "
        "faster).",
        "",
        "| request | server | prompt tokens | TTFT ms | ggufpipe / it | decode tok/s | ggufpipe / it | reply |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for kind in KINDS:
        for name in ["ggufpipe", *bases]:
            row = summaries[name][kind]
            mine = ours[kind]
            reply = json.dumps(row["reply"][:32]) if isinstance(row["reply"], str) else row["reply"]
            lines.append(
                f"| {NAMES[kind]} | {name} | {row['prompt_tokens']} | {row['ttft_ms']:.0f} | "
                + ("" if name == "ggufpipe" else ratio(mine["ttft_ms"], row["ttft_ms"]))
                + f" | {row['decode_tok_s']:.1f} | "
                + ("" if name == "ggufpipe" else ratio(mine["decode_tok_s"], row["decode_tok_s"]))
                + f" | {reply} ({row['finish']}) |"
            )
    base = summaries[bases[0]]
    lines += [
        "",
        f"The 30 tools add {ours['agent']['ttft_ms'] - ours['plain']['ttft_ms']:.0f} ms to ggufpipe's first "
        f"token and {base['agent']['ttft_ms'] - base['plain']['ttft_ms']:.0f} ms to {bases[0]}'s (the prompt's "
        "extra tokens, computed cold); held to the schema, ggufpipe decodes at "
        f"{ratio(ours['schema']['decode_tok_s'], ours['plain']['decode_tok_s'])} of its plain rate, "
        f"{bases[0]} at {ratio(base['schema']['decode_tok_s'], base['plain']['decode_tok_s'])}. "
        "(Under a schema llama-server's chat path lets the model open a ```json fence and gives the JSON "
        "inside it as the content, so its reply there differs from ggufpipe's; tests/e2e/"
        "test_server_vs_llama_server.py.)",
    ]
    return "\n".join(lines) + "\n"


def threads_of(args: argparse.Namespace) -> list[int]:
    return list(dict.fromkeys([args.threads, 1] if args.baseline_t1 else [args.threads]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama-server's -t")
    parser.add_argument(
        "--no-baseline-t1",
        dest="baseline_t1",
        action="store_false",
        help="leave out llama-server -t 1 (one core, as each stage has)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "bench-agents.md")
    args = parser.parse_args()
    args.command = "benchmarks/bench_agents.py " + " ".join(sys.argv[1:])
    args.command = args.command.strip()
    args.load_start = os.getloadavg()[0]
    args.date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    began = time.monotonic()
    binary = llama_server_binary()
    with tempfile.TemporaryDirectory() as workdir:
        folder = Path(workdir)
        template = folder / "hermes.jinja"
        template.write_text(HERMES)
        started: list[LlamaServer] = []
        ours_server: Server | None = None
        try:
            for threads in threads_of(args):
                (folder / f"t{threads}").mkdir()
                started.append(LlamaServer(binary, folder / f"t{threads}", template, threads))
            ours_server = ggufpipe(folder, template)
            servers = {"ggufpipe": (ours_server.url, False)}
            servers |= {
                f"llama-server -t {t}": (s.url, True) for t, s in zip(threads_of(args), started, strict=True)
            }
            results = asyncio.run(measure(servers, args.repeats, args.max_tokens))
        finally:
            for server in started:
                server.close()
            code = ours_server.close() if ours_server is not None else 0
    if code != 0 and ours_server is not None:
        raise SystemExit(f"the server exited {code}:\n" + "".join(ours_server.lines))
    args.load_end = os.getloadavg()[0]
    args.elapsed = time.monotonic() - began
    summaries = {name: {k: summary(v) for k, v in kinds.items()} for name, kinds in results.items()}
    text = report(summaries, args)
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
