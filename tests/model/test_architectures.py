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
from typing import NamedTuple

import pytest

from ggufpipe_agent.errors import UnsupportedArchitecture
from ggufpipe_agent.gguf.architectures import (
    ISSUES_URL,
    SUPPORTED,
    check_architecture,
)
from ggufpipe_agent.gguf.header import read_header
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
    synthetic model of it with splits in SPLITS."""
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
