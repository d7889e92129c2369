"""The stage-file cache on a host: private, verified, manageable.

Layout, in one directory (``$GGUFPIPE_CACHE_DIR``, default
``~/.cache/ggufpipe/stages``)::

    NAME.gguf             a complete stage file (mode 0600)
    NAME.gguf.json        its sidecar: digest, size, mtime_ns, ctime_ns, inode,
                          sampled blocks' digests, format, the model's
                          identity and range, the source files
    NAME.gguf.partial     a transfer in progress (ggufpipe_agent.receiver)
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

The digest is :mod:`ggufpipe_agent.digest`'s: SHA-256 over the SHA-256 of each
1 MiB leaf, so writing, sending and receiving each hash every byte once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from ggufpipe_agent.digest import ALGORITHM, FileDigest, digest_descriptor
from ggufpipe_agent.errors import CacheError, DiskFull
from ggufpipe_agent.modelfiles import SourceFile

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
_LABEL = re.compile(r"[^A-Za-z0-9_-]+")
_HEX = re.compile(r"^[0-9a-f]{64}$")
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def new_digest() -> FileDigest:
    return FileDigest()


def default_cache_dir() -> Path:
    explicit = os.environ.get("GGUFPIPE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ggufpipe" / "stages"


def label_for(name: str) -> str:
    """A model name as a safe file-name part (what a sender's label becomes)."""
    label = _LABEL.sub("-", name).strip("-")[:40]
    return label or "model"


@dataclass(frozen=True, slots=True)
class StageKey:
    """Which stage file: chosen by whoever knows the model (a local writer, or
    the sender of a transfer) from the model's identity; the receiving host
    derives the file name from it and never takes a path from the wire."""

    model: str  # ModelIdentity.digest: 64 hex digits
    label: str  # the model's name, for people reading the cache
    start: int
    end: int
    block_count: int
    stage_format: int

    def check(self) -> None:
        """Refuse a key that could not have come from a model (wire input)."""
        if not _HEX.match(self.model):
            raise CacheError(f"stage key: model digest {self.model!r} is not 64 hex digits")
        if not 0 <= self.start < self.end <= self.block_count < 1 << 20:
            raise CacheError(
                f"stage key: layers [{self.start}, {self.end}) of {self.block_count} blocks is no range"
            )
        if not 0 < self.stage_format < 1 << 16:
            raise CacheError(f"stage key: stage format {self.stage_format} is not valid")

    @property
    def digest(self) -> str:
        text = f"{self.model}|{self.start}|{self.end}|{self.block_count}|{self.stage_format}"
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    @property
    def file_name(self) -> str:
        label = label_for(self.label)
        return f"{label}.blk{self.start}-{self.end}of{self.block_count}.{self.digest}.gguf"


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


# ------------------------------------------------------------ the directory


def private_cache_dir(path: str | os.PathLike[str]) -> Path:
    """The cache directory, created 0700 if missing; refused (CacheError naming
    it and why) when another user owns it or group or others may write in it."""
    return private_directory(path, "stage cache", "cache_dir")


def private_directory(path: str | os.PathLike[str], what: str, setting: str) -> Path:
    """A directory of this user's that only it may write in (``what`` names
    it in errors, ``setting`` is where the user chooses another), created
    0700 if missing; made 0700 if others could read it."""
    directory = Path(path)
    try:
        missing = []
        probe = directory
        while not probe.is_dir() and probe != probe.parent:
            missing.append(probe)
            probe = probe.parent
        for level in reversed(missing):  # what we create is private, ancestors included
            with contextlib.suppress(FileExistsError):
                os.mkdir(level, 0o700)
                os.chmod(level, 0o700)  # mkdir's mode passes through the umask
        info = os.stat(directory)
    except OSError as error:
        raise CacheError(f"cannot create {what} {directory}: {error.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise CacheError(f"{what} {directory} is not a directory")
    if info.st_uid != os.geteuid():
        raise CacheError(
            f"{what} {directory} belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()}); "
            "refusing to trust files another user could have put there "
            f"(set {setting} to a directory of yours)"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022:
        who = {0o020: "its group", 0o002: "others"}.get(mode & 0o022, "its group and others")
        raise CacheError(
            f"{what} {directory} is writable by {who} (mode {mode:04o}); refusing to trust files "
            f"others could have put there (chmod 700 {directory}, or set {setting} to a private directory)"
        )
    if mode & 0o077:
        log.info("%s %s was mode %04o; made private (0700)", what, directory, mode)
        os.chmod(directory, 0o700)
    return directory


def create_private(path: Path) -> int:
    """A new file at ``path``, opened for writing, mode 0600; never follows or
    reuses anything already there (a planted symlink is an error)."""
    fd = os.open(path, _CREATE, 0o600)
    os.fchmod(fd, 0o600)  # the umask may have taken bits away; none are added
    return fd


def temporary_path(directory: Path, target_name: str, suffix: str = "") -> Path:
    """A fresh unpredictable temporary name for ``target_name``; the pid in it
    lets a later writer remove it once this process is gone."""
    return directory / f".{target_name}.{os.getpid()}.{secrets.token_hex(8)}{suffix}.tmp"


def remove_orphans(directory: Path, target_name: str) -> None:
    """Temporary files of this entry left by writers that died (a killed
    agent, a StopRun during the first load): never trusted, so only space."""
    prefix = f".{target_name}."
    for leftover in directory.glob(f".{glob_escape(target_name)}.*.tmp"):
        pid = leftover.name[len(prefix) :].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            leftover.unlink(missing_ok=True)


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fsync_directory(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ------------------------------------------------------------ writing


def write_all(fd: int, data: bytes | memoryview, path: Path, total: int) -> None:
    """``os.write`` until all is written; a full disk is one DiskFull naming
    the path and the space the whole file needs."""
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except OSError as error:
            if error.errno in _NO_SPACE:
                raise disk_full(path, total) from None
            raise CacheError(f"cannot write {path}: {error.strerror}") from None
        view = view[written:]


def disk_full(path: Path, needed: int) -> DiskFull:
    available = free_bytes(path.parent)
    return DiskFull(
        f"no space left for {path}: the stage file needs {needed} bytes ({human_bytes(needed)}), "
        f"{available} bytes ({human_bytes(available)}) are free there",
        str(path),
        needed,
        available,
    )


def human_bytes(count: int) -> str:
    if count >= 1 << 30:
        return f"{count / 2**30:.2f} GiB"
    return f"{count / 2**20:.1f} MiB"


def free_bytes(directory: Path) -> int:
    try:
        info = os.statvfs(directory)
    except OSError:
        return 0
    return info.f_bavail * info.f_frsize


def reserve(fd: int, path: Path, offset: int, length: int, total: int) -> None:
    """Reserve the file's space now, so a full disk is known before the bytes
    are read or sent, not after; filesystems without fallocate go on."""
    if length <= 0:
        return
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as error:
        if error.errno in _NO_SPACE:
            raise disk_full(path, total) from None
        if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise CacheError(f"cannot reserve space for {path}: {error.strerror}") from None


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
    recorded = dataclasses.replace(
        sidecar,
        mtime_ns=info.st_mtime_ns,
        ctime_ns=info.st_ctime_ns,
        inode=info.st_ino,
        samples=samples,
        version=SIDECAR_VERSION,
    )
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
    renewed = dataclasses.replace(
        sidecar,
        mtime_ns=now.st_mtime_ns,
        ctime_ns=now.st_ctime_ns,
        inode=now.st_ino,
        samples=samples,
        unsynced_boot="",
        version=SIDECAR_VERSION,
    )
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
