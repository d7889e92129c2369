"""Llama 4 splits exactly when every stage starts at a multiple of 4 blocks.

The synthetic model (tests/support/synthetic_llama4.py) has 17 blocks as
Maverick lays them out: experts with a shared expert on the odd blocks, dense
feed-forward on the even ones, chunked attention with no RoPE on every 4th
block (3, 7, 11, 15); a Scout-like copy has experts on every block. The rules
proven here are in ggufpipe_agent/gguf/families/llama4.py: stages start at
multiples of ``lcm(4, interleave_moe_layer_step)`` (the planner places its
cuts there) and have at least 4 blocks; every other stage is refused by name,
and so is every split of a model with ``attention.sliding_window = 0``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from ggufpipe_agent.errors import EngineError, ModelError, UnsupportedArchitecture
from ggufpipe_agent.gguf.architectures import SUPPORTED, check_plan, check_split, cut_multiple
from ggufpipe_agent.gguf.header import read_header
from ggufpipe_agent.stagefiles.writer import ensure_stage_file
from ggufpipe_agent.wire.protocol import EngineOptions
from tests.model.test_architectures import ggufpipe_tui, write_inventory
from tests.support import synthetic, synthetic_llama4
from tests.support.common import whole_model_greedy
from tests.support.stage_chain import Chain

ARCH = "llama4"
STEPS = 64
UBATCH = 16
CONTEXT = 256
OPTIONS = EngineOptions(n_ctx=CONTEXT, n_batch=CONTEXT, n_ubatch=UBATCH, threads=1)
PROMPT = synthetic.prompt_tokens(3 * UBATCH - 5)  # three ubatches, the last one partial

SPLITS = {
    "maverick: 1 stage": ("maverick", [(0, 17)]),
    "maverick: 2 stages, a 4-block first": ("maverick", [(0, 4), (4, 17)]),
    "maverick: 2 stages, a 5-block last": ("maverick", [(0, 12), (12, 17)]),
    "maverick: 3 stages": ("maverick", [(0, 8), (8, 12), (12, 17)]),
    "maverick: 4 stages": ("maverick", [(0, 4), (4, 8), (8, 12), (12, 17)]),
    "scout: 3 stages": ("scout", [(0, 4), (4, 12), (12, 17)]),
}
MOE_STEPS = {"maverick": 2, "scout": 1}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("llama4")
    return {
        name: synthetic_llama4.write_model(directory / f"synthetic-llama4-{name}.gguf", moe_step=step)
        for name, step in MOE_STEPS.items()
    }


def reference(path: Path) -> list[int]:
    tokens = whole_model_greedy(path, PROMPT, STEPS, n_ctx=CONTEXT, n_ubatch=UBATCH)
    assert len(set(tokens)) >= 16, f"the random llama4 model collapsed: {tokens}"
    return tokens


def run_chain(path: Path, splits: list[tuple[int, int]], cache_dir: Path | None = None) -> list[int]:
    chain = Chain(path, splits, OPTIONS, cache_dir=cache_dir)
    try:
        return chain.generate(PROMPT, STEPS)
    finally:
        chain.close()


@pytest.mark.parametrize(("model", "splits"), list(SPLITS.values()), ids=list(SPLITS))
def test_split_matches_whole_model(models, model, splits):
    assert run_chain(models[model], splits) == reference(models[model])


def test_stage_files_carry_the_chunked_attention_pattern(models, tmp_path):
    stage = read_header(ensure_stage_file(models["maverick"], 4, 12, tmp_path))
    assert stage.get(f"{ARCH}.attention.sliding_window_pattern") == [True, True, True, False] * 2
    assert stage.get(f"{ARCH}.block_count") == 8
    names = {tensor.name for tensor in stage.tensors}
    assert "rope_freqs.weight" in names and "blk.1.ffn_gate_shexp.weight" in names
    assert "blk.0.ffn_gate_inp.weight" not in names and "output.weight" not in names


def test_a_split_off_the_no_rope_blocks_differs(models, tmp_path, monkeypatch):
    """The control: a stage from block 6 keeps the experts where they are (a
    multiple of the MoE step) and carries the chunked-attention pattern, but
    llama.cpp leaves RoPE out of its blocks 3 and 7 (originals 9 and 13)
    instead of originals 7, 11 and 15: the refusal is needed."""
    monkeypatch.setitem(SUPPORTED, ARCH, replace(SUPPORTED[ARCH], check=None))
    path = models["maverick"]
    assert run_chain(path, [(0, 6), (6, 17)], cache_dir=tmp_path) != reference(path)


def test_a_split_off_the_moe_step_does_not_even_load(models, tmp_path, monkeypatch):
    monkeypatch.setitem(SUPPORTED, ARCH, replace(SUPPORTED[ARCH], check=None))
    with pytest.raises(EngineError, match="could not load"):
        run_chain(models["maverick"], [(0, 7), (7, 17)], cache_dir=tmp_path)


# ------------------------------------------------------------ refusals


def test_stages_start_at_multiples_of_four(models):
    get = read_header(models["maverick"]).get
    assert cut_multiple(ARCH, get) == 4
    for start in (4, 8, 12):
        check_split(ARCH, get, start, 17, "m")
        check_split(ARCH, get, 0, start, "m")
    check_split(ARCH, get, 4, 8, "m")
    for start in (1, 2, 3, 5, 6, 11, 13):
        with pytest.raises(UnsupportedArchitecture, match="must start at a multiple of 4 blocks"):
            check_split(ARCH, get, start, 17, "m")


@pytest.mark.parametrize(("start", "end"), [(4, 5), (4, 7), (16, 17), (0, 3)])
def test_a_stage_of_fewer_than_four_blocks_is_refused(models, start, end):
    get = read_header(models["maverick"]).get
    with pytest.raises(UnsupportedArchitecture, match="at least 4 blocks, one of them without RoPE"):
        check_split(ARCH, get, start, end, "m")


def test_the_moe_step_joins_the_multiple():
    meta = {f"{ARCH}.block_count": 48, f"{ARCH}.interleave_moe_layer_step": 3}
    assert cut_multiple(ARCH, meta.get) == 12
    check_split(ARCH, meta.get, 12, 48, "m")
    with pytest.raises(UnsupportedArchitecture, match="multiple of 12 blocks.*start it at 0 or 12"):
        check_split(ARCH, meta.get, 8, 48, "m")


def test_a_refused_split_is_refused_from_the_model_facts():
    """The orchestrator has no MoE step: 4, right for Scout and Maverick."""
    facts = SimpleNamespace(architecture=ARCH, block_count=48, hidden_dim=5120, head_count=40, key_length=128)
    assert cut_multiple(ARCH, {f"{ARCH}.block_count": 48}.get) == 4
    check_plan(facts, [(0, 24), (24, 48)], "scout")
    with pytest.raises(UnsupportedArchitecture, match="start it at 20 or 24"):
        check_plan(facts, [(0, 22), (22, 48)], "scout")


def test_a_refused_split_is_refused_before_anything_is_written(models, tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(UnsupportedArchitecture, match="multiple of 4"):
        ensure_stage_file(models["maverick"], 6, 17, cache)
    assert not cache.exists(), "nothing may be written for a refused split"


def test_a_model_without_chunked_attention_is_refused(tmp_path):
    path = synthetic_llama4.write_model(tmp_path / "global.gguf", extra={"attention.sliding_window": 0})
    get = read_header(path).get
    check_split(ARCH, get, 0, 17, "m")  # the whole model is the source file itself
    cache = tmp_path / "cache"
    with pytest.raises(UnsupportedArchitecture, match="sliding_window = 0.*runs only as one stage"):
        ensure_stage_file(path, 0, 4, cache)
    assert not cache.exists()


@pytest.mark.parametrize(
    "key", ["attention.head_count", "attention.head_count_kv", "expert_used_count", "feed_forward_length"]
)
def test_per_layer_values_that_differ_are_refused(key):
    meta = {f"{ARCH}.block_count": 8, f"{ARCH}.{key}": [4] * 4 + [2] * 4}
    check_split(ARCH, {**meta, f"{ARCH}.{key}": [4] * 8}.get, 0, 4, "m")
    with pytest.raises(UnsupportedArchitecture, match=f"{ARCH}.{key} differs between blocks"):
        check_split(ARCH, meta.get, 0, 4, "m")


def test_a_pattern_array_of_the_wrong_length_is_refused():
    get = {f"{ARCH}.block_count": 8, f"{ARCH}.attention.sliding_window_pattern": [True] * 5}.get
    with pytest.raises(ModelError, match="5 entries for 8 blocks"):
        check_split(ARCH, get, 0, 4, "odd")


def test_a_stage_without_chunked_attention_is_refused():
    pattern = [True, True, True, False, False, False, False, False]
    get = {f"{ARCH}.block_count": 8, f"{ARCH}.attention.sliding_window_pattern": pattern}.get
    check_split(ARCH, get, 0, 4, "m")
    with pytest.raises(UnsupportedArchitecture, match="without a chunked-attention block"):
        check_split(ARCH, get, 4, 8, "m")


# ------------------------------------------------------- command line

CLI_SPLIT = [(0, 4), (4, 12), (12, 17)]


def test_runs_headless_with_an_uneven_split(models, tmp_path, no_agent_left):
    path = models["maverick"]
    inventory = write_inventory(tmp_path, path, CLI_SPLIT, "max_tokens: 32, ignore_eos: true, chat: false")
    done = ggufpipe_tui(inventory, "the theory of everything in one sentence", timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["architecture"] == ARCH and result["outcome"] == "completed", result
    expected = whole_model_greedy(path, result["prompt_tokens"], 32, n_ctx=CONTEXT, n_ubatch=UBATCH)
    assert len(set(expected)) >= 8, expected
    assert result["tokens"] == expected


def test_runs_headless_with_ranges_the_planner_chose(models, tmp_path, no_agent_left):
    """No ``layers`` in the inventory: the planner cuts at multiples of 4,
    (0, 4), (4, 12), (12, 17) here, where the even shares of 17 blocks would
    be cut at 6 and 11, which llama4 refuses."""
    from ggufpipe_agent.gguf.facts import read_model_facts
    from ggufpipe_tui.core.inventory import parse_inventory
    from ggufpipe_tui.core.placement import evaluate

    path = models["maverick"]
    inventory = write_inventory(tmp_path, path, CLI_SPLIT, "max_tokens: 32, ignore_eos: true, chat: false")
    text = inventory.read_text()
    for start, end in CLI_SPLIT:
        text = text.replace(f", layers: [{start}, {end}]", "")
    inventory.write_text(text)
    ranges = evaluate(parse_inventory(text, inventory), read_model_facts(path), [None] * 3).ranges
    assert all(start % 4 == 0 and end - start >= 4 for start, end in ranges), ranges
    done = ggufpipe_tui(inventory, "the theory of everything in one sentence", timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["outcome"] == "completed", result
    expected = whole_model_greedy(path, result["prompt_tokens"], 32, n_ctx=CONTEXT, n_ubatch=UBATCH)
    assert result["tokens"] == expected
