"""qwen3next (Qwen3-Next) is split-exact; the shapes that cannot be are refused.

The rules and the llama.cpp lines they come from are in
:mod:`ggufpipe_agent.gguf.families.qwen3next`. A synthetic Qwen3-Next
(tests/support/synthetic_qwen3next.py: gated-delta-net and full-attention
blocks, experts with a shared expert, an MTP block) runs as the whole model
and as chains of 1 to 4 stages cut off the recurrent pattern, with a stage of
two blocks (the least a stage may have: one of each kind) and a last stage
that holds the MTP block; every chain must give the whole model's 64 greedy
tokens. Every run starts from an empty cache (prefix reuse is not exercised:
a recurrent stage keeps all of its state or nothing, see the family module).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from ggufpipe_agent.errors import EngineError, ModelError, UnsupportedArchitecture
from ggufpipe_agent.gguf.architectures import check_plan, check_split
from ggufpipe_agent.gguf.families import qwen3next as family
from ggufpipe_agent.gguf.header import read_header
from ggufpipe_agent.stagefiles import writer as stagefile
from ggufpipe_agent.stagefiles.writer import ensure_stage_file
from ggufpipe_agent.wire.protocol import EngineOptions
from tests.model.test_architectures import ggufpipe_tui, write_inventory
from tests.support import synthetic, synthetic_qwen3next
from tests.support.common import whole_model_greedy
from tests.support.stage_chain import Chain

STEPS = 64
UBATCH = 16
CONTEXT = 256
OPTIONS = EngineOptions(n_ctx=CONTEXT, n_batch=CONTEXT, n_ubatch=UBATCH, threads=1)
PROMPT = synthetic.prompt_tokens(3 * UBATCH - 5)  # three ubatches, the last one partial
A = family.ARCH

#: The synthetic models: 16 trunk blocks by interval 4 (full attention at 3,
#: 7, 11, 15) and the MTP block 16; 10 blocks by an irregular per-layer array
#: (full attention at 1, 5, 6, 9) without MTP; the first with its per-layer
#: counts written as (uniform) arrays.
MODELS = {
    "interval+mtp": {"pattern": "interval", "mtp": True},
    "array": {"pattern": "array", "mtp": False},
    "uniform arrays": {
        "pattern": "interval",
        "mtp": True,
        "extra": {
            f"{A}.attention.head_count": [synthetic_qwen3next.HEADS] * 17,
            f"{A}.attention.head_count_kv": [synthetic_qwen3next.KV_HEADS] * 17,
            # expert_used_count as an array: ggufpipe_agent/gguf/memory.py cannot read it yet
        },
    },
}
SPLITS = {
    "interval+mtp": {
        "1 stage": [(0, 17)],
        "2 stages off the period": [(0, 5), (5, 17)],
        "a two-block stage": [(0, 6), (6, 8), (8, 17)],
        "4 stages off the period": [(0, 5), (5, 10), (10, 13), (13, 17)],
        "4 stages on the period": [(0, 4), (4, 8), (8, 12), (12, 17)],
        "last stage: two trunk blocks and the MTP block": [(0, 9), (9, 14), (14, 17)],
    },
    "array": {
        "4 stages, two-block ends": [(0, 2), (2, 6), (6, 8), (8, 10)],
        "2 stages": [(0, 5), (5, 10)],
    },
    "uniform arrays": {"3 stages": [(0, 4), (4, 10), (10, 17)]},
}
CASES = [
    pytest.param(model, splits, id=f"{model}: {name}")
    for model, shapes in SPLITS.items()
    for name, splits in shapes.items()
]

_models: dict[str, Path] = {}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("qwen3next")


def model(directory: Path, name: str) -> Path:
    if name not in _models:
        path = directory / f"synthetic-qwen3next-{name.replace(' ', '-').replace('+', '-')}.gguf"
        _models[name] = synthetic_qwen3next.write_model(path, **MODELS[name])  # type: ignore[arg-type]
    return _models[name]


def reference(directory: Path, name: str) -> list[int]:
    """The whole model's greedy tokens (whole_model_greedy caches them per session)."""
    return whole_model_greedy(model(directory, name), PROMPT, STEPS, n_ctx=CONTEXT, n_ubatch=UBATCH)


def run_chain(path: Path, splits: list[tuple[int, int]], cache_dir: Path) -> list[int]:
    chain = Chain(path, splits, OPTIONS, cache_dir=cache_dir)
    try:
        return chain.generate(PROMPT, STEPS)
    finally:
        chain.close()


@pytest.mark.parametrize(("name", "splits"), CASES)
def test_split_matches_whole_model(models_dir, tmp_path, name, splits):
    expected = reference(models_dir, name)
    assert len(set(expected)) >= 16, f"the random {name} model collapsed: {expected}"
    assert run_chain(model(models_dir, name), splits, tmp_path) == expected


def test_stage_files_carry_the_pattern_and_their_mtp_blocks(models_dir, tmp_path):
    path = model(models_dir, "interval+mtp")
    flags = synthetic_qwen3next.recurrent_flags("interval")
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
    array = read_header(ensure_stage_file(model(models_dir, "array"), 2, 6, tmp_path))
    assert array.get(f"{A}.attention.recurrent_layers") == list(synthetic_qwen3next.ARRAY_PATTERN[2:6])
    assert array.get(f"{A}.nextn_predict_layers") is None


def test_split_without_the_overrides_fails(models_dir, tmp_path, monkeypatch):
    """The control: renumbered blocks classified by their new index (interval
    4) or a trunk block taken for the MTP block are other tensors than llama.cpp
    expects, and the stage does not load."""
    path = model(models_dir, "interval+mtp")
    monkeypatch.setattr(stagefile, "stage_metadata_overrides", lambda *_: {})
    with pytest.raises(EngineError, match="could not load"):
        Chain(path, [(0, 5), (5, 17)], OPTIONS, cache_dir=tmp_path / "none")


def test_split_without_the_mtp_count_fails(models_dir, tmp_path, monkeypatch):
    path = model(models_dir, "interval+mtp")
    overrides = family.ARCHITECTURE.overrides
    assert overrides is not None

    def pattern_only(get, start, end):
        found = overrides(get, start, end)
        found.pop(family.NEXTN_KEY, None)
        return found

    monkeypatch.setattr(stagefile, "stage_metadata_overrides", lambda _arch, *args: pattern_only(*args))
    with pytest.raises(EngineError, match="could not load"):
        Chain(path, [(0, 9), (9, 17)], OPTIONS, cache_dir=tmp_path / "no-nextn")


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
def test_refused_before_anything_is_written(models_dir, tmp_path, name, start, end, reason):
    path = model(models_dir, name)
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
    uniform = _metadata(**{key: [8] * 50}).get
    check_split(A, uniform, 0, 24, "uniform")
    differing = _metadata(**{key: [8] * 49 + [4]}).get
    check_split(A, differing, 0, 50, "whole")  # the whole model is the source itself
    with pytest.raises(UnsupportedArchitecture, match=f"{key} differs between blocks"):
        check_split(A, differing, 0, 24, "differing")


def test_per_layer_head_counts_that_differ_are_refused_before_a_file_is_written(tmp_path):
    counts = [synthetic_qwen3next.HEADS] * 8 + [synthetic_qwen3next.HEADS // 2] * 9
    path = synthetic_qwen3next.write_model(
        tmp_path / "heads.gguf", extra={f"{A}.attention.head_count": counts}
    )
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


# ------------------------------------------------------ the command line


def test_runs_headless_with_three_local_stages(models_dir, tmp_path, no_agent_left):
    path = model(models_dir, "interval+mtp")
    splits = [(0, 5), (5, 10), (10, 17)]
    inventory = write_inventory(tmp_path, path, splits, "max_tokens: 32, ignore_eos: true, chat: false")
    done = ggufpipe_tui(inventory, "the rain in spain falls mainly on the plain, then in the hills", 300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["architecture"] == A and result["outcome"] == "completed", result
    prompt = result["prompt_tokens"]
    assert len(prompt) > 2 * UBATCH
    expected = whole_model_greedy(path, prompt, 32, n_ctx=CONTEXT, n_ubatch=UBATCH)
    assert len(set(expected)) >= 16, expected
    assert result["tokens"] == expected
