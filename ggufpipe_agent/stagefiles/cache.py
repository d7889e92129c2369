"""The stage-file cache on a host: private, verified, manageable.

Layout, in one directory (``$GGUFPIPE_CACHE_DIR``, default
``~/.cache/ggufpipe/stages``)::

    NAME.gguf             a complete stage file (mode 0600)
    NAME.gguf.json        its sidecar: digest, size, mtime_ns, ctime_ns, inode,
                          sampled blocks' digests, format, the model's
                          identity and range, the source files
    NAME.gguf.partial     a transfer in progress (ggufpipe_agent.delivery.receiver)
    NAME.gguf.partial.json  how much of it is verified
    .NAME.gguf.PID.RANDOM[.json].tmp   a writer's temporary

``NAME`` is :attr:`StageKey.file_name`: the model's label, the range and a
digest of the model identity, range and stage format, so the same stage of
the same model has the same name whoever wrote it (a local writer, a
transfer), and never a name derived from a local path.

Trust: the directory is created 0700 and refused when another user owns it
or group or others may write to it (a group- or world-readable one of ours
is tightened to 0700). Every file is created with ``O_CREAT | O_EXCL |
O_NOFOLLOW`` under a random name and renamed into place, so nothing planted
at a predictable name (a symlink included) is followed or trusted; files are
0600 whatever the umask or the source's mode. An entry is used only when its
sidecar vouches for it (:func:`check_entry`, before every use): a stat (size,
mtime_ns, ctime_ns, inode) against what the sidecar recorded when the file was
written or last verified, and the digests of a few sampled blocks (first,
last, pseudo-random ones keyed by the entry: 1 MiB in all). Any stat
difference (a write leaves a new ctime even when the mtime is set back), a
sampled block that differs, or a sidecar of version 1 (no ctime, no samples)
re-hashes the whole file: a match renews the sidecar, a mismatch removes the
entry (so it is written or sent again) and is refused with the file, the
cache and what to do (:class:`EntryDamaged`). An entry without a readable
sidecar is not trusted (callers remove it).

The digest is :mod:`ggufpipe_agent.stagefiles.digest`'s: SHA-256 over the SHA-256 of each
1 MiB leaf, so writing, sending and receiving each hash every byte once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from ggufpipe_agent.errors import CacheError
from ggufpipe_agent.gguf.files import SourceFile
from ggufpipe_agent.stagefiles.digest import ALGORITHM, FileDigest, digest_descriptor
from ggufpipe_agent.stagefiles.private_files import (
    create_private,
    disk_full,
    free_bytes,
    fsync_directory,
    reserve,
    temporary_path,
    write_all,
)
from ggufpipe_agent.wire.records import StageKey, label_for  # noqa: F401 - this module's API too

log = logging.getLogger("ggufpipe.cache")

DIGEST_ALGORITHM = ALGORITHM
#: 2 adds ``ctime_ns`` and ``samples``; a version-1 sidecar is still read, and
#: its entry re-hashed once at its next use (then recorded as version 2).
SIDECAR_VERSION = 2
_READABLE_VERSIONS = (1, 2)
#: The cheap check before every use: this many blocks of this size (the first,
#: the last and pseudo-random ones keyed by the entry), 1 MiB in all.
SAMPLE_BLOCK = 64 << 10
SAMPLE_COUNT = 16
SIDECAR_SUFFIX = ".json"
PARTIAL_SUFFIX = ".partial"


def new_digest() -> FileDigest:
    return FileDigest()


def default_cache_dir() -> Path:
    explicit = os.environ.get("GGUFPIPE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ggufpipe" / "stages"


@dataclass(frozen=True, slots=True)
class Sidecar:
    """What vouches for a cache entry. ``sources`` are the local files it was
    written from; empty for an entry received over the network."""

    digest: str
    size: int
    mtime_ns: int
    inode: int
    key: StageKey
    sources: tuple[SourceFile, ...] = ()
    algorithm: str = DIGEST_ALGORITHM
    version: int = SIDECAR_VERSION
    #: The boot the entry was written in without an fsync of its bytes ("":
    #: they were synced). In that boot the page cache is what the file holds;
    #: after a reboot (a crash may have lost unwritten pages) the first use
    #: re-hashes the file (:func:`verify_entry`).
    unsynced_boot: str = ""
    #: The file's ctime when it was written or last verified: nobody can set
    #: it back, so any write since (an mtime restored with ``touch -d``
    #: included) shows. 0: not recorded (a version-1 sidecar).
    ctime_ns: int = 0
    #: ``(offset, length, sha256 hex)`` of the sampled blocks
    #: (:func:`sample_spans`), checked before every use.
    samples: tuple[tuple[int, int, str], ...] = ()


#: Linux's id of the running boot; another value after every reboot.
BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str:
    """This boot's id, "" where the system has none (then entries are synced)."""
    try:
        return BOOT_ID_PATH.read_text().strip()
    except OSError:
        return ""


# ------------------------------------------------------------ writing


def write_stage_entry(
    directory: Path,
    key: StageKey,
    chunks: Iterable[bytes],
    size: int,
    sources: tuple[SourceFile, ...],
    progress: Callable[[float], None] | None = None,
) -> Path:
    """Write a complete entry from ``chunks`` (``size`` bytes in all): hashed
    while written, fsynced, renamed into place, then its sidecar."""
    target = directory / key.file_name
    temporary = temporary_path(directory, key.file_name)
    available = free_bytes(directory)
    if available and available < size:
        raise disk_full(target, size)
    fd = create_private(temporary)
    try:
        reserve(fd, temporary, 0, size, size)
        digest = new_digest()
        written = 0
        for chunk in chunks:
            write_all(fd, chunk, target, size)
            digest.update(chunk)
            written += len(chunk)
            if progress:
                progress(written / (size or 1))
        if written != size:
            raise CacheError(f"{target}: the stage file stream gave {written} bytes, not {size}")
        os.ftruncate(fd, size)
        os.fsync(fd)
        inode = os.fstat(fd).st_ino
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    record_entry(target, Sidecar(digest.hexdigest(), size, 0, inode, key, sources))
    return target


def _stamped(
    sidecar: Sidecar, info: os.stat_result, samples: tuple[tuple[int, int, str], ...], **more: Any
) -> Sidecar:
    """``sidecar`` recording the file as ``info`` finds it, with its samples."""
    return dataclasses.replace(
        sidecar,
        mtime_ns=info.st_mtime_ns,
        ctime_ns=info.st_ctime_ns,
        inode=info.st_ino,
        samples=samples,
        version=SIDECAR_VERSION,
        **more,
    )


def record_entry(target: Path, sidecar: Sidecar) -> Sidecar:
    """Write the sidecar of a new entry: ``sidecar``'s digest, size, key,
    sources and boot, with the file's stat taken now, after the rename that
    made it the entry (a rename changes the ctime), and the digests of its
    sampled blocks. ``sidecar.inode`` is the file that was written: another
    one at ``target`` now is refused."""
    fd = _open_entry(target)
    try:
        info = os.fstat(fd)
        if info.st_ino != sidecar.inode or info.st_size != sidecar.size:
            raise CacheError(f"{target} was replaced while it was being written; write or send it again")
        samples = sample_digests(fd, sample_spans(sidecar.key, sidecar.size))
    finally:
        os.close(fd)
    recorded = _stamped(sidecar, info, samples)
    write_sidecar(target, recorded)
    return recorded


def _open_entry(target: Path) -> int:
    return os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)


def sample_spans(key: StageKey, size: int) -> tuple[tuple[int, int], ...]:
    """The blocks the cheap check reads: ``(offset, length)`` of the first and
    the last :data:`SAMPLE_BLOCK` bytes and of up to ``SAMPLE_COUNT - 2``
    others at offsets drawn (4 KiB-aligned) from a hash of the entry's key
    and size, so each entry has its own, the same at every check. A file of
    at most ``SAMPLE_COUNT * SAMPLE_BLOCK`` bytes is one block: all of it."""
    if size <= 0:
        return ()
    if size <= SAMPLE_COUNT * SAMPLE_BLOCK:
        return ((0, size),)
    last = size - SAMPLE_BLOCK
    offsets = {0, last}
    seed = f"{key.digest}|{size}".encode()
    for index in range(SAMPLE_COUNT - 2):
        draw = int.from_bytes(hashlib.sha256(seed + b"|%d" % index).digest()[:8], "big")
        offsets.add(draw % (last + 1) // 4096 * 4096)
    return tuple((offset, SAMPLE_BLOCK) for offset in sorted(offsets))


def sample_digests(fd: int, spans: Iterable[tuple[int, int]]) -> tuple[tuple[int, int, str], ...]:
    """``(offset, length, sha256 hex)`` of each block of an open file."""
    return tuple(
        (offset, length, hashlib.sha256(os.pread(fd, length, offset)).hexdigest()) for offset, length in spans
    )


# ------------------------------------------------------------ sidecars


def sidecar_path(target: Path) -> Path:
    return target.with_name(target.name + SIDECAR_SUFFIX)


def write_sidecar(target: Path, sidecar: Sidecar) -> None:
    """Atomically: a fresh temporary, fsynced, renamed over the old sidecar."""
    data = json.dumps(dataclasses.asdict(sidecar), sort_keys=True).encode()
    write_small_file(sidecar_path(target), data)
    fsync_directory(target.parent)


def write_small_file(path: Path, data: bytes) -> None:
    temporary = temporary_path(path.parent, path.name.removesuffix(SIDECAR_SUFFIX), SIDECAR_SUFFIX)
    fd = create_private(temporary)
    try:
        write_all(fd, data, path, len(data))
        os.fsync(fd)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


def read_private_json(path: Path) -> dict[str, Any] | None:
    """A small JSON file of ours, not through a symlink; None when missing,
    foreign or unreadable (then it vouches for nothing)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_size > 1 << 20:
            return None
        raw = os.read(fd, info.st_size + 1)
    finally:
        os.close(fd)
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def read_sidecar(target: Path) -> Sidecar | None:
    raw = read_private_json(sidecar_path(target))
    if raw is None:
        return None
    try:
        key = StageKey(**raw.pop("key"))
        sources = tuple(SourceFile(**source) for source in raw.pop("sources"))
        samples = tuple(_sample(sample) for sample in raw.pop("samples", ()))
        sidecar = Sidecar(key=key, sources=sources, samples=samples, **raw)
    except (TypeError, KeyError, AttributeError, ValueError):
        return None
    if sidecar.version not in _READABLE_VERSIONS or sidecar.algorithm != DIGEST_ALGORITHM:
        return None
    return sidecar


def _sample(value: Any) -> tuple[int, int, str]:
    offset, length, digest = value
    if not (isinstance(offset, int) and isinstance(length, int) and isinstance(digest, str)):
        raise ValueError("not a sample")
    return offset, length, digest


# ------------------------------------------------------------ checking


class EntryDamaged(CacheError):
    """A cache entry whose bytes are not the ones its sidecar vouches for.
    It is removed before this is raised, so it is written or sent again."""


def verify_entry(target: Path, full: bool = False) -> Sidecar | None:
    """The sidecar of a trustworthy entry at ``target``, or None: missing,
    not a regular file of ours, no valid sidecar, or damaged (then removed,
    logged). :func:`check_entry` without the refusal."""
    try:
        return check_entry(target, full)
    except EntryDamaged:
        return None


def check_entry(target: Path, full: bool = False) -> Sidecar | None:
    """The sidecar of the entry at ``target``, checked before it is used.

    None when there is nothing to vouch for (no file, not a regular file of
    ours, no valid sidecar). Cheap when the file's size, mtime_ns, ctime_ns
    and inode are the ones recorded: the sampled blocks' digests
    (:func:`sample_spans`, about 1 MiB read). The whole file is re-hashed
    when any of them changed, a sampled block differs, the sidecar is of
    version 1 (nothing of that recorded), the bytes were not synced before a
    reboot since, or ``full``. A match renews the sidecar (stat, samples,
    synced); a mismatch removes the entry and raises :class:`EntryDamaged`
    naming the file, the cache and what to do."""
    sidecar = read_sidecar(target)
    if sidecar is None:
        return None
    try:
        fd = _open_entry(target)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            return None
        recorded = (sidecar.size, sidecar.mtime_ns, sidecar.ctime_ns, sidecar.inode)
        found = (info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino)
        if stat.S_IMODE(info.st_mode) != 0o600:
            os.fchmod(fd, 0o600)  # a new ctime, but the stat above already differs
        rebooted = bool(sidecar.unsynced_boot) and sidecar.unsynced_boot != boot_id()
        legacy = sidecar.version < SIDECAR_VERSION or not sidecar.ctime_ns or not sidecar.samples
        why = ""
        if full:
            why = "a full check"
        elif rebooted:
            why = "written before a reboot and never synced"
        elif legacy:
            why = "an entry of an older cache version, checked once"
        elif found != recorded:
            why = f"its {_changed(recorded, found)} changed since it was written or last verified"
        else:
            differs = _first_differing_sample(fd, sidecar.samples)
            if differs is None:
                return sidecar
            why = f"its sampled block at byte {differs} is not the one recorded"
        log.info("stage file %s: re-hashing it (%s)", target, why)
        now = os.fstat(fd)  # what is recorded if it matches; a write during the hash shows next time
        if info.st_size != sidecar.size:
            _damaged(target, info.st_ino, f"{why}: {info.st_size} bytes, not the {sidecar.size} recorded")
        if digest_descriptor(fd, info.st_size) != sidecar.digest:
            _damaged(target, info.st_ino, f"{why}, and its digest is not the one recorded")
        spans = [(offset, length) for offset, length, _ in sidecar.samples]
        samples = sample_digests(fd, spans or sample_spans(sidecar.key, sidecar.size))
        if sidecar.unsynced_boot:
            os.fsync(fd)
    finally:
        os.close(fd)
    renewed = _stamped(sidecar, now, samples, unsynced_boot="")
    if renewed != sidecar:
        write_sidecar(target, renewed)
    return renewed


def _changed(recorded: tuple[int, ...], found: tuple[int, ...]) -> str:
    names = ("size", "mtime", "ctime", "inode")
    return ", ".join(name for name, a, b in zip(names, recorded, found, strict=True) if a != b)


def _first_differing_sample(fd: int, samples: tuple[tuple[int, int, str], ...]) -> int | None:
    for offset, length, expected in samples:
        if hashlib.sha256(os.pread(fd, length, offset)).hexdigest() != expected:
            return offset
    return None


def _damaged(target: Path, inode: int, why: str) -> NoReturn:
    """Remove a damaged entry (the file checked, not one another writer has
    put at its name since) and refuse it, saying what to do."""
    log.warning("stage file %s does not match its recorded digest (%s)", target, why)
    with contextlib.suppress(OSError):
        if os.lstat(target).st_ino == inode:
            remove_entry(target, "damaged: its contents do not match its recorded digest")
    raise EntryDamaged(
        f"{target}: the stage file in the stage cache {target.parent} is damaged ({why}); "
        "the entry was removed so that the next start writes or sends it again "
        "(`ggufpipe-tui cache INVENTORY verify` re-hashes every entry of the hosts' caches)"
    )


def remove_entry(target: Path, why: str) -> None:
    """Remove an entry and its sidecar (names only: a symlink is removed, not
    followed); logged, since it means the entry will be written again."""
    existed = False
    for path in (target, sidecar_path(target)):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            existed = True
    if existed:
        log.warning("removed stage cache entry %s (%s); it will be written again", target, why)


def touch(target: Path) -> None:
    """Mark an entry used now (its sidecar's mtime is its last use)."""
    with contextlib.suppress(OSError):
        os.utime(sidecar_path(target), follow_symlinks=False)
