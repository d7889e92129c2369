"""Every accepted architecture is proven split-exact; the rest are refused.

For each architecture in ``ggufpipe_agent.gguf.architectures.SUPPORTED`` a chain of stage
engines (1, 2 and 3 stages, split at awkward places, one-block stages
included) must give the same 64 greedy tokens as the whole model in one
llama.cpp context, with a prompt that spans several ubatches. The models are
small synthetic GGUFs with that architecture's real metadata layout and
tensor names (tests/synthetic.py), plus two real models: SmolLM2 (llama,
tests/test_engine.py) and Gemma 3 270M (gemma3, here, in-process and through
the headless command line).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

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
from ggufpipe_agent.wire.protocol import EngineOptions
from tests.support import synthetic
from tests.support.common import LONG_PROMPT, REPO, whole_model_greedy
from tests.support.stage_chain import Chain

STEPS = 64
UBATCH = 16
CONTEXT = 256
# One thread per engine: on a small shared machine, ggml's spinning worker
# threads of several engines slow each other down by an order of magnitude.
OPTIONS = EngineOptions(n_ctx=CONTEXT, n_batch=CONTEXT, n_ubatch=UBATCH, threads=1)
PROMPT = synthetic.prompt_tokens(3 * UBATCH - 5)  # three ubatches, the last one partial

#: Splits of the 7-block synthetic models of the llama family.
SPLITS_7 = {
    "1 stage": [(0, 7)],
    "2 stages": [(0, 3), (3, 7)],
    "3 stages, one-block ends": [(0, 1), (1, 6), (6, 7)],
    "3 stages, one-block middle": [(0, 2), (2, 3), (3, 7)],
}
#: Splits of the 13-block synthetic gemma3 (period 6: blocks 5 and 11 are global).
SPLITS_GEMMA3 = {
    "1 stage": [(0, 13)],
    "2 stages off the period": [(0, 5), (5, 13)],
    "3 stages off the period": [(0, 5), (5, 11), (11, 13)],
    "3 stages on the period": [(0, 6), (6, 12), (12, 13)],
    "one global block alone": [(0, 11), (11, 12), (12, 13)],
    "4 stages, one-block ends": [(0, 1), (1, 7), (7, 12), (12, 13)],
}
#: The synthetic models of 7 blocks (tests/synthetic.py SPECS).
MODELS_7 = ("llama", "llama-moe", "qwen2", "qwen3", "mistral3", "phi3")
CASES = [
    pytest.param(model, splits, id=f"{model}: {name}")
    for model in MODELS_7
    for name, splits in SPLITS_7.items()
] + [pytest.param("gemma3", splits, id=f"gemma3: {name}") for name, splits in SPLITS_GEMMA3.items()]


@pytest.fixture(scope="session")
def synthetic_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("synthetic")


_models: dict[str, Path] = {}
_references: dict[str, list[int]] = {}


def synthetic_model(directory: Path, name: str) -> Path:
    if name not in _models:
        _models[name] = synthetic.write_model(directory / f"synthetic-{name}.gguf", name)
    return _models[name]


def synthetic_reference(directory: Path, name: str) -> list[int]:
    """The whole model's greedy tokens, computed once per session."""
    if name not in _references:
        path = synthetic_model(directory, name)
        _references[name] = whole_model_greedy(path, PROMPT, STEPS, n_ctx=CONTEXT, n_ubatch=UBATCH)
    return _references[name]


def run_chain(path: Path, splits: list[tuple[int, int]], cache_dir: Path | None = None) -> list[int]:
    chain = Chain(path, splits, OPTIONS, cache_dir=cache_dir)
    try:
        return chain.generate(PROMPT, STEPS)
    finally:
        chain.close()


def test_every_accepted_architecture_is_tested():
    import pkgutil

    from ggufpipe_agent.gguf import families

    tested = {synthetic.SPECS[model].arch for model in (*MODELS_7, "gemma3")}
    for module in pkgutil.iter_modules(families.__path__):
        test = REPO / "tests" / "model" / f"test_arch_{module.name}.py"
        assert test.is_file(), f"ggufpipe_agent/gguf/families/{module.name}.py is accepted without {test}"
        tested.add(__import__(f"{families.__name__}.{module.name}", fromlist=["ARCHITECTURE"]).ARCHITECTURE.name)
    assert set(SUPPORTED) == tested, "an architecture is accepted only with a split-exactness test"


@pytest.mark.parametrize(("model", "splits"), CASES)
def test_split_matches_whole_model(synthetic_dir, model, splits):
    path = synthetic_model(synthetic_dir, model)
    reference = synthetic_reference(synthetic_dir, model)
    assert len(set(reference)) >= 16, f"the random {model} model collapsed: {reference}"
    assert run_chain(path, splits) == reference


# ---------------------------------------------------------------- gemma3


def test_gemma3_stage_files_carry_the_original_window_pattern(synthetic_dir):
    path = synthetic_model(synthetic_dir, "gemma3")
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


def test_gemma3_split_without_the_pattern_differs(synthetic_dir, tmp_path, monkeypatch):
    """The control: renumbered blocks with llama.cpp's default pattern compute
    something else, and the test above would notice."""
    path = synthetic_model(synthetic_dir, "gemma3")
    reference = synthetic_reference(synthetic_dir, "gemma3")
    monkeypatch.setattr(stagefile, "stage_metadata_overrides", lambda *_: {})
    assert run_chain(path, [(0, 5), (5, 11), (11, 13)], cache_dir=tmp_path) != reference


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
def test_unverified_architecture_is_refused_before_anything_loads(synthetic_dir, tmp_path, arch):
    path = synthetic_model(synthetic_dir, arch)
    cache = tmp_path / "cache"
    with pytest.raises(UnsupportedArchitecture) as caught:
        Chain(path, [(0, 1), (1, 3)], OPTIONS, cache_dir=cache)
    message = str(caught.value)
    assert f"architecture '{arch}' is not verified" in message
    assert ISSUES_URL in message and "gemma3" in message  # how to ask, and what is accepted
    assert not cache.exists(), "nothing may be written for a refused architecture"
    with pytest.raises(UnsupportedArchitecture):
        check_architecture(arch, str(path))


def test_unverified_architecture_is_refused_by_the_command_line(synthetic_dir, tmp_path, no_agent_left):
    path = synthetic_model(synthetic_dir, "gpt2")
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
    inventory = write_inventory(
        tmp_path, gemma3_path, GEMMA3_SPLIT, "max_tokens: 32, ignore_eos: true, chat: false"
    )
    done = ggufpipe_tui(inventory, LONG_PROMPT, timeout=400)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["architecture"] == "gemma3" and result["outcome"] == "completed", result
    assert result["prompt_tokens"] == gemma3_prompt
    # greedy: the first 32 tokens of the 64-step whole-model run
    assert result["tokens"] == gemma3_reference[:32]
    assert result["text"]


# -------------------------------------------------------------- helpers


def write_inventory(tmp_path: Path, model: Path, splits: list[tuple[int, int]], run: str) -> Path:
    stages = "".join(f"- {{host: here, layers: [{start}, {end}]}}\n" for start, end in splits)
    path = tmp_path / "inventory.yaml"
    path.write_text(
        f"model: {{path: {model}}}\n"
        "hosts:\n  here: {local: true, threads: 1}\n"
        f"stages:\n{textwrap.indent(stages, '  ')}"
        f"run: {{context: {CONTEXT}, ubatch: {UBATCH}, {run}}}\n"
        "timeouts: {connect: 60, ready: 300, step: 60, teardown: 10}\n"
    )
    return path


def ggufpipe_tui(inventory: Path, prompt: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """The headless command line (what ``ggufpipe-tui`` runs), as a user runs it."""
    command = [sys.executable, "-m", "ggufpipe_tui.cli", str(inventory), "--prompt", prompt, "--json", "-q"]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=os.environ.copy(), cwd=REPO
    )
