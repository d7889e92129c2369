"""Stages that share one agent process (inventory ``share_process: true``).

The first stage placed on such a host starts its agent as always (local
subprocess or SSH exec session), with ``--share-process``; its Hello names a
share socket and a secret (ggufpipe_agent/process/sharing.py). Every further stage on
the host is a :class:`SharedAgent`: it waits for that Hello, reaches the
socket (locally: directly; over SSH: ``<agent> bridge unix:PATH`` on an exec
session of the host's connection, control traffic only), presents the secret
and reads its own Hello. Its data stream goes to the same data socket with
its own token, the way the first stage's does.

The process is the first stage's: when it dies, every stage in it is lost,
and each reports it with the same reason (:attr:`AgentConnection.process_label`):
one loss, for which recovery starts the process again with all its stages
(session/rebuild.py: restart_set; :func:`process_owner` says whose process a
stage runs in).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from ggufpipe_agent.wire.protocol import Hello, Message, ShareAttach
from ggufpipe_tui.core.inventory import HostSpec
from ggufpipe_tui.transports.connection import AgentConnection, LogLine, TransportError

ConnectionFactory = Callable[[HostSpec, int, LogLine], AgentConnection]


class SharedAgent(AgentConnection):
    """A stage whose control session is attached to another stage's agent process."""

    def __init__(self, host: HostSpec, stage: int, on_log: LogLine, first: AgentConnection) -> None:
        super().__init__(host, stage, on_log)
        self.first = first
        self.sharers = first.sharers
        self._ended = False  # the control stream ended (or broke)

    async def start(self, timeout: float) -> Hello:
        first = self.first
        try:
            await asyncio.wait_for(first.settled.wait(), timeout)
        except asyncio.TimeoutError:
            raise TransportError(
                f"{self.label}: the agent of stage {first.stage}, whose process it shares, did not "
                f"start within {timeout:g}s"
            ) from None
        hello = first.hello
        if hello is None:
            raise TransportError(
                f"{self.label}: the agent of stage {first.stage}, whose process it shares, did not start"
            )
        if not hello.share_endpoint:
            raise TransportError(
                f"{self.label}: the agent of stage {first.stage} on {self.host.name} does not share its "
                "process (started without --share-process)"
            )
        try:
            reader, writer = await asyncio.wait_for(first.open_socket(hello.share_endpoint, timeout), timeout)
        except asyncio.TimeoutError:
            raise TransportError(
                f"{self.label}: the shared agent process's socket did not answer within {timeout:g}s"
            ) from None
        self._streams(reader, writer)
        assert self.control is not None
        try:
            await asyncio.wait_for(self.control.send(ShareAttach(hello.share_token)), timeout)
        except (asyncio.TimeoutError, ConnectionError, OSError) as error:
            raise TransportError(f"{self.label}: the shared agent process's socket broke ({error})") from None
        return await self.handshake(timeout)

    @property
    def data_route(self) -> str:
        """How the data stream reached the host (the SSH transport's words)."""
        return str(getattr(self.first, "data_route", ""))

    @property
    def process_label(self) -> str:
        # While the shared process lives, a loss is this stage's alone.
        return self.first.process_label if not self.first.alive() else self.label

    async def receive(self) -> Message | None:
        try:
            message = await super().receive()
        except BaseException:
            self._ended = True
            raise
        if message is None:
            self._ended = True
        return message

    async def _connect_data(self, endpoint: str) -> tuple[Any, Any]:
        return await self.first._connect_data(endpoint)

    async def open_delivery(self) -> tuple[Any, Any]:
        """The first stage's way in: the stage file lands in the same cache
        (over SSH its own receiving session; else the shared data socket)."""
        return await self.first.open_delivery()

    async def settle_exit(self) -> None:
        """A session that ended is most often the process dying: its exit
        (reaped a moment later) is the reason, the same for every stage in it."""
        for _ in range(20):
            if not self.first.alive():
                return
            await asyncio.sleep(0.05)

    def alive(self) -> bool:
        if self._ended or not self.first.alive():
            return False
        return self.writer is not None and not self.writer.is_closing()

    def exit_detail(self) -> str:
        if not self.first.alive():
            return self.first.exit_detail()
        return self._tail()

    def gone_reason(self) -> str:
        if not self.first.alive():
            return self.first.gone_reason()
        return f"its session in the agent process of stage {self.first.stage} ended{self._tail()}"

    async def close(self, grace: float) -> None:
        """Closing the stream ends this stage's session in the shared process
        (it stops its run first); the process is the first stage's to end."""
        writer = self.writer
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.write_eof()
            with contextlib.suppress(Exception):
                writer.close()
        await self.first.close_socket(writer, grace)
        await self.tasks.settle(0.5)
        await self.tasks.close()


def process_owner(link: AgentConnection) -> AgentConnection | None:
    """The link of the stage whose agent process ``link``'s stage runs in,
    when that process is shared (itself for the first stage); else None."""
    if isinstance(link, SharedAgent):
        return link.first
    return link if link.share_process else None


class ProcessSharing:
    """Makes each stage's link: the first stage on a ``share_process`` host
    gets the transport's own link, started with ``--share-process``; every
    later stage there a :class:`SharedAgent` attached to it."""

    def __init__(self, factory: ConnectionFactory) -> None:
        self.factory = factory
        self.firsts: dict[str, AgentConnection] = {}

    def link(self, host: HostSpec, stage: int, on_log: LogLine) -> AgentConnection:
        first = self.firsts.get(host.name) if host.share_process else None
        if first is not None:
            first.sharers.append(stage)
            return SharedAgent(host, stage, on_log, first)
        link = self.factory(host, stage, on_log)
        if host.share_process:
            link.share_process = True
            self.firsts[host.name] = link
        return link
