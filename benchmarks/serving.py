"""What the serving benchmarks of issue 38 share (bench_prefill.py, bench_batched.py,
bench_interleave.py): ggufpipe ``--serve`` on local or SSH stages and llama.cpp's own
server, each in a process group of its own; one streamed completion with the client-side
time of every chunk; the machine line and load average of a doc page.

The process handling is bench_parallel.py's (:class:`~benchmarks.bench_parallel.Process`);
what is new here: any inventory (stages, threads, context), llama-server with any context
per slot, prompts given as token ids, and each chunk's arrival time.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import llama_cpp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_parallel import Process, llama_server_binary  # noqa: E402
from benchmarks.bench_server import Server  # noqa: E402
from tests.support.common import smollm_path  # noqa: E402
from tests.support.sshd import Sshd, free_port, sshd_missing  # noqa: E402

__all__ = [
    "Ggufpipe",
    "LlamaServer",
    "Process",
    "detokenize",
    "session",
    "SshHosts",
    "llama_server_binary",
    "local_inventory",
    "machine",
    "stream",
    "tokenize",
]

AGENT = f"{sys.executable} -m ggufpipe_agent"  # sshd passes none of our environment


def machine() -> str:
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform(terse=True)}, "
        f"Python {platform.python_version()}, llama-cpp-python {llama_cpp.__version__}, ggufpipe at "
        f"{revision()}"
    )


def revision() -> str:
    """The commit measured, and whether the product code differs from it."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "an unknown commit"
    changed = git("status", "--porcelain", "--", "ggufpipe_agent", "ggufpipe_tui")
    return commit + (" with uncommitted changes to the product code" if changed else "")


@functools.cache
def _vocab() -> llama_cpp.Llama:
    return llama_cpp.Llama(str(smollm_path()), vocab_only=True, verbose=False)


def tokenize(text: str, bos: bool = True) -> list[int]:
    return list(_vocab().tokenize(text.encode(), add_bos=bos))


def detokenize(tokens: list[int]) -> str:
    return _vocab().detokenize(tokens).decode("utf-8", errors="replace")


def run_block(context: int, max_tokens: int, ubatch: int = 512) -> str:
    return (
        f"run: {{context: {context}, ubatch: {ubatch}, max_tokens: {max_tokens}, temperature: 0.0, "
        "chat: false, ignore_eos: true}\n"
        # Long prompts on one thread: a prefill of 8k tokens takes a minute here.
        "timeouts: {connect: 30, ready: 300, step: 300, teardown: 15}\n"
    )


def local_inventory(
    ranges: list[tuple[int, int]], context: int, max_tokens: int, threads: int = 1, ubatch: int = 512
) -> str:
    """Each stage on a local host of its own with ``threads`` threads (0: the host's default)."""
    thread = f", threads: {threads}" if threads else ""
    hosts = "".join(f"  h{i}: {{local: true{thread}}}\n" for i in range(len(ranges)))
    stages = "".join(f"  - {{host: h{i}, layers: [{a}, {b}]}}\n" for i, (a, b) in enumerate(ranges))
    return f"model: {{path: '{smollm_path()}'}}\nhosts:\n{hosts}stages:\n{stages}" + run_block(
        context, max_tokens, ubatch
    )


class SshHosts:
    """A loopback OpenSSH server (tests/support/sshd.py, the SSH tests' fixture) and an
    inventory of one SSH host per stage on it, ``threads: 1`` each: the stages talk
    over mutual-TLS direct links as on separate machines."""

    def __init__(self) -> None:
        self.why_not = sshd_missing()
        self.sshd: Sshd | None = None
        if not self.why_not:
            self.sshd = Sshd(Path(tempfile.mkdtemp(prefix="ggufpipe-bench-sshd-")), max_sessions=64).start()
        self.cache = Path(tempfile.mkdtemp(prefix="ggufpipe-bench-ssh-cache-"))

    def inventory(
        self, ranges: list[tuple[int, int]], context: int, max_tokens: int, ubatch: int = 512
    ) -> str:
        assert self.sshd is not None
        s = self.sshd
        hosts = "".join(
            f"  s{i}: {{address: 127.0.0.1, port: {s.port}, user: {s.user}, identity: {s.client_key}, "
            f"known_hosts: {s.known_hosts}, agent: '{AGENT}', cache_dir: {self.cache}, threads: 1}}\n"
            for i in range(len(ranges))
        )
        stages = "".join(f"  - {{host: s{i}, layers: [{a}, {b}]}}\n" for i, (a, b) in enumerate(ranges))
        return f"model: {{path: '{smollm_path()}'}}\nhosts:\n{hosts}stages:\n{stages}" + run_block(
            context, max_tokens, ubatch
        )

    def close(self) -> None:
        if self.sshd is not None:
            self.sshd.stop()


class Ggufpipe(Process):
    """``ggufpipe-tui INVENTORY --serve`` (``options``: more of its options), its agents
    in its process group."""

    def __init__(self, name: str, inventory: str, workdir: Path, *options: str) -> None:
        self.name = name
        folder = Path(tempfile.mkdtemp(prefix="ggufpipe-", dir=workdir))
        path = folder / "inventory.yaml"
        path.write_text(inventory)
        server = Server(path, folder, *options, new_session=True)  # bench_server's
        self.process, self.url, self.lines = server.process, server.url, server.lines


class LlamaServer(Process):
    """llama.cpp's own server on the whole model, one process: ``-t threads
    --parallel parallel -c parallel x per_slot``."""

    def __init__(
        self, binary: str, workdir: Path, threads: int, parallel: int, per_slot: int, *more: str
    ) -> None:
        self.name = f"llama-server -t {threads} --parallel {parallel}"
        port = free_port()
        self.log = workdir / f"llama-server-t{threads}-p{parallel}-{port}.log"
        command = [
            binary, "-m", str(smollm_path()), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "--parallel", str(parallel), "-c", str(parallel * per_slot), *more,
        ]  # fmt: skip
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, text=True,
                start_new_session=True,
            )  # fmt: skip
        self.url = f"http://127.0.0.1:{port}/v1"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                    if json.loads(answer.read()).get("status") == "ok":
                        return
            except (OSError, urllib.error.URLError, ValueError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} did not start:\n" + self.log.read_text()[-4000:])


async def stream(
    http: aiohttp.ClientSession,
    url: str,
    prompt: str | list[int],
    max_tokens: int,
    chunks: list[float] | None = None,
) -> dict[str, Any]:
    """One streamed raw completion, greedy, exactly ``max_tokens`` tokens
    (``ignore_eos``), computed cold (``cache_prompt: false``): its text, its tokens,
    the perf_counter time of its send, of every text chunk and of its end, time to
    first token (client side) and the server's own ``timings`` when it sends them."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "cache_prompt": False,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    chunks = [] if chunks is None else chunks
    text, tokens, timings = "", 0, {}
    async with http.post(f"{url}/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: {response.status} {await response.text()}")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"{url}: {event['error']}")
            now = time.perf_counter()
            for choice in event.get("choices") or []:
                if choice.get("text"):
                    chunks.append(now)
                    text += choice["text"]
            usage = event.get("usage") or {}
            timings = event.get("timings") or timings
            tokens = usage.get("completion_tokens") or timings.get("predicted_n") or tokens
    done = time.perf_counter()
    return {
        "text": text,
        "tokens": tokens or len(chunks),
        "ttft_ms": ((chunks[0] if chunks else done) - started) * 1000.0,
        "started": started,
        "chunks": chunks,
        "done": done,
        "timings": timings,
    }


def session(total: float = 1800) -> aiohttp.ClientSession:
    """A client session; a connection per request (a server may close one after a
    streamed answer, and a kept one reused then fails)."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=total), connector=aiohttp.TCPConnector(force_close=True)
    )
