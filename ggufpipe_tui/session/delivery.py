"""Model delivery, the orchestrator's side: each stage host is sent its stage
file (``model: {path: P, send: true}``).

:func:`deliver_stages` runs once per session, in :meth:`Pipeline.start
<ggufpipe_tui.session.pipeline.Pipeline.start>`, after the placement fixed
every stage's layers and before the data plane opens: a stage cannot load
before its file is there, and the ranges do not change for the session, so
the files are sent before any run exists (a run's ready timeout never counts
a transfer). All stages are sent in parallel.

One stage's delivery (:func:`deliver_stage`) has a connection of its own
(``AgentConnection.open_delivery()``), so gigabytes of chunks never hold up a
control message: over SSH an exec session running ``ggufpipe-agent receive``,
which writes the file into the agent's cache itself
(:mod:`ggufpipe_agent.delivery.receive_command`); locally, and to a hand-started agent, a data
connection to the agent attached with the Hello's token. On it::

    ReceiveStage(offer)  ->            what the host has:
                         <-  ReceiveAnswer(complete+digest | partial+verified | empty | busy)
    StageData(i, digest, 8 MiB) ...  -> each chunk checked, then written
    StageDataEnd(digest)             -> the whole file checked, then a cache entry
                         <-  StageStored | ReceiveFailed

The chunks are read from the model's own files (a single GGUF or a split
set) by :class:`~ggufpipe_agent.delivery.sender.StageSender`, hashed and framed on a
thread of the stage while the previous chunk is written, and every write
waits for the channel to drain (asyncssh sends within the peer's window):
two chunks in memory per stage, whatever the model's size, and nothing
written here. A host that has the complete file with the digest of what
would be sent gets nothing; one that has a verified part gets the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from ggufpipe_agent.delivery.sender import StageChunk, StageSender
from ggufpipe_agent.errors import GgufpipeError, ProtocolError
from ggufpipe_agent.gguf.files import ModelFiles
from ggufpipe_agent.wire.delivery_messages import (
    ReceiveAnswer,
    ReceiveFailed,
    ReceiveStage,
    StageData,
    StageDataEnd,
    StageStored,
)
from ggufpipe_agent.wire.framing import FrameReader, FrameWriter, TruncatedFrame
from ggufpipe_agent.wire.protocol import Message, StageFileRef, encode_message
from ggufpipe_tui.core.events import Emit, StageDelivery
from ggufpipe_tui.core.inventory import Timeouts
from ggufpipe_tui.core.plan import RunPlan
from ggufpipe_tui.session.stages import PipelineError, StageHandle

T = TypeVar("T")

#: Bytes per chunk: a whole number of digest leaves, one frame each.
CHUNK_SIZE = 8 << 20
#: At most this often a progress event per stage (and the first and last).
PROGRESS_SECONDS = 0.25
#: The host read nothing of a chunk for this long: the transfer is stalled.
STALL_SECONDS = 120.0
#: A host that verifies a partial file (or fsyncs a finished one) works at
#: disk speed: the answer may take this long, plus a second per 100 MB.
ANSWER_SECONDS = 60.0
DISK_RATE = 100e6
#: Another transfer is writing the same file on the host: ask again this often.
BUSY_RETRY_SECONDS = 1.0
RATE_WINDOW_SECONDS = 3.0


class DeliveryError(PipelineError):
    """A stage file that could not be delivered; the reason names the stage and host."""


@dataclass(frozen=True, slots=True)
class Delivered:
    stage: int
    ref: StageFileRef
    outcome: str  # "sent", "resumed" or "cached"
    sent: int  # bytes sent
    seconds: float


class _Progress:
    """The stage's StageDelivery events, a few a second, with a recent rate."""

    def __init__(self, stage: StageHandle, emit: Emit, name: str, size: int) -> None:
        self.stage, self.emit, self.name, self.size = stage, emit, name, size
        self.started = time.monotonic()
        self.state = ""
        self.done = 0
        self.sent = 0
        self._shown = 0.0
        self._samples: deque[tuple[float, int]] = deque()

    def rate(self, now: float) -> float:
        samples = self._samples
        samples.append((now, self.sent))
        while len(samples) > 2 and now - samples[0][0] > RATE_WINDOW_SECONDS:
            samples.popleft()
        then, sent = samples[0]
        return (self.sent - sent) / (now - then) if now > then else 0.0

    def show(self, state: str, outcome: str = "", force: bool = False) -> None:
        now = time.monotonic()
        rate = self.rate(now) if state == "sending" else 0.0
        if not force and state == self.state and now - self._shown < PROGRESS_SECONDS:
            return
        self.state, self._shown = state, now
        self.emit(
            StageDelivery(
                self.stage.index,
                self.stage.host.name,
                state,
                self.name,
                self.size,
                self.done,
                self.sent,
                now - self.started,
                rate,
                outcome,
            )
        )


def _next_frame(chunks: Iterator[StageChunk]) -> tuple[bytes, bytes] | None:
    """On the stage's thread: the next chunk read and hashed, and its frame."""
    chunk = next(chunks, None)
    if chunk is None:
        return None
    return encode_message(StageData(chunk.index, chunk.digest, len(chunk.data))), chunk.data


def _disk_seconds(size: int) -> float:
    return ANSWER_SECONDS + size / DISK_RATE


async def deliver_stage(
    stage: StageHandle,
    files: ModelFiles,
    layers: tuple[int, int],
    emit: Emit,
    timeouts: Timeouts,
    chunk_size: int = CHUNK_SIZE,
) -> Delivered:
    """Send stage ``stage`` its file of blocks ``layers`` of ``files`` (or
    nothing, when its host has it). Raises DeliveryError with one reason."""
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(1, thread_name_prefix=f"ggufpipe-send-{stage.index}")

    def run(function: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        return loop.run_in_executor(pool, function, *args)

    sender: StageSender | None = None
    writer: FrameWriter | None = None
    progress: _Progress | None = None
    try:
        sender = await run(StageSender, files, layers[0], layers[1], chunk_size)
        offer = sender.offer
        progress = _Progress(stage, emit, offer.key.file_name, offer.size)
        progress.show("checking", force=True)
        try:
            reader, stream = await asyncio.wait_for(stage.link.open_delivery(), timeouts.connect)
        except asyncio.TimeoutError:
            raise DeliveryError(
                f"{stage.label}: the delivery channel did not open within {timeouts.connect:g}s"
            ) from None
        frames = FrameReader(reader, f"delivery stream of stage {stage.index}")
        writer = FrameWriter(stream, STALL_SECONDS, f"delivery stream of stage {stage.index}")
        first = await _negotiate(stage, sender, frames, writer, run, progress, timeouts)
        if first is None:
            assert sender.digest
            progress.done = offer.size
            progress.show("done", "cached", force=True)
            ref = StageFileRef(offer.key, offer.size, sender.digest)
            return Delivered(stage.index, ref, "cached", 0, time.monotonic() - progress.started)
        resumed = first * chunk_size
        progress.done = resumed
        progress.show("sending", force=True)
        stored = await _send(stage, sender, first, frames, writer, run, progress)
        outcome = "resumed" if resumed else "sent"
        progress.done = offer.size
        progress.show("done", outcome, force=True)
        ref = StageFileRef(offer.key, offer.size, stored.digest)
        return Delivered(stage.index, ref, outcome, progress.sent, time.monotonic() - progress.started)
    except (ConnectionError, OSError, TruncatedFrame) as error:
        sent = ""
        if progress is not None and progress.sent:
            sent = f" after {progress.sent} of {progress.size} bytes"
        reason = await stage.diagnose(f"the delivery of its stage file broke{sent} ({error})")
        raise DeliveryError(f"{reason}; start again to resume the transfer") from None
    except DeliveryError:
        raise
    except GgufpipeError as error:
        raise DeliveryError(f"{stage.label}: cannot send its stage file: {error}") from None
    finally:
        if writer is not None:
            writer.close()
        if sender is not None:
            pool.submit(sender.close)
        pool.shutdown(wait=False)


async def _answer(stage: StageHandle, frames: FrameReader, timeout: float, what: str) -> Message:
    try:
        message = await asyncio.wait_for(frames.message(), timeout)
    except asyncio.TimeoutError:
        raise DeliveryError(f"{stage.label}: no answer to {what} within {timeout:g}s") from None
    if message is None:
        raise ConnectionResetError("the agent closed the delivery connection")
    if isinstance(message, ReceiveFailed):
        raise DeliveryError(f"{stage.label}: {message.reason}")
    return message


async def _negotiate(
    stage: StageHandle,
    sender: StageSender,
    frames: FrameReader,
    writer: FrameWriter,
    run: Callable[..., asyncio.Future[Any]],
    progress: _Progress,
    timeouts: Timeouts,
) -> int | None:
    """Offer the file until the host says where to start (None: it has it)."""
    offer = sender.offer
    waiting_until = time.monotonic() + timeouts.ready
    replacing = False
    while True:
        await writer.send(ReceiveStage(offer, replacing))
        answer = await _answer(stage, frames, _disk_seconds(offer.size), "the offer of its stage file")
        if not isinstance(answer, ReceiveAnswer):
            raise ProtocolError(f"{stage.label}: {answer.tag} where the answer to an offer was expected")
        status = answer.status
        if status.state == "busy":
            if time.monotonic() > waiting_until:
                raise DeliveryError(
                    f"{stage.label}: another transfer kept writing {status.name} in {answer.cache_dir} for "
                    f"{timeouts.ready:g}s (timeouts.ready)"
                )
            progress.show("waiting")
            await asyncio.sleep(BUSY_RETRY_SECONDS)
            continue
        if status.state == "complete":
            progress.show("checking")
            # May hash the file here once (no memo of an earlier send): nothing is sent meanwhile.
            first: int | None = await run(sender.first_chunk, status)
            if first is None:
                return None
            replacing = True  # the host's file has another digest: send ours over it
            continue
        return int(status.verified_chunks)


async def _send(
    stage: StageHandle,
    sender: StageSender,
    first: int,
    frames: FrameReader,
    writer: FrameWriter,
    run: Callable[..., asyncio.Future[Any]],
    progress: _Progress,
) -> StageStored:
    """Chunks from ``first`` on, then the end; the host's StageStored."""
    chunks = sender.chunks(first)
    reply: asyncio.Future[Message | None] = asyncio.ensure_future(frames.message())
    fetch: asyncio.Future[tuple[bytes, bytes] | None] = run(_next_frame, chunks)
    writing: asyncio.Future[None] | None = None
    try:
        while True:
            item = await fetch
            if item is None:
                break
            frame, data = item
            length = len(data)
            fetch = run(_next_frame, chunks)  # read and hash the next while this one goes
            writing = asyncio.ensure_future(writer.write(frame, data))
            del item, data  # the write holds the one reference: two chunks in memory, not three
            waiting: set[asyncio.Future[Any]] = {writing, reply}
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if reply in done and not writing.done():
                writing.cancel()
                with contextlib.suppress(BaseException):
                    await writing
                return _stored(stage, reply.result())  # raises: the host said why it stopped
            try:
                await writing
            except (ConnectionError, OSError):
                await _reason_first(stage, reply)
                raise
            progress.sent += length
            progress.done += length
            progress.show("sending")
        await writer.send(StageDataEnd(sender.digest))
        try:
            message = await asyncio.wait_for(asyncio.shield(reply), _disk_seconds(sender.offer.size))
        except asyncio.TimeoutError:
            raise DeliveryError(
                f"{stage.label}: the host did not confirm its stage file within "
                f"{_disk_seconds(sender.offer.size):g}s"
            ) from None
        return _stored(stage, message)
    finally:
        pending: list[asyncio.Future[Any]] = [reply, fetch]
        if writing is not None:
            pending.append(writing)
        for task in pending[0], *pending[2:]:
            if not task.done():
                task.cancel()
        for task in pending:  # retrieved: a cancelled transfer leaves no stray error
            with contextlib.suppress(BaseException):
                await task  # (the fetch: the thread must not be left reading)


async def _reason_first(stage: StageHandle, reply: asyncio.Future[Message | None]) -> None:
    """A write that failed: the host may have said why just before it closed."""
    message: Message | None = None
    with contextlib.suppress(asyncio.TimeoutError, ConnectionError, OSError, GgufpipeError):
        message = await asyncio.wait_for(asyncio.shield(reply), 2.0)
    if isinstance(message, ReceiveFailed):
        raise DeliveryError(f"{stage.label}: {message.reason}")


def _stored(stage: StageHandle, message: Message | None) -> StageStored:
    if message is None:
        raise ConnectionResetError("the agent closed the delivery connection before confirming the file")
    if isinstance(message, ReceiveFailed):
        raise DeliveryError(f"{stage.label}: {message.reason}")
    if not isinstance(message, StageStored):
        raise ProtocolError(f"{stage.label}: {message.tag} where StageStored was expected")
    return message


async def deliver_stages(
    stages: Sequence[StageHandle],
    files: ModelFiles,
    ranges: Sequence[tuple[int, int]],
    emit: Emit,
    timeouts: Timeouts,
) -> list[Delivered]:
    """Every stage's file, in parallel; the first failure stops the others
    (their hosts keep what they verified) and is raised."""
    tasks: list[asyncio.Task[Delivered]] = [
        asyncio.ensure_future(deliver_stage(stage, files, ranges[stage.index], emit, timeouts))
        for stage in stages
    ]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:  # in stage order: the first stage that failed is the reason
        failure = task.exception() if task.done() and not task.cancelled() else None
        if failure is not None:
            raise failure
    return [task.result() for task in tasks]


def with_stage_files(plan: RunPlan, delivered: dict[int, StageFileRef]) -> RunPlan:
    """The plan whose stages load the files delivered to their hosts."""
    if not delivered:
        return plan
    stages = tuple(replace(stage, stage_file=delivered.get(stage.stage_index)) for stage in plan.stages)
    return replace(plan, stages=stages)
