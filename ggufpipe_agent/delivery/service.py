"""Model delivery on the agent: stage files received over the wire, used by
a provision, and the cache managed for the orchestrator.

* :func:`serve_delivery` serves one delivery connection: a data connection
  (attached with the Hello's token) whose first frame is ``ReceiveStage``.
  It answers what the host holds (``ReceiveAnswer``), takes the chunks
  (``StageData``, each checked against its digest before it is written) and
  the end (``StageDataEnd``: the whole file's digest is checked, then the file
  becomes a cache entry: ``StageStored``), or says in one ``ReceiveFailed``
  why it cannot (a full disk names the path and the space needed; the partial
  file is removed). A connection that breaks keeps the verified prefix for a
  resume. The library underneath is :mod:`ggufpipe_agent.delivery.receiver`; every call
  into it (hashing, writes, checkpoints) runs on a thread of this connection, never
  on the event loop, and one chunk is written while the next is read.
* :func:`received_stage_file` is what a provision with ``stage_file`` loads:
  the entry found by its key, vouched for by its sidecar, of the size and
  digest the orchestrator sent.
* :func:`answer_cache_request` lists, removes or verifies cache entries.

The wire is described in docs/protocol.md, the cache in docs/model-delivery.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from ggufpipe_agent.delivery.receive_command import (
    FRAME_TIMEOUT,
    cache_directory,
    describe_status,
    failure_message,
    open_receiver,
)
from ggufpipe_agent.delivery.receiver import MAX_CHUNK, StageFileReceiver
from ggufpipe_agent.errors import (
    CacheError,
    GgufpipeError,
    ModelError,
    ProtocolError,
    TransferError,
)
from ggufpipe_agent.gguf.architectures import check_architecture
from ggufpipe_agent.gguf.files import read_model_files
from ggufpipe_agent.stagefiles.admin import list_entries, remove_entries
from ggufpipe_agent.stagefiles.cache import check_entry, remove_entry, touch, verify_entry
from ggufpipe_agent.stagefiles.private_files import free_bytes, private_cache_dir
from ggufpipe_agent.wire.delivery_messages import (
    CacheReport,
    CacheRequest,
    ReceiveAnswer,
    ReceiveStage,
    StageData,
    StageDataEnd,
    StageStored,
)
from ggufpipe_agent.wire.framing import FrameReader, FrameWriter, TruncatedFrame
from ggufpipe_agent.wire.protocol import Message, ProvisionStage

log = logging.getLogger("ggufpipe.delivery")
T = TypeVar("T")


async def serve_delivery(
    first: ReceiveStage, frames: FrameReader, writer: FrameWriter, cache_dir: Path | None
) -> None:
    """One delivery connection, from its first ``ReceiveStage`` to its end."""
    loop = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(1, thread_name_prefix="ggufpipe-receive")
    directory = cache_directory(cache_dir)
    receiver: StageFileReceiver | None = None
    pending: asyncio.Future[None] | None = None  # the chunk being written

    def run(function: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        return loop.run_in_executor(executor, function, *args)

    _allow_whole_chunks(frames, first.offer.chunk_size)
    writer.drain_timeout = FRAME_TIMEOUT  # an orchestrator that reads no answer is gone
    try:
        message: Message | None = first
        while message is not None:
            if isinstance(message, ReceiveStage):
                if pending is not None:
                    await pending
                    pending = None
                if receiver is not None:
                    await run(receiver.close)
                    receiver = None
                opened, status = await run(open_receiver, directory, message)
                said = describe_status(status)
                log.info("offered %s (%d bytes): %s", status.name, message.offer.size, said)
                # A complete entry or a busy partial holds nothing open here.
                receiver = opened if status.state in ("partial", "empty") else None
                await writer.send(ReceiveAnswer(status, str(opened.directory), free_bytes(opened.directory)))
            elif isinstance(message, StageData):
                if receiver is None:
                    raise TransferError(f"chunk {message.index} arrived without an open offer")
                if not 0 < message.size <= receiver.chunk_size:
                    raise TransferError(
                        f"chunk {message.index} of {message.size} bytes; chunks are {receiver.chunk_size}"
                    )
                chunk = frames.exactly(message.size, f"chunk {message.index}")  # the bytes after the frame
                data = await asyncio.wait_for(chunk, FRAME_TIMEOUT)
                if pending is not None:
                    await pending  # in order; at most one chunk written while the next is read
                pending = run(receiver.accept, message.index, data, message.digest)
                del data
            elif isinstance(message, StageDataEnd):
                if receiver is None:
                    raise TransferError("the end of a file arrived without an open offer")
                if pending is not None:
                    await pending
                    pending = None
                path = await run(receiver.finish, message.digest)
                log.info("received %s (%d bytes), verified", path, receiver.size)
                await writer.send(StageStored(path.name, receiver.size, message.digest))
                receiver = None
            else:
                raise ProtocolError(f"{message.tag} is not a message of a stage-file transfer")
            message = await asyncio.wait_for(frames.message(), FRAME_TIMEOUT)
    except TruncatedFrame as error:
        log.warning("delivery connection lost: %s", error)
    except GgufpipeError as error:
        log.error("cannot receive the stage file: %s", error)
        with contextlib.suppress(ConnectionError, OSError):
            await writer.send(failure_message(error))
    except asyncio.TimeoutError:
        log.warning("delivery connection: no frame for %.0f s; the transfer is abandoned", FRAME_TIMEOUT)
    except (ConnectionError, OSError) as error:
        log.warning("delivery connection lost: %s", error)
    finally:
        await _close(run, executor, pending, receiver)


def _allow_whole_chunks(frames: FrameReader, chunk_size: int) -> None:
    """Let this connection's reader buffer two whole chunks. The data server's
    readers pause their socket at twice its 1 MiB limit, so an 8 MiB chunk
    cost a pause and a resume per 2 MiB: 47-51 MB/s over SSH against 63
    with room for two chunks (same run, benchmarks/bench_delivery.py's
    setup). Only this connection, which carries nothing but chunks."""
    stream = frames.stream
    if isinstance(stream, asyncio.StreamReader):
        limit = getattr(stream, "_limit", 0)
        setattr(stream, "_limit", max(limit, 2 * min(chunk_size, MAX_CHUNK)))  # noqa: B010


async def _close(
    run: Callable[..., asyncio.Future[Any]],
    executor: ThreadPoolExecutor,
    pending: asyncio.Future[None] | None,
    receiver: StageFileReceiver | None,
) -> None:
    """Keep what was verified for a resume: the close (a checkpoint) runs on
    the connection's thread after any chunk still being written."""
    if pending is not None:
        with contextlib.suppress(Exception):
            await pending
    if receiver is not None:
        if receiver.received:
            log.info(
                "transfer of %s interrupted at byte %d of %d; kept for a resume",
                receiver.target.name,
                receiver.received,
                receiver.size,
            )
        closing = executor.submit(receiver.close)
        try:
            await asyncio.wrap_future(closing)
        except asyncio.CancelledError:  # the agent is exiting: finish the checkpoint first
            with contextlib.suppress(Exception):
                closing.result(timeout=30)
            raise
    executor.shutdown(wait=False)


# ------------------------------------------------------------------ loading


def received_stage_file(cache_dir: Path | None, provision: ProvisionStage) -> Path:
    """The delivered stage file a provision names, checked before it loads:
    the entry of its key, vouched for by its sidecar (a stat and sampled
    blocks, or a re-hash when the stat differs; a damaged entry is removed and
    refused, naming it), of the size and digest that were sent, and a
    header whose block count and width are the plan's."""
    p = provision
    ref = p.stage_file
    if ref is None:
        raise ProtocolError("the provision names no delivered stage file")
    key = ref.key
    key.check()
    span = f"layers [{p.layer_start}, {p.layer_end_exclusive})"
    check_architecture(p.model.architecture, f"the stage file of {span}")
    if (key.start, key.end, key.block_count) != (p.layer_start, p.layer_end_exclusive, p.model.block_count):
        raise ProtocolError(
            f"the delivered stage file is of layers [{key.start}, {key.end}) of {key.block_count}; "
            f"the provision says {span} of {p.model.block_count}"
        )
    directory = private_cache_dir(cache_directory(cache_dir))
    target = directory / key.file_name
    sidecar = check_entry(target)  # damaged: EntryDamaged, naming the file and what to do
    if (
        sidecar is None
        or sidecar.key != key
        or sidecar.size != ref.size
        or not hmac.compare_digest(sidecar.digest, ref.digest)
    ):
        raise CacheError(
            f"{target}: the stage file sent for {span} is not in the cache as it was sent (removed or "
            "damaged since); start the pipeline again to send it"
        )
    touch(target)
    files = read_model_files(target)
    arch = files.architecture
    blocks = int(files.get(f"{arch}.block_count", 0))
    width = int(files.get(f"{arch}.embedding_length", 0))
    if blocks != p.layer_end_exclusive - p.layer_start or width != p.model.hidden_dim:
        raise ModelError(
            f"{target} has {blocks} blocks of width {width}; the plan says "
            f"{p.layer_end_exclusive - p.layer_start} of width {p.model.hidden_dim}"
        )
    return target


# ------------------------------------------------------------------ the cache


def answer_cache_request(cache_dir: Path | None, request: CacheRequest) -> CacheReport:
    """``ggufpipe-tui cache``: list, remove or verify this host's entries."""
    directory = cache_directory(cache_dir)
    removed: list[str] = []
    damaged: list[str] = []
    if request.action == "remove":
        names = [entry.name for entry in list_entries(directory)] if request.every else list(request.names)
        if directory.is_dir():
            removed = remove_entries(private_cache_dir(directory), names)
    elif request.action == "verify":
        if directory.is_dir():
            private_cache_dir(directory)
            for entry in list_entries(directory):
                if entry.state != "complete":
                    continue
                target = directory / entry.name
                if verify_entry(target, full=True) is None:
                    remove_entry(target, "its contents do not match its digest")
                    damaged.append(entry.name)
    elif request.action != "list":
        raise ProtocolError(f"cache action {request.action!r} is not list, remove or verify")
    available = free_bytes(directory) if directory.is_dir() else 0
    return CacheReport(
        request.request_id,
        str(directory),
        available,
        tuple(list_entries(directory)),
        tuple(removed),
        tuple(damaged),
    )
