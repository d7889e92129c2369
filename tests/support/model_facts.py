"""Hand-made ``ModelFacts`` for the tests that need no real model: one record
of SmolLM2 135M's shape, and the same with the fields a test cares about
replaced."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ggufpipe_agent.wire.protocol import ModelFacts

#: What inspecting models/SmolLM2-135M-Instruct.Q4_1.gguf reports, by hand.
SMOL = ModelFacts(
    path="/models/SmolLM2-135M-Instruct.Q4_1.gguf",
    name="SmolLM2 135M Instruct",
    architecture="llama",
    file_type="Q4_1",
    file_size=98_362_432,
    block_count=30,
    hidden_dim=576,
    context_length=8192,
    vocab_size=49152,
    head_count=9,
    head_count_kv=3,
    key_length=64,
    value_length=64,
    bos_token_id=1,
    eos_token_id=2,
    eog_token_ids=(0, 2),
    add_bos=False,
    chat_template="",
    block_bytes=(2_654_208,) * 30,
    embedding_bytes=15_925_248,
    output_bytes=1_152,
)


def model_facts(**fields: Any) -> ModelFacts:
    """SMOL with ``fields`` replaced."""
    return replace(SMOL, **fields)
