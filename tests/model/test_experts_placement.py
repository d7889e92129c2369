"""A mixture of experts' routed experts in host RAM (llama.cpp's ``--cpu-moe``)
and the memory facts of expert tensors, on the synthetic Mixtral-style model
``llama-moe`` (tests/support/synthetic.py: 4 experts, 2 used, 7 blocks).

On the CPU the override moves nothing (every weight is in host memory
already), so what is observable is that llama.cpp accepts the override list
the engine builds (its debug log names each tensor it moved: "tensor
blk.0.ffn_gate_exps.weight (0 MiB f32) buffer type overridden to CPU",
llama-model-loader.cpp) and that the tokens do not change. The GPU side is
planned (tests/unit/test_placement.py), not measured: no GPU here.
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from pathlib import Path

import pytest

from ggufpipe_agent.gguf import architectures
from ggufpipe_agent.gguf.facts import read_model_facts
from ggufpipe_agent.gguf.header import read_header
from ggufpipe_agent.gguf.memory import EXPERTS_PATTERN, estimate_stage, memory_facts, memory_facts_of
from ggufpipe_agent.wire.protocol import EngineOptions
from tests.support import synthetic
from tests.support.common import whole_model_greedy
from tests.support.llama_buffers import LogLines, load_and_report
from tests.support.stage_chain import Chain

UBATCH = 16
CONTEXT = 256
STEPS = 64
OPTIONS = EngineOptions(n_ctx=CONTEXT, n_batch=CONTEXT, n_ubatch=UBATCH, threads=1)
PROMPT = synthetic.prompt_tokens(3 * UBATCH - 5)  # three ubatches, the last one partial
OVERRIDDEN = re.compile(r"tensor blk\.(\d+)\.(\S+) \(.*\) buffer type overridden to CPU")


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic.write_model(tmp_path_factory.mktemp("moe") / "llama-moe.gguf", "llama-moe")


def test_memory_facts_size_each_blocks_experts(moe_model):
    header = read_header(moe_model)
    memory = memory_facts_of(read_model_facts(moe_model))
    experts, hidden, ffn = 4, synthetic.HIDDEN, synthetic.FFN
    for block in range(7):
        tensors = [t for t in header.tensors if t.name.startswith(f"blk.{block}.")]
        exps = [t for t in tensors if re.search(EXPERTS_PATTERN, t.name)]
        assert sorted(t.name.split(".")[2] for t in exps) == ["ffn_down_exps", "ffn_gate_exps", "ffn_up_exps"]
        assert all(t.nbytes == experts * ffn * hidden * 4 for t in exps)  # 3-D, f32
        # The router (ffn_gate_inp) is in the block, not among the experts.
        assert memory.block_bytes[block] == sum(t.nbytes for t in tensors)
        assert memory.expert_bytes[block] == 3 * experts * ffn * hidden * 4
        assert memory.expert_tensor_bytes[block] == experts * ffn * hidden * 4
    assert memory.n_ff == 2 * ffn  # 2 experts used per token
    assert not memory.output_kept


def test_an_output_kept_in_every_stage_is_counted_as_llama_cpp_loads_it(moe_model, tmp_path, monkeypatch):
    """An architecture that keeps ``output.weight`` in every stage file
    (``keep_tensors``; here llama made to, for the test): a middle stage then
    holds it, llama.cpp's model buffer grows by its bytes, and so does the
    estimate."""
    sizes = {}
    for kept in (False, True):
        if kept:
            support = replace(architectures.SUPPORTED["llama"], keep_tensors=("output.weight",))
            monkeypatch.setitem(architectures.SUPPORTED, "llama", support)
        memory = memory_facts(read_header(moe_model))  # not cached, unlike read_model_facts
        assert memory.output_kept == kept
        reported, engine = load_and_report(moe_model, 2, 5, OPTIONS, tmp_path / f"kept-{kept}")
        engine.close()
        sizes[kept] = (estimate_stage(memory, 2, 5, OPTIONS).host.weights, reported.model)
    output = next(t.nbytes for t in read_header(moe_model).tensors if t.name == "output.weight")
    assert sizes[True][0] - sizes[False][0] == output
    assert abs((sizes[True][1] - sizes[False][1]) - output) <= 0.02 * (1 << 20)  # logged to 0.01 MiB


def test_a_split_with_its_experts_in_ram_loads_them_there_and_gives_the_same_tokens(moe_model):
    reference = whole_model_greedy(moe_model, PROMPT, STEPS, n_ctx=CONTEXT, n_ubatch=UBATCH)
    assert len(set(reference)) >= 16, "the reference must keep changing tokens"
    logger = logging.getLogger("ggufpipe.llama")
    handler = LogLines()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)  # llama.cpp logs each override at debug level
    try:
        chain = Chain(moe_model, [(0, 3), (3, 7)], replace(OPTIONS, experts_in_ram=True))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    try:
        tokens = chain.generate(PROMPT, STEPS)
    finally:
        chain.close()
    assert tokens == reference
    moved = [OVERRIDDEN.search(line) for line in handler.lines]
    names = [(int(m.group(1)), m.group(2)) for m in moved if m]
    # Each stage renumbers its blocks from 0: 3 + 4 blocks, three expert tensors each.
    expected = [
        (block, f"{name}.weight")
        for blocks in (3, 4)
        for block in range(blocks)
        for name in ("ffn_gate_exps", "ffn_down_exps", "ffn_up_exps")
    ]
    assert sorted(names) == sorted(expected)
    assert not any("ffn_gate_inp" in line and "overridden" in line for line in handler.lines)


def test_without_the_setting_nothing_is_overridden(moe_model):
    logger = logging.getLogger("ggufpipe.llama")
    handler = LogLines()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        Chain(moe_model, [(0, 7)], OPTIONS).close()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert handler.lines and not any(OVERRIDDEN.search(line) for line in handler.lines)
