"""The receiving side of stage-file delivery: chunks in, a verified cache entry out.

No wire protocol here: the agent runtime calls this library with what the
orchestrator sent. The sender (:mod:`ggufpipe_agent.delivery.sender`) offers a stage
file as a :class:`~ggufpipe_agent.delivery.sender.StageOffer` (a :class:`StageKey` derived
from the model's identity, the range and the stage format; the total size;
the chunk size). :meth:`StageFileReceiver.open` answers what this host
already has (:class:`ReceiveStatus`): a complete entry and its digest, a
partial file and how many verified bytes it holds, or nothing. Chunks then
arrive in order, each with its own digest (a bad one is rejected, never
written); the whole file's digest is checked before the file becomes an
entry (atomic rename, sidecar).

Durability without waiting for the disk: nothing here fsyncs the stage
file's bytes while it arrives (a checkpoint's fdatasync, then the entry's
fsync, held the transfer up to a quarter of its time; the kernel writes the
pages back within seconds, as for any copy). Correctness does not depend on
them reaching the disk before a crash: a progress record is checked against
the bytes on a resume (below), and an entry's sidecar names the boot it was
written in (``Sidecar.unsynced_boot``), so after a reboot its first use
re-hashes it, and a file a crash damaged is removed and sent again. Where
the system has no boot id, the entry is fsynced as before.

Resume: the partial file (``NAME.partial``) and its progress record
(``NAME.partial.json``: key, size, chunk size, verified bytes, the digest of
that prefix) survive a killed connection and a restarted agent (it is
written every ``checkpoint_bytes``, every ``checkpoint_seconds`` and on
:meth:`close`). A restart re-hashes the recorded prefix (at disk speed),
which checks it (a record that outlived its bytes in a crash does not
match: the transfer starts over) and restores the running digest, and the
transfer continues from there. A partial file is written by one receiver at a time (``flock``):
another agent of the same host asking for the same stage is told "busy" and
can ask again; once the first one finishes, it finds the complete entry.

A full disk, found before (free space, ``posix_fallocate`` of the rest) or
while writing, is one :class:`~ggufpipe_agent.errors.DiskFull` naming the path
and the space the file needs; the partial file is removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hmac
import json
import logging
import os
import stat
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ggufpipe_agent.errors import CacheError, DiskFull, TransferError
from ggufpipe_agent.stagefiles.cache import (
    DIGEST_ALGORITHM,
    PARTIAL_SUFFIX,
    SIDECAR_SUFFIX,
    Sidecar,
    StageKey,
    boot_id,
    new_digest,
    read_private_json,
    record_entry,
    remove_entry,
    sidecar_path,
    touch,
    verify_entry,
    write_small_file,
)
from ggufpipe_agent.stagefiles.digest import LEAF, FileDigest, chunk_digest, leaf_digests, new_leaf
from ggufpipe_agent.stagefiles.private_files import (
    create_private,
    disk_full,
    free_bytes,
    fsync_directory,
    private_cache_dir,
    remove_orphans,
    reserve,
    write_all,
)
from ggufpipe_agent.wire.delivery_messages import ReceiveStatus

log = logging.getLogger("ggufpipe.receiver")

MIN_CHUNK = LEAF
#: A chunk travels in one control frame (64 MiB at most, protocol.py).
MAX_CHUNK = 32 << 20
MAX_SIZE = 1 << 48  # 256 TiB: anything larger is not a stage file
CHECKPOINT_BYTES = 256 << 20
PROGRESS_VERSION = 1


class StageFileReceiver:
    """One stage file arriving in a host's cache. Use as a context manager,
    or call :meth:`close` (keeps the partial for a resume) or :meth:`abort`
    (removes it)."""

    def __init__(
        self,
        cache_dir: str | os.PathLike[str],
        key: StageKey,
        size: int,
        chunk_size: int,
        checkpoint_bytes: int = CHECKPOINT_BYTES,
        checkpoint_seconds: float | None = None,
        background_checkpoints: bool = False,
    ) -> None:
        key.check()
        if not 0 < size <= MAX_SIZE:
            raise TransferError(f"stage file size {size} is not a size")
        if not MIN_CHUNK <= chunk_size <= MAX_CHUNK or chunk_size % LEAF:
            raise TransferError(
                f"chunk size {chunk_size} is not a multiple of {LEAF} in [{MIN_CHUNK}, {MAX_CHUNK}]"
            )
        self.key = key
        self.size = size
        self.chunk_size = chunk_size
        self.checkpoint_bytes = max(chunk_size, checkpoint_bytes - checkpoint_bytes % chunk_size)
        # Also by time: an agent killed with its connection (sshd's session
        # ends, PR_SET_PDEATHSIG) never reaches close(); what it resumes from
        # is the last checkpoint.
        self.checkpoint_seconds = checkpoint_seconds
        self._checkpointed_at = time.monotonic()
        # In the background: a checkpoint's record is a small file synced and
        # renamed into place, which waits for the disk's journal, and chunks
        # keep being written meanwhile. The record counts only the bytes
        # received and verified before it was begun.
        self._checkpointer: ThreadPoolExecutor | None = None
        if background_checkpoints:
            self._checkpointer = ThreadPoolExecutor(1, thread_name_prefix="ggufpipe-checkpoint")
        self._checkpointing: Future[None] | None = None
        self.directory = private_cache_dir(cache_dir)
        self.target = self.directory / key.file_name
        self.partial = self.directory / (key.file_name + PARTIAL_SUFFIX)
        self.record = self.directory / (key.file_name + PARTIAL_SUFFIX + SIDECAR_SUFFIX)
        self._fd = -1
        self._digest = FileDigest()
        self.received = 0  # bytes written and verified chunk by chunk
        self._durable = 0  # bytes the progress record vouches for
        self._piece_at = self._piece_end = 0  # the chunk being written in pieces
        self._leaves = bytearray()
        self._leaf = new_leaf()

    def __enter__(self) -> StageFileReceiver:
        return self

    def __exit__(self, kind: object, *_: object) -> None:
        self.close()

    # -------------------------------------------------------------- offer

    def open(self) -> ReceiveStatus:
        """What this host has; after a "partial" or "empty" answer the
        receiver is ready for chunk ``verified_chunks``."""
        name = self.target.name
        if self._fd >= 0:  # asked again while receiving: where it stands
            chunks = self.received // self.chunk_size
            state = "partial" if self.received else "empty"
            return ReceiveStatus(state, name, verified_bytes=self.received, verified_chunks=chunks)
        complete = self._complete()
        if complete:
            self._drop_stale_partial()
            return ReceiveStatus("complete", name, digest=complete)
        remove_orphans(self.directory, self.partial.name)
        try:
            fd = self._open_partial()
        except OSError as error:
            raise CacheError(f"cannot open {self.partial}: {error.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return ReceiveStatus("busy", name)
        self._fd = fd
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            self._drop()
            raise CacheError(f"{self.partial} is not a regular file of this user; removed")
        os.fchmod(fd, 0o600)
        complete = self._complete()  # finished by another receiver just before we locked
        if complete:
            self._drop()  # a partial file of a complete entry is only space
            return ReceiveStatus("complete", name, digest=complete)
        self._resume(info.st_size)
        needed = self.size - self.received
        available = free_bytes(self.directory)
        if available and available < needed:
            self._drop()
            raise disk_full(self.target, self.size)
        try:
            reserve(self._fd, self.target, self.received, needed, self.size)
        except DiskFull:
            self._drop()
            raise
        state = "partial" if self.received else "empty"
        chunks = self.received // self.chunk_size
        return ReceiveStatus(state, name, verified_bytes=self.received, verified_chunks=chunks)

    def _drop_stale_partial(self) -> None:
        """A partial file beside a complete entry is only space, unless another
        receiver still holds it (then it is that one's to finish or drop)."""
        try:
            fd = os.open(self.partial, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return
        self._fd = fd
        self._drop()

    def _open_partial(self) -> int:
        """The partial file, opened or created; never through a symlink."""
        for _ in range(3):  # another receiver may create it between our two calls
            try:
                return os.open(self.partial, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                pass
            except OSError as error:
                if error.errno != errno.ELOOP:
                    raise
                log.warning("%s is a symbolic link, not a partial file of ours; removed", self.partial)
                self.partial.unlink()
                self.record.unlink(missing_ok=True)
            with contextlib.suppress(FileExistsError):
                return create_private(self.partial)
        raise CacheError(f"cannot open {self.partial}: it keeps appearing and vanishing")

    def _complete(self) -> str:
        """The digest of a trustworthy complete entry; a broken one is removed."""
        sidecar = verify_entry(self.target)
        if sidecar is not None and sidecar.key == self.key and sidecar.size == self.size:
            touch(self.target)
            return sidecar.digest
        if os.path.lexists(self.target) or os.path.lexists(sidecar_path(self.target)):
            remove_entry(self.target, "no valid sidecar, or contents that do not match it")
        return ""

    def _resume(self, length: int) -> None:
        """Restore the verified prefix of a partial file, or start over."""
        self._digest = new_digest()
        self.received = self._durable = 0
        record = read_private_json(self.record) or {}
        verified = record.get("verified", 0)
        expected = {
            "version": PROGRESS_VERSION,
            "algorithm": DIGEST_ALGORITHM,
            "key": dataclasses.asdict(self.key),
            "size": self.size,
        }
        usable = (
            all(record.get(field) == value for field, value in expected.items())
            and isinstance(verified, int)
            and 0 < verified <= min(length, self.size)
        )
        if usable:
            keep = verified - verified % self.chunk_size  # whole chunks of this offer
            whole, kept = _hash_prefix(self._fd, verified, keep)
            prefix = str(record.get("prefix", ""))
            if whole is not None and kept is not None and hmac.compare_digest(whole.hexdigest(), prefix):
                self._digest = kept
                self.received = self._durable = keep
                log.info("resuming %s at byte %d of %d", self.partial, keep, self.size)
            else:
                log.warning("%s does not match its progress record; starting over", self.partial)
        if self.received == 0 and length:
            os.ftruncate(self._fd, 0)
        if not self.received:
            self.record.unlink(missing_ok=True)

    # -------------------------------------------------------------- chunks

    def accept(self, index: int, data: bytes | memoryview, digest: str) -> None:
        """Chunk ``index`` (in order) with the digest the sender computed;
        TransferError (and nothing written) when it is out of order, of the
        wrong size, or does not match."""
        length = self._expect(index, len(data))
        leaves = leaf_digests(data)
        if not hmac.compare_digest(chunk_digest(leaves), digest):
            raise TransferError(f"{self.partial}: chunk {index} does not match its digest; rejected")
        self._write(self.received, data)
        self._count(length, leaves)

    # A chunk in pieces, for a reader that takes it off a pipe a little at a
    # time: each piece is hashed and written while it is still in the CPU's
    # cache (one pass over 8 MiB per step cost 3-4 times the CPU of cat on
    # this project's machine). The chunk's bytes are on disk before they are
    # checked, but nothing counts them (not ``received``, not a checkpoint)
    # until end_chunk has matched the digest: a rejected chunk is overwritten
    # by its next try, as a resume overwrites what the record did not vouch for.

    def start_chunk(self, index: int, size: int) -> None:
        """Chunk ``index`` of ``size`` bytes begins; its pieces follow."""
        self._expect(index, size)
        self._piece_at = self.received
        self._piece_end = self.received + size
        self._leaves = bytearray()
        self._leaf = new_leaf()

    def write_piece(self, data: bytes | memoryview) -> None:
        """The next bytes of the chunk begun by start_chunk, in order."""
        if self._piece_at + len(data) > self._piece_end:
            raise TransferError(f"{self.partial}: more bytes than the chunk announced")
        self._write(self._piece_at, data)
        view = memoryview(data)
        while view:  # a chunk starts on a leaf boundary: leaves end every LEAF bytes from it
            filled = (self._piece_at - self.received) % LEAF
            take = min(LEAF - filled, len(view))
            self._leaf.update(view[:take])
            view = view[take:]
            self._piece_at += take
            if filled + take == LEAF:
                self._leaves += self._leaf.digest()
                self._leaf = new_leaf()

    def end_chunk(self, index: int, digest: str) -> None:
        """The chunk is whole: counted when it matches ``digest``, else TransferError."""
        if self._piece_at != self._piece_end:
            raise TransferError(f"{self.partial}: chunk {index} ended early")
        length = self._piece_end - self.received
        if length % LEAF:
            self._leaves += self._leaf.digest()  # the file's last, short leaf
        leaves, self._leaves = bytes(self._leaves), bytearray()
        if not hmac.compare_digest(chunk_digest(leaves), digest):
            raise TransferError(f"{self.partial}: chunk {index} does not match its digest; rejected")
        self._count(length, leaves)

    def _expect(self, index: int, size: int) -> int:
        """Chunk ``index`` of ``size`` bytes may come now: its length, else TransferError."""
        if self._fd < 0:
            raise TransferError(f"{self.partial}: not open for chunks")
        expected_index = self.received // self.chunk_size
        if index != expected_index:
            raise TransferError(f"{self.partial}: chunk {index} arrived, chunk {expected_index} was expected")
        length = min(self.chunk_size, self.size - self.received)
        if size != length:
            raise TransferError(f"{self.partial}: chunk {index} has {size} bytes, not {length}")
        return length

    def _write(self, offset: int, data: bytes | memoryview) -> None:
        os.lseek(self._fd, offset, os.SEEK_SET)
        try:
            write_all(self._fd, data, self.target, self.size)
        except DiskFull:
            self._drop()
            raise

    def _count(self, length: int, leaves: bytes) -> None:
        """A verified chunk: into the file's digest, and a checkpoint when one is due."""
        self._digest.add_leaves(leaves)
        self.received += length
        if self.received < self.size and (
            self.received - self._durable >= self.checkpoint_bytes
            or (
                self.checkpoint_seconds is not None
                and time.monotonic() - self._checkpointed_at >= self.checkpoint_seconds
            )
        ):
            self._checkpoint_due()

    def _checkpoint_due(self) -> None:
        if self._checkpointer is None:
            self.checkpoint()
            return
        if self._checkpointing is not None:
            if not self._checkpointing.done():
                return  # the disk is still syncing the last one: the next chunk asks again
            try:
                self._checkpointing.result()  # a checkpoint that failed fails the transfer
            except DiskFull:
                self._drop()
                raise
        self._checkpointed_at = time.monotonic()
        # What the record will vouch for, taken here, in the writing thread.
        self._checkpointing = self._checkpointer.submit(self._record, self.received, self._digest.hexdigest())

    def checkpoint(self) -> None:
        """Record what was received (a resume starts here)."""
        self._settle()
        if self._fd < 0 or self.received == self._durable:
            return
        self._record(self.received, self._digest.hexdigest())

    def _record(self, verified: int, prefix: str) -> None:
        """The record of the first ``verified`` bytes (not synced: a resume checks them)."""
        record = {
            "version": PROGRESS_VERSION,
            "algorithm": DIGEST_ALGORITHM,
            "key": dataclasses.asdict(self.key),
            "size": self.size,
            "chunk_size": self.chunk_size,
            "verified": verified,
            "prefix": prefix,
        }
        write_small_file(self.record, json.dumps(record, sort_keys=True).encode())
        self._durable = verified
        self._checkpointed_at = time.monotonic()

    def _settle(self) -> None:
        """Wait for a background checkpoint (its errors are the next one's to meet)."""
        pending, self._checkpointing = self._checkpointing, None
        if pending is not None:
            with contextlib.suppress(Exception):
                pending.result()

    def finish(self, digest: str) -> Path:
        """The entry, once every byte is here and the whole file matches
        ``digest``; a mismatch removes the partial file (TransferError)."""
        if self._fd < 0:
            raise TransferError(f"{self.partial}: not open for chunks")
        if self.received != self.size:
            raise TransferError(f"{self.partial}: {self.received} of {self.size} bytes received")
        self._settle()
        actual = self._digest.hexdigest()
        if not hmac.compare_digest(actual, digest):
            self._drop()
            raise TransferError(
                f"{self.target}: the received file's digest {actual[:16]}... is not the announced "
                f"{digest[:16]}...; the partial file is removed, send it again"
            )
        os.ftruncate(self._fd, self.size)
        boot = boot_id()
        if not boot:  # nothing would tell a use after a crash to check it
            os.fsync(self._fd)
        inode = os.fstat(self._fd).st_ino
        os.replace(self.partial, self.target)
        record_entry(self.target, Sidecar(actual, self.size, 0, inode, self.key, unsynced_boot=boot))
        self.record.unlink(missing_ok=True)
        fsync_directory(self.directory)
        self._release()
        return self.target

    # -------------------------------------------------------------- ending

    def close(self) -> None:
        """Stop receiving, keeping the partial file for a resume."""
        if self._fd < 0:
            return
        with contextlib.suppress(OSError):
            self.checkpoint()
        self._release()

    def abort(self) -> None:
        """Stop receiving and remove the partial file."""
        if self._fd >= 0:
            self._drop()

    def _release(self) -> None:
        self._settle()
        if self._checkpointer is not None:
            self._checkpointer.shutdown(wait=True)
            self._checkpointer = None
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)  # releases the flock

    def _drop(self) -> None:
        self._settle()  # no record may be written after the files are gone
        for path in (self.partial, self.record):
            path.unlink(missing_ok=True)
        self._release()


def _hash_prefix(fd: int, verified: int, keep: int) -> tuple[FileDigest | None, FileDigest | None]:
    """The running digests of a file's first ``verified`` and ``keep`` bytes
    (``keep <= verified``); (None, None) when the file is shorter."""
    digest = FileDigest()
    kept: FileDigest | None = None
    position = 0
    for boundary in (keep, verified):
        while position < boundary:
            data = os.pread(fd, min(8 << 20, boundary - position), position)
            if not data:
                return None, None
            digest.update(data)
            position += len(data)
        if kept is None:
            kept = digest.copy()
    return digest, kept
