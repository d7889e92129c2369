"""Framed streams: the one reader and the one writer of every ggufpipe stream.

A stream carries control frames (:mod:`ggufpipe_agent.wire.protocol`) and object
records (:mod:`ggufpipe_agent.wire.objects`); both begin with a four-byte magic, so
a data stream can carry both. The agent and the orchestrator read and write
every stream (control, data, relay, token edges) through these two classes:

* :class:`FrameReader` reads exactly one frame at a time. A clean end of the
  stream between frames is ``None``; an end inside a frame is
  :class:`TruncatedFrame`; bad magic or an oversize length is a
  :class:`~ggufpipe_agent.errors.ProtocolError`, raised before any payload
  byte is awaited.
* :class:`FrameWriter` is the only writer of its stream: it owns the lock, so
  the bytes of two frames never mix, and every frame is written whole and
  drained (a slow reader holds the writer back: backpressure).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from ggufpipe_agent.errors import ProtocolError, TruncatedFrame
from ggufpipe_agent.wire import objects
from ggufpipe_agent.wire.protocol import (
    CONTROL_MAGIC,
    CONTROL_PREFIX_SIZE,
    MAX_CONTROL_BYTES,
    Message,
    decode_payload,
    encode_message,
    parse_prefix,
)

#: How much of an object's payload a relay moves per read.
CHUNK = 1 << 18


class FrameReader:
    """Frames from a stream with asyncio's ``readexactly``/``read`` contract."""

    def __init__(self, stream: Any, what: str = "stream") -> None:
        self.stream = stream
        self.what = what

    async def exactly(self, count: int, inside: str) -> bytes:
        """``count`` raw bytes (a frame's body, or what follows it)."""
        try:
            return bytes(await self.stream.readexactly(count))
        except asyncio.IncompleteReadError:
            raise TruncatedFrame(f"{self.what} ended inside {inside}") from None

    async def _magic(self) -> bytes | None:
        try:
            return bytes(await self.stream.readexactly(4))
        except asyncio.IncompleteReadError as error:
            if error.partial:
                raise TruncatedFrame(f"{self.what} ended inside a frame") from None
            return None

    async def message(self, limit: int = MAX_CONTROL_BYTES) -> Message | None:
        """The next control message; None on a clean end of the stream.
        ``limit`` bounds its size before any of it is awaited (a peer that
        has not authenticated gets a small one)."""
        magic = await self._magic()
        if magic is None:
            return None
        if magic != CONTROL_MAGIC:
            raise ProtocolError(f"bad control frame magic {magic!r}")
        return await self._control(magic, limit)

    async def _control(self, magic: bytes, limit: int = MAX_CONTROL_BYTES) -> Message:
        prefix = magic + await self.exactly(CONTROL_PREFIX_SIZE - 4, "a frame prefix")
        return decode_payload(await self.exactly(parse_prefix(prefix, limit), "a frame"))

    async def frame(self, object_limit: int) -> Message | objects.ObjectHeader | None:
        """The next frame of a data stream: a control message, or an object's
        header (its payload not read yet: :meth:`payload` or :meth:`chunks`).
        ``object_limit`` bounds the payload before any of it is awaited."""
        magic = await self._magic()
        if magic is None:
            return None
        if magic == CONTROL_MAGIC:
            return await self._control(magic)
        if magic != objects.OBJECT_MAGIC:
            raise ProtocolError(f"bad frame magic {magic!r} on the {self.what}")
        head = magic + await self.exactly(objects.HEADER_SIZE - 4, "an object header")
        return objects.unpack_header(head, object_limit)

    async def header(self, object_limit: int) -> objects.ObjectHeader | None:
        """The next object header of a stream of objects only."""
        frame = await self.frame(object_limit)
        if isinstance(frame, Message):
            raise ProtocolError(f"a {frame.tag} control frame where an object was expected")
        return frame

    async def payload(self, header: objects.ObjectHeader) -> bytes:
        return await self.exactly(header.nbytes, header.describe())

    async def record(self, object_limit: int) -> tuple[objects.ObjectHeader, bytes] | None:
        """A whole object record; None on a clean end."""
        header = await self.header(object_limit)
        if header is None:
            return None
        return header, await self.payload(header)

    async def chunks(self, header: objects.ObjectHeader, size: int = CHUNK) -> AsyncIterator[bytes]:
        """An object's payload in pieces of at most ``size`` bytes: memory
        stays bounded whatever the object's size."""
        remaining = header.nbytes
        while remaining:
            chunk = await self.stream.read(min(remaining, size))
            if not chunk:
                raise TruncatedFrame(f"{self.what} ended inside {header.describe()}")
            remaining -= len(chunk)
            yield chunk


async def read_message(stream: Any) -> Message | None:
    """The next control message of a control stream (None on a clean end)."""
    return await FrameReader(stream, "control stream").message()


class FrameWriter:
    """The one writer of a stream. ``drain_timeout`` (seconds, None: no bound)
    bounds how long a frame may wait for a peer that stopped reading; past it
    the write fails with :class:`StalledStream`."""

    def __init__(self, stream: Any, drain_timeout: float | None = None, what: str = "stream") -> None:
        self.stream = stream
        self.drain_timeout = drain_timeout
        self.what = what
        self._lock = asyncio.Lock()

    async def send(self, message: Message) -> None:
        await self.write(encode_message(message))

    async def write(self, *parts: bytes | bytearray | memoryview) -> None:
        """Write ``parts`` as one frame, then drain."""
        async with self._lock:
            for part in parts:
                self.put(part)
            await self.drain()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[FrameWriter]:
        """Hold the stream for several writes (a relay streaming one object in
        chunks): nobody else's frame can land inside it."""
        async with self._lock:
            yield self

    def put(self, part: bytes | bytearray | memoryview) -> None:
        """Inside :meth:`exclusive`: queue bytes without draining."""
        try:
            self.stream.write(part)
        except RuntimeError as error:
            # asyncio's closed transport ("the handler is closed"): a stream
            # the peer or another writer's failure closed is a lost stream.
            raise ConnectionError(f"the {self.what} is closed ({error})") from None

    async def drain(self) -> None:
        try:
            if self.drain_timeout is None:
                await self.stream.drain()
                return
            await asyncio.wait_for(self.stream.drain(), self.drain_timeout)
        except RuntimeError as error:
            raise ConnectionError(f"the {self.what} is closed ({error})") from None
        except asyncio.TimeoutError:
            raise StalledStream(f"the {self.what}'s peer read nothing for {self.drain_timeout:g}s") from None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stream.close()

    def is_closing(self) -> bool:
        return bool(self.stream.is_closing())


class StalledStream(ConnectionError):
    """A peer that stopped reading for longer than the writer's bound."""
