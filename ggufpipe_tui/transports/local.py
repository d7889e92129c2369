"""The local transport: an agent on this machine, as a subprocess on stdio or
a hand-started agent listening on ``host.listen``. No SSH involved."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from ggufpipe_agent.wire import listen_key
from ggufpipe_agent.wire.endpoints import parse_endpoint
from ggufpipe_agent.wire.protocol import Hello
from ggufpipe_tui.core.inventory import HostSpec
from ggufpipe_tui.transports.connection import STREAM_LIMIT, AgentConnection, LogLine, TransportError


async def open_endpoint(endpoint: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    where, port = parse_endpoint(endpoint)
    if port is None:
        return await asyncio.open_unix_connection(where, limit=STREAM_LIMIT)
    return await asyncio.open_connection(where, port, limit=STREAM_LIMIT)


class LocalAgent(AgentConnection):
    def __init__(self, host: HostSpec, stage: int, on_log: LogLine) -> None:
        super().__init__(host, stage, on_log)
        self.process: asyncio.subprocess.Process | None = None

    def command(self) -> list[str]:
        if self.host.agent:
            command = shlex.split(self.host.agent)
        else:
            # The same interpreter and package as the orchestrator: no PATH or
            # version surprises for the embedded transport.
            command = [sys.executable, "-m", "ggufpipe_agent"]
        if self.host.cache_dir:
            command += ["--cache-dir", self.host.cache_dir]
        if self.share_process:
            command.append("--share-process")
        return command

    async def start(self, timeout: float) -> Hello:
        if self.host.listen:
            return await self.attach_listening(timeout)
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
        self._streams(self.process.stdout, self.process.stdin)
        self.tasks.spawn(self.pump_stderr(self.process.stderr), "stderr pump")
        return await self.handshake(timeout)

    async def _open_listening(self, timeout: float) -> None:
        try:
            reader, writer = await asyncio.wait_for(open_endpoint(self.host.listen), timeout)
        except (OSError, asyncio.TimeoutError) as error:
            raise TransportError(
                f"{self.label}: no agent listening on {self.host.listen} ({error or 'timeout'}); "
                f"start one with: ggufpipe-agent --listen {self.host.listen}"
            ) from None
        self._streams(reader, writer)

    async def _drop_listening(self) -> None:
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    async def read_listen_key(self, timeout: float) -> bytes:
        try:
            return listen_key.read_key_file(Path(os.path.expanduser(self.listen_key_path)))
        except listen_key.ListenKeyError as error:
            raise TransportError(
                f"{self.label}: {error}; the agent started with --listen {self.host.listen} prints "
                "the path of its key file (give it as listen_key: when it is not the default)"
            ) from None

    async def _connect_data(self, endpoint: str) -> tuple[Any, Any]:
        try:
            return await open_endpoint(endpoint)
        except OSError as error:
            raise TransportError(
                f"{self.label}: cannot reach the agent's data socket {endpoint}: {error}"
            ) from None

    async def open_socket(self, endpoint: str, timeout: float) -> tuple[Any, Any]:
        try:
            return await open_endpoint(endpoint)
        except OSError as error:
            raise TransportError(f"{self.label}: cannot reach the socket {endpoint}: {error}") from None

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
        # The stderr pump ends at the pipe's EOF; its last lines are the
        # agent's last words, so it is given a moment before it is cancelled.
        await self.tasks.settle(1.0)
        await self.tasks.close()
