"""gpt-oss splits exactly: a chain of stages gives the whole model's greedy tokens.

The synthetic model (tests/support/synthetic_families.py) has 9 blocks with a
sliding window of 8 on the even ones (llama.cpp's default period 2), attention
sinks, biases everywhere gpt-oss has them, a mixture of experts and YaRN. The
rules proven here are in ggufpipe_agent/gguf/families/gpt_oss.py: every stage
file carries the original sliding-window pattern's slice (a stage starting
at an odd block would otherwise slide where the model attends fully), keeps
``output.weight``, and a stage of one full-attention block is refused. Its
splits and its headless run are rows of tests/model/test_architectures.py.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from ggufpipe_agent.errors import ModelError, UnsupportedArchitecture
from ggufpipe_agent.gguf.architectures import SUPPORTED, check_plan, check_split
from ggufpipe_agent.gguf.header import read_header
from ggufpipe_agent.stagefiles.build import ensure_stage_file
from tests.support.arch_harness import assert_per_layer_refused, run_chain
from tests.support.synthetic_families import FAMILIES

ARCH = MODEL = "gpt-oss"


def test_stage_files_carry_the_window_pattern_and_the_output(model, tmp_path):
    stage = read_header(ensure_stage_file(model, 3, 6, tmp_path))
    # blocks 3, 4, 5 of the original: full, sliding, full
    assert stage.get(f"{ARCH}.attention.sliding_window_pattern") == [False, True, False]
    assert stage.get(f"{ARCH}.block_count") == 3
    assert stage.get(f"{ARCH}.attention.sliding_window") == FAMILIES[MODEL].keys["attention.sliding_window"]
    names = {tensor.name for tensor in stage.tensors}
    assert (
        "output.weight" in names and "blk.2.attn_sinks.weight" in names and "blk.3.attn_q.weight" not in names
    )


def test_split_without_the_pattern_differs(model, reference, tmp_path, monkeypatch):
    """The control: renumbered blocks with llama.cpp's default period put the
    window on the wrong blocks, and the tests above would notice."""
    monkeypatch.setitem(SUPPORTED, ARCH, replace(SUPPORTED[ARCH], overrides=None))
    assert run_chain(model, [(0, 3), (3, 9)], cache_dir=tmp_path) != reference


# ------------------------------------------------------------ refusals


def test_a_stage_of_one_full_attention_block_is_refused(model):
    get = read_header(model).get
    for start in (1, 3, 5, 7):
        with pytest.raises(UnsupportedArchitecture, match="without a sliding-window block"):
            check_split(ARCH, get, start, start + 1, "m")
    for start in (0, 2, 4, 6, 8):
        check_split(ARCH, get, start, start + 1, "m")
    check_split(ARCH, get, 3, 5, "m")


def test_a_refused_stage_is_refused_before_anything_is_written(model, tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(UnsupportedArchitecture, match="GGML_ASSERT"):
        ensure_stage_file(model, 3, 4, cache)
    assert not cache.exists(), "nothing may be written for a refused split"


def test_a_refused_stage_is_refused_from_the_model_facts():
    facts = SimpleNamespace(architecture=ARCH, block_count=24, hidden_dim=2880, head_count=64, key_length=64)
    check_plan(facts, [(0, 11), (11, 13), (13, 24)], "20b")
    with pytest.raises(UnsupportedArchitecture, match="block 23 attends fully"):
        check_plan(facts, [(0, 23), (23, 24)], "20b")


@pytest.mark.parametrize(
    "key",
    ["attention.head_count", "attention.head_count_kv", "expert_used_count", "expert_feed_forward_length"],
)
def test_per_layer_values_that_differ_are_refused(key):
    assert_per_layer_refused(
        ARCH, {f"{ARCH}.block_count": 4}, key, [4, 4, 2, 2], (0, 2), whole=False, uniform=True
    )


def test_separate_sliding_window_head_sizes_are_refused():
    meta = {f"{ARCH}.block_count": 4, f"{ARCH}.attention.key_length": 64}
    check_split(ARCH, {**meta, f"{ARCH}.attention.key_length_swa": 64}.get, 0, 2, "m")
    with pytest.raises(UnsupportedArchitecture, match="key_length_swa differs"):
        check_split(ARCH, {**meta, f"{ARCH}.attention.key_length_swa": 32}.get, 0, 2, "m")


def test_a_pattern_array_of_the_wrong_length_is_refused():
    get = {f"{ARCH}.block_count": 6, f"{ARCH}.attention.sliding_window_pattern": [True] * 5}.get
    with pytest.raises(ModelError, match="5 entries for 6 blocks"):
        check_split(ARCH, get, 0, 3, "odd")


def test_a_pattern_array_in_the_file_is_sliced_and_decides():
    get = {
        f"{ARCH}.block_count": 4,
        f"{ARCH}.attention.sliding_window_pattern": [False, True, False, True],
    }.get
    check_split(ARCH, get, 1, 2, "m")
    with pytest.raises(UnsupportedArchitecture, match="block 2 attends fully"):
        check_split(ARCH, get, 2, 3, "m")
