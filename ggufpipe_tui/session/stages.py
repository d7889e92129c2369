"""A handle per stage: everything the orchestrator holds of one stage's agent.

A :class:`StageHandle` owns its :class:`~ggufpipe_tui.transports.connection.AgentConnection`
(control stream, process), its control reader, its requests awaiting an
answer and whether it is lost. The data plane adds the stage's data stream
(:attr:`StageHandle.data`); the run driver sees a stage only through the
narrow :class:`StagePort` protocol (send, alive, report a broken stream).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Protocol

from ggufpipe_agent.errors import ProtocolError
from ggufpipe_agent.heartbeat import Silence
from ggufpipe_agent.tasks import TaskOwner
from ggufpipe_agent.wire.delivery_messages import CacheReport
from ggufpipe_agent.wire.framing import FrameReader, FrameWriter
from ggufpipe_agent.wire.link_messages import LinkConnected, LinkListening
from ggufpipe_agent.wire.protocol import Heartbeat, Hello, Message, ModelInfo, RequestFailed, Tokenized
from ggufpipe_tui.core.errors import PipelineError
from ggufpipe_tui.core.events import AgentSetup, Emit
from ggufpipe_tui.core.inventory import HostSpec, Timeouts
from ggufpipe_tui.dataplane import DataStream
from ggufpipe_tui.transports.connection import AgentConnection, AgentNotSetUp, TransportError

#: Replies that answer a request by its request_id.
REPLIES = (ModelInfo, Tokenized, RequestFailed, CacheReport, LinkListening, LinkConnected)
#: How long a control message may take to be written before heartbeats
#: (and timeouts.heartbeat) apply.
DEFAULT_SEND_TIMEOUT = 30.0


def heartbeat_interval(timeout: float) -> float:
    """How often each side beats for a silence bound of ``timeout``."""
    return timeout / 5


#: Gives a stage's host its agent (:func:`agent_set_up`).
SetUp = Callable[["StageHandle", AgentNotSetUp], Awaitable[None]]


def agent_set_up(timeouts: Timeouts, emit: Emit) -> SetUp:
    """Gives the stage's host its agent (provision/hosts.py), step by step in
    AgentSetup events, within timeouts.setup."""

    async def set_up(stage: StageHandle, missing: AgentNotSetUp) -> None:
        index, name = stage.index, stage.host.name

        def progress(detail: str) -> None:
            emit(AgentSetup(index, name, "setting up", detail))

        progress(str(missing).split(": ", 1)[-1])
        bound = timeouts.setup
        try:
            setting_up = stage.link.set_up(progress, timeouts.connect, redo=missing.broken)
            done = await asyncio.wait_for(setting_up, bound)
        except asyncio.TimeoutError:
            raise PipelineError(
                f"{stage.label}: setting up the agent on {name} took more than timeouts.setup ({bound:g} s)"
            ) from None
        emit(AgentSetup(index, name, "done", "", done.how, done.seconds, done.bytes_sent))

    return set_up


class StagePort(Protocol):
    """What a run driver needs of one stage."""

    @property
    def label(self) -> str: ...

    def alive(self) -> bool: ...

    async def send(self, message: Message) -> None: ...

    def report_lost(self, symptom: str) -> None: ...


class StageHandle:
    def __init__(
        self,
        index: int,
        link: AgentConnection,
        on_message: Callable[[StageHandle, Message], None],
        on_lost: Callable[[StageHandle, str], None],
    ) -> None:
        self.index = index
        self.link = link
        self.data: DataStream | None = None
        self.lost = ""  # the reason, once the stage is lost
        self.retired = False  # a repair replaced it (session/rebuild.py)
        self._on_message = on_message
        self._on_lost = on_lost
        self._requests: dict[int, asyncio.Future[Message]] = {}
        self._request_ids = itertools.count(1)
        # Until heartbeats start: sends are bounded, silence is not.
        self.send_timeout = DEFAULT_SEND_TIMEOUT
        self.silence: Silence | None = None
        self.silent_for = 0.0  # set when the stage is lost for saying nothing

    @property
    def label(self) -> str:
        return self.link.label

    @property
    def host(self) -> HostSpec:
        return self.link.host

    @property
    def hello(self) -> Hello | None:
        return self.link.hello

    def alive(self) -> bool:
        return self.link.alive()

    # -------------------------------------------------------------- start

    async def start(self, timeout: float, set_up: SetUp | None = None) -> Hello:
        """Start the stage's agent; where its host has none yet (an SSH host
        whose entry names no agent:), ``set_up`` gives it one first."""
        try:
            try:
                return await self._start_once(timeout)
            except AgentNotSetUp as missing:
                if set_up is None:
                    raise
                await set_up(self, missing)
            return await self._start_once(timeout)
        finally:
            self.link.settled.set()  # a stage sharing this agent's process may attach now

    async def _start_once(self, timeout: float) -> Hello:
        try:
            return await asyncio.wait_for(self.link.start(timeout), timeout + 5)
        except asyncio.TimeoutError:
            raise TransportError(f"{self.label}: no answer within {timeout:g}s") from None

    async def open_data(self, timeout: float) -> DataStream:
        try:
            reader, writer = await asyncio.wait_for(self.link.open_data(), timeout)
        except asyncio.TimeoutError:
            raise TransportError(f"{self.label}: the data channel did not open within {timeout:g}s") from None
        self.data = DataStream(
            FrameReader(reader, f"data stream of stage {self.index}"),
            FrameWriter(writer, what=f"data stream of stage {self.index}"),
        )
        return self.data

    # ------------------------------------------------------------ control

    async def send(self, message: Message) -> None:
        """A control message, written within :attr:`send_timeout`: an agent
        that stops reading (stopped, or its network gone) is a broken stream,
        never a wait without end."""
        try:
            await asyncio.wait_for(self.link.send(message), self.send_timeout)
        except asyncio.TimeoutError:
            raise ConnectionError(
                f"the control stream took no {message.tag} for {self.send_timeout:g}s"
            ) from None

    async def request(self, make: Callable[[int], Message], timeout: float) -> Message:
        """Send ``make(request_id)`` and wait for the reply with that id (both
        within ``timeout``)."""
        request_id = next(self._request_ids)
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._requests[request_id] = future

        async def ask() -> Message:
            await self.send(make(request_id))
            return await future

        try:
            if self.lost:
                raise PipelineError(self.lost)
            return await asyncio.wait_for(ask(), timeout)
        except asyncio.TimeoutError:
            raise PipelineError(f"{self.label}: no answer to a request within {timeout:g}s") from None
        except (ConnectionError, OSError) as error:
            raise PipelineError(f"{self.label}: the control stream broke ({error})") from None
        finally:
            self._requests.pop(request_id, None)

    def start_heartbeat(self, tasks: TaskOwner, timeout: float) -> None:
        """Beat every ``timeout``/5 s; from now on a stage that sends nothing
        for ``timeout`` s is lost, and no send to it waits longer."""
        self.send_timeout = timeout
        self.silence = Silence(timeout)
        tasks.spawn(self._beat(heartbeat_interval(timeout), timeout), f"heartbeat of stage {self.index}")
        tasks.spawn(self._watch(self.silence), f"silence watch of stage {self.index}")

    async def _watch(self, silence: Silence) -> None:
        bound = await silence.expired()
        if not self.lost:
            self.silent_for = bound
            self.report_lost(f"no answer for {bound:g} s")

    async def _beat(self, interval: float, timeout: float) -> None:
        while not self.lost:
            try:
                await self.send(Heartbeat(interval, timeout))
            except (ConnectionError, OSError) as error:
                self.report_lost(f"cannot send a heartbeat ({error})")
                return
            await asyncio.sleep(interval)

    async def read_control(self) -> None:
        """The control reader: replies resolve their requests, everything else
        goes to the pipeline. Ends when the stream does; then the stage is
        lost (and so it is when the agent says nothing, not even a heartbeat,
        for the heartbeat bound: :meth:`_watch`)."""
        reason = ""
        try:
            while True:
                message = await self.link.receive()
                if self.silence is not None:
                    self.silence.heard()
                if message is None:
                    break
                if isinstance(message, Heartbeat):
                    continue
                if isinstance(message, REPLIES):
                    future = self._requests.get(message.request_id)
                    if future is not None and not future.done():
                        future.set_result(message)
                    continue
                self._on_message(self, message)
        except ProtocolError as error:
            reason = f"corrupt control stream ({error})"
        except (ConnectionError, OSError) as error:
            reason = f"control stream broke ({error})"
        self.report_lost(reason or "the control stream ended")

    def report_lost(self, symptom: str) -> None:
        """A stream of this stage broke or ended (the pipeline says it once)."""
        self._on_lost(self, symptom)

    async def diagnose(self, symptom: str) -> str:
        """The reason a lost stage is reported with: the agent's exit and its
        last words when it exited, else the symptom."""
        link = self.link
        await link.settle_exit()
        for _ in range(20):  # the exit status and last stderr lines may lag a moment
            if not link.alive():
                break
            await asyncio.sleep(0.05)
        if link.alive():
            if self.silent_for:
                return f"no answer from {link.label} for {self.silent_for:g} s"
            return f"{link.label}: {symptom}{link.exit_detail()}"
        # The same words from every stage of a shared process: one reason.
        return f"{link.process_label}: {link.gone_reason()}"

    def fail_requests(self, reason: str) -> None:
        for future in self._requests.values():
            if not future.done():
                future.set_exception(PipelineError(reason))

    # ------------------------------------------------------------ closing

    def close_data(self) -> None:
        if self.data is not None:
            self.data.writer.close()

    async def close(self, grace: float) -> None:
        await self.link.close(grace)
