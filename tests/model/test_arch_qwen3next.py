"""qwen3next (Qwen3-Next) is split-exact; the shapes that cannot be are refused.

The rules and the llama.cpp lines they come from are in
:mod:`ggufpipe_agent.gguf.families.qwen3next`. A synthetic Qwen3-Next
(tests/support/synthetic_families.py: gated-delta-net and full-attention
blocks, experts with a shared expert, an MTP block) runs as the whole model
and as chains of 1 to 4 stages cut off the recurrent pattern, with a stage of
two blocks (the least a stage may have: one of each kind) and a last stage
that holds the MTP block; every chain must give the whole model's 64 greedy
tokens (the splits and a headless run are rows of
tests/model/test_architectures.py). Every run starts from an empty cache
(prefix reuse is not exercised: a recurrent stage keeps all of its state or
nothing, see the family module).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ggufpipe_agent.errors import EngineError, ModelError, UnsupportedArchitecture
from ggufpipe_agent.gguf.architectures import check_plan, check_split
from ggufpipe_agent.gguf.families import qwen3next as family
from ggufpipe_agent.gguf.header import read_header
from ggufpipe_agent.stagefiles import build as stagefile
from ggufpipe_agent.stagefiles.build import ensure_stage_file
from tests.support.arch_harness import OPTIONS, assert_per_layer_refused, model_path
from tests.support.stage_chain import Chain
from tests.support.synthetic import HEADS
from tests.support.synthetic_families import ARRAY_PATTERN, FAMILIES, write_model

A = family.ARCH
MODEL = "qwen3next interval+mtp"


def test_stage_files_carry_the_pattern_and_their_mtp_blocks(model, tmp_path_factory, tmp_path):
    path = model
    flags = list(FAMILIES[MODEL].recurrent)
    first = read_header(ensure_stage_file(path, 0, 5, tmp_path))
    assert first.get(f"{A}.attention.recurrent_layers") == flags[0:5]  # 3 is full attention
    assert first.get(f"{A}.nextn_predict_layers") == 0  # block 4 is no MTP block here
    assert first.get(f"{A}.block_count") == 5
    last = read_header(ensure_stage_file(path, 5, 17, tmp_path))
    assert last.get(f"{A}.attention.recurrent_layers") == [*flags[5:16], False]
    assert last.get(f"{A}.nextn_predict_layers") == 1
    assert last.get(f"{A}.block_count") == 12
    assert any(tensor.name.startswith("blk.11.nextn.") for tensor in last.tensors)
    # a source that has the per-layer array: the stage writer slices it
    array = read_header(ensure_stage_file(model_path(tmp_path_factory, "qwen3next array"), 2, 6, tmp_path))
    assert array.get(f"{A}.attention.recurrent_layers") == list(ARRAY_PATTERN[2:6])
    assert array.get(f"{A}.nextn_predict_layers") is None


def test_split_without_the_overrides_fails(model, tmp_path, monkeypatch):
    """The control: renumbered blocks classified by their new index (interval
    4) or a trunk block taken for the MTP block are other tensors than llama.cpp
    expects, and the stage does not load."""
    monkeypatch.setattr(stagefile, "stage_metadata_overrides", lambda *_: {})
    with pytest.raises(EngineError, match="could not load"):
        Chain(model, [(0, 5), (5, 17)], OPTIONS, cache_dir=tmp_path / "none")


def test_split_without_the_mtp_count_fails(model, tmp_path, monkeypatch):
    overrides = family.ARCHITECTURE.overrides
    assert overrides is not None

    def pattern_only(get, start, end):
        found = overrides(get, start, end)
        found.pop(family.NEXTN_KEY, None)
        return found

    monkeypatch.setattr(stagefile, "stage_metadata_overrides", lambda _arch, *args: pattern_only(*args))
    with pytest.raises(EngineError, match="could not load"):
        Chain(model, [(0, 9), (9, 17)], OPTIONS, cache_dir=tmp_path / "no-nextn")


# ------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("name", "start", "end", "reason"),
    [
        pytest.param("interval+mtp", 16, 17, "MTP blocks only", id="the MTP block alone"),
        pytest.param("interval+mtp", 0, 3, "all recurrent", id="recurrent blocks only"),
        pytest.param("interval+mtp", 7, 8, "all full-attention", id="one full-attention block"),
        pytest.param("interval+mtp", 15, 17, "all full-attention", id="an attention block and MTP"),
        pytest.param("array", 5, 7, "all full-attention", id="array: attention blocks only"),
    ],
)
def test_refused_before_anything_is_written(tmp_path_factory, tmp_path, name, start, end, reason):
    path = model_path(tmp_path_factory, f"qwen3next {name}")
    cache = tmp_path / "cache"
    with pytest.raises(UnsupportedArchitecture, match=reason):
        ensure_stage_file(path, start, end, cache)
    with pytest.raises(UnsupportedArchitecture, match=reason):
        Chain(path, [(start, end)], OPTIONS, cache)
    assert not cache.exists(), "nothing may be written for a refused split"


def _metadata(**extra) -> dict:
    header = {
        f"{A}.block_count": 50,
        f"{A}.nextn_predict_layers": 2,
        f"{A}.full_attention_interval": 4,
        f"{A}.ssm.conv_kernel": 4,
    }
    return {**header, **{f"{A}.{key}": value for key, value in extra.items()}}


def test_cut_between_mtp_blocks_is_refused():
    get = _metadata().get
    check_split(A, get, 0, 24, "two mtp")  # trunk blocks 0..47
    check_split(A, get, 24, 50, "two mtp")
    with pytest.raises(UnsupportedArchitecture, match="falls between the multi-token-prediction"):
        check_split(A, get, 24, 49, "two mtp")
    with pytest.raises(UnsupportedArchitecture, match="MTP blocks only"):
        check_split(A, get, 48, 50, "two mtp")


@pytest.mark.parametrize("key", [key.removeprefix(f"{A}.") for key in family.UNIFORM_KEYS])
def test_per_layer_counts_that_differ_are_refused(key):
    assert_per_layer_refused(A, _metadata(), key, [8] * 49 + [4], (0, 24), uniform=True)


def test_per_layer_head_counts_that_differ_are_refused_before_a_file_is_written(tmp_path):
    counts = [HEADS] * 8 + [HEADS // 2] * 9
    path = write_model(tmp_path / "heads.gguf", MODEL, metadata={f"{A}.attention.head_count": counts})
    cache = tmp_path / "cache"
    with pytest.raises(UnsupportedArchitecture, match="head_count differs between blocks"):
        ensure_stage_file(path, 0, 9, cache)
    assert not cache.exists()


def test_pattern_of_the_wrong_length_and_a_zero_interval_are_refused():
    wrong = _metadata(**{"attention.recurrent_layers": [True] * 49}).get
    with pytest.raises(ModelError, match="49 entries for 50 blocks"):
        check_split(A, wrong, 0, 24, "odd")
    zero = _metadata(full_attention_interval=0).get
    with pytest.raises(ModelError, match="divides by it"):
        check_split(A, zero, 0, 24, "zero")


def test_plan_from_model_facts_leaves_the_pattern_to_the_agents():
    """The orchestrator knows the block count only: it cannot tell the kinds
    apart and lets the agents refuse from the file."""
    facts = SimpleNamespace(architecture=A, block_count=49, hidden_dim=2048, head_count=16, key_length=256)
    check_plan(facts, [(0, 1), (1, 49)], "80b")
