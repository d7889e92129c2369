"""The stage engine on the real SmolLM2 model: a chain of stages gives the same
greedy tokens as the whole model in one llama.cpp context."""

from __future__ import annotations

from pathlib import Path

import pytest

from ggufpipe_agent.errors import ContextOverflow, ModelError, ProtocolError, RangeError
from ggufpipe_agent.gguf.facts import read_model_facts
from ggufpipe_agent.llama.engine import StageEngine, StageShape
from ggufpipe_agent.stagefiles.build import ensure_stage_file
from ggufpipe_agent.wire.protocol import EngineOptions, SamplingParams
from tests.support.common import LONG_PROMPT, whole_model_greedy
from tests.support.local import tokenize
from tests.support.stage_chain import Chain, agreement

pytestmark = pytest.mark.model

STEPS = 64
UBATCH = 32  # the prompt (~90 tokens) spans several ubatches
OPTIONS = EngineOptions(n_ctx=512, n_batch=512, n_ubatch=UBATCH)


@pytest.fixture(scope="module")
def prompt(model_path: Path) -> list[int]:
    tokens = tokenize(model_path, LONG_PROMPT, bos=True)
    assert len(tokens) > 2 * UBATCH
    return tokens


@pytest.fixture(scope="module")
def reference(model_path: Path, prompt: list[int]) -> list[int]:
    return whole_model_greedy(model_path, prompt, STEPS, n_ctx=512, n_ubatch=UBATCH)


SPLITS = {
    "1 stage (whole range)": [(0, 30)],
    "2 stages even": [(0, 15), (15, 30)],
    "3 stages uneven": [(0, 8), (8, 21), (21, 30)],
    "3 stages with one-block ends": [(0, 1), (1, 29), (29, 30)],
    "5 stages uneven": [(0, 4), (4, 11), (11, 12), (12, 25), (25, 30)],
}


@pytest.mark.parametrize("splits", list(SPLITS.values()), ids=list(SPLITS))
def test_chain_matches_whole_model(model_path, prompt, reference, splits):
    chain = Chain(model_path, splits, OPTIONS)
    try:
        tokens = chain.generate(prompt, STEPS)
    finally:
        chain.close()
    assert len(set(reference)) > 5, "the reference should not be one repeated token"
    assert tokens == reference


def test_new_run_resets_the_kv_cache(model_path, prompt, reference):
    chain = Chain(model_path, [(0, 10), (10, 30)], OPTIONS)
    try:
        first = chain.generate(prompt, 8)
        chain.reset()
        second = chain.generate(prompt, 8)
    finally:
        chain.close()
    assert first == second == reference[:8]


def test_float16_activations_agree_with_float32(model_path, prompt, reference, record_property):
    """float16 rounds the residual stream at every stage boundary. Reported two
    ways: free-running (its own tokens fed back: drift compounds) and
    teacher-forced (the float32 tokens fed back: agreement per step)."""
    chain = Chain(model_path, [(0, 8), (8, 21), (21, 30)], OPTIONS, dtype="float16")
    try:
        free = chain.generate(prompt, STEPS)
        chain.reset()
        forced = [chain.step(0, prompt)]
        for sequence in range(1, STEPS):
            forced.append(chain.step(sequence, [reference[sequence - 1]]))
    finally:
        chain.close()
    prefix = agreement(free, reference)
    per_step = sum(a == b for a, b in zip(forced, reference, strict=True)) / STEPS
    record_property("float16_free_running_identical_prefix", prefix)
    record_property("float16_teacher_forced_agreement", per_step)
    print(
        f"\nfloat16 vs float32 over {STEPS} steps: free-running identical for the first "
        f"{prefix:.0%}, teacher-forced agreement {per_step:.0%}"
    )
    assert free[:8] == reference[:8]
    assert per_step >= 0.9


def test_sampling_is_seeded(model_path, prompt):
    def sample(seed: int) -> list[int]:
        chain = Chain(model_path, [(0, 15), (15, 30)], OPTIONS)
        try:
            chain.reset(SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=seed))
            return chain.generate(prompt, 24)
        finally:
            chain.close()

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_stage_file_is_cached_and_written_atomically(model_path, tmp_path):
    first = ensure_stage_file(model_path, 3, 9, tmp_path)
    stamp = first.stat().st_mtime_ns
    again = ensure_stage_file(model_path, 3, 9, tmp_path)
    assert again == first and again.stat().st_mtime_ns == stamp
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary files left"
    facts = read_model_facts(first)
    assert facts.block_count == 6
    assert facts.block_bytes == read_model_facts(model_path).block_bytes[3:9]
    # The whole range is the source itself: nothing written.
    assert ensure_stage_file(model_path, 0, 30, tmp_path) == Path(model_path)


def test_a_broken_temporary_file_is_never_trusted(model_path, tmp_path):
    # A crash while writing leaves only a dot-prefixed temporary name behind.
    target = ensure_stage_file(model_path, 0, 5, tmp_path)
    target.unlink()
    orphan = tmp_path / f".{target.name}.999999999.tmp"  # its writer (that pid) is gone
    orphan.write_bytes(b"GGUF truncated")
    rebuilt = ensure_stage_file(model_path, 0, 5, tmp_path)
    assert rebuilt == target and read_model_facts(rebuilt).block_count == 5
    assert not orphan.exists(), "a dead writer's temporary file is cleaned up"


@pytest.mark.parametrize(
    ("start", "end", "words"),
    [(5, 5, "empty"), (9, 3, "reversed"), (20, 31, "out of bounds"), (-1, 3, "negative")],
)
def test_bad_ranges_name_the_file_and_range(model_path, tmp_path, start, end, words):
    with pytest.raises(RangeError) as error:
        ensure_stage_file(model_path, start, end, tmp_path)
    message = str(error.value)
    assert words in message and f"[{start}, {end})" in message and str(model_path) in message


def test_missing_and_non_gguf_files(tmp_path):
    with pytest.raises(ModelError, match="no such file"):
        read_model_facts(tmp_path / "nope.gguf")
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ModelError, match="not a GGUF file"):
        read_model_facts(text)
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x05" * 10)
    with pytest.raises(ModelError, match="corrupt or truncated|cannot read"):
        read_model_facts(truncated)


def test_context_overflow_is_a_clear_error(model_path, prompt):
    engine = StageEngine(
        str(model_path), StageShape(True, True, 30, 576), EngineOptions(n_ctx=128, n_batch=128, n_ubatch=32)
    )
    try:
        engine.step(prompt)  # ~90 positions
        with pytest.raises(ContextOverflow, match="context full"):
            engine.step(prompt)
        engine.reset(SamplingParams())
        engine.step(prompt)  # a new run has the whole context again
    finally:
        engine.close()


def test_activation_shape_is_checked(model_path, tmp_path):
    import numpy as np

    stage = ensure_stage_file(model_path, 10, 30, tmp_path)
    engine = StageEngine(str(stage), StageShape(False, True, 20, 576), OPTIONS)
    try:
        with pytest.raises(ProtocolError, match="576"):
            engine.step(np.zeros((3, 100), dtype=np.float32))
    finally:
        engine.close()


def test_thread_count_is_settable(model_path):
    engine = StageEngine(
        str(model_path),
        StageShape(True, True, 30, 576),
        EngineOptions(n_ctx=64, n_batch=64, n_ubatch=64, threads=1),
    )
    try:
        assert isinstance(engine.step([1, 2, 3]), int)
    finally:
        engine.close()
