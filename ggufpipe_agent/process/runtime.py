"""The agent runtime: the process around its orchestrator sessions (each a
:class:`~ggufpipe_agent.process.control.ControlChannel`: a control stream and the stage runs it
drives), the data socket for edge streams, and the one worker thread every
stage of the process steps on.

* Control stream: stdin/stdout when launched over SSH or as a subprocess, or
  an authenticated connection to ``--listen`` when started by hand
  (:mod:`ggufpipe_agent.process.listener`). The agent writes a Hello first, then
  answers control messages.
* Data socket: a Unix socket in a private directory, named in the Hello. The
  orchestrator connects to it (directly, or through ``ggufpipe-agent bridge``
  on an SSH exec channel), presents the Hello's data token, sets up the edge
  streams of a provisioned run (OpenEdge) and then exchanges object records.
* Direct links (:mod:`ggufpipe_agent.process.peer_links`): streams to and from the
  neighbouring stages' agents, set up by the orchestrator over the control
  stream and served like the data stream.

Everything docs/design.md, "Security model" says a stage rejects is refused by the session with a
``Refused`` message and a log line; nothing a peer sends can crash the agent.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import secrets
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from ggufpipe_agent.errors import ProtocolError
from ggufpipe_agent.llama.loaded import LoadedEngine
from ggufpipe_agent.process.control import ControlChannel, SeenRuns
from ggufpipe_agent.process.hello import make_hello
from ggufpipe_agent.process.socket_dir import PrivateDirectory, base_directory
from ggufpipe_agent.wire.framing import FrameReader
from ggufpipe_agent.wire.protocol import (
    DataAttach,
    Hello,
)

if TYPE_CHECKING:
    from ggufpipe_agent.process.sharing import Sharing

log = logging.getLogger("ggufpipe.agent")


class Agent:
    """What outlives one orchestrator session: the loaded engine, the data
    socket, the worker threads and the run ids already used.

    A shared process (``--share-process``, :mod:`ggufpipe_agent.process.sharing`)
    serves one session per stage: the first on stdio, the others attached on
    its share socket. Each has its own data token, engine slot and run ids
    (the stages of one run share its run id); all run their steps on the one
    worker thread, so the stages of a host share one OpenMP team instead of
    waking each other's."""

    def __init__(self, cache_dir: Path | None = None) -> None:
        self.cache_dir = cache_dir
        self.engines = LoadedEngine()
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="ggufpipe-worker")
        self.helper = ThreadPoolExecutor(1, thread_name_prefix="ggufpipe-helper")
        self.data_token = secrets.token_hex(16)
        self.private = PrivateDirectory(base_directory())
        self.private_dir = self.private.path
        self.data_path = self.private_dir / "data.sock"
        self.sessions: list[ControlChannel] = []  # attached now: the first, then any sharing the process
        self.seen_runs = SeenRuns()
        self.share: Sharing | None = None  # --share-process: the share socket
        self._data_server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self._data_server = await asyncio.start_unix_server(
            self._data_connection, path=str(self.data_path), limit=1 << 20
        )
        os.chmod(self.data_path, 0o600)

    def hello(self, data_token: str, guest: bool) -> Hello:
        share = self.share
        if share is None or guest:
            return make_hello(f"unix:{self.data_path}", data_token)
        return make_hello(f"unix:{self.data_path}", data_token, share.endpoint, share.token)

    def _session_of(self, token: str) -> ControlChannel | None:
        """The attached session whose data token this is (compared in constant time)."""
        found = None
        for session in self.sessions:
            if hmac.compare_digest(token, session.data_token):
                found = session
        return found

    async def _data_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            first = await asyncio.wait_for(FrameReader(reader, "data connection").message(), timeout=10)
            if not isinstance(first, DataAttach):
                log.warning("refused a data connection without the data token")
                return
            session = self._session_of(first.token)
            if session is None and hmac.compare_digest(first.token, self.data_token):
                log.warning("refused a data connection: no orchestrator session")
                return
            if session is None:
                log.warning("refused a data connection without the data token")
                return
            await session.data.serve(reader, writer)
        except (asyncio.TimeoutError, ProtocolError, ConnectionError) as error:
            log.warning("data connection closed: %s", error or type(error).__name__)
        except asyncio.CancelledError:
            # The agent is ending and asyncio.run cancels what is left; this
            # is the handler's outermost frame (Python 3.11's stream server
            # logs a traceback for a handler that ends cancelled).
            return
        finally:
            writer.close()

    def close(self) -> None:
        if self.share is not None:
            self.share.close_server()
        if self._data_server is not None:
            self._data_server.close()
        self.private.remove()


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


async def serve_stdio(cache_dir: Path | None, share: bool = False) -> str:
    """The agent on stdio; ``share``: further stages may attach to this
    process (:mod:`ggufpipe_agent.process.sharing`)."""
    agent = Agent(cache_dir)
    await agent.start()
    try:
        if share:
            from ggufpipe_agent.process.sharing import Sharing

            agent.share = Sharing(agent)
            await agent.share.start()
        reader, writer = await stdio_streams()
        session = ControlChannel(agent, reader, writer)
        return await session.serve()
    finally:
        agent.close()
