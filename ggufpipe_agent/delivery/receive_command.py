"""``ggufpipe-agent receive [--cache-dir DIR]``: one stage-file delivery on
stdin/stdout, in a process of its own.

Over SSH the orchestrator runs this on an exec session of the host's
connection for ``model: {send: true}``, instead of reaching the agent's data
socket through ``ggufpipe-agent bridge``: the bytes go from sshd's pipe
straight into the cache file, with no bridge process, no socket hop and no
event loop on the way. The wire is the one of :func:`ggufpipe_agent.delivery.service.
serve_delivery` (ReceiveStage, StageData + bytes, StageDataEnd; answers
ReceiveAnswer, StageStored or one ReceiveFailed) and the cache library is the
same (:class:`~ggufpipe_agent.delivery.receiver.StageFileReceiver`), so what is
checked, kept for a resume and refused is the same too; only the reading
differs: blocking reads of a quarter MiB at a time into one reused buffer,
each piece hashed and written while it is still in the CPU's cache. Measured with
benchmarks/bench_delivery.py: the host side of a delivery costs less than
half the CPU of the bridge and the agent together (docs/bench-delivery.md).

The cache entries it writes are the agent's: an agent given the same
``--cache-dir`` (or none, both defaulting alike) loads them by key, and the
file locks that keep two transfers of one file apart work across processes.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import select
import sys
from pathlib import Path

from ggufpipe_agent.delivery.receiver import ReceiveStatus, StageFileReceiver
from ggufpipe_agent.errors import (
    DiskFull,
    GgufpipeError,
    ProtocolError,
    TransferError,
    TruncatedFrame,
)
from ggufpipe_agent.stagefiles.cache import default_cache_dir, remove_entry
from ggufpipe_agent.stagefiles.private_files import free_bytes
from ggufpipe_agent.wire.delivery_messages import (
    ReceiveAnswer,
    ReceiveFailed,
    ReceiveStage,
    StageData,
    StageDataEnd,
    StageStored,
)
from ggufpipe_agent.wire.protocol import (
    CONTROL_PREFIX_SIZE,
    Message,
    decode_payload,
    encode_message,
    parse_prefix,
)

log = logging.getLogger("ggufpipe.receive")

#: sshd writes into our stdin pipe; a larger pipe lets it keep writing while
#: a read waits for the hashing thread (best effort: /proc/sys/fs/pipe-max-size).
PIPE_SIZE = 1 << 20
#: What one read takes off the pipe: small enough to stay in the CPU's cache
#: from the read through the hash to the write.
PIECE = 256 << 10
_F_SETPIPE_SZ = 1031


#: How long a delivery connection may wait for its next frame. The sender may
#: be hashing locally (a resumed send re-hashes the prefix it skips, a first
#: check of a cached entry hashes the whole stage file) before it sends more.
FRAME_TIMEOUT = 600.0
#: A checkpoint (the progress record) at least this often, so an agent
#: killed with its connection resumes from at most a second back.
CHECKPOINT_SECONDS = 1.0


def cache_directory(cache_dir: Path | None) -> Path:
    return Path(cache_dir) if cache_dir is not None else default_cache_dir()


def open_receiver(directory: Path, offer: ReceiveStage) -> tuple[StageFileReceiver, ReceiveStatus]:
    stage = offer.offer
    receiver = StageFileReceiver(
        directory,
        stage.key,
        stage.size,
        stage.chunk_size,
        checkpoint_seconds=CHECKPOINT_SECONDS,
        background_checkpoints=True,
    )
    if offer.replace:
        remove_entry(receiver.target, "the sender has another file under this name")
    return receiver, receiver.open()


def failure_message(error: GgufpipeError) -> ReceiveFailed:
    if isinstance(error, DiskFull):
        return ReceiveFailed(str(error), "disk_full", error.path, error.needed, error.available)
    if isinstance(error, TransferError | ProtocolError):
        return ReceiveFailed(str(error), "transfer")
    return ReceiveFailed(str(error), "cache")


def describe_status(status: ReceiveStatus) -> str:
    if status.state == "partial":
        return f"partial, resuming at byte {status.verified_bytes}"
    if status.state == "busy":
        return "another transfer is writing it"
    return status.state


class StalledInput(TransferError):
    """No byte arrived for the frame timeout."""


class BlockingFrames:
    """Control frames and raw bytes from a file descriptor, blocking, each
    read bounded by ``timeout`` seconds of silence."""

    def __init__(self, fd: int, timeout: float, what: str = "delivery stream") -> None:
        self.fd = fd
        self.timeout = timeout
        self.what = what
        self._file = open(fd, "rb", buffering=0, closefd=False)  # noqa: SIM115 - owned by the caller
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    def readinto(self, view: memoryview, inside: str) -> int:
        """Fill ``view`` whole; the count read before a clean end (0 at once)
        is returned only when nothing was read, else TruncatedFrame."""
        got = 0
        while got < len(view):
            if not self._poll.poll(self.timeout * 1000.0):
                raise StalledInput(f"the {self.what} sent nothing for {self.timeout:g}s inside {inside}")
            count = self._file.readinto(view[got:])
            if not count:
                if got:
                    raise TruncatedFrame(f"the {self.what} ended inside {inside}")
                return 0
            got += count
        return got

    def exactly(self, count: int, inside: str) -> bytes:
        buffer = bytearray(count)
        if count and not self.readinto(memoryview(buffer), inside):
            raise TruncatedFrame(f"the {self.what} ended inside {inside}")
        return bytes(buffer)

    def message(self) -> Message | None:
        """The next control message; None on a clean end between frames."""
        prefix = bytearray(CONTROL_PREFIX_SIZE)
        if not self.readinto(memoryview(prefix), "a frame"):
            return None
        return decode_payload(self.exactly(parse_prefix(bytes(prefix)), "a frame"))


def send(fd: int, message: Message) -> None:
    view = memoryview(encode_message(message))
    while view:
        view = view[os.write(fd, view) :]


class Delivery:
    """The state of one delivery connection: the open receiver and the one
    buffer every piece of every chunk passes through."""

    def __init__(self, frames: BlockingFrames, out: int, directory: Path) -> None:
        self.frames = frames
        self.out = out
        self.directory = directory
        self.receiver: StageFileReceiver | None = None
        self.buffer = memoryview(bytearray(PIECE))

    def offer(self, message: ReceiveStage) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        opened, status = open_receiver(self.directory, message)
        log.info("offered %s (%d bytes): %s", status.name, message.offer.size, describe_status(status))
        self.receiver = opened if status.state in ("partial", "empty") else None
        send(self.out, ReceiveAnswer(status, str(opened.directory), free_bytes(opened.directory)))

    def chunk(self, message: StageData) -> None:
        """The chunk's bytes off the pipe, a piece at a time: each piece
        hashed and written while it is in the CPU's cache."""
        receiver = self.receiver
        if receiver is None:
            raise TransferError(f"chunk {message.index} arrived without an open offer")
        if not 0 < message.size <= receiver.chunk_size:
            raise TransferError(
                f"chunk {message.index} of {message.size} bytes; chunks are {receiver.chunk_size}"
            )
        receiver.start_chunk(message.index, message.size)
        left = message.size
        while left:
            piece = self.buffer[: min(left, PIECE)]
            if not self.frames.readinto(piece, f"chunk {message.index}"):
                raise TruncatedFrame(f"the {self.frames.what} ended inside chunk {message.index}")
            receiver.write_piece(piece)
            left -= len(piece)
        receiver.end_chunk(message.index, message.digest)

    def end(self, message: StageDataEnd) -> None:
        receiver = self.receiver
        if receiver is None:
            raise TransferError("the end of a file arrived without an open offer")
        path = receiver.finish(message.digest)
        log.info("received %s (%d bytes), verified", path, receiver.size)
        send(self.out, StageStored(path.name, receiver.size, message.digest))
        self.receiver = None

    def close(self) -> None:
        """Keep what was verified for a resume (a checkpoint)."""
        receiver, self.receiver = self.receiver, None
        if receiver is not None:
            if receiver.received:
                log.info(
                    "transfer of %s interrupted at byte %d of %d; kept for a resume",
                    receiver.target.name,
                    receiver.received,
                    receiver.size,
                )
            receiver.close()


def serve(frames: BlockingFrames, out: int, directory: Path) -> int:
    """Serve one delivery connection to its end; 0 when it ended cleanly."""
    delivery = Delivery(frames, out, directory)
    try:
        message = frames.message()
        if message is not None and not isinstance(message, ReceiveStage):
            raise ProtocolError(f"{message.tag} where a delivery begins with ReceiveStage")
        while message is not None:
            if isinstance(message, ReceiveStage):
                delivery.offer(message)
            elif isinstance(message, StageData):
                delivery.chunk(message)
            elif isinstance(message, StageDataEnd):
                delivery.end(message)
            else:
                raise ProtocolError(f"{message.tag} is not a message of a stage-file transfer")
            message = frames.message()
        return 0
    except TruncatedFrame as error:
        log.warning("delivery connection lost: %s", error)
    except StalledInput as error:
        log.warning("%s; the transfer is abandoned", error)
    except GgufpipeError as error:
        log.error("cannot receive the stage file: %s", error)
        with contextlib.suppress(OSError):
            send(out, failure_message(error))
    except OSError as error:
        log.warning("delivery connection lost: %s", error)
    finally:
        delivery.close()
    return 1


def receive_main(args: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="ggufpipe-agent receive",
        description="Receive one stage file into the cache: the ggufpipe delivery protocol on "
        "stdin/stdout (the orchestrator runs this over SSH for model: {send: true}).",
    )
    parser.add_argument("--cache-dir", type=Path, help="stage file cache directory (as the agent's)")
    options = parser.parse_args(args)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    cache_dir = options.cache_dir.expanduser() if options.cache_dir is not None else None
    with contextlib.suppress(OSError):
        import fcntl

        fcntl.fcntl(0, _F_SETPIPE_SZ, PIPE_SIZE)  # not a pipe, or over the limit: as it is
    frames = BlockingFrames(0, FRAME_TIMEOUT)
    return serve(frames, 1, cache_directory(cache_dir))


__all__ = ["BlockingFrames", "receive_main", "serve"]
