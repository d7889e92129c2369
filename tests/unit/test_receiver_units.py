"""Stage-file delivery as a library: a sender's chunks become a verified cache
entry on the receiving host, resumably, and a full disk is one clear error.
The two sides talk through plain calls here; the wire part is the
orchestrator's.

The receiver checks sizes, chunk digests and the whole file's digest, never
what the GGUF holds: the stage file here is cut from a llama-shaped GGUF of
random data (tests/support/bulky_gguf.py), as big as the tests need, not from
the real model. Its bounded memory and the digest's arithmetic are
tests/model/test_receiver.py's."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from ggufpipe_agent.delivery import receiver as receiver_module
from ggufpipe_agent.delivery.receiver import StageFileReceiver
from ggufpipe_agent.delivery.sender import StageSender
from ggufpipe_agent.errors import CacheError, DiskFull, TransferError
from ggufpipe_agent.stagefiles import cache as stagecache
from ggufpipe_agent.stagefiles.admin import list_entries
from ggufpipe_agent.stagefiles.build import ensure_stage_file
from ggufpipe_agent.stagefiles.cache import boot_id, read_sidecar, verify_entry
from ggufpipe_agent.stagefiles.digest import digest_file
from ggufpipe_agent.wire.delivery_messages import ReceiveStatus
from tests.support.bulky_gguf import big_model
from tests.support.common import REPO

CHUNK = 1 << 20
#: The middle of a 5-block model of 1 MiB tensors: a stage file of 19 MiB, 20
#: chunks: more than the 16 MiB disk below holds, 4 MiB chunks enough.
RANGE = (1, 4)


@pytest.fixture(scope="module")
def stage_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return big_model(tmp_path_factory.mktemp("source") / "bulky.gguf", blocks=5, mib_per_tensor=1)


@pytest.fixture
def sender(stage_source: Path, tmp_path: Path):
    with StageSender(stage_source, *RANGE, chunk_size=CHUNK, memo_dir=tmp_path / "sent") as opened:
        yield opened


def receiver_for(sender: StageSender, cache: Path, **options: int) -> StageFileReceiver:
    offer = sender.offer
    return StageFileReceiver(cache, offer.key, offer.size, offer.chunk_size, **options)


def send(sender: StageSender, receiver: StageFileReceiver, first: int, stop: int | None = None) -> int:
    """Chunks from ``first`` (up to chunk ``stop``, excluded); how many were sent."""
    sent = 0
    for chunk in sender.chunks(first):
        if stop is not None and chunk.index >= stop:
            break
        receiver.accept(chunk.index, chunk.data, chunk.digest)
        sent += 1
    return sent


def resumed(sender: StageSender, cache: Path) -> tuple[ReceiveStatus, Path]:
    """A new receiver on ``cache``: what it found there, and the file it made
    once sent the chunks from the first it lacked."""
    with receiver_for(sender, cache) as receiver:
        status = receiver.open()
        send(sender, receiver, sender.first_chunk(status))
        entry = receiver.finish(sender.digest)
    return status, entry


def test_a_stage_file_arrives_verified_and_a_second_offer_sends_nothing(sender, stage_source, tmp_path):
    cache = tmp_path / "cache"
    with receiver_for(sender, cache) as receiver:
        status = receiver.open()
        assert (status.state, status.verified_bytes) == ("empty", 0)
        assert send(sender, receiver, sender.first_chunk(status)) == -(-sender.offer.size // CHUNK)
        entry = receiver.finish(sender.digest)
    local = ensure_stage_file(stage_source, *RANGE, tmp_path / "local")
    assert entry.name == local.name and entry.read_bytes() == local.read_bytes()
    assert read_sidecar(entry).digest == sender.digest == digest_file(entry)
    assert read_sidecar(entry).sources == (), "a received entry was written from no local file"
    assert oct(entry.stat().st_mode & 0o777) == "0o600"
    assert sorted(p.name for p in cache.iterdir()) == [entry.name, entry.name + ".json"]
    with receiver_for(sender, cache) as again:
        status = again.open()
        assert (status.state, status.digest) == ("complete", sender.digest)
        assert sender.first_chunk(status) is None


def test_a_bad_chunk_is_rejected_and_nothing_written(sender, tmp_path):
    with receiver_for(sender, tmp_path / "cache") as receiver:
        receiver.open()
        chunks = sender.chunks(0)
        good = next(chunks)
        damaged = bytes([good.data[0] ^ 1]) + good.data[1:]
        with pytest.raises(TransferError, match="chunk 0 does not match its digest; rejected"):
            receiver.accept(0, damaged, good.digest)
        assert receiver.received == 0
        with pytest.raises(TransferError, match="chunk 1 arrived, chunk 0 was expected"):
            receiver.accept(1, good.data, good.digest)
        with pytest.raises(TransferError, match="has 10 bytes, not"):
            receiver.accept(0, good.data[:10], good.digest)
        receiver.accept(0, good.data, good.digest)
        assert receiver.received == CHUNK


def test_a_killed_connection_resumes_instead_of_restarting(sender, tmp_path):
    cache = tmp_path / "cache"
    total = -(-sender.offer.size // CHUNK)
    with receiver_for(sender, cache) as receiver:
        receiver.open()
        send(sender, receiver, 0, stop=total // 2)
    # The connection is gone; the partial file and its record stay.
    with receiver_for(sender, cache) as receiver:
        status = receiver.open()
        assert (status.state, status.verified_chunks) == ("partial", total // 2)
        assert status.verified_bytes == total // 2 * CHUNK
        assert sender.first_chunk(status) == total // 2
        assert send(sender, receiver, total // 2) == total - total // 2, "only the rest is sent"
        entry = receiver.finish(sender.digest)
    assert digest_file(entry) == sender.digest


def test_a_killed_agent_resumes_from_its_last_checkpoint(sender, stage_source, tmp_path):
    """A receiving process killed (SIGKILL) after 10 chunks, its record
    written every 4: the next one resumes at chunk 8."""
    cache = tmp_path / "cache"
    script = textwrap.dedent(
        f"""
        import os, signal
        from ggufpipe_agent.delivery.receiver import StageFileReceiver
        from ggufpipe_agent.delivery.sender import StageSender
        sender = StageSender({str(stage_source)!r}, {RANGE[0]}, {RANGE[1]}, chunk_size={CHUNK},
                             memo_dir={str(tmp_path / "other-sent")!r})
        offer = sender.offer
        receiver = StageFileReceiver({str(cache)!r}, offer.key, offer.size, offer.chunk_size,
                                     checkpoint_bytes={4 * CHUNK})
        receiver.open()
        for chunk in sender.chunks(0):
            receiver.accept(chunk.index, chunk.data, chunk.digest)
            if chunk.index == 9:
                os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    status, entry = resumed(sender, cache)
    assert (status.state, status.verified_chunks) == ("partial", 8)
    assert digest_file(entry) == sender.digest


def test_a_damaged_partial_file_starts_over(sender, tmp_path):
    cache = tmp_path / "cache"
    with receiver_for(sender, cache) as receiver:
        receiver.open()
        send(sender, receiver, 0, stop=6)
        partial = receiver.partial
    with partial.open("r+b") as handle:
        handle.seek(3 * CHUNK)
        handle.write(b"\xff")
    status, entry = resumed(sender, cache)
    assert (status.state, status.verified_bytes) == ("empty", 0)
    assert digest_file(entry) == sender.digest


def test_a_wrong_whole_file_digest_removes_the_partial_file(sender, tmp_path):
    with receiver_for(sender, tmp_path / "cache") as receiver:
        receiver.open()
        send(sender, receiver, 0)
        with pytest.raises(TransferError, match="is not the announced .*the partial file is removed"):
            receiver.finish("0" * 64)
        assert not receiver.partial.exists() and not receiver.target.exists()


def test_a_second_receiver_of_the_same_stage_waits_for_the_first(sender, tmp_path):
    cache = tmp_path / "cache"
    with receiver_for(sender, cache) as first, receiver_for(sender, cache) as second:
        first.open()
        busy = second.open()
        assert busy.state == "busy"
        with pytest.raises(TransferError, match="another transfer to that host is writing it"):
            sender.first_chunk(busy)
        send(sender, first, 0)
        first.finish(sender.digest)
        status = second.open()
        assert (status.state, status.digest) == ("complete", sender.digest)


def test_a_partial_file_beside_a_complete_entry_is_removed(sender, stage_source, tmp_path):
    cache = tmp_path / "cache"
    with receiver_for(sender, cache) as receiver:
        receiver.open()
        send(sender, receiver, 0, stop=3)
    ensure_stage_file(stage_source, *RANGE, cache)  # the same entry, written from a local copy
    with receiver_for(sender, cache) as receiver:
        status = receiver.open()
        assert status.state == "complete" and sender.first_chunk(status) is None
        assert not receiver.partial.exists() and not receiver.record.exists()


def received_entry(sender: StageSender, cache: Path) -> Path:
    with receiver_for(sender, cache) as receiver:
        receiver.open()
        send(sender, receiver, 0)
        return receiver.finish(sender.digest)


def sent_again(sender: StageSender, cache: Path, entry: Path) -> None:
    """The host has nothing it can use: the whole file comes again."""
    with receiver_for(sender, cache) as receiver:
        status = receiver.open()
        assert status.state == "empty" and sender.first_chunk(status) == 0
        send(sender, receiver, 0)
        receiver.finish(sender.digest)
    assert digest_file(entry) == sender.digest


def test_a_corrupted_entry_is_sent_again(sender, tmp_path):
    cache = tmp_path / "cache"
    entry = received_entry(sender, cache)
    with entry.open("r+b") as handle:
        handle.seek(entry.stat().st_size - 1000)
        handle.write(b"\x55\xaa")
    sent_again(sender, cache, entry)


def reboot(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What the receiver sees after a reboot: another boot id."""
    path = tmp_path / "boot_id"
    path.write_text(str(uuid.uuid4()) + "\n")
    monkeypatch.setattr(stagecache, "BOOT_ID_PATH", path)


@pytest.mark.skipif(not boot_id(), reason="no boot id on this system: entries are fsynced")
def test_a_received_entry_is_trusted_in_its_boot_and_checked_after_a_reboot(sender, tmp_path, monkeypatch):
    """The entry's bytes are not fsynced; its sidecar names the boot. In
    that boot a stat vouches for it; after a reboot its first use re-hashes
    it, and then it is synced and trusted by a stat again."""
    entry = received_entry(sender, tmp_path / "cache")
    assert read_sidecar(entry).unsynced_boot == boot_id()
    hashed = []
    real = stagecache.digest_descriptor
    monkeypatch.setattr(stagecache, "digest_descriptor", lambda *a: hashed.append(a) or real(*a))
    assert verify_entry(entry) is not None and not hashed, "in its boot, a stat vouches for the entry"
    reboot(monkeypatch, tmp_path)
    assert verify_entry(entry).digest == sender.digest and len(hashed) == 1
    assert read_sidecar(entry).unsynced_boot == "", "checked after the reboot, and synced"
    assert verify_entry(entry) is not None and len(hashed) == 1


@pytest.mark.skipif(not boot_id(), reason="no boot id on this system: entries are fsynced")
def test_an_entry_a_crash_damaged_is_sent_again(sender, tmp_path, monkeypatch):
    """A crash before the kernel wrote the pages back: the file has its size
    and times but not its bytes. The stat matches; the boot does not."""
    cache = tmp_path / "cache"
    entry = received_entry(sender, cache)
    stat = entry.stat()
    with entry.open("r+b") as handle:
        handle.seek(stat.st_size // 2)
        handle.write(bytes(4096))  # pages the disk never got read back as zeros
    os.utime(entry, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    # A crash leaves the inode as the record has it, ctime included (a write
    # here changes the ctime, which the check would otherwise catch at once).
    recorded = read_sidecar(entry)
    stagecache.write_sidecar(entry, dataclasses.replace(recorded, ctime_ns=entry.stat().st_ctime_ns))
    assert verify_entry(entry) is not None, "before a reboot nothing can tell (the page cache is the file)"
    reboot(monkeypatch, tmp_path)
    sent_again(sender, cache, entry)


def test_without_a_boot_id_a_received_entry_is_fsynced(sender, tmp_path, monkeypatch):
    monkeypatch.setattr(stagecache, "BOOT_ID_PATH", tmp_path / "missing")
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd))
    entry = received_entry(sender, tmp_path / "cache")
    assert read_sidecar(entry).unsynced_boot == ""
    assert str(entry) + ".partial" in synced, "the stage file's bytes were synced before it became the entry"


def test_a_complete_entry_of_other_weights_is_sent_again(tmp_path):
    """The receiver's entry carries its digest; the sender compares it with
    its own (memoized), so same-identity copies with other weights are replaced."""
    from tests.support import synthetic

    first = synthetic.write_model(tmp_path / "a.gguf", "llama", seed=0)
    second = synthetic.write_model(tmp_path / "b.gguf", "llama", seed=1)
    cache = tmp_path / "cache"
    sender = StageSender(first, 2, 5, chunk_size=1 << 20, memo_dir=tmp_path / "sent")
    with sender, receiver_for(sender, cache) as receiver:
        receiver.open()
        send(sender, receiver, 0)
        receiver.finish(sender.digest)
    with StageSender(second, 2, 5, chunk_size=1 << 20, memo_dir=tmp_path / "sent") as other:
        assert other.key == sender.key, "one identity, so one cache name"
        with receiver_for(other, cache) as receiver:
            status = receiver.open()
            assert status.state == "complete"
            assert other.first_chunk(status) == 0, "but other bytes: sent again"


def test_the_sender_remembers_what_it_sent(stage_source, sender, tmp_path):
    with receiver_for(sender, tmp_path / "cache") as receiver:
        receiver.open()
        send(sender, receiver, 0)
        receiver.finish(sender.digest)
    again = StageSender(stage_source, *RANGE, chunk_size=CHUNK, memo_dir=tmp_path / "sent")
    assert again.known_digest() == sender.digest, "known without reading the model again"
    elsewhere = StageSender(stage_source, *RANGE, chunk_size=CHUNK, memo_dir=tmp_path / "fresh")
    assert elsewhere.known_digest() == ""
    assert elsewhere.full_digest() == sender.digest


def test_a_symlink_at_the_partial_name_is_not_followed(sender, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (cache / (sender.key.file_name + ".partial")).symlink_to(victim)
    with receiver_for(sender, cache) as receiver:
        receiver.open()
        send(sender, receiver, 0, stop=2)
        assert not receiver.partial.is_symlink()
    assert victim.read_bytes() == b"precious"


def test_a_key_from_the_wire_is_checked(sender, tmp_path):
    from dataclasses import replace

    for bad in (replace(sender.key, model="../../etc"), replace(sender.key, start=5, end=5)):
        with pytest.raises(CacheError):
            StageFileReceiver(tmp_path / "cache", bad, 100, CHUNK)
    assert replace(sender.key, label="../../x y").file_name.startswith("x-y.blk")


# ------------------------------------------------------------ full disk


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 16 MiB tmpfs (the test runs as root on this machine)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_is_known_before_anything_is_sent(sender, small_disk):
    cache = small_disk / "cache"
    with receiver_for(sender, cache) as receiver, pytest.raises(DiskFull) as caught:
        receiver.open()
    message = str(caught.value)
    assert str(cache / sender.key.file_name) in message
    assert f"needs {sender.offer.size} bytes" in message and "are free there" in message
    assert caught.value.needed == sender.offer.size and caught.value.available <= 16 << 20
    assert list(cache.iterdir()) == [], "the partial file is removed"


def test_a_full_disk_while_writing_removes_the_partial_file(sender, small_disk, monkeypatch):
    """A filesystem whose free space is unknown and that has no fallocate:
    the write that finds the disk full is the one clear error."""
    monkeypatch.setattr(receiver_module, "free_bytes", lambda _: 0)
    monkeypatch.setattr(receiver_module, "reserve", lambda *_: None)
    cache = small_disk / "cache"
    with receiver_for(sender, cache) as receiver:
        receiver.open()
        with pytest.raises(DiskFull, match=f"no space left for {cache / sender.key.file_name}"):
            send(sender, receiver, 0)
        assert receiver.received <= 16 << 20
    assert list(cache.iterdir()) == []
    assert list_entries(cache) == []


def test_a_full_disk_while_writing_a_local_stage_file(stage_source, small_disk):
    cache = small_disk / "cache"
    with pytest.raises(DiskFull, match="needs .* bytes"):
        ensure_stage_file(stage_source, *RANGE, cache)
    assert list(cache.iterdir()) == []


# ------------------------------------------------------------ chunks


def test_chunk_sizes_are_whole_leaves(sender, stage_source, tmp_path):
    with pytest.raises(TransferError, match="is not a multiple of"):
        StageFileReceiver(tmp_path / "cache", sender.key, sender.offer.size, (1 << 20) + 1)
    with pytest.raises(ValueError, match="not a positive multiple"):
        StageSender(stage_source, *RANGE, chunk_size=64 << 10)


def test_chunks_in_pieces_make_the_same_entry_and_a_bad_one_is_not_counted(stage_source, tmp_path):
    """What ``ggufpipe-agent receive`` does: each chunk written in pieces that
    cross leaf boundaries anywhere, checked at its end. The entry is the one
    whole chunks make; a damaged chunk counts for nothing, and its next try
    (over the bytes it left) is taken."""
    piece = 300 << 10  # not a divisor of a leaf: pieces straddle leaves
    with StageSender(stage_source, *RANGE, chunk_size=4 << 20, memo_dir=tmp_path / "sent") as sender:
        with receiver_for(sender, tmp_path / "cache") as receiver:
            assert receiver.open().state == "empty"
            for chunk in sender.chunks(0):
                if chunk.index == 2:
                    receiver.start_chunk(chunk.index, len(chunk.data))
                    receiver.write_piece(bytes([chunk.data[0] ^ 1]) + chunk.data[1:])
                    with pytest.raises(TransferError, match="chunk 2 does not match its digest; rejected"):
                        receiver.end_chunk(chunk.index, chunk.digest)
                    assert receiver.received == 2 * (4 << 20)
                    with pytest.raises(TransferError, match="chunk 3 arrived, chunk 2 was expected"):
                        receiver.start_chunk(3, len(chunk.data))
                receiver.start_chunk(chunk.index, len(chunk.data))
                view = memoryview(chunk.data)
                for offset in range(0, len(view), piece):
                    receiver.write_piece(view[offset : offset + piece])
                receiver.end_chunk(chunk.index, chunk.digest)
            entry = receiver.finish(sender.digest)
        assert digest_file(entry) == sender.digest
        assert entry.read_bytes() == b"".join(chunk.data for chunk in sender.chunks(0))
