"""Llama 4 splits exactly when every stage starts at a multiple of 4 blocks.

The synthetic model (tests/support/synthetic_families.py) has 17 blocks as
Maverick lays them out: experts with a shared expert on the odd blocks, dense
feed-forward on the even ones, chunked attention with no RoPE on every 4th
block (3, 7, 11, 15); a Scout-like copy has experts on every block. The rules
proven here are in ggufpipe_agent/gguf/families/llama4.py: stages start at
multiples of ``lcm(4, interleave_moe_layer_step)`` (the planner places its
cuts there) and have at least 4 blocks; every other stage is refused by name,
and so is every split of a model with ``attention.sliding_window = 0``. The
splits of both models and a headless run are rows of
tests/model/test_architectures.py.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from ggufpipe_agent.errors import EngineError, ModelError, UnsupportedArchitecture
from ggufpipe_agent.gguf.architectures import SUPPORTED, check_plan, check_split, cut_multiple
from ggufpipe_agent.gguf.header import read_header
from ggufpipe_agent.stagefiles.build import ensure_stage_file
from tests.support.arch_harness import (
    HEADLESS_RUN,
    assert_per_layer_refused,
    headless_greedy,
    run_chain,
    run_headless,
    write_inventory,
)
from tests.support.synthetic_families import write_model

ARCH = "llama4"
MODEL = "llama4 maverick"


def test_stage_files_carry_the_chunked_attention_pattern(model, tmp_path):
    stage = read_header(ensure_stage_file(model, 4, 12, tmp_path))
    assert stage.get(f"{ARCH}.attention.sliding_window_pattern") == [True, True, True, False] * 2
    assert stage.get(f"{ARCH}.block_count") == 8
    names = {tensor.name for tensor in stage.tensors}
    assert "rope_freqs.weight" in names and "blk.1.ffn_gate_shexp.weight" in names
    assert "blk.0.ffn_gate_inp.weight" not in names and "output.weight" not in names


def test_a_split_off_the_no_rope_blocks_differs(model, reference, tmp_path, monkeypatch):
    """The control: a stage from block 6 keeps the experts where they are (a
    multiple of the MoE step) and carries the chunked-attention pattern, but
    llama.cpp leaves RoPE out of its blocks 3 and 7 (originals 9 and 13)
    instead of originals 7, 11 and 15: the refusal is needed."""
    monkeypatch.setitem(SUPPORTED, ARCH, replace(SUPPORTED[ARCH], check=None))
    assert run_chain(model, [(0, 6), (6, 17)], cache_dir=tmp_path) != reference


def test_a_split_off_the_moe_step_does_not_even_load(model, tmp_path, monkeypatch):
    monkeypatch.setitem(SUPPORTED, ARCH, replace(SUPPORTED[ARCH], check=None))
    with pytest.raises(EngineError, match="could not load"):
        run_chain(model, [(0, 7), (7, 17)], cache_dir=tmp_path)


# ------------------------------------------------------------ refusals


def test_stages_start_at_multiples_of_four(model):
    get = read_header(model).get
    assert cut_multiple(ARCH, get) == 4
    for start in (4, 8, 12):
        check_split(ARCH, get, start, 17, "m")
        check_split(ARCH, get, 0, start, "m")
    check_split(ARCH, get, 4, 8, "m")
    for start in (1, 2, 3, 5, 6, 11, 13):
        with pytest.raises(UnsupportedArchitecture, match="must start at a multiple of 4 blocks"):
            check_split(ARCH, get, start, 17, "m")


@pytest.mark.parametrize(("start", "end"), [(4, 5), (4, 7), (16, 17), (0, 3)])
def test_a_stage_of_fewer_than_four_blocks_is_refused(model, start, end):
    get = read_header(model).get
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


def test_a_refused_split_is_refused_before_anything_is_written(model, tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(UnsupportedArchitecture, match="multiple of 4"):
        ensure_stage_file(model, 6, 17, cache)
    assert not cache.exists(), "nothing may be written for a refused split"


def test_a_model_without_chunked_attention_is_refused(tmp_path):
    path = write_model(tmp_path / "global.gguf", MODEL, metadata={"attention.sliding_window": 0})
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
    meta = {f"{ARCH}.block_count": 8}
    assert_per_layer_refused(ARCH, meta, key, [4] * 4 + [2] * 4, (0, 4), whole=False, uniform=True)


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

CLI_SPLIT = [
    (0, 4),
    (4, 12),
    (12, 17),
]  # the headless run with it is a row of tests/model/test_architectures.py


def test_runs_headless_with_ranges_the_planner_chose(model, tmp_path, no_agent_left):
    """No ``layers`` in the inventory: the planner cuts at multiples of 4,
    (0, 4), (4, 12), (12, 17) here, where the even shares of 17 blocks would
    be cut at 6 and 11, which llama4 refuses."""
    from ggufpipe_agent.gguf.facts import read_model_facts
    from ggufpipe_tui.core.inventory import parse_inventory
    from ggufpipe_tui.core.placement import evaluate

    inventory = write_inventory(tmp_path, model, CLI_SPLIT, HEADLESS_RUN)
    text = inventory.read_text()
    for start, end in CLI_SPLIT:
        text = text.replace(f", layers: [{start}, {end}]", "")
    inventory.write_text(text)
    ranges = evaluate(parse_inventory(text, inventory), read_model_facts(model), [None] * 3).ranges
    assert all(start % 4 == 0 and end - start >= 4 for start, end in ranges), ranges
    result = run_headless(inventory, "the theory of everything in one sentence")
    assert result["tokens"] == headless_greedy(model, result)
