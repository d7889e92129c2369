"""How the orchestrator reaches an agent: one small interface, two transports.

An :class:`AgentLink` is one running agent with a control stream (msgpack
frames through one :class:`~ggufpipe_agent.framing.FrameWriter` and one
:class:`~ggufpipe_agent.framing.FrameReader`), a way to open its data stream
(edge objects) and its stderr. :mod:`ggufpipe_tui.transports.local` starts the
agent as a subprocess (the embedded default, no SSH);
:mod:`ggufpipe_tui.transports.ssh` starts it over SSH. Nothing above this
package knows which one carries a stage.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import deque
from collections.abc import Callable
from typing import Any

from ggufpipe_agent import PROTOCOL_VERSION, __version__
from ggufpipe_agent.errors import GgufpipeError, ProtocolError
from ggufpipe_agent.framing import FrameReader, FrameWriter
from ggufpipe_agent.protocol import DataAttach, Hello, Message, Refused
from ggufpipe_agent.tasks import TaskOwner
from ggufpipe_tui.core.inventory import HostSpec

log = logging.getLogger("ggufpipe.transport")

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
        self.control: FrameWriter | None = None
        self.hello: Hello | None = None
        self.stderr_tail: deque[str] = deque(maxlen=20)
        # The link's own background work (stderr pumps): a pump that dies of a
        # bug says so in the stage's log instead of going quiet.
        self.tasks = TaskOwner(self._task_failed, f"stage {stage} link")

    @property
    def label(self) -> str:
        if self.stage < 0:  # an agent for something else than a stage (ggufpipe-tui cache)
            return f"agent on {self.host.name} ({self.host.where})"
        return f"stage {self.stage} on {self.host.name} ({self.host.where})"

    def _task_failed(self, name: str, error: BaseException) -> None:
        self.on_log(f"internal error in the orchestrator's {name}: {type(error).__name__}: {error}")

    def _streams(self, reader: Any, writer: Any) -> None:
        """The control stream, once the transport has it."""
        self.reader, self.writer = reader, writer
        self._control_reader = FrameReader(reader, "control stream")
        self.control = FrameWriter(writer, what="control stream")

    # -------------------------------------------------------------- control

    async def handshake(self, timeout: float) -> Hello:
        try:
            first = await asyncio.wait_for(self._control_reader.message(), timeout)
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
        assert self.control is not None, "the link has not started"
        await self.control.send(message)

    async def receive(self) -> Message | None:
        return await self._control_reader.message()

    def _tail(self) -> str:
        """The agent's last words for a failure reason: its last stderr line
        that is not a routine INFO/DEBUG record (a state change logged just
        before a SIGKILL says nothing about it)."""
        lines = [line for line in self.stderr_tail if line.strip() and not ROUTINE_LOG.match(line)]
        return f"; agent stderr: {lines[-1]}" if lines else ""

    def log_line(self, line: str) -> None:
        self.stderr_tail.append(line)
        self.on_log(line)

    async def pump_stderr(self, stream: Any, prefix: str = "") -> None:
        """A stderr stream into the stage log, line by line, until it ends."""
        while True:
            try:
                raw = await stream.readline()
            except (ConnectionError, OSError):
                return
            if not raw:
                return
            line = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
            self.log_line(prefix + line.rstrip("\n"))

    # ----------------------------------------------------------------- data

    async def open_data(self) -> tuple[Any, Any]:
        """A data stream to the agent, attached with the Hello's token."""
        assert self.hello is not None
        reader, writer = await self._connect_data(self.hello.data_endpoint)
        await FrameWriter(writer).send(DataAttach(self.hello.data_token))
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
