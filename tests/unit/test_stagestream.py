"""The streamed stage-file producer: byte for byte what gguf.GGUFWriter writes
(tests/reference_stagefile.py), readable from any offset in any chunk size,
its size known before the first byte, and nothing written on the way."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from ggufpipe_agent.errors import ModelError
from ggufpipe_agent.gguf.files import read_model_files
from ggufpipe_agent.gguf.header import read_header
from ggufpipe_agent.stagefiles.stream import StageFileStream, open_stage_stream
from tests.support import synthetic
from tests.support.bulky_gguf import write_out
from tests.support.reference_stagefile import write_reference_stage_file
from tests.support.splitset import write_split_set


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def per_layer_model(path: Path) -> Path:
    """A llama-shaped GGUF with per-layer arrays of every kind llama.cpp reads
    per layer (OpenELM-style head counts, floats, bools, strings), a custom
    alignment and an array that only looks per-layer (not under llama.)."""
    writer = gguf.GGUFWriter(path, arch="llama")
    blocks = 6
    writer.add_custom_alignment(64)
    writer.add_uint32("llama.block_count", blocks)
    writer.add_uint32("llama.embedding_length", 8)
    writer.add_array("llama.attention.head_count", [1, 2, 3, 4, 5, 6])
    writer.add_key_value(
        "llama.attention.head_count_kv",
        [6, 5, 4, 3, 2, 1],
        gguf.GGUFValueType.ARRAY,
        gguf.GGUFValueType.UINT16,
    )
    writer.add_array("llama.rope.scales", [0.5, 1.5, 2.5, 3.5, 4.5, 5.5])
    writer.add_array("llama.flags", [True, False, True, False, True, False])
    writer.add_array("llama.names", ["a", "bb", "ccc", "dddd", "eeeee", "ffffff"])
    writer.add_array("tokenizer.ggml.six", [1, 2, 3, 4, 5, 6])  # not per layer: copied whole
    writer.add_tensor("token_embd.weight", np.arange(48, dtype=np.float32).reshape(6, 8))
    for block in range(blocks):
        writer.add_tensor(f"blk.{block}.attn_q.weight", np.full((3, 8), block, dtype=np.float16))
    writer.add_tensor("output.weight", np.ones((6, 8), dtype=np.float32))
    write_out(writer)
    return path


CASES = [
    ("llama", [(0, 3), (3, 7), (6, 7)]),
    ("llama-moe", [(2, 5)]),
    ("qwen2", [(0, 1), (1, 7)]),
    ("qwen3", [(3, 6)]),
    ("mistral3", [(0, 4)]),
    ("phi3", [(4, 7)]),
    ("gemma3", [(0, 5), (5, 11), (11, 12), (12, 13)]),
    ("per-layer", [(0, 2), (2, 5), (5, 6)]),
]


def model_file(models: Path, name: str) -> Path:
    path = models / f"{name}.gguf"
    if not path.exists():
        if name == "per-layer":
            per_layer_model(path)
        else:
            synthetic.write_model(path, name)
    return path


@pytest.mark.parametrize(("name", "ranges"), CASES, ids=[case[0] for case in CASES])
def test_stream_is_byte_for_byte_the_gguf_writers(models, tmp_path, name, ranges):
    source = model_file(models, name)
    for start, end in ranges:
        reference = write_reference_stage_file(source, start, end, tmp_path / f"{start}-{end}.gguf")
        with open_stage_stream(read_model_files(source), start, end) as stream:
            produced = b"".join(stream.chunks(4096))
            assert stream.size == len(produced)
        assert produced == reference.read_bytes(), f"{name} [{start}, {end})"


def test_per_layer_arrays_are_sliced(models, tmp_path):
    source = model_file(models, "per-layer")
    with open_stage_stream(read_model_files(source), 2, 5) as stream:
        (tmp_path / "stage.gguf").write_bytes(b"".join(stream.chunks()))
    stage = read_header(tmp_path / "stage.gguf")
    assert stage.get("llama.block_count") == 3
    assert stage.get("llama.attention.head_count") == [3, 4, 5]
    assert stage.get("llama.attention.head_count_kv") == [4, 3, 2]
    assert stage.get("llama.rope.scales") == [2.5, 3.5, 4.5]
    assert stage.get("llama.flags") == [True, False, True]
    assert stage.get("llama.names") == ["ccc", "dddd", "eeeee"]
    assert stage.get("tokenizer.ggml.six") == [1, 2, 3, 4, 5, 6]
    assert stage.alignment == 64 and stage.data_offset % 64 == 0
    assert [t.name for t in stage.tensors] == [
        "token_embd.weight",
        "blk.0.attn_q.weight",
        "blk.1.attn_q.weight",
        "blk.2.attn_q.weight",
    ]


def test_a_split_set_streams_what_its_single_file_does(models, tmp_path):
    source = model_file(models, "gemma3")
    parts = write_split_set(source, tmp_path, "g", 20)
    assert len(parts) > 2
    for start, end in [(0, 5), (5, 11), (11, 13)]:
        with (
            open_stage_stream(read_model_files(parts[-1]), start, end) as from_set,
            open_stage_stream(read_model_files(source), start, end) as from_file,
        ):
            assert b"".join(from_set.chunks()) == b"".join(from_file.chunks())


def test_any_offset_in_any_chunk_size(models):
    files = read_model_files(model_file(models, "llama"))
    with StageFileStream(files, 1, 6) as stream:
        whole = stream.read(0, stream.size)
        assert len(whole) == stream.size
        generator = random.Random(7)
        for _ in range(200):
            offset = generator.randrange(stream.size)
            length = generator.randrange(1, 300_000)
            assert stream.read(offset, length) == whole[offset : offset + length]
        for chunk_size in (1, 777, 65536, stream.size, 10 * stream.size):
            offset = generator.randrange(stream.size) if chunk_size > 1 else stream.size - 5000
            chunks = list(stream.chunks(chunk_size, offset))
            assert b"".join(chunks) == whole[offset:]
            assert all(len(chunk) == chunk_size for chunk in chunks[:-1])


def test_streaming_writes_nothing(models, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GGUFPIPE_CACHE_DIR", str(tmp_path / "cache"))
    with open_stage_stream(read_model_files(model_file(models, "qwen2")), 2, 5) as stream:
        for _ in stream.chunks(1000):
            pass
    assert list(tmp_path.iterdir()) == []


def test_a_source_changed_after_its_header_was_read_is_refused(models, tmp_path):
    source = Path(shutil.copy(model_file(models, "llama"), tmp_path / "m.gguf"))
    files = read_model_files(source)
    stamp = source.stat()
    os.utime(source, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 1_000_000))
    with pytest.raises(ModelError, match="changed since its header was read"):
        open_stage_stream(files, 2, 5)
