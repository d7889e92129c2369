"""gemma3 splits exactly: what the Gemma 3 family needs proven beyond its splits.

The synthetic model (tests/support/synthetic.py SPECS "gemma3") has 13 blocks
with a sliding window of 8 and llama.cpp's default period 6 (blocks 5 and 11
are global). The rules proven here are in ggufpipe_agent/gguf/families/gemma3.py:
every stage file carries the original sliding-window pattern's slice (a stage
of global blocks only has no window at all), and a split that would change
the attention scale llama.cpp picks from the block count (62: Gemma 3 27B)
is refused.
Its splits are rows of tests/model/test_architectures.py, with the real
Gemma 3 270M.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ggufpipe_agent.errors import ModelError, UnsupportedArchitecture
from ggufpipe_agent.gguf.architectures import check_plan, check_split
from ggufpipe_agent.gguf.header import read_header
from ggufpipe_agent.stagefiles import build as stagefile
from ggufpipe_agent.stagefiles.build import ensure_stage_file
from tests.support.arch_harness import greedy_reference, model_path, run_chain


def test_gemma3_stage_files_carry_the_original_window_pattern(tmp_path_factory):
    path = model_path(tmp_path_factory, "gemma3")
    stage = read_header(ensure_stage_file(path, 5, 11))
    # blocks 5..10 of the original: 5 is global, 6..10 sliding (period 6)
    assert stage.get("gemma3.attention.sliding_window_pattern") == [False, True, True, True, True, True]
    assert stage.get("gemma3.attention.sliding_window") == 8
    assert stage.get("gemma3.block_count") == 6
    # A stage of global blocks only has no window at all: llama.cpp aborts on a
    # sliding-window model without a sliding-window block.
    alone = read_header(ensure_stage_file(path, 11, 12))
    assert alone.get("gemma3.attention.sliding_window") == 0
    assert "gemma3.attention.sliding_window_pattern" not in alone.metadata


def test_gemma3_split_without_the_pattern_differs(tmp_path_factory, tmp_path, monkeypatch):
    """The control: renumbered blocks with llama.cpp's default pattern compute
    something else, and the test above would notice."""
    path = model_path(tmp_path_factory, "gemma3")
    expected = greedy_reference(path)
    monkeypatch.setattr(stagefile, "stage_metadata_overrides", lambda *_: {})
    assert run_chain(path, [(0, 5), (5, 11), (11, 13)], cache_dir=tmp_path) != expected


GEMMA3_27B = {  # the metadata llama.cpp reads for Gemma 3 27B
    "gemma3.block_count": 62,
    "gemma3.embedding_length": 5376,
    "gemma3.attention.head_count": 32,
    "gemma3.attention.key_length": 128,
    "gemma3.attention.sliding_window": 1024,
}


def test_gemma3_27b_split_is_refused():
    get = GEMMA3_27B.get
    check_split("gemma3", get, 0, 62, "27b")  # the whole model is the source file itself
    with pytest.raises(UnsupportedArchitecture, match="Gemma 3 27B cannot be split exactly"):
        check_split("gemma3", get, 0, 31, "27b")


def test_gemma3_27b_plan_is_refused_from_model_facts():
    facts = SimpleNamespace(
        architecture="gemma3", block_count=62, hidden_dim=5376, head_count=32, key_length=128
    )
    check_plan(facts, [(0, 62)], "27b")
    with pytest.raises(UnsupportedArchitecture, match="27B"):
        check_plan(facts, [(0, 20), (20, 62)], "27b")
    check_plan(SimpleNamespace(**{**vars(facts), "block_count": 18}), [(0, 5), (5, 18)], "270m")


def test_gemma3_stage_of_62_blocks_is_refused():
    """A 62-block stage of another model would be taken for the 27B."""
    get = {**GEMMA3_27B, "gemma3.block_count": 70}.get
    check_split("gemma3", get, 0, 61, "big")
    check_split("gemma3", get, 0, 63, "big")
    with pytest.raises(UnsupportedArchitecture, match="more or fewer than 62 blocks"):
        check_split("gemma3", get, 8, 70, "big")


def test_gemma3_27b_is_refused_before_a_stage_file_is_written(tmp_path):
    import gguf

    source = tmp_path / "gemma3-27b-metadata-only.gguf"
    writer = gguf.GGUFWriter(source, arch="gemma3")
    for key, value in GEMMA3_27B.items():
        writer.add_uint32(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cache = tmp_path / "cache"
    with pytest.raises(UnsupportedArchitecture, match="27B"):
        ensure_stage_file(source, 0, 40, cache)
    assert not cache.exists()


def test_gemma3_pattern_array_of_the_wrong_length_is_refused():
    get = {"gemma3.block_count": 6, "gemma3.attention.sliding_window_pattern": [True] * 5}.get
    with pytest.raises(ModelError, match="5 entries for 6 blocks"):
        check_split("gemma3", get, 0, 3, "odd")
