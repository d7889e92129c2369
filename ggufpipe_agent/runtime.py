"""The agent runtime: one orchestrator session on a control stream, a data socket
for edge streams, and the stage runs they drive.

* Control stream: stdin/stdout when launched over SSH or as a subprocess, or
  a connection to ``--listen`` when started by hand. The agent writes a Hello
  first, then answers control messages.
* Data socket: a Unix socket in a private directory, named in the Hello. The
  orchestrator connects to it (directly, or through ``ggufpipe-agent bridge``
  on an SSH exec channel), presents the Hello's data token, sets up the edge
  streams of a provisioned run (OpenEdge) and then exchanges object records.

Everything §10 says a stage rejects is refused here with a ``Refused`` message
and a log line; nothing a peer sends can crash the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import platform
import secrets
import shutil
import socket
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from ggufpipe_agent import PROTOCOL_VERSION, __version__, objects
from ggufpipe_agent.bridge import parse_endpoint
from ggufpipe_agent.errors import GgufpipeError, ProtocolError
from ggufpipe_agent.framing import FrameReader, FrameWriter, TruncatedFrame
from ggufpipe_agent.protocol import (
    DataAttach,
    Hello,
    Inspect,
    Message,
    ModelInfo,
    OpenEdge,
    ProvisionStage,
    Refused,
    RequestFailed,
    RewireEdge,
    Shutdown,
    StageStopped,
    StopRun,
    Tokenize,
    Tokenized,
    encode_message,
)
from ggufpipe_agent.stage_fsm import EdgeEstablished, Provision, StageState, StopRunEvent
from ggufpipe_agent.stage_run import EngineSlot, StageRun
from ggufpipe_agent.tasks import TaskOwner

log = logging.getLogger("ggufpipe.agent")


def make_hello(data_endpoint: str, data_token: str) -> Hello:
    import llama_cpp

    from ggufpipe_agent.engine import gpu_offload_supported
    from ggufpipe_agent.ggml import list_devices
    from ggufpipe_agent.memory import system_memory

    devices = tuple(list_devices())
    backend = "cpu"
    if devices:
        backend = devices[0].name.rstrip("0123456789").lower() or "gpu"
    total, available = system_memory()  # bounded by a container's cgroup limit
    return Hello(
        protocol=PROTOCOL_VERSION,
        version=__version__,
        hostname=socket.gethostname(),
        pid=os.getpid(),
        python=platform.python_version(),
        llama_cpp=getattr(llama_cpp, "__version__", ""),
        backend=backend,
        gpu_offload=gpu_offload_supported(),
        devices=devices,
        memory_total=total,
        memory_available=available,
        data_endpoint=data_endpoint,
        data_token=data_token,
    )


class Agent:
    """What outlives one orchestrator session: the loaded engine, the data
    socket, the worker threads and the run ids already used."""

    def __init__(self, cache_dir: Path | None = None) -> None:
        self.cache_dir = cache_dir
        self.engines = EngineSlot()
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="ggufpipe-worker")
        self.helper = ThreadPoolExecutor(1, thread_name_prefix="ggufpipe-helper")
        self.data_token = secrets.token_hex(16)
        base = os.environ.get("XDG_RUNTIME_DIR")
        if not base or not os.access(base, os.W_OK):
            base = None
        self.private_dir = Path(tempfile.mkdtemp(prefix="ggufpipe-agent-", dir=base))
        self.data_path = self.private_dir / "data.sock"
        self.session: Session | None = None
        self.seen_runs: set[int] = set()
        self._data_server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self._data_server = await asyncio.start_unix_server(
            self._data_connection, path=str(self.data_path), limit=1 << 20
        )
        os.chmod(self.data_path, 0o600)

    def hello(self) -> Hello:
        return make_hello(f"unix:{self.data_path}", self.data_token)

    async def _data_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session = self.session
        try:
            first = await asyncio.wait_for(FrameReader(reader, "data connection").message(), timeout=10)
            if not isinstance(first, DataAttach) or first.token != self.data_token:
                log.warning("refused a data connection without the data token")
                return
            if session is None:
                log.warning("refused a data connection: no orchestrator session")
                return
            await session.serve_data(reader, writer)
        except (asyncio.TimeoutError, ProtocolError, ConnectionError) as error:
            log.warning("data connection closed: %s", error or type(error).__name__)
        finally:
            writer.close()

    def close(self) -> None:
        if self._data_server is not None:
            self._data_server.close()
        shutil.rmtree(self.private_dir, ignore_errors=True)


class Session:
    """One orchestrator on one control stream."""

    def __init__(self, agent: Agent, reader: Any, writer: Any) -> None:
        self.agent = agent
        self.reader = FrameReader(reader, "control stream")
        self.writer = FrameWriter(writer, what="control stream")
        self.run: StageRun | None = None
        self.closing = False
        self.tasks = TaskOwner(self._task_failed, "agent session")
        # Every message to the orchestrator goes through one outbox, in the
        # order it was posted: a stage's StageFault is always read before the
        # refusal of an OpenEdge that arrived after the fault.
        self._outbox: asyncio.Queue[Message | None] = asyncio.Queue()

    def _task_failed(self, name: str, error: BaseException) -> None:
        """A session task that fails (answering a request) is a fault of the
        active run, if any: the orchestrator hears of it, never silence."""
        if self.run is not None:
            self.run.internal_fault(f"internal error in the agent ({name}): {type(error).__name__}: {error}")

    def post(self, message: Message) -> None:
        """Queue a message to the orchestrator (sent in posting order)."""
        if self.closing and not isinstance(message, StageStopped):
            return
        self._outbox.put_nowait(message)

    async def _send_posted(self) -> None:
        """The control stream's one writer. A stream that breaks ends it: the
        control reader sees the same loss and ends the session."""
        while True:
            message = await self._outbox.get()
            if message is None:
                return
            try:
                await self.writer.send(message)
            except (ConnectionError, OSError):
                return

    def refuse(self, what: str, reason: str) -> None:
        log.warning("refused %s: %s", what, reason)
        self.post(Refused(what, reason))

    # ------------------------------------------------------------ control

    async def serve(self) -> str:
        """Answer control messages until the stream ends; returns why it ended."""
        self.agent.session = self
        sender = self.tasks.spawn(self._send_posted(), "control writer")
        try:
            self.post(self.agent.hello())
            while True:
                try:
                    message = await self.reader.message()
                except ProtocolError as error:
                    # A corrupt control stream cannot be resynchronised.
                    self.refuse("control frame", str(error))
                    return f"corrupt control stream: {error}"
                if message is None:
                    return "the orchestrator closed the control stream"
                if isinstance(message, Shutdown):
                    return f"shutdown requested: {message.reason}"
                await self.dispatch(message)
        except (ConnectionError, OSError) as error:
            return f"the control stream broke ({error})"
        finally:
            await self.stop_all("orchestrator session ended")
            self.closing = True
            self._outbox.put_nowait(None)  # what was posted still goes, then the writer ends
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(sender), 5)
            await self.tasks.close()
            if self.agent.session is self:
                self.agent.session = None

    async def dispatch(self, message: Message) -> None:
        if isinstance(message, ProvisionStage):
            await self.provision(message)
        elif isinstance(message, StopRun):
            await self.stop_run(message)
        elif isinstance(message, Inspect | Tokenize):
            self.tasks.spawn(self.answer(message), f"answer to {message.tag}")
        elif isinstance(message, RewireEdge):
            self.refuse(
                "RewireEdge",
                f"edge {message.edge_id} of run {message.run_id:016x}: peer rewiring is "
                "refused; only the orchestrator's ProvisionStage wires a stage",
            )
        else:
            self.refuse(message.tag, "not a message an orchestrator sends to an agent")

    async def answer(self, request: Inspect | Tokenize) -> None:
        loop = asyncio.get_running_loop()
        try:
            reply = await loop.run_in_executor(self.agent.helper, _answer, request)
        except GgufpipeError as error:
            reply = RequestFailed(request.request_id, str(error))
        except Exception as error:  # noqa: BLE001 - a boundary: report, don't crash
            log.exception("request failed")
            reply = RequestFailed(request.request_id, f"{type(error).__name__}: {error}")
        self.post(reply)

    async def provision(self, message: ProvisionStage) -> None:
        run = self.run
        if run is not None and run.fsm.state is not StageState.STOPPED:
            if run.run_id == message.run_id:
                reason = f"run {message.run_id:016x} is already provisioned (StopRun it first)"
            else:
                reason = f"stage is busy with run {run.run_id:016x} (one run at a time)"
            self.refuse("ProvisionStage", reason)
            return
        if message.run_id in self.agent.seen_runs:
            self.refuse("ProvisionStage", f"stale run id {message.run_id:016x}")
            return
        self.agent.seen_runs.add(message.run_id)
        run = StageRun(message, self.post, self.agent.worker, self.agent.engines, self.agent.cache_dir)
        self.run = run
        run.apply(Provision(message.run_id, validate_provision(message)))

    async def stop_run(self, message: StopRun) -> None:
        run = self.run
        if run is None or run.run_id != message.run_id:
            if message.run_id in self.agent.seen_runs:
                # An older run than the current one. (A retried StopRun of the
                # current, stopped run is answered with StageStopped again.)
                self.refuse("StopRun", f"stale run id {message.run_id:016x}")
            else:
                self.refuse("StopRun", f"unknown run id {message.run_id:016x}")
            return
        run.apply(StopRunEvent(message.reason))

    async def stop_all(self, reason: str) -> None:
        run = self.run
        if run is None or run.fsm.state is StageState.STOPPED:
            return
        run.apply(StopRunEvent(reason))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(run.stopped.wait(), timeout=30)

    # --------------------------------------------------------------- data

    async def serve_data(self, reader: asyncio.StreamReader, writer: Any) -> None:
        """Edge streams: OpenEdge frames and inbound object records. A frame
        that cannot be parsed loses the stream (it cannot be resynchronised),
        and with it the active run."""
        frames = FrameReader(reader, "data connection")
        outbound = FrameWriter(writer, what="outbound edge")
        while True:
            run = self.run
            limit = run.provision.inbound.object_spec.max_extent if run else objects.ABSOLUTE_MAX_PAYLOAD
            payload = b""
            try:
                frame = await frames.frame(limit)
                if isinstance(frame, objects.ObjectHeader):
                    payload = await frames.payload(frame)
            except TruncatedFrame:
                await self._data_fault("truncated frame: the data connection ended inside it")
                return
            except ProtocolError as error:
                await self._data_fault(str(error))
                return
            if frame is None:
                return
            if isinstance(frame, OpenEdge):
                await self.open_edge(frame, outbound)
            elif isinstance(frame, Message):
                self.refuse(frame.tag, "not a data-connection message")
            else:
                await self.inbound_object(frame, payload)

    async def _data_fault(self, reason: str) -> None:
        """A frame that cannot be parsed: the stream is lost, and with it the run."""
        self.refuse("data frame", reason)
        run = self.run
        if run is not None and run.fsm.state in (
            StageState.READY,
            StageState.EXECUTING,
            StageState.PREPARING,
        ):
            from ggufpipe_agent.stage_fsm import InboundFault

            run.apply(InboundFault(f"malformed frame on the inbound edge: {reason}"))

    async def open_edge(self, message: OpenEdge, writer: Any) -> None:
        run = self.run
        problem = self._run_problem(message.run_id)
        if problem:
            self.refuse("OpenEdge", problem)
            return
        assert run is not None
        expected = {
            "inbound": run.provision.inbound.edge_id,
            "outbound": run.provision.outbound.edge_id,
        }.get(message.role)
        if expected is None or expected != message.edge_id:
            self.refuse(
                "OpenEdge",
                f"edge {message.edge_id} ({message.role}) is not in the provision message of run "
                f"{run.run_id:016x}",
            )
            return
        if run.fsm.state is not StageState.PREPARING:
            self.refuse("OpenEdge", f"edge {message.edge_id} set up outside Preparing")
            return
        if message.role == "outbound":
            run.outbound = writer
        try:
            run.apply(EdgeEstablished(message.role))
        except GgufpipeError as error:
            self.refuse("OpenEdge", str(error))

    async def inbound_object(self, header: objects.ObjectHeader, payload: bytes) -> None:
        problem = self._run_problem(header.run_id)
        if problem:
            self.refuse("object", f"{header.describe()}: {problem}")
            return
        run = self.run
        assert run is not None
        if header.edge_id != run.provision.inbound.edge_id:
            self.refuse(
                "object",
                f"{header.describe()}: edge {header.edge_id} is not this stage's inbound edge",
            )
            return
        await run.deliver(header, payload)

    def _run_problem(self, run_id: int) -> str:
        run = self.run
        if run is not None and run.run_id == run_id and run.fsm.state is not StageState.STOPPED:
            return ""
        if run_id in self.agent.seen_runs:
            return f"stale run id {run_id:016x}"
        return f"unknown run id {run_id:016x}"


def validate_provision(message: ProvisionStage) -> str:
    """Spec §6 'validate run_id and stage assignment'; '' when it is sound."""
    p = message
    if not 0 <= p.stage_index < p.stage_count:
        return f"stage index {p.stage_index} outside a pipeline of {p.stage_count}"
    if p.inbound.edge_id == p.outbound.edge_id:
        return f"inbound and outbound edges share id {p.inbound.edge_id}"
    want_in = "TokenIn" if p.stage_index == 0 else "Activation"
    want_out = "TokenOut" if p.stage_index == p.stage_count - 1 else "Activation"
    if p.inbound.kind != want_in:
        return f"stage {p.stage_index} inbound edge must be {want_in}, not {p.inbound.kind}"
    if p.outbound.kind != want_out:
        return f"stage {p.stage_index} outbound edge must be {want_out}, not {p.outbound.kind}"
    for name, spec in (("inbound", p.inbound.object_spec), ("outbound", p.outbound.object_spec)):
        if spec.dtype not in ("int32", "float32", "float16"):
            return f"{name} edge dtype {spec.dtype!r} is not supported"
        if spec.kind == "activation" and (
            spec.width != p.model.hidden_dim or spec.max_rows != p.model.max_seq_len
        ):
            return (
                f"{name} edge carries [{spec.max_rows}, {spec.width}] activations; the model "
                f"facts say [{p.model.max_seq_len}, {p.model.hidden_dim}]"
            )
    if p.layer_start >= p.layer_end_exclusive:
        return f"layers [{p.layer_start}, {p.layer_end_exclusive}) is empty or reversed"
    if p.engine.n_ctx < p.model.max_seq_len:
        return f"context {p.engine.n_ctx} is shorter than max_seq_len {p.model.max_seq_len}"
    offer = p.reuse
    if offer.run_id < 0 or offer.run_id == p.run_id or not 0 <= offer.positions <= p.model.max_seq_len:
        return f"a prefix offer of {offer.positions} positions of run {offer.run_id:x} is out of bounds"
    return ""


def _answer(request: Inspect | Tokenize) -> Message:
    """Inspect and Tokenize, in a helper thread (vocabulary loads take a moment)."""
    from ggufpipe_agent.model import read_model_facts
    from ggufpipe_agent.vocab import vocabulary

    facts = read_model_facts(request.path)
    if isinstance(request, Inspect):
        pieces: tuple[bytes, ...] = ()
        if request.vocabulary:
            vocab = vocabulary(facts.path)
            pieces = vocab.pieces()
            facts = replace(facts, eog_token_ids=vocab.eog_tokens())
        return ModelInfo(request.request_id, facts, pieces)
    vocab = vocabulary(facts.path)
    tokens, rendered = vocab.prompt_tokens(facts.chat_template, request.text, request.chat, request.messages)
    return Tokenized(request.request_id, tuple(tokens), rendered)


# ------------------------------------------------------------------ entry


async def stdio_streams() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Control streams on stdin/stdout. Frames get a private copy of stdout and
    fd 1 is pointed at stderr, so a stray print (ours or a C library's) can
    never corrupt the protocol."""
    loop = asyncio.get_running_loop()
    frames_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin.buffer)
    transport, protocol = await loop.connect_write_pipe(
        asyncio.streams.FlowControlMixin, os.fdopen(frames_fd, "wb", buffering=0)
    )
    writer = asyncio.StreamWriter(transport, protocol, None, loop)
    return reader, writer


async def serve_stdio(cache_dir: Path | None) -> str:
    agent = Agent(cache_dir)
    await agent.start()
    try:
        reader, writer = await stdio_streams()
        session = Session(agent, reader, writer)
        return await session.serve()
    finally:
        agent.close()


async def serve_listen(endpoint: str, cache_dir: Path | None) -> None:
    """A hand-started agent: one orchestrator at a time on ``endpoint``."""
    agent = Agent(cache_dir)
    await agent.start()
    busy = asyncio.Lock()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername") or "unix peer"
        if busy.locked():
            log.warning("refused orchestrator %s: another one is attached", peer)
            writer.write(encode_message(Refused("connection", "another orchestrator is attached")))
            writer.close()
            return
        async with busy:
            log.info("orchestrator attached from %s", peer)
            reason = await Session(agent, reader, writer).serve()
            log.info("orchestrator detached: %s", reason)
            writer.close()

    where, port = parse_endpoint(endpoint)
    if port is None:
        server = await asyncio.start_unix_server(on_connect, path=where, limit=1 << 20)
    else:
        server = await asyncio.start_server(on_connect, where, port, limit=1 << 20)
    log.info("listening on %s (data socket unix:%s)", endpoint, agent.data_path)
    try:
        async with server:
            await server.serve_forever()
    finally:
        agent.close()
