"""One orchestrator session of the agent: its control stream, the stage runs
it drives, its edges and links (:class:`ControlChannel`), and the runs it has seen.

:mod:`ggufpipe_agent.process.runtime` holds the process around it (the data socket,
the worker thread every stage steps on, the sessions of a shared process) and
starts a session on stdio; :mod:`ggufpipe_agent.process.listener` starts one per
authenticated connection of a hand-started agent.

Everything docs/design.md, "Security model" says a stage rejects is refused here with a ``Refused`` message
and a log line; nothing a peer sends can crash the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Protocol

from ggufpipe_agent.errors import GgufpipeError, ProtocolError
from ggufpipe_agent.heartbeat import Silence
from ggufpipe_agent.ids import NO_RUN, RunId
from ggufpipe_agent.llama.loaded import LoadedEngine
from ggufpipe_agent.process.data_streams import DataStreams, live
from ggufpipe_agent.process.peer_links import Links
from ggufpipe_agent.process.requests import answer_request
from ggufpipe_agent.stage import slots
from ggufpipe_agent.stage.batching import StepBatcher
from ggufpipe_agent.stage.fsm import Provision, StageState, StopRunEvent
from ggufpipe_agent.stage.job import StageJob
from ggufpipe_agent.stage.validation import fits_bits, validate_provision
from ggufpipe_agent.tasks import TaskOwner
from ggufpipe_agent.wire.delivery_messages import CacheRequest
from ggufpipe_agent.wire.framing import FrameReader, FrameWriter
from ggufpipe_agent.wire.link_messages import LinkConnect, LinkEdge, LinkListen
from ggufpipe_agent.wire.protocol import (
    Heartbeat,
    Hello,
    Inspect,
    Message,
    ProvisionStage,
    Refused,
    RequestFailed,
    RewireEdge,
    Shutdown,
    StageStopped,
    StopRun,
    Tokenize,
)

log = logging.getLogger("ggufpipe.agent")


class GuestStages(Protocol):
    """The stages attached to a shared process (process/sharing.py)."""

    async def end_guests(self, reason: str) -> None: ...


class AgentProcess(Protocol):
    """What a control session needs of the process it runs in
    (:class:`ggufpipe_agent.process.runtime.Agent` is one)."""

    @property
    def cache_dir(self) -> Path | None: ...

    @property
    def data_token(self) -> str: ...

    @property
    def engines(self) -> LoadedEngine: ...

    @property
    def seen_runs(self) -> SeenRuns: ...

    @property
    def private_dir(self) -> Path: ...

    @property
    def sessions(self) -> list[ControlChannel]: ...

    @property
    def share(self) -> GuestStages | None: ...

    @property
    def worker(self) -> Executor: ...

    @property
    def helper(self) -> Executor: ...

    def hello(self, data_token: str, guest: bool) -> Hello: ...


#: How long an agent waits for a word from its orchestrator before the first
#: Heartbeat says how long to wait (the orchestrator's timeouts.heartbeat).
DEFAULT_SILENCE_S = 120.0
#: The range a Heartbeat's timeout is held to.
SILENCE_RANGE_S = (0.5, 3600.0)


class SeenRuns:
    """The run ids this agent has taken, to refuse a stale one (docs/design.md, "Security model"):
    the newest :attr:`keep`, so an agent that serves for months stays the
    same size (an id older than that is refused as unknown instead)."""

    keep = 1 << 16

    def __init__(self) -> None:
        self._ids: dict[int, None] = {}  # insertion-ordered: oldest first

    def add(self, run_id: RunId) -> None:
        self._ids[run_id] = None
        while len(self._ids) > self.keep:
            del self._ids[next(iter(self._ids))]

    def __contains__(self, run_id: object) -> bool:
        return run_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)


class ControlChannel:
    """One orchestrator on one control stream.

    The session ends when the stream does, and also when the orchestrator
    falls silent: once it has sent a Heartbeat, nothing from it for that
    Heartbeat's ``timeout`` ends the session (an agent on stdio then exits;
    a hand-started one waits for the next orchestrator), and so does a
    control stream it stops reading for as long. The agent's own heartbeats
    tell the orchestrator it is alive in turn.

    ``guest``: a further stage attached to a shared process (its own data
    token, engine and run ids; it ends with the process's first session)."""

    def __init__(self, agent: AgentProcess, reader: Any, writer: Any, guest: bool = False) -> None:
        self.agent = agent
        self.guest = guest
        self.data_token = secrets.token_hex(16) if guest else agent.data_token
        self.engines = LoadedEngine() if guest else agent.engines
        self.batcher = StepBatcher(agent.worker)
        self.seen_runs = SeenRuns() if guest else agent.seen_runs
        self.reader = FrameReader(reader, "control stream")
        self.writer = FrameWriter(writer, what="control stream")
        # The stage's runs, by run id: up to engine.parallel in flight at once,
        # each on its own slot (docs/architecture.md, "Runs in flight"); a stopped run stays until its slot
        # is taken again, so a retried StopRun is answered.
        self.runs: dict[int, StageJob] = {}
        self.closing = False
        self.tasks = TaskOwner(self._task_failed, "agent session")
        # Every message to the orchestrator goes through one outbox, in the
        # order it was posted: a stage's StageFault is always read before the
        # refusal of an OpenEdge that arrived after the fault.
        self._outbox: asyncio.Queue[Message | None] = asyncio.Queue()
        self.data = DataStreams(self.runs, self.seen_runs, self.refuse, lambda: agent.cache_dir)
        self.links = Links(
            agent.private_dir,
            self.post,
            self.data.serve,
            self.tasks.spawn,
            self.runs.get,
            self.data.inbound_object,
        )
        self.silence = Silence(DEFAULT_SILENCE_S)
        self._beat_interval = 0.0
        self._beating: asyncio.Task[None] | None = None
        self._writer_lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._ended: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    def end(self, reason: str) -> None:
        """End the session from outside (a shared process's first session ended)."""
        if not self._ended.done():
            self._ended.set_result(reason)

    def _task_failed(self, name: str, error: BaseException) -> None:
        """A session task that fails (answering a request) is a fault of the
        runs in flight, if any: the orchestrator hears of it, never silence."""
        for run in self.live_runs():
            run.internal_fault(f"internal error in the agent ({name}): {type(error).__name__}: {error}")

    def held(self) -> list[slots.Held]:
        """The runs the stage knows, as the slot rules see them."""
        stopped = StageState.STOPPED
        return [slots.Held(run.run_id, run.slot, run.fsm.state is stopped) for run in self.runs.values()]

    def live_runs(self) -> list[StageJob]:
        """The runs not stopped yet."""
        return live(self.runs)

    def post(self, message: Message) -> None:
        """Queue a message to the orchestrator (sent in posting order)."""
        if self.closing and not isinstance(message, StageStopped):
            return
        self._outbox.put_nowait(message)

    async def _send_posted(self) -> None:
        """The control stream's one writer. A stream that breaks, or that the
        orchestrator stops reading past the heartbeat bound, ends the session."""
        while True:
            message = await self._outbox.get()
            if message is None:
                return
            try:
                await self.writer.send(message)
            except (ConnectionError, OSError) as error:
                if not self._writer_lost.done():
                    self._writer_lost.set_result(f"the control stream broke ({error})")
                return

    def refuse(self, what: str, reason: str, run_id: RunId = NO_RUN) -> None:
        log.warning("refused %s: %s", what, reason)
        self.post(Refused(what, reason, run_id))

    # ------------------------------------------------------------ control

    async def serve(self) -> str:
        """Answer control messages until the stream ends or the orchestrator
        falls silent; returns why it ended."""
        self.agent.sessions.append(self)
        sender = self.tasks.spawn(self._send_posted(), "control writer")
        reading = self.tasks.spawn(self._read(), "control reader")
        watching = self.tasks.spawn(self._watch(), "silence watch")
        try:
            self.post(self.agent.hello(self.data_token, self.guest))
            await asyncio.wait(
                {reading, watching, self._writer_lost, self._ended}, return_when=asyncio.FIRST_COMPLETED
            )
            for ended in (reading, watching):
                if ended.done() and not ended.cancelled() and ended.exception() is None:
                    return ended.result()
            for lost in (self._writer_lost, self._ended):
                if lost.done():
                    return lost.result()
            return f"internal error in the agent's control reader: {reading.exception()!r}"
        finally:
            reading.cancel()
            watching.cancel()
            await self.stop_all("orchestrator session ended")
            share = self.agent.share
            if share is not None and not self.guest:
                # The process lives as long as its first session: the stages
                # sharing it end with it (each stops its run first).
                await share.end_guests("the shared process's first stage ended")
            self.closing = True
            self.links.close()
            self._outbox.put_nowait(None)  # what was posted still goes, then the writer ends
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(sender), 5)
            await self.tasks.close()
            if self in self.agent.sessions:
                self.agent.sessions.remove(self)
            if self.guest:
                await self._unload()

    async def _unload(self) -> None:
        """A guest's engine is its own: freed with its session (on the worker,
        where every engine call runs), not kept for a next orchestrator."""
        loop = asyncio.get_running_loop()
        with contextlib.suppress(asyncio.TimeoutError, RuntimeError):
            await asyncio.wait_for(loop.run_in_executor(self.agent.worker, self.engines.close), 30)

    async def _watch(self) -> str:
        bound = await self.silence.expired()
        return f"no message from the orchestrator for {bound:g}s"

    async def _read(self) -> str:
        """The control reader; returns why the session ends."""
        while True:
            try:
                message = await self.reader.message()
            except ProtocolError as error:
                # A corrupt control stream cannot be resynchronised.
                self.refuse("control frame", str(error))
                return f"corrupt control stream: {error}"
            except (ConnectionError, OSError) as error:
                return f"the control stream broke ({error})"
            self.silence.heard()
            if message is None:
                return "the orchestrator closed the control stream"
            if isinstance(message, Shutdown):
                return f"shutdown requested: {message.reason}"
            if isinstance(message, Heartbeat):
                self._heartbeat(message)
                continue
            await self.dispatch(message)

    def _heartbeat(self, beat: Heartbeat) -> None:
        """The orchestrator's heartbeat: its bound becomes the session's, and
        the agent beats back at its interval."""
        low, high = SILENCE_RANGE_S
        if not (math.isfinite(beat.timeout) and math.isfinite(beat.interval)):
            return
        self.silence.timeout = min(max(beat.timeout, low), high)
        self._beat_interval = min(max(beat.interval, low / 10), self.silence.timeout / 2)
        self.writer.drain_timeout = self.silence.timeout
        if self._beating is None:
            self._beating = self.tasks.spawn(self._beat(), "heartbeat")

    async def _beat(self) -> None:
        while True:
            self.post(Heartbeat(self._beat_interval, self.silence.timeout))
            await asyncio.sleep(self._beat_interval)

    async def dispatch(self, message: Message) -> None:
        if isinstance(message, ProvisionStage):
            await self.provision(message)
        elif isinstance(message, StopRun):
            await self.stop_run(message)
        elif isinstance(message, Inspect | Tokenize | CacheRequest):
            self.tasks.spawn(self.answer(message), f"answer to {message.tag}")
        elif isinstance(message, LinkListen | LinkConnect):
            self.tasks.spawn(self.link_request(message), f"answer to {message.tag}")
        elif isinstance(message, LinkEdge):
            await self.link_edge(message)
        elif isinstance(message, RewireEdge):
            self.refuse(
                "RewireEdge",
                f"edge {message.edge_id} of run {message.run_id:016x}: peer rewiring is "
                "refused; only the orchestrator's ProvisionStage wires a stage",
            )
        else:
            self.refuse(message.tag, "not a message an orchestrator sends to an agent")

    async def answer(self, request: Inspect | Tokenize | CacheRequest) -> None:
        loop = asyncio.get_running_loop()
        try:
            agent = self.agent
            reply = await loop.run_in_executor(agent.helper, answer_request, request, agent.cache_dir)
        except GgufpipeError as error:
            reply = RequestFailed(request.request_id, str(error))
        except Exception as error:  # noqa: BLE001 - a boundary: report, don't crash
            log.exception("request failed")
            reply = RequestFailed(request.request_id, f"{type(error).__name__}: {error}")
        self.post(reply)

    async def link_request(self, request: LinkListen | LinkConnect) -> None:
        try:
            if isinstance(request, LinkListen):
                reply = await self.links.listen(request)
            else:
                reply = await self.links.connect(request)
        except (OSError, ValueError, GgufpipeError) as error:  # ssl.SSLError is an OSError
            reply = RequestFailed(request.request_id, f"{type(error).__name__}: {error}")
        self.post(reply)

    async def provision(self, message: ProvisionStage) -> None:
        held = self.held()
        reason = slots.refusal(held, message.run_id, message.slot, message.engine.parallel)
        if reason:
            self.refuse("ProvisionStage", reason, message.run_id)
            return
        problem = validate_provision(message)
        if problem:
            # Nothing of it is taken: the stage stays as it was, free for a
            # sound provision (a field the wire cannot carry must never reach
            # struct.pack or llama.cpp and fault a step).
            sound_id = fits_bits(message.run_id, 64)
            refused_id = message.run_id if sound_id else NO_RUN
            self.refuse("ProvisionStage", f"run {message.run_id:#x}: {problem}", refused_id)
            if sound_id:
                self.seen_runs.add(message.run_id)
            return
        if message.run_id in self.seen_runs:
            self.refuse("ProvisionStage", f"stale run id {message.run_id:016x}", message.run_id)
            return
        taken = self.engines.claim(message.slot, message.run_id)
        if taken:  # a run of an earlier session that has not stopped yet
            self.refuse("ProvisionStage", f"stage {taken}", message.run_id)
            return
        self.seen_runs.add(message.run_id)
        batcher = None
        if message.engine.batching:  # one per engine: the runs in flight on its slots
            self.batcher.stage = message.stage_index
            self.batcher.stages = message.stage_count
            batcher = self.batcher
        run = StageJob(message, self.post, self.agent.worker, self.engines, self.agent.cache_dir, batcher)
        for old in slots.replaced(held, message.slot):
            del self.runs[old]  # stopped: the slot is the new run's
        self.runs[run.run_id] = run
        ring = message.ring
        run.apply(
            Provision(
                message.run_id,
                ring_in=ring is not None and ring.consume,
                ring_out=ring is not None and ring.produce,
                eog=frozenset(ring.eog_token_ids) if ring else frozenset(),
                max_tokens=ring.max_tokens if ring else 0,
            )
        )

    async def stop_run(self, message: StopRun) -> None:
        run = self.runs.get(message.run_id)
        if run is None:
            if message.run_id in self.seen_runs:
                # An older run than the current one. (A retried StopRun of the
                # current, stopped run is answered with StageStopped again.)
                self.refuse("StopRun", f"stale run id {message.run_id:016x}")
            else:
                self.refuse("StopRun", f"unknown run id {message.run_id:016x}")
            return
        run.apply(StopRunEvent(message.reason))

    async def stop_all(self, reason: str) -> None:
        live = self.live_runs()
        for run in live:
            run.apply(StopRunEvent(reason))
        if live:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(run.stopped.wait() for run in live)), timeout=30)

    async def link_edge(self, message: LinkEdge) -> None:
        """This run's outbound (or ring-out) end on the stage's link."""
        problem = self.data.run_problem(message.run_id)
        if problem:
            self.refuse("LinkEdge", problem, message.run_id)
            return
        run = self.runs[message.run_id]
        await self.links.edge(run, message, self.refuse, self.data.inbound_object)


# ------------------------------------------------------------------ entry
