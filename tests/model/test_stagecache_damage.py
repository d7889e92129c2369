"""A stage file damaged in the cache is never loaded (docs/model-delivery.md).

The sidecar records, when the entry is written or last verified, the file's
size, mtime, ctime and inode and the digests of sampled blocks. Before every
use: any stat difference (a write leaves a new ctime even when the mtime is
set back with ``os.utime``/``touch -d``) re-hashes the whole file; an
unchanged stat still reads the sampled blocks. A mismatch removes the entry
and is refused naming the file, the cache and what to do.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest

from ggufpipe_agent.delivery.receiver import StageFileReceiver
from ggufpipe_agent.delivery.sender import StageSender
from ggufpipe_agent.delivery.service import answer_cache_request
from ggufpipe_agent.errors import CacheError
from ggufpipe_agent.stagefiles import cache as stagecache
from ggufpipe_agent.stagefiles.admin import list_entries
from ggufpipe_agent.stagefiles.build import ensure_stage_file
from ggufpipe_agent.stagefiles.cache import (
    SAMPLE_BLOCK,
    SAMPLE_COUNT,
    SIDECAR_VERSION,
    EntryDamaged,
    StageKey,
    check_entry,
    read_sidecar,
    sidecar_path,
    verify_entry,
    write_sidecar,
    write_stage_entry,
)
from ggufpipe_agent.stagefiles.private_files import private_cache_dir
from ggufpipe_agent.wire.delivery_messages import CacheRequest
from tests.support import synthetic

KEY = StageKey("ab" * 32, "damage test", 0, 4, 8, 3)
SIZE = 8 << 20  # bigger than the sampled MiB, so that some of it is not sampled


@pytest.fixture
def entry(tmp_path: Path) -> Path:
    data = os.urandom(SIZE)
    chunks = [data[offset : offset + (1 << 20)] for offset in range(0, SIZE, 1 << 20)]
    return write_stage_entry(private_cache_dir(tmp_path / "cache"), KEY, chunks, SIZE, ())


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every whole-file hash of the cache check, by its length."""
    calls: list[int] = []
    real = stagecache.digest_descriptor

    def counting(fd: int, length: int, *rest: Any) -> str:
        calls.append(length)
        return real(fd, length, *rest)

    monkeypatch.setattr(stagecache, "digest_descriptor", counting)
    return calls


def flip(path: Path, offset: int, keep_times: bool = True) -> None:
    """One byte inverted; with ``keep_times`` its size, mtime and inode as before."""
    before = path.stat()
    with path.open("r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))
    if keep_times:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        after = path.stat()
        assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
            before.st_size,
            before.st_mtime_ns,
            before.st_ino,
        )


def without_a_trace(path: Path) -> None:
    """What damage below the file system (bit rot, a bad disk) leaves: the
    inode as recorded. A user cannot set a ctime back, so the test moves the
    sidecar's record to the file's new ctime instead."""
    recorded = read_sidecar(path)
    write_sidecar(path, dataclasses.replace(recorded, ctime_ns=path.stat().st_ctime_ns))


def outside_the_samples(path: Path) -> int:
    spans = [(offset, offset + length) for offset, length, _ in read_sidecar(path).samples]
    for offset in range(SAMPLE_BLOCK, SIZE, 4096):
        if not any(start <= offset < end for start, end in spans):
            return offset
    raise AssertionError("every byte is sampled")


# ------------------------------------------------------------ what is recorded


def test_a_new_entry_records_its_stat_after_the_rename_and_its_samples(entry):
    sidecar = read_sidecar(entry)
    info = entry.stat()
    assert sidecar.version == SIDECAR_VERSION == 2
    assert (sidecar.size, sidecar.mtime_ns, sidecar.ctime_ns, sidecar.inode) == (
        info.st_size,
        info.st_mtime_ns,
        info.st_ctime_ns,
        info.st_ino,
    )
    offsets = [offset for offset, _, _ in sidecar.samples]
    assert offsets[0] == 0 and offsets[-1] == SIZE - SAMPLE_BLOCK, "the header and the tail"
    assert len(offsets) == SAMPLE_COUNT and all(length == SAMPLE_BLOCK for _, length, _ in sidecar.samples)
    assert sidecar.samples == stagecache.sample_digests(
        os.open(entry, os.O_RDONLY), [(o, n) for o, n, _ in sidecar.samples]
    )


def test_a_small_file_is_sampled_whole(tmp_path):
    assert stagecache.sample_spans(KEY, 500_000) == ((0, 500_000),)
    spans = stagecache.sample_spans(KEY, 10 << 30)
    assert spans == stagecache.sample_spans(KEY, 10 << 30), "the same at every check"
    assert spans != stagecache.sample_spans(dataclasses.replace(KEY, start=1), 10 << 30), "keyed by the entry"
    assert all(offset % 4096 == 0 for offset, _ in spans[:-1]) and spans[-1] == (
        (10 << 30) - SAMPLE_BLOCK,
        SAMPLE_BLOCK,
    )


# ------------------------------------------------------------ the cheap check


def test_an_untouched_entry_passes_the_sampled_check(entry, hashed, monkeypatch):
    recorded = read_sidecar(entry)
    sidecar_stamp = sidecar_path(entry).stat().st_mtime_ns
    read: list[int] = []
    real = os.pread

    def counting(fd: int, length: int, offset: int) -> bytes:
        data = real(fd, length, offset)
        read.append(len(data))
        return data

    monkeypatch.setattr(os, "pread", counting)
    assert check_entry(entry) == recorded
    assert hashed == [], "not re-hashed"
    assert sum(read) == SAMPLE_COUNT * SAMPLE_BLOCK == 1 << 20
    assert sidecar_path(entry).stat().st_mtime_ns == sidecar_stamp, "nothing rewritten"


def test_a_flipped_byte_behind_restored_size_and_mtime_is_refused(entry, hashed):
    """The issue's case: the file keeps its size, mtime and inode; the ctime
    the write left is what tells. Refused before anything loads it."""
    cache = entry.parent
    flip(entry, outside_the_samples(entry))  # the samples alone would not see it
    with pytest.raises(EntryDamaged) as refused:
        check_entry(entry)
    message = str(refused.value)
    assert isinstance(refused.value, CacheError)
    assert message.startswith(
        f"{entry}: the stage file in the stage cache {cache} is damaged (its ctime changed"
    )
    assert "the entry was removed so that the next start writes or sends it again" in message
    assert "ggufpipe-tui cache INVENTORY verify" in message
    assert hashed == [SIZE]
    assert not entry.exists() and not sidecar_path(entry).exists()


def test_a_shortened_entry_is_refused(entry):
    with entry.open("r+b") as handle:
        handle.truncate(SIZE - 1)
    with pytest.raises(
        EntryDamaged, match=rf"its size, mtime, ctime changed .*: {SIZE - 1} bytes, not the {SIZE} recorded"
    ):
        check_entry(entry)


def test_a_file_another_writer_put_at_the_name_meanwhile_is_not_removed(entry):
    with pytest.raises(EntryDamaged):
        stagecache._damaged(entry, entry.stat().st_ino + 1, "checked another inode")
    assert entry.exists() and sidecar_path(entry).exists()


def test_verify_entry_says_none_for_a_damaged_entry(entry):
    flip(entry, SIZE // 2)
    assert verify_entry(entry) is None
    assert list_entries(entry.parent) == []


def test_damage_that_leaves_no_trace_in_the_stat_is_caught_when_it_is_sampled(entry, hashed):
    last = read_sidecar(entry).samples[-1][0]
    flip(entry, last + 100)
    without_a_trace(entry)
    with pytest.raises(EntryDamaged, match=rf"its sampled block at byte {last} is not the one recorded"):
        check_entry(entry)
    assert hashed == [SIZE], "a differing sample is confirmed by the whole digest first"
    assert not entry.exists()


def test_damage_that_leaves_no_trace_and_is_not_sampled_needs_cache_verify(entry, hashed):
    """The limit of the cheap check: 1 MiB of the file is read; a flip
    elsewhere that leaves the stat (ctime included) as recorded passes it.
    The full check (``cache verify``, ``ensure_stage_file(verify=True)``)
    finds it."""
    flip(entry, outside_the_samples(entry))
    without_a_trace(entry)
    assert check_entry(entry) is not None and hashed == []
    with pytest.raises(EntryDamaged, match=r"\(a full check, and its digest is not the one recorded\)"):
        check_entry(entry, full=True)


def test_cache_verify_finds_what_the_samples_miss(entry):
    flip(entry, outside_the_samples(entry))
    without_a_trace(entry)
    report = answer_cache_request(entry.parent, CacheRequest(1, "verify"))
    assert report.damaged == (entry.name,) and report.entries == ()


def test_a_wrong_sample_record_is_renewed_not_refused(entry, hashed):
    recorded = read_sidecar(entry)
    offset, length, _ = recorded.samples[3]
    wrong = (*recorded.samples[:3], (offset, length, "0" * 64), *recorded.samples[4:])
    write_sidecar(entry, dataclasses.replace(recorded, samples=wrong))
    assert check_entry(entry) == recorded
    assert hashed == [SIZE] and read_sidecar(entry) == recorded


# ------------------------------------------------------------ a changed stat, an old sidecar


def test_an_intact_entry_whose_stat_changed_is_hashed_once_and_recorded(entry, hashed):
    os.chmod(entry, 0o644)  # a new ctime; the cache makes it 0600 again (another new ctime)
    os.utime(entry, ns=(1, 1))
    renewed = check_entry(entry)
    assert renewed is not None and hashed == [SIZE]
    info = entry.stat()
    assert (info.st_mode & 0o777, renewed.mtime_ns, renewed.ctime_ns) == (0o600, 1, info.st_ctime_ns)
    assert read_sidecar(entry) == renewed
    assert check_entry(entry) == renewed and hashed == [SIZE], "trusted again by the cheap check"


def old_format(path: Path) -> None:
    """The sidecar as the cache wrote it before: version 1, no ctime, no samples."""
    raw = json.loads(sidecar_path(path).read_text())
    del raw["ctime_ns"], raw["samples"]
    raw["version"] = 1
    sidecar_path(path).write_text(json.dumps(raw))


def test_an_old_format_entry_still_loads_checked_once(entry, hashed):
    old_format(entry)
    assert read_sidecar(entry).version == 1 and list_entries(entry.parent)[0].state == "complete"
    first = check_entry(entry)
    assert first is not None and hashed == [SIZE], "re-hashed once"
    assert (
        first.version == 2
        and first.ctime_ns == entry.stat().st_ctime_ns
        and len(first.samples) == SAMPLE_COUNT
    )
    assert read_sidecar(entry) == first
    assert check_entry(entry) == first and hashed == [SIZE], "then the cheap check"


def test_a_damaged_old_format_entry_is_refused(entry):
    flip(entry, SIZE // 2)
    old_format(entry)
    with pytest.raises(EntryDamaged, match=r"an entry of an older cache version, checked once"):
        check_entry(entry)


# ------------------------------------------------------------ the writers and their users


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic.write_model(tmp_path_factory.mktemp("model") / "synthetic-llama.gguf", "llama")


def test_a_received_entry_records_its_stat_and_samples(model, tmp_path, hashed):
    cache = tmp_path / "cache"
    with StageSender(model, 2, 5, chunk_size=1 << 20, memo_dir=tmp_path / "sent") as sender:
        offer = sender.offer
        with StageFileReceiver(cache, offer.key, offer.size, offer.chunk_size) as receiver:
            receiver.open()
            for chunk in sender.chunks(0):
                receiver.accept(chunk.index, chunk.data, chunk.digest)
            entry = receiver.finish(sender.digest)
        recorded = read_sidecar(entry)
        assert (recorded.ctime_ns, recorded.inode) == (entry.stat().st_ctime_ns, entry.stat().st_ino)
        assert recorded.samples == ((0, offer.size, recorded.samples[0][2]),), "a small file: all of it"
        assert check_entry(entry) == recorded and hashed == []
        flip(entry, offer.size // 2)
        with StageFileReceiver(cache, offer.key, offer.size, offer.chunk_size) as receiver:
            assert receiver.open().state == "empty", "removed: it is sent again"


def test_a_locally_written_entry_damaged_is_written_again(model, tmp_path, caplog):
    cache = tmp_path / "cache"
    entry = ensure_stage_file(model, 2, 5, cache)
    good = entry.read_bytes()
    flip(entry, len(good) - 100)
    assert ensure_stage_file(model, 2, 5, cache) == entry
    assert entry.read_bytes() == good
    assert f"stage file {entry} does not match its recorded digest (its ctime changed" in caplog.text
    assert "written again" in caplog.text


# ------------------------------------------------------------ end to end (real agents, llama.cpp)


@pytest.mark.model
async def test_a_delivered_file_damaged_before_it_loads_is_the_stage_fault(
    tmp_path, model_path, no_agent_left
):
    """Delivered, then damaged behind its restored size and mtime before the
    run loads it: the stage refuses it, and the run faults with that one
    reason (nothing generated)."""
    from ggufpipe_tui.core.inventory import load_inventory
    from ggufpipe_tui.session.pipeline import Pipeline
    from tests.support.local import send_inventory

    caches = [tmp_path / "cache-0", tmp_path / "cache-1"]
    pipeline = Pipeline(load_inventory(send_inventory(tmp_path, model_path, caches)), lambda event: None)
    try:
        await pipeline.start()
        damaged = caches[1] / pipeline.delivered[1].ref.key.file_name
        flip(damaged, damaged.stat().st_size // 2)
        result = await pipeline.generate("Once upon a time")
    finally:
        await pipeline.close()
    assert result.outcome == "faulted" and not result.tokens
    assert result.failure.startswith(
        f"stage 1 on h1 (local): {damaged}: the stage file in the stage cache {caches[1]} is damaged "
        "(its ctime changed since it was written or last verified, and its digest is not the one recorded); "
        "the entry was removed so that the next start writes or sends it again"
    ), result.failure
    assert not damaged.exists()


@pytest.mark.model
def test_a_run_after_damage_behind_restored_times_sends_the_file_again(tmp_path, model_path, no_agent_left):
    """Between two headless runs a cached stage file is damaged, its size and
    mtime restored: the second run finds it at the offer, has it sent again,
    and its tokens are the first run's (exit 0 only with the right output)."""
    from tests.support.local import run_cli, send_inventory

    caches = [tmp_path / "c0", tmp_path / "c1"]
    path = send_inventory(tmp_path, model_path, caches)
    first = run_cli(str(path), "--prompt", "Hello", "--json", "-q")
    assert first.returncode == 0, first.stderr
    before = json.loads(first.stdout)
    row = before["delivery"][1]
    damaged = caches[1] / row["file"]
    flip(damaged, row["size"] // 2)
    second = run_cli(str(path), "--prompt", "Hello", "--json", "-q")
    assert second.returncode == 0, second.stderr
    after = json.loads(second.stdout)
    assert [r["outcome"] for r in after["delivery"]] == ["cached", "sent"]
    assert after["delivery"][1]["bytes_sent"] == row["size"]
    assert after["tokens"] == before["tokens"]
