"""Whether a stage's kernels are batch-invariant: the probe that decides how
much of a kept KV cache a new run may reuse (docs/worker.md, "Prefix reuse").

Kernels that switch with the batch size (llamafile's sgemm, repacked
weights, a tiled attention, GPU batch kernels) make a decode step's KV differ
from a prefill's; only where a row comes out bit for bit alike in any batch
may a new run keep the positions the last run decoded.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import numpy as np

from ggufpipe_agent.errors import GgufpipeError
from ggufpipe_agent.llama.plumbing import StageShape
from ggufpipe_agent.wire.protocol import SamplingParams

log = logging.getLogger("ggufpipe.engine")

#: Rows of the batch-invariance probe compared between batch shapes.
PROBE_ROWS = 4


class Probed(Protocol):
    """What the probe uses of a stage engine."""

    path: str
    shape: StageShape
    n_ubatch: int
    n_ctx: int

    @property
    def n_past(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...

    def reset(self, sampling: SamplingParams, keep: bool = False) -> None: ...
    def step(
        self, inputs: np.ndarray | list[int], position: int | None = None, sample: bool = True
    ) -> np.ndarray | int | None: ...
    def last_logits(self) -> bytes: ...
    def sequence_state(self) -> bytes: ...
    def restore_sequence(self, state: bytes, positions: int, exact_end: int | None = None) -> None: ...


def probe_keeping_the_cache(engine: Probed, exact_end: int) -> tuple[bool, str]:
    """Probe batch invariance once, with the cache (``exact_end``: the end of
    what its slot computed as a cold run does) saved and put back: whether
    rows come out alike in any batch, and what differed if not."""
    saved, positions = engine.sequence_state(), engine.n_past
    try:
        note = probe_batch_invariance(engine)
        invariant = not note
    except GgufpipeError as error:
        invariant, note = False, f"the probe failed: {error}"
    try:
        engine.restore_sequence(saved, positions, exact_end)
    except GgufpipeError:
        engine.reset(SamplingParams())  # nothing kept rather than something wrong
    log.info(
        "%s: %s",
        engine.path,
        "rows come out alike in any batch: decoded positions can be kept"
        if invariant
        else f"{note}: only whole prefilled ubatches can be kept",
    )
    return invariant, note


def probe_batch_invariance(engine: Probed) -> str:
    """Whether a row's results depend on the batch around it: '' when the
    last rows of a ubatch come out bit for bit the same (KV cache and
    outputs: activations, or the last row's logits) computed in the
    ubatch, one by one, and in a small batch; else what differed. Leaves
    the engine reset (its cache empty): the caller saves what it holds."""
    rows = min(engine.n_ubatch, engine.n_ctx)
    tail = min(PROBE_ROWS, rows - 1)
    random = np.random.default_rng(0)
    inputs: np.ndarray | list[int]
    if engine.shape.first:
        inputs = random.integers(1, max(2, engine.vocab_size), rows).tolist()
    else:
        inputs = random.standard_normal((rows, engine.shape.hidden)).astype(np.float32)

    def result(outputs: list[Any]) -> tuple[bytes, bytes]:
        """The KV cache and the outputs (activations, or the last row's logits)."""
        out = engine.last_logits() if engine.shape.last else np.concatenate(outputs).tobytes()
        return engine.sequence_state(), out

    try:
        engine.reset(SamplingParams())
        reference = result([engine.step(inputs)])
        if tail == 0:
            return ""
        engine.reset(SamplingParams())
        head = engine.step(inputs[: rows - tail])
        after_head = engine.sequence_state()
        arms = {"one by one": [1] * tail, "in a small batch": [tail] if tail > 1 else []}
        for name, sizes in arms.items():
            if not sizes:
                continue
            engine.restore_sequence(after_head, rows - tail)
            outputs = [head]
            begin = rows - tail
            for size in sizes:
                outputs.append(engine.step(inputs[begin : begin + size]))
                begin += size
            cache, out = result(outputs)
            if cache != reference[0]:
                return f"its KV cache differs when rows are computed {name} and in one ubatch"
            if out != reference[1]:
                return f"its outputs differ when rows are computed {name} and in one ubatch"
        return ""
    finally:
        engine.reset(SamplingParams())
