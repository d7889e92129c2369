"""qwen3moe (Qwen3-30B-A3B, 235B-A22B, Coder-480B) splits exactly; what cannot is refused.

The rules and the llama.cpp lines they come from are in
:mod:`ggufpipe_agent.gguf.families.qwen3moe`: nothing to carry (the block
count only picks a model-type label), and a split of a file whose per-layer
head or expert counts differ between blocks is refused, because llama.cpp
reads layer 0's value for every block and a stage's layer 0 is another block.

The model is a synthetic 8-block GGUF (tests/support/synthetic_qwen3moe.py).
There is no override whose removal the control could show; the controls show
instead that the comparison notices one block skipped, and a stage that
routes one more expert than the whole model.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from ggufpipe_agent.errors import UnsupportedArchitecture
from ggufpipe_agent.gguf.architectures import SUPPORTED, check_split
from ggufpipe_agent.gguf.header import read_header
from ggufpipe_agent.stagefiles import writer as stagefile
from ggufpipe_agent.stagefiles.writer import ensure_stage_file
from ggufpipe_agent.wire.protocol import EngineOptions
from tests.model.test_architectures import ggufpipe_tui, write_inventory
from tests.support import synthetic, synthetic_qwen3moe
from tests.support.common import whole_model_greedy
from tests.support.stage_chain import Chain

ARCH = "qwen3moe"
STEPS = 64
UBATCH = 16
CONTEXT = 256
OPTIONS = EngineOptions(n_ctx=CONTEXT, n_batch=CONTEXT, n_ubatch=UBATCH, threads=1)
PROMPT = synthetic.prompt_tokens(3 * UBATCH - 5)  # three ubatches, the last one partial
BLOCKS = synthetic_qwen3moe.BLOCKS

SPLITS = {
    "2 stages": [(0, 3), (3, 8)],
    "3 stages, one-block ends": [(0, 1), (1, 7), (7, 8)],
    "3 stages, one-block middle": [(0, 2), (2, 3), (3, 8)],
    "4 stages, uneven": [(0, 1), (1, 4), (4, 5), (5, 8)],
    "4 stages, one-block ends": [(0, 1), (1, 6), (6, 7), (7, 8)],
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic_qwen3moe.write_model(tmp_path_factory.mktemp(ARCH) / "synthetic-qwen3moe.gguf")


@pytest.fixture(scope="module")
def reference(model: Path) -> list[int]:
    tokens = whole_model_greedy(model, PROMPT, STEPS, n_ctx=CONTEXT, n_ubatch=UBATCH)
    assert len(set(tokens)) >= 16, f"the random {ARCH} model collapsed: {tokens}"
    return tokens


def run_chain(path: Path, splits: list[tuple[int, int]], cache_dir: Path | None = None) -> list[int]:
    chain = Chain(path, splits, OPTIONS, cache_dir=cache_dir)
    try:
        return chain.generate(PROMPT, STEPS)
    finally:
        chain.close()


def test_qwen3moe_is_accepted():
    assert ARCH in SUPPORTED
    assert SUPPORTED[ARCH].overrides is None and SUPPORTED[ARCH].keep_tensors == ()


def test_qwen3moe_whole_model_as_one_stage_matches(model, reference):
    assert run_chain(model, [(0, BLOCKS)]) == reference


@pytest.mark.parametrize("splits", list(SPLITS.values()), ids=list(SPLITS))
def test_qwen3moe_split_matches_whole_model(model, reference, splits):
    assert run_chain(model, splits) == reference


def test_qwen3moe_stage_file_is_the_renumbered_blocks(model):
    stage = read_header(ensure_stage_file(model, 3, 5))
    assert stage.get("qwen3moe.block_count") == 2
    assert stage.get("qwen3moe.expert_used_count") == synthetic_qwen3moe.EXPERTS_USED
    assert stage.get("qwen3moe.attention.key_length") == synthetic_qwen3moe.HEAD_DIM


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
    assert run_chain(model, SPLITS["2 stages"], cache_dir=tmp_path) != reference


# ------------------------------------------------------------- refusals

UNIFORM = {"qwen3moe.block_count": 48, "qwen3moe.attention.head_count": 32, "qwen3moe.expert_used_count": 8}


@pytest.mark.parametrize(
    ("key", "values"),
    [
        ("attention.head_count", [32] * 24 + [16] * 24),
        ("attention.head_count_kv", [4] * 47 + [8]),
        ("expert_used_count", [8] * 40 + [4] * 8),
        ("expert_feed_forward_length", [768] * 47 + [1536]),
        ("feed_forward_length", [6144] + [3072] * 47),
    ],
)
def test_qwen3moe_non_uniform_per_layer_counts_are_refused(key, values):
    get = {**UNIFORM, f"qwen3moe.{key}": values}.get
    check_split(ARCH, get, 0, 48, "odd")  # the whole model is the source file itself
    with pytest.raises(UnsupportedArchitecture, match=rf"qwen3moe\.{key} differs between blocks"):
        check_split(ARCH, get, 0, 24, "odd")
    with pytest.raises(UnsupportedArchitecture, match="runs only as one stage"):
        check_split(ARCH, get, 24, 48, "odd")


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
    source = synthetic_qwen3moe.write_model(tmp_path / "odd.gguf", metadata={key: values})
    cache = tmp_path / "cache"
    with pytest.raises(UnsupportedArchitecture, match=f"{key} differs between blocks"):
        ensure_stage_file(source, 0, 4, cache)
    assert not cache.exists()


def test_qwen3moe_non_uniform_chain_is_refused_before_anything_loads(tmp_path):
    kv_heads = [2] * (BLOCKS - 1) + [4]
    source = synthetic_qwen3moe.write_model(
        tmp_path / "odd.gguf", metadata={"attention.head_count_kv": kv_heads}
    )
    cache = tmp_path / "cache"
    with pytest.raises(UnsupportedArchitecture, match="runs only as one stage"):
        Chain(source, [(0, 4), (4, BLOCKS)], OPTIONS, cache_dir=cache)
    assert not cache.exists()


# --------------------------------------------------------- command line

CLI_PROMPT = "The rain in Spain stays mainly in the plain, then the river runs on."


def test_qwen3moe_runs_headless_with_three_local_stages(model, tmp_path, no_agent_left):
    splits = [(0, 2), (2, 3), (3, BLOCKS)]
    inventory = write_inventory(tmp_path, model, splits, "max_tokens: 32, ignore_eos: true, chat: false")
    done = ggufpipe_tui(inventory, CLI_PROMPT, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["architecture"] == ARCH and result["outcome"] == "completed", result
    prompt = result["prompt_tokens"]
    assert len(prompt) > 2 * UBATCH, prompt  # the prompt spans three ubatches
    expected = whole_model_greedy(model, prompt, 32, n_ctx=CONTEXT, n_ubatch=UBATCH)
    assert len(set(expected)) >= 8, expected
    assert result["tokens"] == expected
