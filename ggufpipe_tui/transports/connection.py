"""How the orchestrator reaches an agent: one small interface, two transports.

An :class:`AgentConnection` is one running agent with a control stream (msgpack
frames through one :class:`~ggufpipe_agent.wire.framing.FrameWriter` and one
:class:`~ggufpipe_agent.wire.framing.FrameReader`), a way to open its data stream
(edge objects) and its stderr. :mod:`ggufpipe_tui.transports.local` starts the
agent as a subprocess (the embedded default, no SSH);
:mod:`ggufpipe_tui.transports.ssh` starts it over SSH. Nothing above this
package knows which one carries a stage.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ggufpipe_agent import PROTOCOL_VERSION, __version__
from ggufpipe_agent.errors import GgufpipeError, ProtocolError
from ggufpipe_agent.tasks import TaskOwner
from ggufpipe_agent.wire import listen_key
from ggufpipe_agent.wire.framing import FrameReader, FrameWriter
from ggufpipe_agent.wire.protocol import (
    AuthChallenge,
    AuthProof,
    AuthResponse,
    DataAttach,
    Hello,
    Message,
    Refused,
)
from ggufpipe_tui.core.inventory import HostSpec

if TYPE_CHECKING:  # provision.hosts loads asyncssh: not for a local-only run
    from ggufpipe_tui.provision.hosts import SetupResult

log = logging.getLogger("ggufpipe.transport")

LogLine = Callable[[str], None]
STREAM_LIMIT = 1 << 20
#: The largest frame read while connecting, before the agent is known.
CONNECT_FRAME_LIMIT = 4096
# The agent's own routine log records ("2026-01-01 12:00:00,000 INFO name: ...").
ROUTINE_LOG = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (DEBUG|INFO) ")
#: A hand-started agent (listen:) that is busy or closes the connection before
#: its handshake is done is tried again after these pauses (the last repeats,
#: each +-20%), within the connect timeout; a try starts only with at least
#: LISTEN_TRY_MIN seconds of it left.
LISTEN_BACKOFF = (0.25, 0.5, 1.0, 2.0, 4.0)
LISTEN_TRY_MIN = 1.0


class TransportError(GgufpipeError):
    """An agent that cannot be started, reached or understood."""


class AgentNotSetUp(TransportError):
    """The host has no agent of this orchestrator's build yet (its entry
    names no agent:), or it has one that cannot run (``broken``: set it up
    again); :meth:`AgentConnection.set_up` gives it one."""

    def __init__(self, message: str, broken: bool = False) -> None:
        super().__init__(message)
        self.broken = broken


class HostUnreachable(TransportError):
    """The host does not answer: its SSH server cannot be reached (refused,
    no route, the connection dropped during its handshake) or says nothing
    within timeouts.connect. Recovery moves its lost stages to a spare host
    (docs/recovery.md); a host that answers and refuses is not this."""


class ListenRetry(TransportError):
    """A hand-started agent that may take this orchestrator on another try:
    it is busy, or it closed the connection before its handshake was done.
    ``met`` says which, in a few words, for the error that gives up."""

    def __init__(self, message: str, met: str) -> None:
        super().__init__(message)
        self.met = met


class AgentConnection:
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
        # share_process: true (transports/shared.py): this agent is started
        # with --share-process, and these stages run in its process.
        self.share_process = False
        self.sharers: list[int] = [stage]
        self.settled = asyncio.Event()  # start() has returned or failed (StageHandle.start)
        self._listen_key: bytes | None = None  # a hand-started agent's key, once read

    @property
    def process_label(self) -> str:
        """Who is lost when this agent's process is: its stages, on its host."""
        if len(self.sharers) < 2:
            return self.label
        stages = ", ".join(str(stage) for stage in self.sharers)
        return f"stages {stages} on {self.host.name} ({self.host.where}), one agent process"

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

    async def _first(
        self, timeout: float, what: str, limit: int = CONNECT_FRAME_LIMIT, listening: bool = False
    ) -> Message:
        """The next control message while connecting, small and within ``timeout``.
        On a hand-started agent's connection (``listening``) an end of stream
        is the connection closed, which another try may get past."""
        try:
            first = await asyncio.wait_for(self._control_reader.message(limit), timeout)
        except asyncio.TimeoutError:
            raise TransportError(
                f"{self.label}: the agent sent no {what} within {timeout:g}s{self._tail()}"
            ) from None
        except ProtocolError as error:
            raise TransportError(
                f"{self.label}: the agent's first frame is not ggufpipe protocol ({error}); is "
                f"'{self.host.agent or 'the agent ggufpipe set up'}' a ggufpipe agent?{self._tail()}"
            ) from None
        except (ConnectionError, OSError) as error:
            if listening:
                raise ListenRetry(
                    f"{self.label}: the connection was reset before its {what} ({error}){self._tail()}",
                    f"reset before its {what}",
                ) from None
            raise TransportError(f"{self.label}: the connection broke before its {what} ({error})") from None
        if first is None:
            if listening:
                raise ListenRetry(
                    f"{self.label}: the agent closed the connection before its {what}{self._tail()}",
                    f"closed before its {what}",
                )
            raise TransportError(f"{self.label}: the agent exited before its {what}{self._tail()}")
        return first

    def _refused(self, message: Refused) -> TransportError:
        return TransportError(f"{self.label}: the agent refused the connection: {message.reason}")

    def _check_protocol(self, protocol: int, version: str) -> None:
        if protocol != PROTOCOL_VERSION:
            raise TransportError(
                f"{self.label}: the agent speaks protocol {protocol}{version}, this orchestrator "
                f"speaks {PROTOCOL_VERSION}: install ggufpipe=={__version__} on {self.host.name}"
            )

    def _check_version(self, version: str) -> None:
        """Agents of another release are refused even at the same protocol:
        one version everywhere (a host ggufpipe sets up gets exactly this one)."""
        if version != __version__:
            raise TransportError(
                f"{self.label}: the agent on {self.host.name} is ggufpipe {version}, this orchestrator is "
                f"ggufpipe {__version__}: install ggufpipe=={__version__} there"
                + (
                    " (or leave agent: out of its entry: ggufpipe then sets one up)"
                    if self.host.agent
                    else ""
                )
            )

    async def handshake(self, timeout: float, listening: bool = False) -> Hello:
        first = await self._first(timeout, "Hello", limit=1 << 20, listening=listening)
        if isinstance(first, Refused):
            if listening:  # after the proofs, only "another orchestrator is attached"
                busy = "another orchestrator" in first.reason
                raise ListenRetry(
                    str(self._refused(first)), "busy: serving another orchestrator" if busy else first.reason
                )
            raise self._refused(first)
        if not isinstance(first, Hello):
            raise TransportError(f"{self.label}: the agent's first message is {first.tag}, not Hello")
        self._check_protocol(first.protocol, f" (ggufpipe {first.version})")
        self._check_version(first.version)
        self.hello = first
        return first

    @property
    def listen_key_path(self) -> str:
        return self.host.listen_key or listen_key.default_key_path(self.host.listen)

    async def read_listen_key(self, timeout: float) -> bytes:
        """The key file of the hand-started agent, read where it runs."""
        raise NotImplementedError

    async def attach_listening(self, timeout: float) -> Hello:
        """A hand-started agent (``listen:``): connect, authenticate, Hello.
        One that is busy (another orchestrator attached, or too many
        connections authenticating) or closes the connection before the
        handshake is done is tried again after a pause (LISTEN_BACKOFF), as
        long as ``timeout`` allows; giving up names what each try met."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        deadline = began + timeout
        met: list[str] = []
        while True:
            try:
                return await self._listen_try(max(deadline - loop.time(), LISTEN_TRY_MIN))
            except ListenRetry as error:
                met.append(error.met)
                last = str(error).removeprefix(f"{self.label}: ")
            await self._drop_listening()
            pause = LISTEN_BACKOFF[min(len(met), len(LISTEN_BACKOFF)) - 1] * random.uniform(0.8, 1.2)
            if deadline - loop.time() - pause < LISTEN_TRY_MIN:
                break
            await asyncio.sleep(pause)
        tries = "; ".join(f"try {number}: {what}" for number, what in enumerate(met, 1))
        count = f"{len(met)} tries" if len(met) > 1 else "1 try"
        raise TransportError(
            f"{self.label}: the agent listening on {self.host.listen} on {self.host.name} did not take "
            f"this orchestrator ({count} in {loop.time() - began:.1f}s: {tries}); the last: {last}"
        )

    async def _listen_try(self, timeout: float) -> Hello:
        """One try of :meth:`attach_listening`."""
        await self._open_listening(timeout)
        await self.authenticate(timeout)
        return await self.handshake(timeout, listening=True)

    async def _open_listening(self, timeout: float) -> None:
        """A new control connection to the hand-started agent (its streams)."""
        raise NotImplementedError

    async def _drop_listening(self) -> None:
        """Close what :meth:`_open_listening` opened, after a failed try."""
        raise NotImplementedError

    async def authenticate(self, timeout: float) -> None:
        """A hand-started agent (``listen:``): prove we hold its listen key and
        check that it does, before anything is sent to it or believed from it
        (ggufpipe_agent/process/key_file.py). Whoever else took the endpoint gets
        nothing but our proof for its own challenge, which it cannot use.

        The key file is read (once; later tries reuse it) while the challenge
        is on its way: the agent gives a connection little time to answer.
        A failure to read it is said only once the endpoint has answered."""
        reading = None
        if self._listen_key is None:
            reading = asyncio.ensure_future(self.read_listen_key(timeout))
            reading.add_done_callback(lambda task: task.cancelled() or task.exception())
        try:
            challenge = self._check_challenge(await self._first(timeout, "challenge", listening=True))
            if reading is not None:
                self._listen_key = await reading
        finally:
            if reading is not None:
                reading.cancel()
        assert self._listen_key is not None
        await self._prove(challenge, self._listen_key, timeout)

    def _check_challenge(self, challenge: Message) -> AuthChallenge:
        """The endpoint's first message, if it is a well-formed challenge."""
        where = f"{self.host.listen} on {self.host.name}"
        if isinstance(challenge, Refused):  # budgets: too many connections authenticating
            raise ListenRetry(str(self._refused(challenge)), challenge.reason)
        if isinstance(challenge, Hello):
            raise TransportError(
                f"{self.label}: the endpoint {where} sent a Hello without asking for the listen key: "
                f"an agent of another ggufpipe (protocol {challenge.protocol}) or not a ggufpipe agent "
                "at all; nothing was sent to it"
            )
        if not isinstance(challenge, AuthChallenge):
            raise TransportError(
                f"{self.label}: the endpoint {where} sent {challenge.tag}, not the challenge of a "
                "hand-started agent; nothing was sent to it"
            )
        self._check_protocol(challenge.protocol, "")
        if len(challenge.nonce) != listen_key.NONCE_BYTES:
            raise TransportError(f"{self.label}: the endpoint {where} sent a malformed challenge")
        return challenge

    async def _prove(self, challenge: AuthChallenge, key: bytes, timeout: float) -> None:
        """Our answer to the challenge, then the agent's proof, checked."""
        where = f"{self.host.listen} on {self.host.name}"
        nonce = listen_key.new_nonce()
        response = AuthResponse(nonce, listen_key.proof(key, listen_key.ORCHESTRATOR, challenge.nonce, nonce))
        assert self.control is not None
        try:
            await asyncio.wait_for(self.control.send(response), timeout)
        except asyncio.TimeoutError:
            raise TransportError(f"{self.label}: the connection to {where} stalled") from None
        except (ConnectionError, OSError) as error:
            raise ListenRetry(
                f"{self.label}: the connection to {where} broke ({error})",
                "closed before it had our answer to its challenge",
            ) from None
        answer = await self._first(timeout, "proof of the listen key", listening=True)
        if isinstance(answer, Refused):
            raise TransportError(
                f"{self._refused(answer)}; the key file {self.listen_key_path} on {self.host.name} "
                "is not the one that agent printed when it started (restarted since, or another one?)"
            )
        if not isinstance(answer, AuthProof) or not listen_key.verify(
            key, listen_key.AGENT, challenge.nonce, nonce, answer.proof
        ):
            raise TransportError(
                f"{self.label}: the endpoint {where} does not hold the listen key in "
                f"{self.listen_key_path}: it is not the agent that wrote it (did something else take "
                "the port?); nothing was sent to it"
            )

    async def send(self, message: Message) -> None:
        if self.control is None:  # its agent is (being) started again
            raise ConnectionError("the link has not started")
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

    async def open_delivery(self) -> tuple[Any, Any]:
        """The stream a stage file is sent on (``model: {send: true}``): by
        default a data stream to the agent, which writes it into its cache."""
        return await self.open_data()

    async def start(self, timeout: float) -> Hello:
        """Start (or reach) the agent and return its Hello."""
        raise NotImplementedError

    async def set_up(
        self, progress: Callable[[str], None], timeout: float, redo: bool = False
    ) -> SetupResult:
        """Give the host this orchestrator's agent, after :meth:`start`
        raised :class:`AgentNotSetUp` (only a transport that raises it does)."""
        raise NotImplementedError

    async def _connect_data(self, endpoint: str) -> tuple[Any, Any]:
        raise NotImplementedError

    async def open_socket(self, endpoint: str, timeout: float) -> tuple[Any, Any]:
        """A byte stream to a socket where this agent runs (a shared
        process's share socket, for a stage attaching to it)."""
        raise NotImplementedError

    async def close_socket(self, writer: Any, grace: float) -> None:
        """What :meth:`open_socket` started for ``writer`` ends (its writer is closed)."""

    async def close(self, grace: float) -> None:
        raise NotImplementedError

    def alive(self) -> bool:
        raise NotImplementedError

    def exit_detail(self) -> str:
        """Why the agent is gone, for a fault reason."""
        return self._tail()

    async def settle_exit(self) -> None:
        """Before a loss is diagnosed: let news of the agent's exit arrive."""

    def gone_reason(self) -> str:
        """A fault reason's tail once alive() is False."""
        return f"the agent exited{self.exit_detail()}"
