"""Every accepted architecture is proven split-exact; the rest are refused.

For each architecture in ``ggufpipe_agent.gguf.architectures.SUPPORTED`` a chain of stage
engines (1 to 4 stages, split at awkward places, one-block stages included)
must give the same 64 greedy tokens as the whole model in one llama.cpp
context, with a prompt that spans several ubatches (:data:`SPLITS`, one row
per synthetic model of tests/support/arch_harness.py), and the headless
command line must give the whole model's tokens too (:data:`HEADLESS`). The
models are small synthetic GGUFs with that architecture's real metadata
layout and tensor names (tests/support/synthetic*.py), plus two real models:
SmolLM2 (llama, tests/model/test_engine.py) and Gemma 3 270M (gemma3, here,
in-process and through the headless command line). What only one family
needs proven (its stage files, its controls, its refusals) is in
tests/model/test_arch_<family>.py.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import pytest

from ggufpipe_agent.errors import ModelError, UnsupportedArchitecture
from ggufpipe_agent.gguf.architectures import (
    ISSUES_URL,
    SUPPORTED,
    check_architecture,
    check_plan,
    check_split,
)
from ggufpipe_agent.gguf.header import read_header
from ggufpipe_agent.stagefiles import writer as stagefile
from ggufpipe_agent.stagefiles.writer import ensure_stage_file
from tests.support.arch_harness import (
    ARCHITECTURES,
    CONTEXT,
    HEADLESS_RUN,
    OPTIONS,
    STEPS,
    UBATCH,
    ggufpipe_tui,
    greedy_reference,
    headless_greedy,
    model_path,
    run_chain,
    run_headless,
    write_inventory,
)
from tests.support.common import LONG_PROMPT, whole_model_greedy
from tests.support.stage_chain import Chain

Splits = list[tuple[int, int]]

#: Splits of the 7-block synthetic models of the llama family.
SPLITS_7 = {
    "1 stage": [(0, 7)],
    "2 stages": [(0, 3), (3, 7)],
    "3 stages, one-block ends": [(0, 1), (1, 6), (6, 7)],
    "3 stages, one-block middle": [(0, 2), (2, 3), (3, 7)],
}
#: The synthetic models of 7 blocks (tests/support/synthetic.py SPECS).
MODELS_7 = ("llama", "llama-moe", "qwen2", "qwen3", "mistral3", "phi3")
#: The 8-block mixtures of experts without dense or multi-token-prediction blocks.
SPLITS_8 = {
    "1 stage": [(0, 8)],
    "2 stages": [(0, 3), (3, 8)],
    "3 stages, one-block ends": [(0, 1), (1, 7), (7, 8)],
    "3 stages, one-block middle": [(0, 2), (2, 3), (3, 8)],
    "4 stages, uneven": [(0, 1), (1, 4), (4, 5), (5, 8)],
    "4 stages, one-block ends": [(0, 1), (1, 6), (6, 7), (7, 8)],
}

#: The splits each synthetic model must run token-identically to the whole model.
SPLITS: dict[str, dict[str, Splits]] = {
    **{model: SPLITS_7 for model in MODELS_7},
    # 13 blocks, period 6: blocks 5 and 11 are global
    "gemma3": {
        "1 stage": [(0, 13)],
        "2 stages off the period": [(0, 5), (5, 13)],
        "3 stages off the period": [(0, 5), (5, 11), (11, 13)],
        "3 stages on the period": [(0, 6), (6, 12), (12, 13)],
        "one global block alone": [(0, 11), (11, 12), (12, 13)],
        "4 stages, one-block ends": [(0, 1), (1, 7), (7, 12), (12, 13)],
    },
    # 30 blocks: 0-2 dense, 3-28 MoE, 29 multi-token prediction
    "deepseek2": {
        "1 stage": [(0, 30)],
        "cut right after the dense blocks": [(0, 3), (3, 16), (16, 30)],
        "inside the dense blocks, one-block first stage, 26-block last stage with the MTP block": [
            (0, 1),
            (1, 4),
            (4, 30),
        ],
        "one dense block alone, 4 stages": [(0, 2), (2, 3), (3, 17), (17, 30)],
        "one MoE block alone": [(0, 11), (11, 12), (12, 30)],
        "28 trunk blocks, then the last trunk block with the MTP block": [(0, 28), (28, 30)],
    },
    # 26 blocks: block 0 dense
    "deepseek2 lite": {
        "the dense block alone, 24-block middle": [(0, 1), (1, 25), (25, 26)],
        "2 stages": [(0, 13), (13, 26)],
        "4 stages, one-block stage": [(0, 7), (7, 8), (8, 20), (20, 26)],
    },
    # 8 blocks: 0-1 dense, 2-6 experts, 7 multi-token prediction
    "glm4moe": {
        "1 stage": [(0, 8)],
        "2 stages after the dense blocks": [(0, 2), (2, 8)],
        "2 stages between the dense blocks": [(0, 1), (1, 8)],
        "3 stages, one-block dense middle": [(0, 1), (1, 2), (2, 8)],
        "3 stages, last trunk block with the MTP block": [(0, 3), (3, 6), (6, 8)],
        "4 stages, uneven": [(0, 3), (3, 4), (4, 5), (5, 8)],
        "4 stages, one-block stages": [(0, 1), (1, 2), (2, 3), (3, 8)],
    },
    # 9 blocks: sliding window on 0, 2, 4, 6, 8; full attention on 1, 3, 5, 7
    "gpt-oss": {
        "1 stage": [(0, 9)],
        "2 stages, the second from a full-attention block": [(0, 3), (3, 9)],
        "3 stages, one sliding block first": [(0, 1), (1, 6), (6, 9)],
        "3 stages, one sliding block in the middle": [(0, 4), (4, 5), (5, 9)],
        "4 stages, one sliding block last": [(0, 2), (2, 5), (5, 8), (8, 9)],
        "4 stages, every later one from a full-attention block": [(0, 1), (1, 3), (3, 7), (7, 9)],
    },
    # 17 blocks, stages at multiples of 4; experts on every second block (maverick) or all (scout)
    "llama4 maverick": {
        "1 stage": [(0, 17)],
        "2 stages, a 4-block first": [(0, 4), (4, 17)],
        "2 stages, a 5-block last": [(0, 12), (12, 17)],
        "3 stages": [(0, 8), (8, 12), (12, 17)],
        "4 stages": [(0, 4), (4, 8), (8, 12), (12, 17)],
    },
    "llama4 scout": {"3 stages": [(0, 4), (4, 12), (12, 17)]},
    "minimax-m2": SPLITS_8,
    "qwen3moe": SPLITS_8,
    # 16 trunk blocks by interval 4 (full attention at 3, 7, 11, 15) and the MTP block 16
    "qwen3next interval+mtp": {
        "1 stage": [(0, 17)],
        "2 stages off the period": [(0, 5), (5, 17)],
        "a two-block stage": [(0, 6), (6, 8), (8, 17)],
        "4 stages off the period": [(0, 5), (5, 10), (10, 13), (13, 17)],
        "4 stages on the period": [(0, 4), (4, 8), (8, 12), (12, 17)],
        "last stage: two trunk blocks and the MTP block": [(0, 9), (9, 14), (14, 17)],
    },
    # 10 blocks by an irregular per-layer array (full attention at 1, 5, 6, 9), no MTP
    "qwen3next array": {
        "4 stages, two-block ends": [(0, 2), (2, 6), (6, 8), (8, 10)],
        "2 stages": [(0, 5), (5, 10)],
    },
    "qwen3next uniform arrays": {"3 stages": [(0, 4), (4, 10), (10, 17)]},
}
CASES = [
    pytest.param(model, splits, id=f"{model}: {name}")
    for model, splits_by_name in SPLITS.items()
    for name, splits in splits_by_name.items()
]


class Headless(NamedTuple):
    """A headless run of three local stages: the whole model's tokens must come back."""

    splits: Splits
    prompt: str
    #: The prompt spans three ubatches (more than 2 of 16 tokens).
    long_prompt: bool = True
    #: Different tokens the whole model's 32 must have at least.
    distinct: int = 8


RAIN = "The rain in Spain stays mainly in the plain, then the river runs on."
THEORY = "the theory of everything in one sentence"
HEADLESS = {
    "deepseek2": Headless([(0, 2), (2, 17), (17, 30)], RAIN),
    "glm4moe": Headless([(0, 1), (1, 4), (4, 8)], RAIN),  # inside the dense blocks, uneven, MTP block last
    "gpt-oss": Headless([(0, 3), (3, 8), (8, 9)], THEORY, long_prompt=False),
    "llama4 maverick": Headless([(0, 4), (4, 12), (12, 17)], THEORY, long_prompt=False),
    "minimax-m2": Headless([(0, 2), (2, 3), (3, 8)], RAIN),
    "qwen3moe": Headless([(0, 2), (2, 3), (3, 8)], RAIN),
    "qwen3next interval+mtp": Headless(
        [(0, 5), (5, 10), (10, 17)],
        "the rain in spain falls mainly on the plain, then in the hills",
        distinct=16,
    ),
}


def test_every_accepted_architecture_is_tested():
    """An architecture is accepted only with its split-exactness test: a
    synthetic model of it with splits in SPLITS (family modules with hooks
    included, whether or not they have a tests/model/test_arch_<module>.py)."""
    tested = {ARCHITECTURES[model] for model in SPLITS}
    assert set(SUPPORTED) == tested, "an architecture is accepted only with a split-exactness test"


@pytest.mark.parametrize(("model", "splits"), CASES)
def test_split_matches_whole_model(tmp_path_factory, tmp_path, model, splits):
    path = model_path(tmp_path_factory, model)
    assert run_chain(path, splits, cache_dir=tmp_path) == greedy_reference(path)


@pytest.mark.parametrize("model", list(HEADLESS))
def test_runs_headless_with_three_local_stages(tmp_path_factory, tmp_path, no_agent_left, model):
    case = HEADLESS[model]
    path = model_path(tmp_path_factory, model)
    result = run_headless(write_inventory(tmp_path, path, case.splits, HEADLESS_RUN), case.prompt)
    assert result["architecture"] == read_header(path).get("general.architecture"), result
    if case.long_prompt:
        assert len(result["prompt_tokens"]) > 2 * UBATCH, result["prompt_tokens"]
    expected = headless_greedy(path, result)
    assert len(set(expected)) >= case.distinct, expected
    assert result["tokens"] == expected
    assert result["text"]


# ---------------------------------------------------------------- gemma3


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


# ------------------------------------------------------------ refusals


@pytest.mark.parametrize("arch", ["gpt2", "falcon"])
def test_unverified_architecture_is_refused_before_anything_loads(tmp_path_factory, tmp_path, arch):
    path = model_path(tmp_path_factory, arch)
    cache = tmp_path / "cache"
    with pytest.raises(UnsupportedArchitecture) as caught:
        Chain(path, [(0, 1), (1, 3)], OPTIONS, cache_dir=cache)
    message = str(caught.value)
    assert f"architecture '{arch}' is not verified" in message
    assert ISSUES_URL in message and "gemma3" in message  # how to ask, and what is accepted
    assert not cache.exists(), "nothing may be written for a refused architecture"
    with pytest.raises(UnsupportedArchitecture):
        check_architecture(arch, str(path))


def test_unverified_architecture_is_refused_by_the_command_line(tmp_path_factory, tmp_path, no_agent_left):
    path = model_path(tmp_path_factory, "gpt2")
    inventory = write_inventory(tmp_path, path, [(0, 1), (1, 3)], "max_tokens: 4")
    done = ggufpipe_tui(inventory, "hello", timeout=120)
    assert done.returncode == 2, done.stderr
    assert "architecture 'gpt2' is not verified" in done.stderr and ISSUES_URL in done.stderr
    assert done.stdout == ""


# ------------------------------------------------------ real Gemma 3 270M

GEMMA3_SPLIT = [(0, 5), (5, 11), (11, 18)]  # uneven, off the period (blocks 5, 11, 17 are global)


@pytest.fixture(scope="session")
def gemma3_prompt(gemma3_path: Path) -> list[int]:
    import llama_cpp

    llm = llama_cpp.Llama(str(gemma3_path), vocab_only=True, verbose=False)
    tokens = llm.tokenize(LONG_PROMPT.encode(), add_bos=True)
    llm.close()
    assert len(tokens) > 4 * UBATCH
    return tokens


@pytest.fixture(scope="session")
def gemma3_reference(gemma3_path: Path, gemma3_prompt: list[int]) -> list[int]:
    return whole_model_greedy(gemma3_path, gemma3_prompt, STEPS, n_ctx=CONTEXT, n_ubatch=UBATCH)


@pytest.mark.model
@pytest.mark.slow
def test_gemma3_270m_split_off_the_period_matches_whole_model(gemma3_path, gemma3_prompt, gemma3_reference):
    # The stage files land in the session's cache (GGUFPIPE_CACHE_DIR), where
    # the command-line test below finds them again.
    chain = Chain(gemma3_path, GEMMA3_SPLIT, OPTIONS)
    try:
        tokens = chain.generate(gemma3_prompt, STEPS)
    finally:
        chain.close()
    assert len(set(gemma3_reference)) >= 10, gemma3_reference
    assert tokens == gemma3_reference


@pytest.mark.model
@pytest.mark.slow
def test_gemma3_270m_runs_headless_with_an_uneven_split(
    gemma3_path, gemma3_prompt, gemma3_reference, tmp_path, no_agent_left
):
    inventory = write_inventory(tmp_path, gemma3_path, GEMMA3_SPLIT, HEADLESS_RUN)
    result = run_headless(inventory, LONG_PROMPT, timeout=400)
    assert result["architecture"] == "gemma3", result
    assert result["prompt_tokens"] == gemma3_prompt
    # greedy: the first 32 tokens of the 64-step whole-model run
    assert result["tokens"] == gemma3_reference[:32]
    assert result["text"]
