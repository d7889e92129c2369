"""An in-process chain of stage engines: the split pipeline without agents.

Activations pass between engines through the same object-record encoding the
wire uses, so float16 here rounds exactly as it would between hosts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ggufpipe_agent.gguf.facts import read_model_facts
from ggufpipe_agent.llama.engine import StageEngine, StageShape
from ggufpipe_agent.stagefiles.build import ensure_stage_file
from ggufpipe_agent.wire import objects
from ggufpipe_agent.wire.protocol import EngineOptions, SamplingParams


def even_splits(blocks: int, stages: int) -> list[tuple[int, int]]:
    base, extra = divmod(blocks, stages)
    ranges, start = [], 0
    for index in range(stages):
        end = start + base + (1 if index < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


class Chain:
    def __init__(
        self,
        path: Path,
        splits: list[tuple[int, int]],
        options: EngineOptions,
        cache_dir: Path | None = None,
        dtype: str = "float32",
    ) -> None:
        facts = read_model_facts(path)
        self.hidden = facts.hidden_dim
        self.dtype = dtype
        self.engines = []
        for index, (start, end) in enumerate(splits):
            stage_file = ensure_stage_file(path, start, end, cache_dir)
            shape = StageShape(index == 0, index == len(splits) - 1, end - start, facts.hidden_dim)
            self.engines.append(StageEngine(str(stage_file), shape, options))

    def reset(self, sampling: SamplingParams | None = None) -> None:
        for engine in self.engines:
            engine.reset(sampling or SamplingParams())

    def step(self, sequence: int, tokens: list[int]) -> int:
        value: object = tokens
        for engine in self.engines[:-1]:
            rows = engine.step(value)  # type: ignore[arg-type]
            head, body = objects.activation_record(1, 1, sequence, rows, self.dtype)
            header = objects.unpack_header(head, objects.ABSOLUTE_MAX_PAYLOAD)
            value = objects.decode_activation(header, bytes(body))
        result = self.engines[-1].step(value)  # type: ignore[arg-type]
        return int(result)  # type: ignore[arg-type]

    def generate(self, prompt: list[int], steps: int) -> list[int]:
        out = [self.step(0, prompt)]
        while len(out) < steps:
            out.append(self.step(len(out), [out[-1]]))
        return out

    def close(self) -> None:
        for engine in self.engines:
            engine.close()


def generate(
    path: Path,
    splits: list[tuple[int, int]],
    prompt: list[int],
    steps: int,
    options: EngineOptions,
    dtype: str = "float32",
) -> list[int]:
    chain = Chain(path, splits, options, dtype=dtype)
    try:
        return chain.generate(prompt, steps)
    finally:
        chain.close()


def agreement(a: list[int], b: list[int]) -> float:
    """Share of positions where two token sequences agree, up to the first
    difference counted as the prefix length over the length."""
    same = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        same += 1
    return same / max(1, len(a))


__all__ = ["Chain", "even_splits", "generate", "agreement", "np"]
