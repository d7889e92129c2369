"""The stage-file cache trusts nothing it did not write and verify: a private
directory, files created exclusively and never through a symlink, 0600
files, a sidecar checked before every use (docs/model-delivery.md)."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from ggufpipe_agent.errors import CacheError
from ggufpipe_agent.gguf.header import read_header
from ggufpipe_agent.stagefiles.admin import list_entries, remove_entries
from ggufpipe_agent.stagefiles.build import ensure_stage_file
from ggufpipe_agent.stagefiles.cache import read_sidecar, sidecar_path
from ggufpipe_agent.stagefiles.digest import digest_file
from ggufpipe_agent.stagefiles.private_files import create_private
from tests.support import synthetic


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic.write_model(tmp_path_factory.mktemp("model") / "synthetic-llama.gguf", "llama")


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_an_entry_has_a_sidecar_that_vouches_for_it(model, tmp_path):
    entry = ensure_stage_file(model, 2, 5, tmp_path / "cache")
    sidecar = read_sidecar(entry)
    assert sidecar is not None
    assert sidecar.digest == digest_file(entry)
    assert (sidecar.size, sidecar.inode) == (entry.stat().st_size, entry.stat().st_ino)
    assert (sidecar.key.start, sidecar.key.end, sidecar.key.block_count) == (2, 5, 7)
    assert [source.path for source in sidecar.sources] == [os.path.realpath(model)]


def test_a_corrupted_entry_is_written_again(model, tmp_path, caplog):
    cache = tmp_path / "cache"
    entry = ensure_stage_file(model, 2, 5, cache)
    good = entry.read_bytes()
    with entry.open("r+b") as handle:  # a byte of tensor data, past the header
        handle.seek(len(good) - 100)
        handle.write(bytes([good[-100] ^ 0xFF]))
    assert ensure_stage_file(model, 2, 5, cache) == entry
    assert entry.read_bytes() == good
    assert "does not match its recorded digest" in caplog.text and "written again" in caplog.text


def test_a_corruption_that_keeps_size_and_mtime_is_written_again(model, tmp_path):
    """A write followed by restoring the mtime leaves a new ctime, which the
    sidecar records too: the entry is re-hashed, found damaged, written again
    (tests/test_stagecache_damage.py has the rest)."""
    cache = tmp_path / "cache"
    entry = ensure_stage_file(model, 2, 5, cache)
    good = entry.read_bytes()
    before = entry.stat()
    with entry.open("r+b") as handle:
        handle.seek(len(good) - 100)
        handle.write(bytes([good[-100] ^ 0xFF]))
    os.utime(entry, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert ensure_stage_file(model, 2, 5, cache) == entry
    assert entry.read_bytes() == good


def test_a_touched_but_intact_entry_is_kept(model, tmp_path):
    cache = tmp_path / "cache"
    entry = ensure_stage_file(model, 2, 5, cache)
    inode = entry.stat().st_ino
    os.utime(entry, ns=(1, 1))  # the stat no longer matches: re-hashed, found intact
    assert ensure_stage_file(model, 2, 5, cache) == entry
    assert entry.stat().st_ino == inode, "not rewritten"
    assert read_sidecar(entry).mtime_ns == 1, "the sidecar follows the file"


def test_an_entry_without_a_sidecar_is_not_trusted(model, tmp_path):
    cache = tmp_path / "cache"
    entry = ensure_stage_file(model, 2, 5, cache)
    good = entry.read_bytes()
    sidecar_path(entry).unlink()
    entry.write_bytes(b"GGUF anything")  # planted at the predictable name
    assert ensure_stage_file(model, 2, 5, cache).read_bytes() == good


def test_a_changed_source_writes_the_entry_again(model, tmp_path):
    """Copies that differ only in weights share an identity, so a cache name;
    an entry is reused only for the very source files it was written from."""
    cache = tmp_path / "cache"
    other = synthetic.write_model(tmp_path / "other.gguf", "llama", seed=1)
    first = ensure_stage_file(model, 2, 5, cache).read_bytes()
    second = ensure_stage_file(other, 2, 5, cache)
    assert second.read_bytes() != first
    assert read_sidecar(second).sources[0].path == os.path.realpath(other)


# ------------------------------------------------------------ symlinks


def test_a_symlink_at_the_target_name_is_not_followed(model, tmp_path):
    cache = tmp_path / "cache"
    entry_name = ensure_stage_file(model, 2, 5, cache).name
    shutil.rmtree(cache)
    cache.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (cache / entry_name).symlink_to(victim)
    (cache / (entry_name + ".json")).symlink_to(victim)
    entry = ensure_stage_file(model, 2, 5, cache)
    assert victim.read_bytes() == b"precious"
    assert not entry.is_symlink() and not sidecar_path(entry).is_symlink()
    assert read_sidecar(entry) is not None


def test_temporaries_are_created_exclusively_and_never_through_a_symlink(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    planted = tmp_path / ".entry.gguf.123.abc.tmp"
    planted.symlink_to(victim)
    with pytest.raises(FileExistsError):
        create_private(planted)
    dangling = tmp_path / ".entry.gguf.456.def.tmp"
    dangling.symlink_to(tmp_path / "would-be-created")
    with pytest.raises(FileExistsError):
        create_private(dangling)
    assert victim.read_bytes() == b"precious" and not (tmp_path / "would-be-created").exists()


def test_temporary_names_are_unpredictable(tmp_path):
    from ggufpipe_agent.stagefiles import cache as stagecache

    names = [stagecache.temporary_path(tmp_path, "x.gguf").name for _ in range(3)]
    assert len(set(names)) == 3 and all(name.startswith(f".x.gguf.{os.getpid()}.") for name in names)


# ------------------------------------------------------------ the directory


@pytest.mark.parametrize(
    ("bits", "who"), [(0o002, "others"), (0o020, "its group"), (0o022, "its group and others")]
)
def test_a_cache_writable_by_others_is_refused(model, tmp_path, bits, who):
    cache = tmp_path / "cache"
    cache.mkdir()
    os.chmod(cache, 0o755 | bits)
    with pytest.raises(CacheError) as caught:
        ensure_stage_file(model, 2, 5, cache)
    message = str(caught.value)
    assert str(cache) in message and f"writable by {who}" in message
    assert list(cache.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_a_cache_owned_by_another_user_is_refused(model, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    os.chown(cache, 65534, 65534)
    with pytest.raises(CacheError, match=r"belongs to uid 65534, not to this user"):
        ensure_stage_file(model, 2, 5, cache)


def test_a_readable_cache_of_ours_is_made_private(model, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    os.chmod(cache, 0o755)
    ensure_stage_file(model, 2, 5, cache)
    assert mode(cache) == 0o700


def test_modes_are_private_whatever_the_umask_and_the_source(model, tmp_path):
    source = Path(shutil.copy(model, tmp_path / "world-readable.gguf"))
    os.chmod(source, 0o644)
    old = os.umask(0)
    try:
        entry = ensure_stage_file(source, 2, 5, tmp_path / "new" / "cache")
    finally:
        os.umask(old)
    assert mode(tmp_path / "new" / "cache") == 0o700
    assert mode(entry) == 0o600 and mode(sidecar_path(entry)) == 0o600


# ------------------------------------------------------------ management


def test_entries_are_listed_and_removed(model, tmp_path):
    cache = tmp_path / "cache"
    first = ensure_stage_file(model, 0, 3, cache)
    second = ensure_stage_file(model, 3, 7, cache)
    legacy = cache / "legacy.blk0-3of7.0123456789abcdef0123.gguf"  # an older format's name
    legacy.write_bytes(b"an older format")
    for path, used in (
        (sidecar_path(first), 1_000_000),
        (legacy, 2_000_000),
        (sidecar_path(second), 3_000_000),
    ):
        os.utime(path, (used, used))  # a sidecar's mtime is its entry's last use
    entries = list_entries(cache)
    assert [entry.name for entry in entries] == [
        second.name,
        "legacy.blk0-3of7.0123456789abcdef0123.gguf",
        first.name,
    ]
    newest = entries[0]
    assert newest.state == "complete" and newest.model_name == read_header(model).get("general.name")
    assert (newest.start, newest.end, newest.block_count, newest.size) == (3, 7, 7, second.stat().st_size)
    assert entries[1].state == "unverified" and entries[2].last_used == 1_000_000
    assert remove_entries(cache, [first.name, "legacy.blk0-3of7.0123456789abcdef0123.gguf"]) == [
        first.name,
        "legacy.blk0-3of7.0123456789abcdef0123.gguf",
    ]
    assert sorted(path.name for path in cache.iterdir()) == [second.name, second.name + ".json"]
    for bad in ("../escape.gguf", ".hidden", second.name + ".json", ""):
        with pytest.raises(CacheError):
            remove_entries(cache, [bad])


def test_listing_shows_a_partial_transfer(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    (cache / "m.blk0-3of7.x.gguf.partial").write_bytes(b"\0" * 10)
    record = {
        "key": {"model": "ab" * 32, "label": "m", "start": 0, "end": 3, "block_count": 7},
        "verified": 4,
        "size": 10,
    }
    (cache / "m.blk0-3of7.x.gguf.partial.json").write_text(json.dumps(record))
    (entry,) = list_entries(cache)
    assert (entry.state, entry.size, entry.expected_size, entry.model_name) == ("partial", 4, 10, "m")
