"""A TCP proxy on loopback in front of a port (the loopback sshd), that can
be cut: its listening socket and every connection through it closed at once,
so that the host behind it stops answering altogether (tc netem does not work
on this machine). Runs in the test's event loop."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from tests.support.sshd import Sshd


class CuttableProxy:
    def __init__(self, target: int) -> None:
        self.target = target
        self.server: asyncio.AbstractServer | None = None
        self.writers: set[asyncio.StreamWriter] = set()
        self.cut_down = False

    async def start(self) -> int:
        """Listens; returns its port."""
        self.server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut_down:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.transport.abort()
            return
        self.writers |= {writer, up_writer}
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
        for end in (writer, up_writer):
            end.transport.abort()
            self.writers.discard(end)

    async def _pump(self, source: asyncio.StreamReader, target: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await source.read(1 << 16):
                target.write(data)
                await target.drain()
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            target.write_eof()

    def cut(self) -> None:
        """No new connection gets in, every one through it is gone (a reset)."""
        self.cut_down = True
        if self.server is not None:
            self.server.close()
        for writer in list(self.writers):
            writer.transport.abort()
        self.writers.clear()

    async def close(self) -> None:
        self.cut()
        if self.server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 5)


def known_hosts_for(sshd: Sshd, port: int, path: Path) -> Path:
    """A known_hosts file with the sshd's key under ``port`` (the proxy's)."""
    kind, blob = sshd.host_key.with_suffix(".pub").read_text().split()[:2]
    path.write_text(f"[127.0.0.1]:{port} {kind} {blob}\n")
    return path
