"""How the orchestrator reaches an agent: one small interface, two transports.

An :class:`AgentLink` is one running agent with a control stream (msgpack
frames), a way to open its data stream (edge objects) and its stderr. The
local transport starts the agent as a subprocess (the embedded default, no
SSH); :mod:`ggufpipe_tui.transports.ssh` starts it over SSH. Nothing above this module
knows which one carries a stage.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shlex
import sys
from collections import deque
from collections.abc import Callable
from typing import Any

from ggufpipe_agent import PROTOCOL_VERSION, __version__
from ggufpipe_agent.bridge import parse_endpoint
from ggufpipe_agent.errors import GgufpipeError, ProtocolError
from ggufpipe_agent.protocol import DataAttach, Hello, Message, Refused, encode_message, read_message
from ggufpipe_tui.core.inventory import HostSpec

LogLine = Callable[[str], None]
STREAM_LIMIT = 1 << 20
# The agent's own routine log records ("2026-01-01 12:00:00,000 INFO name: ...").
ROUTINE_LOG = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (DEBUG|INFO) ")


class TransportError(GgufpipeError):
    """An agent that cannot be started, reached or understood."""


class AgentLink:
    """A running agent. Subclasses provide the streams and how to end it."""

    def __init__(self, host: HostSpec, stage: int, on_log: LogLine) -> None:
        self.host = host
        self.stage = stage
        self.on_log = on_log
        self.reader: Any = None
        self.writer: Any = None
        self.hello: Hello | None = None
        self.stderr_tail: deque[str] = deque(maxlen=20)
        self._write_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def label(self) -> str:
        return f"stage {self.stage} on {self.host.name} ({self.host.where})"

    # -------------------------------------------------------------- control

    async def handshake(self, timeout: float) -> Hello:
        try:
            first = await asyncio.wait_for(read_message(self.reader), timeout)
        except asyncio.TimeoutError:
            raise TransportError(
                f"{self.label}: the agent sent no Hello within {timeout:g}s{self._tail()}"
            ) from None
        except ProtocolError as error:
            raise TransportError(
                f"{self.label}: the agent's first frame is not ggufpipe protocol ({error}); is "
                f"'{self.host.agent}' a ggufpipe agent?{self._tail()}"
            ) from None
        if first is None:
            raise TransportError(f"{self.label}: the agent exited before its Hello{self._tail()}")
        if isinstance(first, Refused):
            raise TransportError(f"{self.label}: the agent refused the connection: {first.reason}")
        if not isinstance(first, Hello):
            raise TransportError(f"{self.label}: the agent's first message is {first.tag}, not Hello")
        if first.protocol != PROTOCOL_VERSION:
            raise TransportError(
                f"{self.label}: the agent speaks protocol {first.protocol} (ggufpipe "
                f"{first.version}), this orchestrator speaks {PROTOCOL_VERSION}: install "
                f"ggufpipe=={__version__} on {self.host.name}"
            )
        self.hello = first
        return first

    async def send(self, message: Message) -> None:
        async with self._write_lock:
            self.writer.write(encode_message(message))
            await self.writer.drain()

    async def receive(self) -> Message | None:
        return await read_message(self.reader)

    def _tail(self) -> str:
        """The agent's last words for a failure reason: its last stderr line
        that is not a routine INFO/DEBUG record (a state change logged just
        before a SIGKILL says nothing about it)."""
        lines = [line for line in self.stderr_tail if line.strip() and not ROUTINE_LOG.match(line)]
        return f"; agent stderr: {lines[-1]}" if lines else ""

    def log_line(self, line: str) -> None:
        self.stderr_tail.append(line)
        self.on_log(line)

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _pump_stderr(self, stream: Any) -> None:
        while True:
            raw = await stream.readline()
            if not raw:
                return
            line = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
            self.log_line(line.rstrip("\n"))

    # ----------------------------------------------------------------- data

    async def open_data(self) -> tuple[Any, Any]:
        """A data stream to the agent, attached with the Hello's token."""
        assert self.hello is not None
        reader, writer = await self._connect_data(self.hello.data_endpoint)
        writer.write(encode_message(DataAttach(self.hello.data_token)))
        await writer.drain()
        return reader, writer

    async def start(self, timeout: float) -> Hello:
        """Start (or reach) the agent and return its Hello."""
        raise NotImplementedError

    async def _connect_data(self, endpoint: str) -> tuple[Any, Any]:
        raise NotImplementedError

    async def close(self, grace: float) -> None:
        raise NotImplementedError

    def alive(self) -> bool:
        raise NotImplementedError

    def exit_detail(self) -> str:
        """Why the agent is gone, for a fault reason."""
        return self._tail()

    def gone_reason(self) -> str:
        """A fault reason's tail once alive() is False."""
        return f"the agent exited{self.exit_detail()}"


async def open_endpoint(endpoint: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    where, port = parse_endpoint(endpoint)
    if port is None:
        return await asyncio.open_unix_connection(where, limit=STREAM_LIMIT)
    return await asyncio.open_connection(where, port, limit=STREAM_LIMIT)


class LocalAgent(AgentLink):
    """An agent on this machine: a subprocess on stdio, or a hand-started agent
    listening on ``host.listen``."""

    def __init__(self, host: HostSpec, stage: int, on_log: LogLine) -> None:
        super().__init__(host, stage, on_log)
        self.process: asyncio.subprocess.Process | None = None

    def command(self) -> list[str]:
        if self.host.agent != "ggufpipe-agent":
            command = shlex.split(self.host.agent)
        else:
            # The same interpreter and package as the orchestrator: no PATH or
            # version surprises for the embedded transport.
            command = [sys.executable, "-m", "ggufpipe_agent"]
        if self.host.cache_dir:
            command += ["--cache-dir", self.host.cache_dir]
        return command

    async def start(self, timeout: float) -> Hello:
        if self.host.listen:
            try:
                self.reader, self.writer = await asyncio.wait_for(open_endpoint(self.host.listen), timeout)
            except (OSError, asyncio.TimeoutError) as error:
                raise TransportError(
                    f"{self.label}: no agent listening on {self.host.listen} ({error or 'timeout'}); "
                    f"start one with: ggufpipe-agent --listen {self.host.listen}"
                ) from None
            return await self.handshake(timeout)
        command = self.command()
        try:
            self.process = await asyncio.create_subprocess_exec(
                *command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                limit=STREAM_LIMIT,
            )  # the agent ends itself with its parent (PR_SET_PDEATHSIG, agent cli)
        except OSError as error:
            raise TransportError(f"{self.label}: cannot start {command[0]}: {error.strerror}") from None
        assert self.process.stdout and self.process.stdin and self.process.stderr
        self.reader, self.writer = self.process.stdout, self.process.stdin
        self._spawn(self._pump_stderr(self.process.stderr))
        return await self.handshake(timeout)

    async def _connect_data(self, endpoint: str) -> tuple[Any, Any]:
        try:
            return await open_endpoint(endpoint)
        except OSError as error:
            raise TransportError(
                f"{self.label}: cannot reach the agent's data socket {endpoint}: {error}"
            ) from None

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.returncode is None
        return self.writer is not None and not self.writer.is_closing()

    def exit_detail(self) -> str:
        code = self.process.returncode if self.process is not None else None
        status = ""
        if code is not None:
            status = f" (exit status {code})" if code >= 0 else f" (killed by signal {-code})"
        return status + self._tail()

    async def close(self, grace: float) -> None:
        """End the agent: closing its stdin is the request to exit; then
        SIGTERM, then SIGKILL. Nothing this started outlives it."""
        if self.writer is not None:
            with contextlib.suppress(Exception):
                self.writer.close()
        process = self.process
        if process is None:
            return
        for action in (None, process.terminate, process.kill):
            if process.returncode is not None:
                break
            if action is not None:
                with contextlib.suppress(ProcessLookupError):
                    action()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(process.wait(), grace)
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(task, 1.0)
