"""Where a stage writes an outbound record: a stream's ``FrameWriter``, or a
stage of this process, by hand (:class:`LocalFeed`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from ggufpipe_agent.wire import objects

#: Takes an inbound object as the consumer's data stream would (its checks,
#: then the run's delivery).
Forward = Callable[[objects.ObjectHeader, bytes], Awaitable[None]]


class RecordSink(Protocol):
    """Where a stage writes an outbound record: a stream's FrameWriter, or
    the stage's own inbound side (:class:`LocalFeed`)."""

    async def write(self, *parts: bytes | bytearray | memoryview) -> None: ...


class LocalFeed:
    """A record for a stage of this process, delivered as if it had arrived
    on a stream (same checks), without the stream: the token ring of a
    one-stage pipeline (the stage feeds itself), and a shared process's
    direct links (process/peer_links.py)."""

    def __init__(self, forward: Forward) -> None:
        self.forward = forward

    async def write(self, *parts: bytes | bytearray | memoryview) -> None:
        if len(parts) == 2:  # a header and its payload (activations)
            head, payload = bytes(parts[0]), bytes(parts[1])
        else:
            record = b"".join(bytes(part) for part in parts)
            head, payload = record[: objects.HEADER_SIZE], record[objects.HEADER_SIZE :]
        await self.forward(objects.unpack_header(head, len(payload)), payload)
