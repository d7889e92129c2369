"""The messages of model delivery (``model: {send: true}``) and of the host's
stage cache (``ggufpipe-tui cache``): control messages like every other
(:class:`ggufpipe_agent.wire.codec.Message`, registered by class name, encoded
and decoded only by :mod:`ggufpipe_agent.wire.protocol`, which imports and
re-exports them). They live here to keep ``protocol.py`` a readable size.

A stage file travels on a data connection of its own, after DataAttach, so
gigabytes of chunks never hold up the control stream: o -> a ReceiveStage,
a -> o ReceiveAnswer, o -> a StageData... StageDataEnd, a -> o StageStored or
ReceiveFailed. CacheRequest and CacheReport go on the control stream. See
docs/protocol.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from ggufpipe_agent.wire.codec import Message
from ggufpipe_agent.wire.records import StageKey


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """One entry of a host's stage cache, for listing (``ggufpipe-tui cache``)."""

    name: str  # file name in the cache directory
    state: str  # "complete", "partial" (a transfer to resume) or "unverified"
    model: str  # the model's identity digest ('' when unknown)
    model_name: str
    start: int
    end: int
    block_count: int
    size: int  # bytes on disk
    expected_size: int  # of the complete file (0 when unknown)
    last_used: float  # seconds since the epoch


@dataclass(frozen=True, slots=True)
class ReceiveStatus:
    """What this host holds of an offered stage file."""

    state: str  # "complete", "partial", "empty" or "busy" (another receiver writes it)
    name: str  # the entry's file name in the cache
    digest: str = ""  # of the complete entry
    verified_bytes: int = 0  # of a partial file: verified (and re-checked on a resume); resume from here
    verified_chunks: int = 0  # verified_bytes // chunk_size


@dataclass(frozen=True, slots=True)
class StageOffer:
    """What the sender announces; the receiver builds its StageFileReceiver from it."""

    key: StageKey
    size: int
    chunk_size: int


@dataclass(frozen=True, slots=True)
class ReceiveStage(Message):
    """Offer a stage file. ``replace``: the host's complete entry of this key
    is not what the sender has (another digest); remove it and start over."""

    offer: StageOffer
    replace: bool = False


@dataclass(frozen=True, slots=True)
class ReceiveAnswer(Message):
    """What the host holds of the offered file, where, and the free space there."""

    status: ReceiveStatus
    cache_dir: str
    free_bytes: int


@dataclass(frozen=True, slots=True)
class StageData(Message):
    """Chunk ``index`` of the offered file (``offer.chunk_size`` bytes, the
    last one shorter) and its digest (ggufpipe_agent.stagefiles.digest). The frame is
    followed on the stream by the chunk's ``size`` raw bytes: megabytes are
    never copied through msgpack, and control frames stay small."""

    index: int
    digest: str
    size: int


@dataclass(frozen=True, slots=True)
class StageDataEnd(Message):
    """Every chunk is sent; ``digest`` is the whole file's."""

    digest: str


@dataclass(frozen=True, slots=True)
class StageStored(Message):
    """The file is verified and in the cache under ``name``."""

    name: str
    size: int
    digest: str


@dataclass(frozen=True, slots=True)
class ReceiveFailed(Message):
    """The host cannot take the file. ``kind``: "disk_full" (``path``,
    ``needed`` and ``available`` say where and how much), "transfer" (a
    chunk or the file did not verify) or "cache" (the cache cannot be used)."""

    reason: str
    kind: str
    path: str = ""
    needed: int = 0
    available: int = 0


@dataclass(frozen=True, slots=True)
class CacheRequest(Message):
    """Manage the host's stage cache (``ggufpipe-tui cache``). ``action``:
    "list", "remove" (``names``, or every entry when ``every``) or "verify"
    (re-hash every complete entry; the damaged ones are removed)."""

    request_id: int
    action: str
    names: tuple[str, ...] = ()
    every: bool = False


@dataclass(frozen=True, slots=True)
class CacheReport(Message):
    """The answer to CacheRequest: the cache as it is after the action."""

    request_id: int
    cache_dir: str
    free_bytes: int
    entries: tuple[CacheEntry, ...]
    removed: tuple[str, ...] = ()
    damaged: tuple[str, ...] = ()  # removed by "verify": their contents did not match
