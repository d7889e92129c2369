"""Split sets as input: the real SmolLM2 written as a llama.cpp split set (the
``gguf`` package's writer, ``split_max_tensors``) is the same model as the
single file everywhere a model path is accepted, from any of its parts; an
incomplete or mixed set is refused before anything loads, naming the part."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ggufpipe_agent.errors import ModelError
from ggufpipe_agent.gguf.facts import read_model_facts
from ggufpipe_agent.gguf.files import read_model_files, split_path, split_prefix
from ggufpipe_agent.gguf.header import read_header
from ggufpipe_agent.gguf.identity import describe_difference, model_identity
from ggufpipe_agent.llama.vocabulary import Vocabulary
from ggufpipe_agent.stagefiles.build import ensure_stage_file
from ggufpipe_agent.wire.protocol import EngineOptions
from tests.support.common import LONG_PROMPT, REPO, whole_model_greedy
from tests.support.local import tokenize
from tests.support.splitset import write_split_set
from tests.support.stage_chain import Chain

pytestmark = pytest.mark.model

STEPS = 64
UBATCH = 32
# One thread per engine: spinning ggml threads of several engines on a small
# shared machine slow each other down (as in tests/test_architectures.py).
OPTIONS = EngineOptions(n_ctx=512, n_batch=512, n_ubatch=UBATCH, threads=1)


@pytest.fixture(scope="module")
def split_set(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """SmolLM2's 272 tensors in three parts of at most 100."""
    parts = write_split_set(model_path, tmp_path_factory.mktemp("split"), "smol", 100)
    assert [part.name for part in parts] == [f"smol-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    return parts


@pytest.fixture(scope="module")
def prompt(model_path: Path) -> list[int]:
    return tokenize(model_path, LONG_PROMPT, bos=True)


@pytest.fixture(scope="module")
def reference(model_path: Path, prompt: list[int]) -> list[int]:
    """The single file's whole-model greedy tokens."""
    return whole_model_greedy(model_path, prompt, STEPS, n_ctx=512, n_ubatch=UBATCH)


def test_llama_cpp_naming_rules():
    # llama_split_path / llama_split_prefix (src/llama.cpp)
    assert split_path("/m/ggml-model-q4_0", 1, 4) == "/m/ggml-model-q4_0-00002-of-00004.gguf"
    assert split_prefix("/m/ggml-model-q4_0-00002-of-00004.gguf", 1, 4) == "/m/ggml-model-q4_0"
    assert split_prefix("/m/ggml-model-q4_0-00002-of-00004.gguf", 0, 4) is None
    assert split_prefix("-00001-of-00002.gguf", 0, 2) is None  # an empty prefix is no prefix


@pytest.mark.parametrize("part", [0, 1, 2])
def test_facts_of_a_split_set_are_the_single_files(model_path, split_set, part):
    single = read_model_facts(model_path)
    facts = read_model_facts(split_set[part])
    assert facts.path == str(split_set[0]), "the path given to llama.cpp is the first part"
    assert facts.file_size == sum(p.stat().st_size for p in split_set)
    assert dataclasses.replace(facts, path=single.path, file_size=single.file_size) == single
    assert read_model_files(split_set[part]).is_split


def test_identity_of_a_split_set_is_the_single_files(model_path, split_set):
    assert model_identity(split_set[1]) == model_identity(model_path)
    assert describe_difference(model_identity(split_set[2]), model_identity(model_path)) == ""
    # ... although their metadata differs by the split keys
    assert "split.count" in read_header(split_set[0]).metadata


def test_vocabulary_and_chat_template_of_a_split_set(model_path, split_set):
    single = Vocabulary(str(model_path))
    split = Vocabulary(str(split_set[2]))  # any part; llama.cpp gets the first
    try:
        assert split.path == str(split_set[0])
        assert split.size == single.size
        assert split.pieces() == single.pieces()
        assert split.eog_tokens() == single.eog_tokens()
        template = read_model_facts(split_set[1]).chat_template
        assert template and template == read_model_facts(model_path).chat_template
        assert split.prompt_tokens(template, "Why is the sky blue?", True) == single.prompt_tokens(
            template, "Why is the sky blue?", True
        )
    finally:
        split.close()
        single.close()


def test_stage_files_of_a_split_set_are_the_single_files(model_path, split_set, tmp_path):
    for start, end in [(0, 8), (8, 21), (21, 30)]:
        from_set = ensure_stage_file(split_set[1], start, end, tmp_path / "set")
        from_file = ensure_stage_file(model_path, start, end, tmp_path / "file")
        assert from_set.name == from_file.name, "the same stage of the same model has one name"
        assert from_set.read_bytes() == from_file.read_bytes()
        assert not any(key.startswith("split.") for key in read_header(from_set).metadata)
    # The whole range is the set itself, loaded by llama.cpp from its first part.
    assert ensure_stage_file(split_set[2], 0, 30, tmp_path / "set") == split_set[0]


SPLITS = {
    "1 stage (the set itself)": [(0, 30)],
    "2 stages": [(0, 15), (15, 30)],
    "3 stages uneven": [(0, 8), (8, 21), (21, 30)],
}


@pytest.mark.parametrize("splits", list(SPLITS.values()), ids=list(SPLITS))
def test_chain_on_a_split_set_matches_the_single_file(split_set, prompt, reference, splits, tmp_path):
    chain = Chain(split_set[1], splits, OPTIONS, cache_dir=tmp_path)
    try:
        tokens = chain.generate(prompt, STEPS)
    finally:
        chain.close()
    assert len(set(reference)) > 5
    assert tokens == reference


# ------------------------------------------------------------ refusals


@pytest.fixture
def copied_set(split_set: list[Path], tmp_path: Path) -> list[Path]:
    directory = tmp_path / "copy"
    directory.mkdir()
    return [Path(shutil.copy(part, directory / part.name)) for part in split_set]


def _refusals(path: Path, cache: Path) -> list[str]:
    """The error of every entry point that takes a model path."""
    messages = []
    for use in (
        read_model_facts,
        model_identity,
        Vocabulary,
        lambda p: ensure_stage_file(p, 0, 8, cache),
        lambda p: ensure_stage_file(p, 0, 30, cache),
    ):
        with pytest.raises(ModelError) as caught:
            use(path)
        messages.append(str(caught.value))
    return messages


@pytest.mark.parametrize("given", [0, 2])
def test_an_incomplete_set_is_refused_naming_the_missing_part(copied_set, tmp_path, given):
    copied_set[1].unlink()
    for message in _refusals(copied_set[given], tmp_path / "cache"):
        assert message.startswith(f"{copied_set[1]}: missing part 2 of 3"), message
    assert not (tmp_path / "cache").exists(), "nothing is written for an incomplete set"


def test_a_part_of_another_count_is_refused(copied_set, model_path, tmp_path):
    other = write_split_set(model_path, tmp_path, "two", 150)  # a 2-part set
    shutil.copy(other[1], copied_set[1])
    for message in _refusals(copied_set[0], tmp_path / "cache"):
        assert str(copied_set[1]) in message and "says it is part 2 of 2" in message, message


def test_a_part_of_another_set_with_the_same_count_is_refused(copied_set, model_path, tmp_path):
    other = write_split_set(model_path, tmp_path, "other", 120)  # 3 parts: 120, 120, 32 tensors
    shutil.copy(other[1], copied_set[1])
    for message in _refusals(copied_set[0], tmp_path / "cache"):
        assert "a part of another set?" in message and "holds tensor" in message, message


def test_a_renamed_part_is_refused(copied_set, tmp_path):
    renamed = copied_set[0].with_name("smol.gguf")
    copied_set[0].rename(renamed)
    for message in _refusals(renamed, tmp_path / "cache"):
        assert "its name does not end in -00001-of-00003.gguf" in message, message


# ------------------------------------------------------- the command line


@pytest.mark.slow
def test_headless_run_on_a_split_set(split_set, prompt, reference, tmp_path, no_agent_left):
    """Two local stages through the real command line, given the set's last part."""
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(
        f"model: {{path: {split_set[2]}}}\n"
        "hosts:\n  here: {local: true, threads: 1}\n"
        "stages:\n  - {host: here, layers: [0, 13]}\n  - {host: here, layers: [13, 30]}\n"
        f"run: {{context: 512, ubatch: {UBATCH}, max_tokens: 24, ignore_eos: true, chat: false}}\n"
        "timeouts: {connect: 60, ready: 300, step: 60, teardown: 10}\n"
    )
    command = [
        sys.executable,
        "-m",
        "ggufpipe_tui.cli",
        str(inventory),
        "--prompt",
        LONG_PROMPT,
        "--json",
        "-q",
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env=os.environ.copy(), cwd=REPO
    )
    assert done.returncode == 0, textwrap.shorten(done.stderr, 2000)
    result = json.loads(done.stdout)
    assert result["outcome"] == "completed", result
    assert result["prompt_tokens"] == prompt
    assert result["tokens"] == reference[:24]
