"""minimax-m2 (MiniMax M2) splits exactly; what cannot is refused.

The rules and the llama.cpp lines they come from are in
:mod:`ggufpipe_agent.gguf.families.minimax_m2`: nothing of a block's index or
the block count reaches the computation, but llama.cpp requires
``output.weight`` to load the model at all, so every stage file keeps it
(``keep_tensors``); a split of a file whose per-layer head or expert counts
differ between blocks is refused.

The model is a synthetic 8-block GGUF (tests/support/synthetic_families.py);
its splits and its headless run are rows of tests/model/test_architectures.py.
The control: without ``keep_tensors`` a stage that is not the last fails to
load, and llama.cpp says why.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest

from ggufpipe_agent.errors import EngineError, UnsupportedArchitecture
from ggufpipe_agent.gguf import architectures
from ggufpipe_agent.gguf.architectures import SUPPORTED, check_split
from ggufpipe_agent.gguf.header import read_header
from ggufpipe_agent.stagefiles.build import ensure_stage_file
from tests.support.arch_harness import OPTIONS, assert_per_layer_refused
from tests.support.stage_chain import Chain
from tests.support.synthetic_families import FAMILIES, write_model

ARCH = MODEL = "minimax-m2"
BLOCKS = FAMILIES[MODEL].blocks
#: A split of tests/model/test_architectures.py the controls run.
TWO_STAGES = [(0, 3), (3, 8)]


def test_minimax_m2_is_accepted():
    assert ARCH in SUPPORTED
    assert SUPPORTED[ARCH].keep_tensors == ("output.weight",)


def test_minimax_m2_every_stage_file_keeps_the_output_projection(model):
    for start, end in [(0, 1), (3, 5), (7, 8)]:
        stage = read_header(ensure_stage_file(model, start, end))
        names = {tensor.name for tensor in stage.tensors}
        assert "output.weight" in names, (start, end)
        assert stage.get("minimax-m2.block_count") == end - start
        assert stage.get("minimax-m2.rope.dimension_count") == FAMILIES[MODEL].keys["rope.dimension_count"]


# ------------------------------------------------------------- control


def test_minimax_m2_stage_without_the_output_projection_fails_to_load(model, tmp_path, monkeypatch, caplog):
    """The control: without ``keep_tensors`` the stage writer drops
    ``output.weight`` outside the last stage, and llama.cpp refuses the file."""
    bare = dataclasses.replace(SUPPORTED[ARCH], keep_tensors=())
    monkeypatch.setitem(architectures.SUPPORTED, ARCH, bare)
    first = read_header(ensure_stage_file(model, 0, 3, tmp_path))
    assert "output.weight" not in {tensor.name for tensor in first.tensors}
    caplog.set_level(logging.ERROR, logger="ggufpipe.llama")
    with pytest.raises(EngineError, match="could not load"):
        Chain(model, TWO_STAGES, OPTIONS, cache_dir=tmp_path)
    assert "tensor 'output.weight' not found" in caplog.text


# ------------------------------------------------------------- refusals

MINIMAX_M2 = {  # the metadata llama.cpp reads for MiniMax M2 (scalars)
    "minimax-m2.block_count": 62,
    "minimax-m2.embedding_length": 3072,
    "minimax-m2.attention.head_count": 48,
    "minimax-m2.attention.head_count_kv": 8,
    "minimax-m2.expert_used_count": 8,
}


def test_minimax_m2_real_shape_splits_anywhere():
    get = MINIMAX_M2.get
    for start, end in [(0, 1), (0, 31), (31, 62), (61, 62)]:
        check_split(ARCH, get, start, end, "m2")


@pytest.mark.parametrize(
    ("key", "values"),
    [
        ("attention.head_count", [48] * 61 + [24]),
        ("attention.head_count_kv", [8] * 31 + [4] * 31),
        ("expert_used_count", [8] * 31 + [4] * 31),
        ("feed_forward_length", [1536] * 61 + [768]),
        ("expert_feed_forward_length", [768] + [1536] * 61),
    ],
)
def test_minimax_m2_non_uniform_per_layer_counts_are_refused(key, values):
    assert_per_layer_refused(ARCH, MINIMAX_M2, key, values, (31, 62))


def test_minimax_m2_multi_token_prediction_blocks_are_refused():
    get = {**MINIMAX_M2, "minimax-m2.nextn_predict_layers": 3}.get
    with pytest.raises(UnsupportedArchitecture, match="nextn_predict_layers = 3"):
        check_split(ARCH, get, 0, 31, "mtp")


def test_minimax_m2_non_uniform_model_is_refused_before_anything_is_written(tmp_path):
    used = [2] * (BLOCKS - 1) + [3]
    source = write_model(tmp_path / "odd.gguf", MODEL, metadata={"expert_used_count": used})
    cache = tmp_path / "cache"
    with pytest.raises(UnsupportedArchitecture, match="expert_used_count differs between blocks"):
        ensure_stage_file(source, 0, 4, cache)
    kv_heads = [2] * (BLOCKS - 1) + [4]
    source = write_model(tmp_path / "odd-kv.gguf", MODEL, metadata={"attention.head_count_kv": kv_heads})
    with pytest.raises(UnsupportedArchitecture, match="runs only as one stage"):
        Chain(source, [(0, 4), (4, BLOCKS)], OPTIONS, cache_dir=cache)
    assert not cache.exists()
