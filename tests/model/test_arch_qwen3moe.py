"""qwen3moe (Qwen3-30B-A3B, 235B-A22B, Coder-480B) splits exactly; what cannot is refused.

The rules and the llama.cpp lines they come from are in
:mod:`ggufpipe_agent.gguf.families.qwen3moe`: nothing to carry (the block
count only picks a model-type label), and a split of a file whose per-layer
head or expert counts differ between blocks is refused, because llama.cpp
reads layer 0's value for every block and a stage's layer 0 is another block.

The model is a synthetic 8-block GGUF (tests/support/synthetic_families.py);
its splits and its headless run are rows of tests/model/test_architectures.py.
There is no override whose removal the control could show; the controls show
instead that the comparison notices one block skipped, and a stage that
routes one more expert than the whole model.
"""

from __future__ import annotations

import gguf
import pytest

from ggufpipe_agent.errors import UnsupportedArchitecture
from ggufpipe_agent.gguf.architectures import SUPPORTED, check_split
from ggufpipe_agent.gguf.header import read_header
from ggufpipe_agent.stagefiles import build as stagefile
from ggufpipe_agent.stagefiles.build import ensure_stage_file
from tests.support.arch_harness import OPTIONS, assert_per_layer_refused, per_layer_cases, run_chain
from tests.support.stage_chain import Chain
from tests.support.synthetic import EXPERTS_USED
from tests.support.synthetic_families import FAMILIES, write_model

ARCH = MODEL = "qwen3moe"
BLOCKS = FAMILIES[MODEL].blocks
#: A split of tests/model/test_architectures.py the controls run.
TWO_STAGES = [(0, 3), (3, 8)]


def test_qwen3moe_is_accepted():
    assert ARCH in SUPPORTED
    assert SUPPORTED[ARCH].overrides is None and SUPPORTED[ARCH].keep_tensors == ()


def test_qwen3moe_stage_file_is_the_renumbered_blocks(model):
    stage = read_header(ensure_stage_file(model, 3, 5))
    assert stage.get("qwen3moe.block_count") == 2
    assert stage.get("qwen3moe.expert_used_count") == EXPERTS_USED
    assert stage.get("qwen3moe.attention.key_length") == FAMILIES[MODEL].head_dim


# ------------------------------------------------------------- controls


def test_qwen3moe_split_one_block_off_differs(model, reference, tmp_path):
    """The control: a chain that skips one of the 8 blocks computes something
    else, and the comparison notices (float16 activations between stages do
    not change a token of this model: its logits are far apart)."""
    assert run_chain(model, [(0, 3), (4, BLOCKS)], cache_dir=tmp_path) != reference


def test_qwen3moe_stage_routing_one_more_expert_differs(model, reference, tmp_path, monkeypatch):
    """The control for the refusal below: a stage whose blocks read another
    expert count than the whole model's layer 0 computes something else."""
    extra = {"qwen3moe.expert_used_count": (3, gguf.GGUFValueType.UINT32, None)}
    monkeypatch.setattr(
        stagefile, "stage_metadata_overrides", lambda _a, _g, start, _e: extra if start == 3 else {}
    )
    assert run_chain(model, TWO_STAGES, cache_dir=tmp_path) != reference


# ------------------------------------------------------------- refusals

UNIFORM = {"qwen3moe.block_count": 48, "qwen3moe.attention.head_count": 32, "qwen3moe.expert_used_count": 8}


@pytest.mark.parametrize(
    ("key", "values"),
    per_layer_cases(48, head=(32, 16), kv=(4, 8), used=(8, 4), expert_ff=(768, 1536), ff=(6144, 3072)),
)
def test_qwen3moe_non_uniform_per_layer_counts_are_refused(key, values):
    assert_per_layer_refused(ARCH, UNIFORM, key, values, (0, 24), rest=(24, 48))


def test_qwen3moe_uniform_per_layer_arrays_are_fine():
    get = {**UNIFORM, "qwen3moe.expert_used_count": [8] * 48, "qwen3moe.attention.head_count": [32] * 48}.get
    check_split(ARCH, get, 5, 17, "uniform")


def test_qwen3moe_multi_token_prediction_blocks_are_refused():
    get = {**UNIFORM, "qwen3moe.nextn_predict_layers": 1}.get
    with pytest.raises(UnsupportedArchitecture, match="nextn_predict_layers = 1"):
        check_split(ARCH, get, 0, 24, "mtp")


@pytest.mark.parametrize(
    ("key", "values"),
    [("expert_used_count", [2] * (BLOCKS - 1) + [3]), ("attention.head_count_kv", [2] * (BLOCKS - 1) + [4])],
)
def test_qwen3moe_non_uniform_model_is_refused_before_a_stage_file_is_written(tmp_path, key, values):
    source = write_model(tmp_path / "odd.gguf", MODEL, metadata={key: values})
    cache = tmp_path / "cache"
    with pytest.raises(UnsupportedArchitecture, match=f"{key} differs between blocks"):
        ensure_stage_file(source, 0, 4, cache)
    assert not cache.exists()


def test_qwen3moe_non_uniform_chain_is_refused_before_anything_loads(tmp_path):
    kv_heads = [2] * (BLOCKS - 1) + [4]
    source = write_model(tmp_path / "odd.gguf", MODEL, metadata={"attention.head_count_kv": kv_heads})
    cache = tmp_path / "cache"
    with pytest.raises(UnsupportedArchitecture, match="runs only as one stage"):
        Chain(source, [(0, 4), (4, BLOCKS)], OPTIONS, cache_dir=cache)
    assert not cache.exists()
