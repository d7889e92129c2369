"""deepseek2 (DeepSeek V2/V3/R1/V3.1, Kimi K2) splits exactly; what cannot is refused.

The rules and the llama.cpp lines they come from are in
:mod:`ggufpipe_agent.gguf.families.deepseek2`. A stage file carries the
leading dense block count clamped to the stage, the number of multi-token
prediction (MTP) blocks inside the stage (0 but in the last stage), the
expert gating function the whole model uses, and, for a lite model,
``q_lora_rank = 0``. Refused before anything is written: a stage whose
trunk llama.cpp would take for "lite" (26 or 27 blocks, or 48 with a
128256-token vocabulary) in a model that is not, a stage of MTP blocks
only (llama.cpp aborts the process on it), a cut between MTP blocks, and
non-uniform per-layer head or expert counts.

The models (tests/support/synthetic_families.py): a V3-like GGUF of 29
trunk blocks (3 dense, 26 MoE) and 1 MTP block, so that it has stages of
26 and 27 blocks, and a V2-Lite-like GGUF of 26 blocks. Their splits and
the headless run are rows of tests/model/test_architectures.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import pytest

from ggufpipe_agent.errors import GgufpipeError, UnsupportedArchitecture
from ggufpipe_agent.gguf import architectures
from ggufpipe_agent.gguf.architectures import SUPPORTED, check_plan, check_split, stage_metadata_overrides
from ggufpipe_agent.gguf.families import deepseek2
from ggufpipe_agent.gguf.header import read_header
from ggufpipe_agent.stagefiles.build import ensure_stage_file
from tests.support.arch_harness import (
    assert_per_layer_refused,
    greedy_reference,
    model_path,
    per_layer_cases,
    run_chain,
)
from tests.support.synthetic_families import FAMILIES

ARCH = MODEL = "deepseek2"
BLOCKS = FAMILIES[MODEL].blocks  # 30: blocks 0-2 dense, 3-28 MoE, 29 MTP
LITE_BLOCKS = FAMILIES["deepseek2 lite"].blocks  # 26: block 0 dense
#: Splits of tests/model/test_architectures.py the controls run.
INSIDE_THE_DENSE_BLOCKS = [(0, 1), (1, 4), (4, BLOCKS)]  # the last stage: 26 blocks with the MTP block
AFTER_THE_DENSE_BLOCKS = [(0, 3), (3, 16), (16, BLOCKS)]
LITE_TWO_STAGES = [(0, 13), (13, LITE_BLOCKS)]


@pytest.fixture(scope="module")
def lite_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_path(tmp_path_factory, "deepseek2 lite")


@pytest.fixture(scope="module")
def lite_reference(lite_model: Path) -> list[int]:
    return greedy_reference(lite_model)


def outcome(path: Path, splits: list[tuple[int, int]], cache_dir: Path) -> list[int] | str:
    """The chain's tokens, or why it could not run."""
    try:
        return run_chain(path, splits, cache_dir)
    except GgufpipeError as error:
        return f"failed: {error}"


def test_deepseek2_is_accepted():
    assert ARCH in SUPPORTED
    assert SUPPORTED[ARCH].keep_tensors == ()


def test_deepseek2_stage_files_carry_their_share(model, lite_model):
    def meta(path: Path, start: int, end: int) -> dict[str, object]:
        header = read_header(ensure_stage_file(path, start, end))
        keys = ("block_count", "leading_dense_block_count", "nextn_predict_layers", "expert_gating_func")
        out = {key: header.get(f"{ARCH}.{key}") for key in keys}
        out["q_lora_rank"] = header.get(f"{ARCH}.attention.q_lora_rank")
        return out

    sigmoid, softmax = deepseek2.GATING_SIGMOID, deepseek2.GATING_SOFTMAX
    q = FAMILIES[MODEL].keys["attention.q_lora_rank"]
    assert meta(model, 0, 2) == {  # inside the dense blocks: all dense
        "block_count": 2,
        "leading_dense_block_count": 2,
        "nextn_predict_layers": 0,
        "expert_gating_func": sigmoid,
        "q_lora_rank": q,
    }
    assert meta(model, 1, 4)["leading_dense_block_count"] == 2  # blocks 1, 2 dense, 3 MoE
    assert meta(model, 3, 16)["leading_dense_block_count"] == 0
    assert meta(model, 3, 16)["nextn_predict_layers"] == 0  # not the model's 1: its last block runs
    assert meta(model, 4, BLOCKS) == {
        "block_count": 26,  # 25 trunk blocks: not "lite"
        "leading_dense_block_count": 0,
        "nextn_predict_layers": 1,
        "expert_gating_func": sigmoid,
        "q_lora_rank": q,
    }
    lite = meta(lite_model, 1, 25)
    assert lite["q_lora_rank"] == 0  # a 24-block stage is not "lite" but reads q_lora_rank
    assert lite["expert_gating_func"] == softmax  # the whole model's default, written down
    assert lite["nextn_predict_layers"] is None  # the model has no MTP block
    stage = read_header(ensure_stage_file(model, 4, BLOCKS))
    assert "blk.25.nextn.eh_proj.weight" in {tensor.name for tensor in stage.tensors}


# ------------------------------------------------------------- controls


def without(monkeypatch: pytest.MonkeyPatch, drop: set[str] | None = None, check: bool = True) -> None:
    """The family without some of its overrides (all when ``drop`` is None)
    or without its check."""
    family = SUPPORTED[ARCH]
    original = family.overrides
    assert original is not None

    def overrides(get, start, end):
        if drop is None:
            return {}
        return {key: value for key, value in original(get, start, end).items() if key not in drop}

    changed = dataclasses.replace(family, overrides=overrides, check=family.check if check else None)
    monkeypatch.setitem(architectures.SUPPORTED, ARCH, changed)


def test_deepseek2_split_without_the_overrides_differs(model, reference, tmp_path, monkeypatch):
    """The control: renumbered blocks with the copied metadata make llama.cpp
    look for dense tensors in MoE blocks (or compute something else)."""
    without(monkeypatch)
    splits = INSIDE_THE_DENSE_BLOCKS
    assert outcome(model, splits, tmp_path) != reference


def test_deepseek2_split_without_the_dense_count_differs(model, reference, tmp_path, monkeypatch):
    without(monkeypatch, {f"{ARCH}.leading_dense_block_count"})
    assert outcome(model, AFTER_THE_DENSE_BLOCKS, tmp_path) != reference


def test_deepseek2_split_with_the_models_nextn_count_differs(model, reference, tmp_path, monkeypatch):
    """Copying ``nextn_predict_layers = 1`` into every stage drops the last
    block of each stage before the last one."""
    without(monkeypatch, {f"{ARCH}.nextn_predict_layers"})
    assert outcome(model, AFTER_THE_DENSE_BLOCKS, tmp_path) != reference


def test_deepseek2_stage_with_the_default_gating_differs(model, reference, tmp_path, monkeypatch):
    """What a stage would compute if it fell back on another gating function
    than the whole model's (a 20-block stage of GLM-4.7-Flash without the key
    would take softmax for the model's sigmoid): the comparison notices."""
    family = SUPPORTED[ARCH]
    original = family.overrides
    assert original is not None

    def softmax_gating(get, start, end):
        gating = (deepseek2.GATING_SOFTMAX, gguf.GGUFValueType.UINT32, None)
        return {**original(get, start, end), f"{ARCH}.expert_gating_func": gating}

    monkeypatch.setitem(architectures.SUPPORTED, ARCH, dataclasses.replace(family, overrides=softmax_gating))
    result = outcome(model, AFTER_THE_DENSE_BLOCKS, tmp_path)
    assert isinstance(result, list) and result != reference


def test_deepseek2_lite_split_without_q_lora_rank_fails(lite_model, lite_reference, tmp_path, monkeypatch):
    """A stage of a lite model that is not 26 or 27 blocks reads q_lora_rank,
    which a lite GGUF does not have."""
    without(monkeypatch, {f"{ARCH}.attention.q_lora_rank"})
    result = outcome(lite_model, LITE_TWO_STAGES, tmp_path)
    assert result != lite_reference and str(result).startswith("failed"), result


def test_deepseek2_lite_looking_stage_fails_without_the_check(model, tmp_path, monkeypatch):
    """The control for the refusal: a 27-block stage of this model is taken
    for lite and does not load (it looks for attn_q)."""
    without(monkeypatch, check=False)
    assert str(outcome(model, [(0, 3), (3, BLOCKS)], tmp_path)).startswith("failed")


# ------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("start", "end", "reason"),
    [
        (3, BLOCKS, "a stage of 26 blocks would be taken for a lite deepseek2 model"),  # 27, 1 MTP
        (2, BLOCKS, "a stage of 27 blocks would be taken for a lite"),  # 28 with the MTP block
        (0, 27, "a stage of 27 blocks would be taken for a lite"),
        (1, 27, "a stage of 26 blocks would be taken for a lite"),
        (BLOCKS - 1, BLOCKS, "a stage of only those would run no block"),
    ],
)
def test_deepseek2_impossible_stage_is_refused_before_a_stage_file_is_written(
    model, tmp_path, start, end, reason
):
    cache = tmp_path / "cache"
    with pytest.raises(UnsupportedArchitecture, match=reason):
        ensure_stage_file(model, start, end, cache)
    assert not cache.exists()


V3 = {  # the metadata llama.cpp reads for DeepSeek V3 with its MTP block
    "deepseek2.block_count": 62,
    "deepseek2.nextn_predict_layers": 1,
    "deepseek2.leading_dense_block_count": 3,
    "deepseek2.attention.q_lora_rank": 1536,
    "deepseek2.attention.head_count": 128,
    "deepseek2.expert_used_count": 8,
    "deepseek2.vocab_size": 129280,
}


def test_deepseek2_v3_split_rules_from_metadata():
    get = V3.get
    check_split(ARCH, get, 0, 62, "v3")
    check_split(ARCH, get, 0, 31, "v3")
    check_split(ARCH, get, 31, 62, "v3")
    check_split(ARCH, get, 36, 62, "v3")  # 26 blocks, 25 trunk
    with pytest.raises(UnsupportedArchitecture, match="26 blocks would be taken for a lite"):
        check_split(ARCH, get, 35, 62, "v3")
    with pytest.raises(UnsupportedArchitecture, match="27 blocks would be taken for a lite"):
        check_split(ARCH, get, 10, 37, "v3")
    with pytest.raises(UnsupportedArchitecture, match="only those would run no block"):
        check_split(ARCH, get, 61, 62, "v3")
    # Two MTP blocks: a cut between them leaves a stage whose last block is never run.
    two = {**V3, "deepseek2.block_count": 63, "deepseek2.nextn_predict_layers": 2}.get
    check_split(ARCH, two, 40, 63, "mtp2")
    with pytest.raises(UnsupportedArchitecture, match="a cut between them"):
        check_split(ARCH, two, 40, 62, "mtp2")


def test_deepseek2_lite_by_vocabulary_and_q_lora_rank_from_metadata():
    kanana = {**V3, "deepseek2.block_count": 60, "deepseek2.nextn_predict_layers": 0}
    check_split(ARCH, {**kanana, "deepseek2.vocab_size": 129280}.get, 0, 48, "48")
    with pytest.raises(UnsupportedArchitecture, match="48 blocks with a 128256-token vocabulary"):
        check_split(ARCH, {**kanana, "deepseek2.vocab_size": 128256}.get, 0, 48, "48")
    # A model that does not use low-rank queries loads attn_q in a lite-looking stage too.
    check_split(ARCH, {**kanana, "deepseek2.attention.q_lora_rank": 0}.get, 0, 27, "q0")
    # A lite model (27 blocks) splits anywhere: its stages all read q_lora_rank = 0.
    lite = {**kanana, "deepseek2.block_count": 27}
    del lite["deepseek2.attention.q_lora_rank"]
    check_split(ARCH, lite.get, 0, 13, "lite")
    assert stage_metadata_overrides(ARCH, lite.get, 0, 13)[f"{ARCH}.attention.q_lora_rank"][0] == 0
    assert f"{ARCH}.attention.q_lora_rank" not in stage_metadata_overrides(ARCH, kanana.get, 0, 13)


def test_deepseek2_default_gating_is_written_from_the_whole_model():
    """llama.cpp picks sigmoid for 47 or 48 trunk blocks with a 154880-token
    vocabulary (GLM-4.7-Flash) and softmax otherwise; a stage of another
    count would pick softmax, so every stage writes the model's choice."""
    glm = {
        "deepseek2.block_count": 48,
        "deepseek2.nextn_predict_layers": 1,
        "deepseek2.leading_dense_block_count": 1,
        "deepseek2.vocab_size": 154880,
    }
    gating = f"{ARCH}.expert_gating_func"
    assert stage_metadata_overrides(ARCH, glm.get, 0, 20)[gating][0] == deepseek2.GATING_SIGMOID
    v2 = {**glm, "deepseek2.block_count": 60, "deepseek2.vocab_size": 102400}
    assert stage_metadata_overrides(ARCH, v2.get, 0, 20)[gating][0] == deepseek2.GATING_SOFTMAX
    explicit = {**v2, gating: 3}
    assert stage_metadata_overrides(ARCH, explicit.get, 0, 20)[gating] == (3, gguf.GGUFValueType.UINT32, None)


@pytest.mark.parametrize(
    ("key", "values"),
    per_layer_cases(62, head=(128, 64), kv=(1, 2), used=(8, 6), expert_ff=(2048, 1024), ff=(18432, 2048)),
)
def test_deepseek2_non_uniform_per_layer_counts_are_refused(key, values):
    assert_per_layer_refused(ARCH, V3, key, values, (0, 31), uniform=True)


def test_deepseek2_lite_looking_plan_is_refused_from_model_facts():
    """The orchestrator knows the block count, not q_lora_rank nor the MTP
    count: a stage of 26 or 27 blocks of a larger model is refused there."""
    facts = dataclasses.make_dataclass(
        "Facts", ["architecture", "block_count", "hidden_dim", "head_count", "key_length"]
    )(ARCH, 62, 7168, 128, 576)
    check_plan(facts, [(0, 31), (31, 62)], "v3")
    with pytest.raises(UnsupportedArchitecture, match="lite"):
        check_plan(facts, [(0, 35), (35, 62)], "v3")
