"""Memory under bad input: does a flood of refused requests grow the server?

    .venv/bin/python benchmarks/bench_bad_input.py [--rounds 1000] [--good 600] [--no-baseline]

A real ``--serve`` (two local stages of SmolLM2, a thread each, an API key)
is sent, over real HTTP (aiohttp's client, 8 at a time), every kind of
request it refuses, round after round (one of each kind a round, each
request's content its own: field names, schemas, prompts, ids and paths
differ, so nothing keyed by content is hit twice): malformed JSON, unknown
and mistyped fields, 2 MB bodies, unknown routes, bad tools, bad schemas, a
bad API key, a prompt past the context (tokenized by stage 0, refused by
the run), an unknown ``previous_response_id``, a bad Anthropic body. The
server's resident memory (VmRSS from /proc) and its agents' is read after
100, 500 and --rounds rounds; then after --good good requests (chat, 4
tokens each) for comparison. llama.cpp's own server (``llama-server``, the
whole model, the same key) gets the same rounds in the same run, as the
baseline. Writes docs/bench-bad-input.md.
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
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_parallel import llama_server_binary  # noqa: E402
from tests.support.agent_served import TWO_STAGES  # noqa: E402
from tests.support.common import smollm_path  # noqa: E402
from tests.support.served import KEY, start_server  # noqa: E402
from tests.support.sshd import free_port  # noqa: E402

CHECKPOINTS = (100, 500)
CONCURRENCY = 8
BIG = "a" * (2 * 1024 * 1024)  # a 2 MB body
PAST = "word " * 600  # past the 512-token context

#: (kind, method, path, body of request i or None, wrong key)
Kind = tuple[str, str, Callable[[int], str], Callable[[int], bytes | None], bool]


def chat(**fields: object) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **fields}).encode()


KINDS: list[Kind] = [
    ("malformed JSON", "POST", lambda i: "/v1/chat/completions", lambda i: b'{"messages": [' + str(i).encode(), False),
    ("mistyped field", "POST", lambda i: "/v1/chat/completions", lambda i: chat(temperature=f"hot {i}", **{f"field_{i}": i}), False),
    (
        "2 MB body",
        "POST",
        lambda i: "/v1/chat/completions",
        lambda i: json.dumps({"messages": f"{i}{BIG}", "max_tokens": 1}).encode(),  # not a list
        False,
    ),
    ("unknown route", "GET", lambda i: f"/v1/nowhere/{i}", lambda i: None, False),
    (
        "bad tools",
        "POST",
        lambda i: "/v1/chat/completions",
        lambda i: chat(tools=[{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": f"no{i}"}}}]),
        False,
    ),
    (
        "bad schema",
        "POST",
        lambda i: "/v1/chat/completions",
        lambda i: chat(
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": f"s{i}",
                    "schema": {"type": "object", "properties": {f"k{i}": {"type": "string", "minLength": -i - 1}}},
                },
            }
        ),
        False,
    ),
    ("bad API key", "POST", lambda i: "/v1/chat/completions", lambda i: chat(), True),
    (
        "prompt past the context",
        "POST",
        lambda i: "/v1/completions",
        lambda i: json.dumps({"prompt": f"{i} {PAST}", "max_tokens": 8}).encode(),
        False,
    ),
    (
        "unknown previous_response_id",
        "POST",
        lambda i: "/v1/responses",
        lambda i: json.dumps({"input": "hi", "previous_response_id": f"resp_{i:024x}", "max_output_tokens": 16}).encode(),
        False,
    ),
    (
        "bad Anthropic body",
        "POST",
        lambda i: "/v1/messages",
        lambda i: json.dumps({"max_tokens": 1, "messages": f"x{i}"}).encode(),
        False,
    ),
]  # fmt: skip


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(word) for word in out.split()]


class Target:
    """A server under test: its base URL, its process (and its agents')."""

    def __init__(self, name: str, url: str, pid: int, close: Callable[[], object]) -> None:
        self.name, self.url, self.pid, self.close = name, url, pid, close
        self.agents = children(pid)

    def memory(self) -> tuple[int, int]:
        """(server KiB, its agents' KiB)."""
        return rss_kib(self.pid), sum(rss_kib(pid) for pid in self.agents if Path(f"/proc/{pid}").exists())


def start_llama_server(binary: str, workdir: Path) -> Target:
    port = free_port()
    log = (workdir / "llama-server.log").open("w")
    command = [
        binary, "-m", str(smollm_path()), "--host", "127.0.0.1", "--port", str(port),
        "-t", "2", "-c", "512", "--api-key", KEY, "--jinja",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                if json.loads(answer.read()).get("status") == "ok":
                    break
        except (OSError, urllib.error.URLError, ValueError):
            time.sleep(0.2)

    def close() -> None:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()

    return Target("llama-server", f"http://127.0.0.1:{port}", process.pid, close)


def start_ggufpipe(workdir: Path) -> Target:
    served = start_server(workdir, smollm_path(), stages=TWO_STAGES, here="{local: true, threads: 1}")
    return Target("ggufpipe --serve", served.url, served.process.pid, served.stop)


async def send(
    http: aiohttp.ClientSession, target: Target, kind: Kind, i: int, statuses: Counter[tuple[str, int]]
) -> None:
    name, method, path, body, wrong = kind
    headers = {"Authorization": f"Bearer {'wrong' if wrong else KEY}", "Content-Type": "application/json"}
    try:
        async with http.request(method, target.url + path(i), data=body(i), headers=headers) as response:
            await response.read()
            statuses[(name, response.status)] += 1
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        statuses[(name, -1)] += 1  # no answer: said in the table
        print(f"  {target.name}: {name}: {type(error).__name__}: {error}", file=sys.stderr)


async def good(
    http: aiohttp.ClientSession, target: Target, i: int, statuses: Counter[tuple[str, int]]
) -> None:
    body = {"messages": [{"role": "user", "content": f"Say hello to number {i}."}], "max_tokens": 4}
    headers = {"Authorization": f"Bearer {KEY}"}
    try:
        async with http.post(target.url + "/v1/chat/completions", json=body, headers=headers) as response:
            await response.read()
            statuses[("good", response.status)] += 1
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        statuses[("good", -1)] += 1  # no answer: said in the table
        print(f"  {target.name}: good: {type(error).__name__}: {error}", file=sys.stderr)


async def flood(target: Target, rounds: int, goods: int) -> dict[str, object]:
    samples: list[tuple[str, int, int]] = [("start", *target.memory())]
    statuses: Counter[tuple[str, int]] = Counter()
    gate = asyncio.Semaphore(CONCURRENCY)
    started = time.perf_counter()

    async def one(job: Callable[[], object]) -> None:
        async with gate:
            await job()  # type: ignore[misc]

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        done = 0
        for checkpoint in (*(c for c in CHECKPOINTS if c < rounds), rounds):
            jobs = [
                one(lambda kind=kind, i=i: send(http, target, kind, i, statuses))
                for i in range(done, checkpoint)
                for kind in KINDS
            ]
            await asyncio.gather(*jobs)
            done = checkpoint
            samples.append(
                (f"after {checkpoint} rounds ({checkpoint * len(KINDS)} refused)", *target.memory())
            )
            print(f"{target.name}: {samples[-1]} at {time.perf_counter() - started:.0f} s", file=sys.stderr)
        bad_s = time.perf_counter() - started
        await asyncio.gather(*(one(lambda i=i: good(http, target, i, statuses)) for i in range(goods)))
        samples.append((f"then {goods} good requests", *target.memory()))
        print(f"{target.name}: {samples[-1]}", file=sys.stderr)
    return {"samples": samples, "statuses": statuses, "bad_s": bad_s}


READING = (
    "Reading: the server's memory rises over the first rounds (the parsers' and jsonschema's "
    "first use, the allocator keeping the pages of the 2 MB bodies for the next ones) and is flat "
    "after: what 100 rounds left is what 1,000 leave, within the noise of a megabyte or two "
    "(nothing it keeps grows with what it refuses: the schema cache holds the last 64, the "
    "Responses store the last 256 answered, /metrics' series are per route and status, an "
    "unknown path is 'other'; a refused request keeps nothing). \"agents\": the stages' "
    "processes, which only the prompts past the context reach (tokenized, then refused). "
    "llama-server runs some of these (a tool it does not check, an Anthropic body it reads "
    "otherwise) instead of refusing them, and answers them more slowly: it has fewer rounds."
)


def mib(kib: int) -> str:
    return f"{kib / 1024:.1f}"


def report(results: dict[str, dict[str, object]]) -> str:
    lines = [
        "# Memory under bad input (benchmarks/bench_bad_input.py)",
        "",
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, {os.cpu_count()} cores, "
        f"SmolLM2-135M. `{' '.join(['.venv/bin/python', 'benchmarks/bench_bad_input.py', *sys.argv[1:]])}`",
        "",
        f"One round is one refused request of each of the {len(KINDS)} kinds below, each with content "
        "of its own (field names, schemas, prompts, ids, paths); "
        f"{CONCURRENCY} requests at a time over real HTTP. ggufpipe: `--serve` on two local stages "
        "(a thread each) with an API key; llama-server: llama.cpp's own server on the whole model "
        "(`-t 2 -c 512 --api-key --jinja`), the same requests. Resident memory (VmRSS) in MiB.",
        "",
        "| when | " + " | ".join(f"{name} server | {name} agents" for name in results) + " |",
        "|---|" + "---|---|" * len(results),
    ]
    names = list(results)
    labels = list(dict.fromkeys(label for name in names for label, _, _ in results[name]["samples"]))  # type: ignore[attr-defined]
    for label in labels:
        cells = []
        for name in names:
            found = {row[0]: row for row in results[name]["samples"]}  # type: ignore[attr-defined]
            if label in found:
                _, server, agents = found[label]
                cells += [mib(server), mib(agents) if agents else "-"]
            else:
                cells += ["", ""]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "Growth of the server from 100 rounds to the last (MiB):", ""]
    for name in names:
        samples = results[name]["samples"]
        rounds, goods = results[name]["rounds"], results[name]["good"]
        at100, last_bad, last = samples[1][1], samples[-2][1], samples[-1][1]  # type: ignore[index]
        lines.append(
            f"- {name}: {mib(last_bad - at100)} over {(rounds - 100) * len(KINDS)} more refused requests "
            f"({results[name]['bad_s']:.0f} s for all {rounds * len(KINDS)}); "
            f"{mib(last - last_bad)} over {goods} good ones"
        )
    lines += ["", "What each kind was answered (status: count):", "", "| kind | " + " | ".join(names) + " |"]
    lines.append("|---|" + "---|" * len(names))
    for kind in [*(k[0] for k in KINDS), "good"]:
        cells = []
        for name in names:
            statuses: Counter[tuple[str, int]] = results[name]["statuses"]  # type: ignore[assignment]
            cells.append(", ".join(f"{s}: {n}" for (k, s), n in sorted(statuses.items()) if k == kind))
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    lines += ["", READING]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rounds", type=int, default=1000, help="rounds of refused requests (one of each kind)"
    )
    parser.add_argument("--good", type=int, default=600, help="good requests after them")
    parser.add_argument("--no-baseline", action="store_true", help="leave out llama-server")
    parser.add_argument(
        "--baseline-rounds",
        type=int,
        default=100,
        help="llama-server's rounds (it answers some kinds slowly)",
    )
    parser.add_argument("--baseline-good", type=int, default=100, help="llama-server's good requests")
    parser.add_argument("--out", default=str(REPO / "docs" / "bench-bad-input.md"))
    args = parser.parse_args()
    results: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        starts: list[tuple[Callable[[], Target], int, int]] = [
            (lambda: start_ggufpipe(work / "ggufpipe"), args.rounds, args.good)
        ]
        if not args.no_baseline:
            binary = llama_server_binary()
            starts.append(
                (lambda: start_llama_server(binary, work), args.baseline_rounds, args.baseline_good)
            )
        (work / "ggufpipe").mkdir()
        for start, rounds, goods in starts:
            target = start()
            try:
                results[target.name] = asyncio.run(flood(target, rounds, goods))
                results[target.name] |= {"rounds": rounds, "good": goods}
            finally:
                target.close()
    text = report(results)
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
