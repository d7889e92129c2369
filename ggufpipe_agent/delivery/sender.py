"""The sending side of stage-file delivery: an offer, chunks with digests.

Runs where the model is (the orchestrator's machine for ``send: true``).
:class:`StageSender` wraps the stage-file stream of one range: its
:class:`StageOffer` (key, size, chunk size) goes to the host, whose
:class:`~ggufpipe_agent.delivery.receiver.ReceiveStatus` answer says where to start
(:meth:`StageSender.first_chunk`); :meth:`StageSender.chunks` yields
:class:`StageChunk` objects from there, each with its digest, and
:attr:`StageSender.digest` is the whole file's digest once the last chunk is
out (a resumed send hashes the prefix it skips from the local files, at disk
speed, instead of sending it).

A host that already has the complete entry answers with its digest. The
sender compares it with the digest of what it would send, which it knows
without reading tens of GB again: every full digest is memoized in a small
file keyed by the source files' identity (real path, size, mtime, inode),
the range and the stage format (``memo_dir``, default ``sent/`` beside the
stage cache). With no memo (a first run, or a changed source), the digest is
computed by streaming the file locally once (:meth:`StageSender.full_digest`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ggufpipe_agent.errors import CacheError, TransferError
from ggufpipe_agent.gguf.files import ModelFiles, read_model_files
from ggufpipe_agent.stagefiles.build import stage_key
from ggufpipe_agent.stagefiles.cache import default_cache_dir, new_digest, read_private_json, write_small_file
from ggufpipe_agent.stagefiles.digest import LEAF, chunk_digest, leaf_digests
from ggufpipe_agent.stagefiles.private_files import private_cache_dir
from ggufpipe_agent.stagefiles.stream import DEFAULT_CHUNK, StageFileStream
from ggufpipe_agent.wire.delivery_messages import StageOffer

if TYPE_CHECKING:  # the receiver is the other side: only its answer's type
    from ggufpipe_agent.delivery.receiver import ReceiveStatus

log = logging.getLogger("ggufpipe.sender")


@dataclass(frozen=True, slots=True)
class StageChunk:
    index: int  # chunk ``index`` covers bytes [index * chunk_size, ...)
    data: bytes
    digest: str  # of ``data``


class StageSender:
    """The stage file of blocks ``[start, end)`` of ``source``, to be sent."""

    def __init__(
        self,
        source: str | os.PathLike[str] | ModelFiles,
        start: int,
        end: int,
        chunk_size: int = DEFAULT_CHUNK,
        memo_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if chunk_size <= 0 or chunk_size % LEAF:
            raise ValueError(f"chunk size {chunk_size} is not a positive multiple of {LEAF}")
        self.files = source if isinstance(source, ModelFiles) else read_model_files(source)
        self.stream = StageFileStream(self.files, start, end)
        self.key = stage_key(self.files, start, end)
        self.chunk_size = chunk_size
        self.offer = StageOffer(self.key, self.stream.size, chunk_size)
        self._memo_dir = Path(memo_dir) if memo_dir is not None else default_cache_dir().parent / "sent"
        self._sources = self.files.resolved_sources()
        self.digest = self.known_digest()

    def __enter__(self) -> StageSender:
        self.stream.open()
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self.stream.close()

    # -------------------------------------------------------------- digests

    def _memo_path(self) -> Path:
        return self._memo_dir / f"{self.key.file_name}.sent.json"

    def known_digest(self) -> str:
        """The full digest from an earlier send or check of these very source
        files; '' when there is none."""
        memo = read_private_json(self._memo_path()) or {}
        if memo.get("sources") != [dataclasses.asdict(s) for s in self._sources]:
            return ""
        if memo.get("size") != self.offer.size or memo.get("key") != dataclasses.asdict(self.key):
            return ""
        digest = memo.get("digest")
        return digest if isinstance(digest, str) else ""

    def _remember(self, digest: str) -> None:
        self.digest = digest
        record = {
            "key": dataclasses.asdict(self.key),
            "size": self.offer.size,
            "sources": [dataclasses.asdict(s) for s in self._sources],
            "digest": digest,
        }
        try:
            directory = private_cache_dir(self._memo_dir)
            write_small_file(directory / f"{self.key.file_name}.sent.json", json.dumps(record).encode())
        except (CacheError, OSError) as error:
            # Only a shortcut for the next start (it would hash the file again).
            log.warning("cannot remember the digest of %s: %s", self.key.file_name, error)

    def full_digest(self) -> str:
        """The digest of the whole stage file: memoized, or computed now by
        reading it locally (nothing sent)."""
        if not self.digest:
            self.stream.open()
            digest = new_digest()
            for chunk in self.stream.chunks(self.chunk_size):
                digest.update(chunk)
            self._remember(digest.hexdigest())
        return self.digest

    # -------------------------------------------------------------- sending

    def first_chunk(self, status: ReceiveStatus) -> int | None:
        """Where to start for a host that answered ``status``: None when it
        already has exactly this file (nothing to send); TransferError when
        another transfer is writing it there (offer again later)."""
        if status.state == "busy":
            raise TransferError(
                f"{status.name}: another transfer to that host is writing it; offer it again later"
            )
        if status.state == "complete":
            return None if status.digest == self.full_digest() else 0
        if status.state == "partial":
            return status.verified_chunks
        return 0

    def chunks(self, first: int = 0) -> Iterator[StageChunk]:
        """Chunks from ``first`` to the end, each with its digest; the whole
        file's digest is in :attr:`digest` (and memoized) after the last."""
        self.stream.open()
        offset = first * self.chunk_size
        whole = new_digest()
        position = 0
        while position < offset:  # a resumed send: hash what the host already has
            data = self.stream.read(position, min(self.chunk_size, offset - position))
            whole.update(data)
            position += len(data)
        index = first
        for data in self.stream.chunks(self.chunk_size, offset):
            leaves = leaf_digests(data)  # each byte hashed once: for the chunk and the file
            whole.add_leaves(leaves)
            yield StageChunk(index, data, chunk_digest(leaves))
            index += 1
        self._remember(whole.hexdigest())


__all__ = ["StageChunk", "StageOffer", "StageSender"]
