"""A real ggufpipe-tui --serve process on a local inventory, and plain HTTP to it."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import openai

from tests.support.common import first_line, serve
from tests.support.local import UNEVEN, write_inventory

KEY = "sk-test-ggufpipe"


START_TIMEOUT = 180.0


@dataclass
class Served:
    process: subprocess.Popen[str]
    port: int
    log_dir: Path
    inventory: Path
    lines: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120)

    def wait_line(self, predicate: Callable[[str], bool], timeout: float, what: str) -> str:
        line = first_line(self.lines, self.process, predicate, timeout)
        if line is not None:
            return line
        raise AssertionError(f"no line for {what} in {timeout:g}s; stderr:\n" + "".join(self.lines))

    def settle(self, quiet: float = 0.5, timeout: float = 10) -> None:
        """Wait until no stderr line has arrived for ``quiet`` seconds: an
        access line is written once its reply is out, which may be after the
        client has read the reply."""
        count, since, end = len(self.lines), time.monotonic(), time.monotonic() + timeout
        while time.monotonic() < end:
            time.sleep(0.05)
            if len(self.lines) != count:
                count, since = len(self.lines), time.monotonic()
            elif time.monotonic() - since >= quiet:
                return

    def run_log(self, run_id: str) -> list[dict[str, object]]:
        (path,) = self.log_dir.glob(f"*-{run_id}.jsonl")
        return [json.loads(line) for line in path.read_text().splitlines()]

    def stop(self, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)


def raw(
    served: Served, method: str, path: str, key: str | None = KEY, **options: object
) -> tuple[int, dict[str, object]]:
    """One plain HTTP request: its status and JSON body."""

    async def main() -> tuple[int, dict[str, object]]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with (
            aiohttp.ClientSession(headers=headers) as http,
            http.request(method, served.url + path, **options) as response,  # type: ignore[arg-type]
        ):
            return response.status, await response.json(content_type=None)

    return asyncio.run(main())


def start_server(
    tmp_path: Path,
    model_path: Path,
    *args: str,
    key: str = KEY,
    data: str = "",
    stages: str = UNEVEN,
    here: str = "{local: true}",
    context: int = 512,
) -> Served:
    """``data``: more top-level inventory lines (e.g. ``recovery: {attempts: 0}``);
    ``stages``, ``here`` and ``context`` as :func:`write_inventory` takes them."""
    inventory = write_inventory(tmp_path, model_path, stages, data=data, here=here, context=context)
    log_dir = tmp_path / "runs"
    env = dict(os.environ, GGUFPIPE_API_KEY=key)
    process, lines = serve(inventory, log_dir, *args, env=env)
    served = Served(process, 0, log_dir, inventory, lines)
    try:
        listening = served.wait_line(lambda line: "listening on http://" in line, 60, "the listening line")
        served.port = int(re.search(r"127\.0\.0\.1:(\d+)/v1", listening).group(1))  # type: ignore[union-attr]
        served.wait_line(
            lambda line: line.startswith("ggufpipe: ready:"), START_TIMEOUT, "the stages to load"
        )
    except BaseException:
        served.stop()  # a server that never got ready is not left running
        raise
    return served
