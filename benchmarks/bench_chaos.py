"""Chaos: load, kills, stalls, bad requests and a shutdown at once; is any reply lost or changed?

    .venv/bin/python benchmarks/bench_chaos.py [--duration 150] [--port 0] [--quick]

A real ``ggufpipe-tui INVENTORY --serve`` (three local stages of SmolLM2-135M,
one agent process each, a thread each, ``--parallel 3``, ``run.batching: off``,
recovery on, ``timeouts.heartbeat`` short so a stopped agent is found) is
first asked every request of a pool one at a time: each reply alone, the
reference (greedy, a fixed ``max_tokens``). Then, for --duration seconds:

* clients (aiohttp, a connection each) send the pool's chat and completions
  requests over and over, streamed and not, more at once than there are slots;
  each reply is checked against the same request's reply alone;
* a client sends bad_input's refused requests (benchmarks/bench_bad_input.py's
  KINDS: malformed JSON, unknown and mistyped fields, 2 MB bodies, unknown
  routes, ...; its prompt past the context longer, for this context), each of
  which must get its 4xx;
* the schedule: a stage agent SIGKILLed at 20, 40 and 60 s (stages 1, 2, 0),
  one SIGSTOPped at 80 s for 35 s then SIGCONTed (recovery has killed it by
  then: the heartbeat), and at the end long streamed replies are started and
  the server is sent SIGTERM while they stream: each must end with an error
  event naming the shutdown (a 503 when not streamed or still queued), none
  may look complete, and every streamed text must be a prefix of its
  reply alone.

The server's resident memory (VmRSS) is read every 2 s, its /health (stages
lost, repairs, runs replayed) likewise. --quick: about a minute, one kill, a
12 s stall and the shutdown. Writes docs/bench-chaos.md. Every process it
started is gone at the end, on error too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_bad_input import KEY, KINDS, rss_kib  # noqa: E402
from benchmarks.serving import Ggufpipe, machine  # noqa: E402
from tests.support.common import smollm_path  # noqa: E402

STAGES = ((0, 10), (10, 20), (20, 30))
CONTEXT = 1024  # positions per slot: room for the long replies
HEARTBEAT = 8.0
LONG_TOKENS = 1000  # the shutdown's replies: far longer than the drain's 10 s
PAST = "word " * 1200  # past the context (bad_input's prompt is past its 512)
SHOWN = 20  # findings listed in the page
CLIENTS = 5  # good clients: the 3 slots and 2 waiting
QUESTIONS = [
    "Why is the sky blue?",
    "Name three fruits.",
    "What is two plus two?",
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "Give me a tip for learning to code.",
    "What do cats eat?",
    "Describe a rainbow in one sentence.",
]
STORY = "Once upon a time, in a village by the sea, there lived"


def past_context(i: int) -> bytes:
    return json.dumps({"prompt": f"{i} {PAST}", "max_tokens": 8}).encode()


#: bad_input's refused requests, its prompt past the context made longer for this context
BAD = [(k[0], k[1], k[2], past_context if k[0] == "prompt past the context" else k[3], k[4]) for k in KINDS]


@dataclass(frozen=True)
class Ask:
    """One request of the pool: its path, its body (without ``stream``)."""

    name: str
    path: str
    body: dict[str, Any]


def pool(size: int) -> list[Ask]:
    asks = []
    for i, question in enumerate(QUESTIONS[:size]):
        tokens = (24, 40, 56)[i % 3]
        chat = {"messages": [{"role": "user", "content": question}], "max_tokens": tokens, "temperature": 0}
        asks.append(Ask(f"chat {i}", "/v1/chat/completions", chat))
        raw = {"prompt": f"Question: {question}\nAnswer:", "max_tokens": tokens, "temperature": 0}
        asks.append(Ask(f"completion {i}", "/v1/completions", raw))
    return asks


LONG = Ask(
    "long",
    "/v1/completions",
    {"prompt": STORY, "max_tokens": LONG_TOKENS, "temperature": 0, "ignore_eos": True},
)


def inventory(work: Path) -> str:
    """Three local hosts, a stage and an agent process each; a cache dir
    each, which names the stage in its agent's command line."""
    hosts = "".join(
        f"  h{i}: {{local: true, threads: 1, cache_dir: '{work / f'cache-h{i}'}'}}\n" for i in range(3)
    )
    stages = "".join(f"  - {{host: h{i}, layers: [{a}, {b}]}}\n" for i, (a, b) in enumerate(STAGES))
    return (
        f"model: {{path: '{smollm_path()}'}}\nhosts:\n{hosts}stages:\n{stages}"
        f"run: {{context: {CONTEXT}, parallel: 3, batching: off, temperature: 0.0}}\n"
        f"timeouts: {{connect: 30, ready: 300, step: 120, teardown: 15, heartbeat: {HEARTBEAT:g}}}\n"
        "recovery: {attempts: 4, deadline: 300}\n"
    )


def agent_pid(work: Path, stage: int) -> int | None:
    """The live agent process of ``stage`` (its --cache-dir names it)."""
    mark = str(work / f"cache-h{stage}").encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            words = (entry / "cmdline").read_bytes().split(b"\0")
            if b"ggufpipe_agent" in words and mark in words and state(int(entry.name)) not in "ZX":
                return int(entry.name)
    return None


def leftovers(work: Path) -> list[int]:
    """Processes whose command line names the work folder (agents, the server)."""
    mark = str(work).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if mark in (entry / "cmdline").read_bytes() and state(int(entry.name)) not in "ZX":
                    found.append(int(entry.name))
    return found


def state(pid: int) -> str:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split()[1]
    return "X"


@dataclass
class Tally:
    """What the run saw."""

    reference: dict[str, str] = field(default_factory=dict)
    outcomes: Counter[str] = field(default_factory=Counter)
    by_mode: Counter[tuple[str, str]] = field(default_factory=Counter)
    findings: list[str] = field(default_factory=list)
    lost_why: Counter[str] = field(default_factory=Counter)  # lost replies by status and error
    bad: Counter[tuple[str, str]] = field(default_factory=Counter)
    chaos: list[str] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)  # kills and stops: when, what
    rss: list[tuple[float, int]] = field(default_factory=list)
    health: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    shutdown: list[str] = field(default_factory=list)
    sigterm_at: float = 0.0
    died: tuple[float, int | None] | None = None  # when the server exited before the SIGTERM, its status


async def ask(
    http: aiohttp.ClientSession, url: str, request: Ask, stream: bool, seen: dict[str, str] | None = None
) -> dict[str, Any]:
    """Send one request: its status, text, finish reason, error (if any), and
    whether a streamed reply ended with [DONE] (``seen``: its text so far, as it streams)."""
    body = dict(request.body, stream=stream)
    headers = {"Authorization": f"Bearer {KEY}"}
    out: dict[str, Any] = {"status": 0, "text": "", "finish": None, "error": None, "done": False, "chunks": 0}
    try:
        async with http.post(url + request.path, json=body, headers=headers) as response:
            out["status"] = response.status
            if response.status != 200 or not stream:
                answer = await response.json(content_type=None)
                if response.status != 200:
                    out["error"] = json.dumps(answer.get("error", answer))[:300]
                    return out
                choice = answer["choices"][0]
                out["text"] = choice["message"]["content"] if "message" in choice else choice["text"]
                out["finish"], out["done"] = choice.get("finish_reason"), True
                return out
            async for raw in response.content:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    out["done"] = True
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out["error"] = json.dumps(event["error"])[:300]
                    continue
                for choice in event.get("choices") or []:
                    piece = choice["delta"].get("content") if "delta" in choice else choice.get("text")
                    if piece:
                        out["text"] += piece
                        out["chunks"] += 1
                        if seen is not None:
                            seen["text"] = out["text"]
                    out["finish"] = choice.get("finish_reason") or out["finish"]
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as error:
        out["error"] = f"{type(error).__name__}: {error}"[:300]
    return out


def whole(out: dict[str, Any]) -> bool:
    """A reply that looks complete: a 200 with a finish reason (and [DONE]
    when streamed), no error."""
    return out["status"] == 200 and out["finish"] is not None and out["done"] and out["error"] is None


def judge(
    tally: Tally, request: Ask, stream: bool, out: dict[str, Any], started: float, ended: float
) -> None:
    mode = "streamed" if stream else "whole"
    cut = tally.sigterm_at and ended >= tally.sigterm_at  # ended during the shutdown
    reference = tally.reference[request.name]
    where = f"{request.name} ({mode}, sent at {started:.1f} s, ended at {ended:.1f} s)"
    if whole(out):
        if out["text"] == reference:
            tally.outcomes["equal"] += 1
        else:
            tally.outcomes["changed"] += 1
            tally.findings.append(f"changed: {where}: {out['text']!r} against {reference!r} alone")
    elif cut and shutdown_marked(out) and reference.startswith(out["text"]):
        tally.outcomes["cut by the shutdown, marked"] += 1
    elif cut and shutdown_marked(out):
        tally.outcomes["changed"] += 1
        tally.findings.append(f"changed before the shutdown cut it: {where}: {out['text']!r}")
    else:
        tally.outcomes["lost"] += 1
        tally.lost_why[f"{out['status']}: {out['error']}"[:160]] += 1
        tally.findings.append(
            f"lost: {where}: status {out['status']}, finish {out['finish']}, [DONE] {out['done']}, "
            f"error {out['error']}, {len(out['text'])} characters"
        )
    tally.by_mode[(mode, request.path)] += 1


def shutdown_marked(out: dict[str, Any]) -> bool:
    """Cut by the shutdown and saying so: a 503, or an error event naming it, and no finish."""
    return out["finish"] is None and "shutting down" in str(out["error"]) and out["status"] in (200, 503)


async def client(
    url: str, asks: list[Ask], index: int, tally: Tally, until: asyncio.Event, t0: float
) -> None:
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=600), connector=aiohttp.TCPConnector(force_close=True)
    ) as http:
        turn = index
        while not until.is_set():
            request, stream = asks[turn % len(asks)], (turn // len(asks) + index) % 2 == 0
            turn += 1
            started = time.monotonic() - t0
            out = await ask(http, url, request, stream)
            judge(tally, request, stream, out, started, time.monotonic() - t0)
            if not whole(out):
                await asyncio.sleep(0.5)  # as a client would before it tries again


async def bad_client(url: str, tally: Tally, until: asyncio.Event) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        i = 0
        while not until.is_set():
            name, method, path, body, wrong = BAD[i % len(BAD)]
            headers = {
                "Authorization": f"Bearer {'wrong' if wrong else KEY}",
                "Content-Type": "application/json",
            }
            try:
                async with http.request(method, url + path(i), data=body(i), headers=headers) as response:
                    await response.read()
                    late = response.status == 503 and tally.sigterm_at > 0
                    tally.bad[(name, "503 (the shutdown)" if late else str(response.status))] += 1
            except (aiohttp.ClientError, asyncio.TimeoutError) as error:
                tally.bad[(name, "no answer")] += 1
                tally.findings.append(f"bad request {name}: no answer: {type(error).__name__}: {error}")
            i += 1
            await asyncio.sleep(0.1)


async def watch(server: Ggufpipe, tally: Tally, t0: float, died: asyncio.Event, stop: asyncio.Event) -> None:
    """The server exiting before the SIGTERM: said, and the clients stopped."""
    while server.process.poll() is None or tally.sigterm_at:
        await asyncio.sleep(0.2)
    tally.died = (time.monotonic() - t0, server.process.returncode)
    tally.chaos.append(
        f"{tally.died[0]:6.1f} s: THE SERVER EXITED (status {tally.died[1]}) before the SIGTERM"
    )
    print("chaos:", tally.chaos[-1], file=sys.stderr, flush=True)
    stop.set()
    died.set()


async def sampler(server: Ggufpipe, tally: Tally, t0: float, stop: asyncio.Event) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        while not stop.is_set():
            now = time.monotonic() - t0
            with contextlib.suppress(OSError):
                tally.rss.append((now, rss_kib(server.process.pid)))
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                async with http.get(server.url.removesuffix("/v1") + "/health") as response:
                    tally.health.append((now, await response.json(content_type=None)))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 2.0)


async def chaos(work: Path, server: Ggufpipe, tally: Tally, plan: dict[str, Any], t0: float) -> None:
    async def at(moment: float) -> None:
        await asyncio.sleep(max(0.0, moment - (time.monotonic() - t0)))

    def note(what: str) -> None:
        line = f"{time.monotonic() - t0:6.1f} s: {what}"
        tally.chaos.append(line)
        print("chaos:", line, file=sys.stderr, flush=True)

    for moment, stage in plan["kills"]:
        await at(moment)
        pid = agent_pid(work, stage)
        if pid is None:
            note(f"stage {stage}: no live agent to kill")
            continue
        os.kill(pid, signal.SIGKILL)
        tally.events.append((time.monotonic() - t0, f"SIGKILL stage {stage}"))
        note(f"SIGKILL stage {stage}'s agent (pid {pid})")
    if plan["stall"]:
        moment, stage, seconds = plan["stall"]
        await at(moment)
        pid = agent_pid(work, stage)
        if pid is None:
            note(f"stage {stage}: no live agent to stop")
        else:
            os.kill(pid, signal.SIGSTOP)
            tally.events.append((time.monotonic() - t0, f"SIGSTOP stage {stage}"))
            note(f"SIGSTOP stage {stage}'s agent (pid {pid}) for {seconds:g} s")
            await at(moment + seconds)
            try:
                os.kill(pid, signal.SIGCONT)
                note(f"SIGCONT pid {pid} ({'still there' if state(pid) not in 'ZX' else 'gone'})")
            except ProcessLookupError:
                note(f"SIGCONT pid {pid}: gone (recovery ended it)")


async def shutdown(server: Ggufpipe, url: str, tally: Tally, t0: float, stop_clients: asyncio.Event) -> None:
    """Long replies (1 whole, then 3 streamed: one of them waits for a slot) started, then SIGTERM while they
    stream; the good clients stop sending at the SIGTERM."""
    results: list[tuple[bool, dict[str, Any], float]] = []
    streamed: dict[int, dict[str, str]] = {}

    async def one(index: int, stream: bool) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            started = time.monotonic() - t0
            out = await ask(http, url, LONG, stream, streamed.setdefault(index, {"text": ""}))
            results.append((stream, out, started))

    tasks = [asyncio.create_task(one(i, stream)) for i, stream in enumerate((False, True, True, True))]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and sum(len(s["text"]) > 40 for s in streamed.values()) < 2:
        await asyncio.sleep(0.2)
    stop_clients.set()
    tally.sigterm_at = time.monotonic() - t0
    server.process.send_signal(signal.SIGTERM)
    tally.chaos.append(f"{tally.sigterm_at:6.1f} s: SIGTERM the server, long replies streaming")
    print("chaos:", tally.chaos[-1], file=sys.stderr, flush=True)
    await asyncio.gather(*tasks)
    reference = tally.reference[LONG.name]
    for stream, out, started in results:
        mode = "streamed" if stream else "whole"
        text = out["text"]
        if whole(out) and text == reference:
            verdict = "completed in the drain, equal to alone"
        elif whole(out):
            verdict = "LOOKS COMPLETE but is not the reply alone"
            tally.findings.append(
                f"shutdown: a {mode} long reply looks whole: {len(text)} chars, {out['finish']}"
            )
        elif shutdown_marked(out) and reference.startswith(text):
            verdict = "cut, marked (" + ("error event" if out["status"] == 200 else "503") + ")"
        else:
            verdict = "NOT MARKED as cut by the shutdown"
            tally.findings.append(f"shutdown: a {mode} long reply: {out}")
        tally.shutdown.append(
            f"{mode}, sent at {started:.1f} s: status {out['status']}, {out['chunks']} chunks "
            f"({len(text)} of {len(reference)} characters, a prefix of alone: "
            f"{'yes' if reference.startswith(text) else 'NO'}), finish {out['finish']}, "
            f"error {out['error']}: {verdict}"
        )


async def references(url: str, asks: list[Ask], tally: Tally) -> None:
    """Each request of the pool alone, one at a time, before the chaos."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        for request in [*asks, LONG]:
            out = await ask(http, url, request, False)
            if not whole(out):
                raise RuntimeError(f"the reference of {request.name} failed: {out}")
            tally.reference[request.name] = out["text"]
    print(f"references: {len(tally.reference)} requests alone", file=sys.stderr, flush=True)


async def run(work: Path, server: Ggufpipe, args: argparse.Namespace, plan: dict[str, Any]) -> Tally:
    tally = Tally()
    url = server.url.removesuffix("/v1")
    t_ready = time.monotonic()
    tally.rss.append((0.0, rss_kib(server.process.pid)))
    await references(url, pool(args.pool), tally)
    reference_s = time.monotonic() - t_ready
    t0 = time.monotonic()
    tally.rss.append((0.0, rss_kib(server.process.pid)))
    stop_clients, stop_sampler = asyncio.Event(), asyncio.Event()
    sampling = asyncio.create_task(sampler(server, tally, t0, stop_sampler))
    asks = pool(args.pool)
    clients = [asyncio.create_task(client(url, asks, i, tally, stop_clients, t0)) for i in range(CLIENTS)]
    clients.append(asyncio.create_task(bad_client(url, tally, stop_clients)))
    died = asyncio.Event()
    watching = asyncio.create_task(watch(server, tally, t0, died, stop_clients))

    async def chaos_then_end() -> None:
        await chaos(work, server, tally, plan, t0)
        await asyncio.sleep(max(0.0, plan["end"] - (time.monotonic() - t0)))

    schedule_task = asyncio.create_task(chaos_then_end())
    dying = asyncio.create_task(died.wait())
    await asyncio.wait([schedule_task, dying], return_when=asyncio.FIRST_COMPLETED)
    if not died.is_set():
        tally.rss.append((time.monotonic() - t0, rss_kib(server.process.pid)))  # just before the shutdown
        await shutdown(server, url, tally, t0, stop_clients)
    schedule_task.cancel()
    dying.cancel()
    watching.cancel()
    await asyncio.gather(*clients)
    stop_sampler.set()
    await sampling
    tally.outcomes["reference_s"] = round(reference_s)
    return tally


def report(tally: Tally, args: argparse.Namespace, plan: dict[str, Any], extra: dict[str, Any]) -> str:
    outcomes = tally.outcomes
    total = sum(outcomes[k] for k in ("equal", "changed", "lost", "cut by the shutdown, marked"))
    rss = [kib for _, kib in tally.rss if kib]  # 0: read after the server exited
    before_chaos = tally.rss[1][1] if len(tally.rss) > 1 else rss[0]
    last = [health for _, health in tally.health if "stages_lost" in health]
    final = last[-1] if last else {}
    recovering = sum(1 for _, health in tally.health if health.get("status") == "recovering")
    bad_total = sum(tally.bad.values())
    bad_4xx = sum(n for (_, status), n in tally.bad.items() if status.startswith("4"))
    bad_late = sum(n for (_, status), n in tally.bad.items() if "shutdown" in status)
    command = " ".join([".venv/bin/python", "benchmarks/bench_chaos.py", *sys.argv[1:]])
    lines = [
        "# Chaos: load, kills, stalls, bad requests and a shutdown at once (benchmarks/bench_chaos.py)",
        "",
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {machine()}. `{command}`",
        "",
        f"`ggufpipe-tui INVENTORY --serve` with an API key on three local stages of SmolLM2-135M "
        f"(layers {', '.join(f'[{a}, {b})' for a, b in STAGES)}), one agent process and one thread each, "
        f"`run: {{context: {CONTEXT}, parallel: 3, batching: off}}`, `recovery: {{attempts: 4, deadline: 300}}`, "
        f"`timeouts.heartbeat: {HEARTBEAT:g}`. Each of the pool's {len(tally.reference) - 1} requests (chat "
        "and completions, greedy, 24 to 56 tokens) and the long one were first answered alone, one at a "
        f"time ({outcomes['reference_s']} s): the reference. Then for {plan['end']:g} s {CLIENTS} clients "
        "sent them over and over, streamed and not (3 slots: 2 requests waiting), and one client sent "
        f"benchmarks/bench_bad_input.py's {len(KINDS)} kinds of refused request in turn (its prompt past "
        f"the context made {len(PAST.split())} words for this context), while:",
        "",
        *(f"- {line}" for line in tally.chaos),
        "",
        "## Replies",
        "",
        "| replies | count |",
        "|---|---:|",
        f"| total (sent before the SIGTERM) | {total} |",
        f"| complete and equal to the request alone | {outcomes['equal']} |",
        f"| **changed** (complete, another text) | **{outcomes['changed']}** |",
        f"| **lost** (an error, cut, no answer) | **{outcomes['lost']}** |",
        f"| cut by the shutdown, saying so (error event or 503, a prefix of alone) | "
        f"{outcomes['cut by the shutdown, marked']} |",
        "",
        "By kind: "
        + ", ".join(f"{mode} {path}: {n}" for (mode, path), n in sorted(tally.by_mode.items()))
        + ".",
        "",
        f"The shutdown: 4 long completions ({LONG_TOKENS} tokens, `ignore_eos`; 3 streamed, 1 not) were "
        "sent, and the server got SIGTERM once two streams had text (the good clients stopped sending then):",
        "",
        *(f"- {line}" for line in tally.shutdown or ["none: the server had exited before it."]),
        "",
        f'The server\'s exit status: {extra["exit"]}; its log lines saying "cut short by the shutdown": '
        f"{extra['cut_lines']}, its 503 lines naming the shutdown: {extra['shutdown_503']}; processes "
        f"left after it: {extra['left']}.",
        "",
        "## Recoveries (`GET /health` at the end)",
        "",
        f"stages_lost {final.get('stages_lost', '?')}, repairs {final.get('repairs', '?')}, "
        f"runs_replayed {final.get('runs_replayed', '?')}; `status: recovering` in {recovering} of "
        f"{len(tally.health)} samples (every 2 s).",
        "",
        *repairs(tally),
        "",
        "## Bad requests",
        "",
        f"{bad_total} sent, {bad_4xx} answered with a 4xx, {bad_late} with a 503 at the shutdown "
        "(in flight at the SIGTERM).",
        "",
        "| kind | answers (status: count) |",
        "|---|---|",
    ]
    for name, *_ in KINDS:
        cells = ", ".join(f"{s}: {n}" for (k, s), n in sorted(tally.bad.items()) if k == name)
        lines.append(f"| {name} | {cells} |")
    lines += [
        "",
        "## The server's memory (VmRSS, MiB)",
        "",
        f"at ready {rss[0] / 1024:.1f}; after the references {before_chaos / 1024:.1f}; peak "
        f"{max(rss) / 1024:.1f}; at the end {rss[-1] / 1024:.1f} "
        f"({len(tally.rss)} samples). Its agents are not counted (each restart is a new process).",
        "",
        "## Findings",
        "",
        *(f"- {line}" for line in tally.findings[:SHOWN] or ["none: no reply lost or changed."]),
    ]
    if len(tally.findings) > SHOWN:
        lines.append(f"- ... and {len(tally.findings) - SHOWN} more")
    if tally.lost_why:
        lines += ["", "The lost replies by status and error:", "", "| count | status: error |", "|---:|---|"]
        lines += [f"| {n} | {why.replace('|', '/')} |" for why, n in tally.lost_why.most_common()]
    return "\n".join(lines) + "\n"


def repairs(tally: Tally) -> list[str]:
    """For each kill or stop: when /health first counted its repair."""
    out = ["| what | at (s) | /health's repairs counted it by (s after) |", "|---|---:|---:|"]
    for moment, what in tally.events:
        before = [h.get("repairs", 0) for t, h in tally.health if t <= moment and "repairs" in h]
        count = before[-1] if before else 0
        later = [t for t, h in tally.health if t > moment and h.get("repairs", 0) > count]
        out.append(
            f"| {what} | {moment:.1f} | {later[0] - moment:.1f} |"
            if later
            else f"| {what} | {moment:.1f} | never |"
        )
    return out


def schedule(args: argparse.Namespace) -> dict[str, Any]:
    """When each stage is killed (20 s apart) and stopped; when the shutdown comes."""
    if args.quick:
        kills = [int(k) for k in (args.kills or "1").split(",")]
        return {
            "kills": [(12.0 + 10.0 * i, stage) for i, stage in enumerate(kills)],
            "stall": (12.0 + 10.0 * len(kills) + 3.0, 2, 14.0),
            "end": args.duration or 55.0,
        }
    kills = [int(k) for k in (args.kills or "1,2,0").split(",")]
    stall = 20.0 * len(kills) + 20.0
    end = args.duration or 150.0
    return {
        "kills": [(20.0 * (i + 1), stage) for i, stage in enumerate(kills)],
        "stall": (stall, 1, 35.0),
        "end": end,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--duration", type=float, default=0.0, help="seconds of chaos before the shutdown (150; --quick 55)"
    )
    parser.add_argument("--port", type=int, default=0, help="the server's loopback port (0: a free one)")
    parser.add_argument(
        "--quick", action="store_true", help="about a minute: one kill, a short stall, the shutdown"
    )
    parser.add_argument(
        "--pool", type=int, default=0, help="questions in the pool (x2: chat and completions)"
    )
    parser.add_argument("--out", default=str(REPO / "docs" / "bench-chaos.md"))
    parser.add_argument("--server-log", help="write the server's stderr here")
    parser.add_argument(
        "--kills", help="the stages SIGKILLed, in order, 20 s apart (1,2,0; --quick: 1, 10 s apart)"
    )
    args = parser.parse_args()
    args.pool = args.pool or (4 if args.quick else 8)
    plan = schedule(args)
    with tempfile.TemporaryDirectory(prefix="ggufpipe-chaos-") as folder:
        work = Path(folder)
        server = None
        try:
            options = ["--api-key", KEY, "--parallel", "3"]
            if args.port:
                options += ["--serve", f"127.0.0.1:{args.port}"]  # the last --serve is the one
            server = Ggufpipe("ggufpipe --serve", inventory(work), work, *options)
            tally = asyncio.run(run(work, server, args, plan))
            code = server.process.wait(120)
            time.sleep(2)
            left = leftovers(work)
            cut_lines = sum("cut short by the shutdown" in line for line in server.lines)
            shutdown_503 = sum(" 503 " in line and "shutting down" in line for line in server.lines)
            if args.server_log:
                Path(args.server_log).write_text("".join(server.lines))
        finally:
            if server is not None:
                server.close()
            for pid in leftovers(work):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    text = report(
        tally,
        args,
        plan,
        {"exit": code, "left": len(left), "cut_lines": cut_lines, "shutdown_503": shutdown_503},
    )
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
