"""glm4moe (GLM-4.5, GLM-4.5-Air, GLM-4.6) splits exactly; what cannot is refused.

The rules and the llama.cpp lines they come from are in
:mod:`ggufpipe_agent.gguf.families.glm4moe`: a stage file carries its share of
the leading dense blocks, ``nextn_predict_layers = 0`` unless it is the last
stage (which keeps the multi-token-prediction block and skips it as the whole
model does), and, when it is fed embeddings, M-RoPE sections that llama.cpp
requires for embedding input and that equal plain RoPE for text positions,
which the stage engine writes 4 per token.

The model is a synthetic GGUF of 7 trunk blocks (2 dense, 5 mixture-of-experts)
and 1 multi-token-prediction block (tests/support/synthetic_families.py); its
splits and its headless run are rows of tests/model/test_architectures.py.
The controls take each override away in turn: without the sections llama.cpp
aborts the process, without ``nextn_predict_layers = 0`` a stage skips its
last block (the engine then misses its output), without the dense-block
count a stage does not load, and with 1 position per token the engine
refuses the stage.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import pytest

from ggufpipe_agent.errors import EngineError, UnsupportedArchitecture
from ggufpipe_agent.gguf import architectures
from ggufpipe_agent.gguf.architectures import SUPPORTED, check_split, positions_per_token
from ggufpipe_agent.gguf.families import glm4moe
from ggufpipe_agent.gguf.header import read_header
from ggufpipe_agent.stagefiles import build as stagefile
from ggufpipe_agent.stagefiles.build import ensure_stage_file
from tests.support.arch_harness import OPTIONS, UBATCH, assert_per_layer_refused, per_layer_cases, run_chain
from tests.support.common import REPO
from tests.support.stage_chain import Chain
from tests.support.synthetic import HIDDEN
from tests.support.synthetic_families import FAMILIES, write_model

ARCH = MODEL = "glm4moe"
BLOCKS = FAMILIES[MODEL].blocks  # 8: blocks 0-1 dense, 2-6 experts, 7 multi-token prediction
#: The splits of tests/model/test_architectures.py the controls run.
AFTER_THE_DENSE_BLOCKS = [(0, 2), (2, 8)]
BETWEEN_THE_DENSE_BLOCKS = [(0, 1), (1, 8)]


def test_glm4moe_is_accepted():
    assert ARCH in SUPPORTED and SUPPORTED[ARCH] is glm4moe.ARCHITECTURE


def test_glm4moe_stage_files_carry_their_share(model):
    first = read_header(ensure_stage_file(model, 0, 3))
    assert first.get("glm4moe.block_count") == 3
    assert first.get("glm4moe.leading_dense_block_count") == 2
    assert first.get("glm4moe.nextn_predict_layers") == 0
    assert "glm4moe.rope.dimension_sections" not in first.metadata  # fed tokens: plain NeoX RoPE
    assert positions_per_token(ARCH, first.get) == 1

    middle = read_header(ensure_stage_file(model, 1, 4))
    assert middle.get("glm4moe.leading_dense_block_count") == 1  # block 1 of the original
    assert middle.get("glm4moe.nextn_predict_layers") == 0
    # fed embeddings: the rotated pairs (16 / 2) over the first two sections
    assert middle.get("glm4moe.rope.dimension_sections") == [4, 4, 0, 0]
    assert positions_per_token(ARCH, middle.get) == 4

    last = read_header(ensure_stage_file(model, 5, 8))
    assert last.get("glm4moe.block_count") == 3
    assert last.get("glm4moe.leading_dense_block_count") == 0
    assert last.get("glm4moe.nextn_predict_layers") == 1  # keeps the MTP block, skipped as in the whole model
    assert "blk.2.nextn.eh_proj.weight" in {tensor.name for tensor in last.tensors}
    assert positions_per_token(ARCH, last.get) == 4


def test_glm4moe_text_sections_are_positive_for_any_rotary_size():
    for n_rot in (2, 4, 16, 64, 128):
        sections = glm4moe.text_sections({"glm4moe.rope.dimension_count": n_rot}.get)
        assert glm4moe.uses_mrope(sections) and sections[2:] == [0, 0]
        assert sum(sections) <= max(2, n_rot // 2)


def test_glm4moe_model_sections_are_kept_in_every_stage():
    """A model that has M-RoPE sections already uses them for text too
    (positions [p, p, p, 0]); every stage keeps them, even where a 4-entry
    array would be taken for a per-layer array of a 4-block model."""
    get = {"glm4moe.block_count": 4, "glm4moe.rope.dimension_sections": [8, 12, 12, 0]}.get
    for start, end in ((0, 2), (2, 4)):
        values, _, _ = glm4moe._overrides(get, start, end)["glm4moe.rope.dimension_sections"]
        assert values == [8, 12, 12, 0]
    assert positions_per_token(ARCH, get) == 4


def test_glm4moe_embedding_stage_keeps_a_prefix_exactly(model):
    """Prefix reuse in a stage fed embeddings: its M-RoPE cache cells (saved,
    restored and trimmed by the batch-invariance probe and keep) give what a
    cold run gives."""
    import numpy as np

    from ggufpipe_agent.llama.engine import StageEngine, StageShape
    from ggufpipe_agent.wire.protocol import SamplingParams

    stage = ensure_stage_file(model, 2, 5)
    engine = StageEngine(str(stage), StageShape(False, False, 3, HIDDEN), OPTIONS)
    try:
        rows = np.random.default_rng(0).standard_normal((40, HIDDEN)).astype(np.float32)
        cold = engine.step(rows)
        engine.reset(SamplingParams(), keep=True)
        kept, _why = engine.keepable()
        assert kept >= 2 * UBATCH
        engine.keep(2 * UBATCH)
        assert np.array_equal(engine.step(rows[2 * UBATCH :]), cold[2 * UBATCH :])
    finally:
        engine.close()


# ------------------------------------------------------------- controls


def test_glm4moe_stage_without_sections_aborts_llama_cpp(model, tmp_path):
    """The control for the sections: an embedding-fed stage without them
    makes llama.cpp abort the whole process, so it runs in a child."""
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(REPO)!r})
        import ggufpipe_agent.gguf.architectures  # discovers the families
        from ggufpipe_agent.gguf.families import glm4moe
        from ggufpipe_agent.stagefiles import build
        from ggufpipe_agent.wire.protocol import EngineOptions
        from tests.support.stage_chain import Chain

        def without_sections(arch, get, start, end):
            found = glm4moe._overrides(get, start, end)
            found.pop(glm4moe.SECTIONS, None)
            return found

        build.stage_metadata_overrides = without_sections
        options = EngineOptions(n_ctx=64, n_batch=64, n_ubatch=16, threads=1)
        chain = Chain(Path({str(model)!r}), [(0, 2), (2, 8)], options, cache_dir=Path({str(tmp_path)!r}))
        chain.generate([1, 2, 3], 2)
        print("no abort")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.returncode != 0 and "no abort" not in done.stdout
    assert "This GGUF does not support multimodal" in done.stderr, done.stderr[-2000:]


def without_override(monkeypatch: pytest.MonkeyPatch, key: str) -> None:
    """Stage files written without the family's override of ``key``."""

    def overrides(arch, get, start, end):
        found = glm4moe._overrides(get, start, end)
        found.pop(key, None)
        return found

    monkeypatch.setattr(stagefile, "stage_metadata_overrides", overrides)


def test_glm4moe_stage_that_keeps_nextn_skips_its_last_block(model, tmp_path, monkeypatch):
    """The control for nextn_predict_layers = 0: a trunk stage that keeps the
    model's 1 takes its last block for a multi-token-prediction block and
    skips it; llama.cpp says nothing, the engine misses that block's output."""
    without_override(monkeypatch, glm4moe.NEXTN)
    with pytest.raises(EngineError, match="captured 0 of .* rows from l_out-1"):
        run_chain(model, AFTER_THE_DENSE_BLOCKS, cache_dir=tmp_path)


def test_glm4moe_stage_without_its_dense_count_does_not_load(model, tmp_path, monkeypatch):
    """The control for the leading dense blocks: a stage of blocks 1..7 that
    copies the model's 2 expects its block 1 (block 2 of the model, experts)
    to be dense, and llama.cpp finds no dense tensors for it."""
    without_override(monkeypatch, glm4moe.LEAD)
    with pytest.raises(EngineError, match="could not load"):
        run_chain(model, BETWEEN_THE_DENSE_BLOCKS, cache_dir=tmp_path)


def test_glm4moe_engine_refuses_one_position_per_token(model, tmp_path, monkeypatch):
    """The control for the 4 positions per token: llama.cpp reads 4 per
    embedding of an M-RoPE stage, more than llama_batch_init allocates; an
    engine told 1 refuses the stage instead of letting llama.cpp read past it."""
    one = dataclasses.replace(glm4moe.ARCHITECTURE, positions_per_token=None)
    monkeypatch.setitem(architectures.SUPPORTED, ARCH, one)
    with pytest.raises(EngineError, match="reads 4 positions per token"):
        run_chain(model, AFTER_THE_DENSE_BLOCKS, cache_dir=tmp_path)


def test_glm4moe_float16_activations_differ(model, reference, tmp_path):
    """The comparison notices a rounding-level difference between stages,
    so the identical runs above prove something."""
    assert run_chain(model, AFTER_THE_DENSE_BLOCKS, cache_dir=tmp_path, dtype="float16") != reference


# ------------------------------------------------------------- refusals

GLM45_AIR = {  # what llama.cpp reads of GLM-4.5-Air's shape: 46 trunk blocks and 1 MTP block
    "glm4moe.block_count": 47,
    "glm4moe.nextn_predict_layers": 1,
    "glm4moe.leading_dense_block_count": 1,
    "glm4moe.attention.head_count": 96,
    "glm4moe.attention.head_count_kv": 8,
    "glm4moe.expert_used_count": 8,
}


@pytest.mark.parametrize(
    ("key", "values"),
    per_layer_cases(47, head=(96, 64), kv=(8, 4), used=(8, 4), expert_ff=(1408, 2816), ff=(10944, 1408)),
)
def test_glm4moe_non_uniform_per_layer_counts_are_refused(key, values):
    assert_per_layer_refused(ARCH, GLM45_AIR, key, values, (0, 24), rest=(24, 47))


def test_glm4moe_uniform_per_layer_arrays_are_fine():
    get = {**GLM45_AIR, "glm4moe.expert_used_count": [8] * 47, "glm4moe.attention.head_count": [96] * 47}.get
    check_split(ARCH, get, 5, 17, "uniform")


def test_glm4moe_stage_of_the_mtp_block_alone_is_refused():
    get = GLM45_AIR.get
    check_split(ARCH, get, 20, 47, "air")  # the last stage keeps the MTP block
    check_split(ARCH, get, 20, 46, "air")  # a stage may end where the trunk ends
    with pytest.raises(UnsupportedArchitecture, match="multi-token-prediction blocks .* no block to run"):
        check_split(ARCH, get, 46, 47, "air")


def test_glm4moe_stage_ending_inside_the_mtp_blocks_is_refused():
    get = {**GLM45_AIR, "glm4moe.block_count": 48, "glm4moe.nextn_predict_layers": 2}.get
    check_split(ARCH, get, 30, 48, "two mtp")
    with pytest.raises(UnsupportedArchitecture, match="end inside the multi-token-prediction blocks"):
        check_split(ARCH, get, 30, 47, "two mtp")
    with pytest.raises(UnsupportedArchitecture, match="no block to run"):
        check_split(ARCH, get, 47, 48, "two mtp")


@pytest.mark.parametrize(
    ("metadata", "start", "end", "reason"),
    [
        ({"attention.head_count_kv": [2] * (BLOCKS - 1) + [1]}, 0, 4, "head_count_kv differs between blocks"),
        ({}, 7, 8, "no block to run"),
    ],
    ids=["non-uniform", "MTP block alone"],
)
def test_glm4moe_refused_before_a_stage_file_is_written(tmp_path, metadata, start, end, reason):
    source = write_model(tmp_path / "refused.gguf", MODEL, metadata=metadata)
    cache = tmp_path / "cache"
    with pytest.raises(UnsupportedArchitecture, match=reason):
        ensure_stage_file(source, start, end, cache)
    with pytest.raises(UnsupportedArchitecture, match=reason):
        Chain(
            source,
            [(start, end), (end, BLOCKS)] if end < BLOCKS else [(start, end)],
            OPTIONS,
            cache_dir=cache,
        )
    assert not cache.exists()
