"""A shared agent process: the stages of one host in one agent
(``ggufpipe-agent --share-process``, inventory ``share_process: true``).

Three stage processes on one machine pay for waking each other's llama.cpp
threads at every token (docs/bench-pipeline.md); in one process every stage
runs its steps on the one worker thread, so they share one OpenMP team. It is
also what a host with several GPUs, one stage each, would use.

The orchestrator starts the first stage's agent as always (a subprocess on
stdio, or an SSH exec session) with ``--share-process``. That agent opens a
share socket in its private directory (mode 0700, the socket 0600: only this
user reaches it) and names it in its Hello with a secret, ``share_token``,
generated per process; only the orchestrator that read that Hello knows it.
Every further stage of the host connects there (locally; over SSH through
``ggufpipe-agent bridge unix:PATH`` on an exec session), presents the secret
(:class:`~ggufpipe_agent.wire.protocol.ShareAttach`) and is then served a control
session of its own, Hello first: one :class:`~ggufpipe_agent.process.runtime.ControlChannel`
and one stage FSM per stage, each with its own data token, engine and run
ids. A connection without the secret is closed unanswered.

The process lives as long as its first session: when that ends, every other
ends too (each stops its run first), and when the process dies every stage
in it is lost at once, which the orchestrator reports as one loss (and
recovers by starting the process again with all its stages).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import secrets
from typing import Any

from ggufpipe_agent.errors import ProtocolError
from ggufpipe_agent.process.control import AgentProcess, ControlChannel
from ggufpipe_agent.wire.framing import FrameReader
from ggufpipe_agent.wire.protocol import ShareAttach

log = logging.getLogger("ggufpipe.agent")

#: How long an attaching stage has to present the share token.
ATTACH_TIMEOUT = 10.0
#: Nothing bigger than a token is read before it.
ATTACH_FRAME_LIMIT = 4096
#: How long the stages sharing the process get to stop when its first ends.
GUEST_END_TIMEOUT = 40.0


class Sharing:
    """The share socket of one agent process and the sessions attached there."""

    def __init__(self, agent: AgentProcess) -> None:
        self.agent = agent
        self.path = agent.private_dir / "share.sock"
        self.endpoint = f"unix:{self.path}"
        self.token = secrets.token_hex(16)
        self.guests: dict[ControlChannel, asyncio.Task[Any]] = {}
        self.ending = False
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._on_connect, path=str(self.path), limit=1 << 20)
        os.chmod(self.path, 0o600)

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                first = await asyncio.wait_for(
                    FrameReader(reader, "share connection").message(ATTACH_FRAME_LIMIT), ATTACH_TIMEOUT
                )
            except (asyncio.TimeoutError, ProtocolError, ConnectionError, OSError) as error:
                log.warning("refused a share connection: %s", error or type(error).__name__)
                return
            if not isinstance(first, ShareAttach) or not hmac.compare_digest(first.token, self.token):
                log.warning("refused a share connection without the share token")
                return
            if self.ending:
                log.warning("refused a share connection: the process is ending")
                return
            session = ControlChannel(self.agent, reader, writer, guest=True)
            task = asyncio.current_task()
            assert task is not None
            self.guests[session] = task
            log.info("a stage attached to this process (%d sharing it)", len(self.guests) + 1)
            try:
                reason = await session.serve()
            finally:
                self.guests.pop(session, None)
            log.info("a stage sharing this process detached: %s", reason)
        except asyncio.CancelledError:
            return  # the agent is ending (see Agent._data_connection)
        finally:
            writer.close()

    async def end_guests(self, reason: str) -> None:
        """End every attached session (the first one ended): each stops its
        run and says so; no new one is taken."""
        self.ending = True
        self.close_server()
        guests = dict(self.guests)
        for session in guests:
            session.end(reason)
        if guests:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(
                    asyncio.gather(*guests.values(), return_exceptions=True), GUEST_END_TIMEOUT
                )

    def close_server(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
