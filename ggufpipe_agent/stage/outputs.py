"""What a stage's step becomes on its edges, and the counts it adds to.

A non-last stage's step is activation rows for the next stage; the last
stage's is the sampled token (with its logprobs when the run asked for them)
for the orchestrator, and on a token ring stage 0's next input. The records
are built here from the provision; stage/sending.py writes them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

from ggufpipe_agent.llama.sent import SentPart
from ggufpipe_agent.wire import objects
from ggufpipe_agent.wire.protocol import ProvisionStage, StepCounters


def ring_record(p: ProvisionStage, sequence: int, token: int, position: int) -> bytes:
    """Stage 0's next input on the token ring (its object ``sequence``)."""
    assert p.ring is not None
    return objects.tokens_record(p.run_id, p.ring.edge_id, sequence, [token], position=position)


def token_record(p: ProvisionStage, header: objects.ObjectHeader, result: tuple[int, Any]) -> bytes:
    """The last stage's token for ``header``'s step (``result``: the token and
    its logprob words or None), fed back at the position after the rows that
    made it."""
    token, words = result
    after = header.position + header.rows
    if words is not None:  # the run asked for logprobs: they travel with the token
        return objects.sample_record(p.run_id, p.outbound.edge_id, header.sequence, words, position=after)
    return objects.tokens_record(p.run_id, p.outbound.edge_id, header.sequence, [int(token)], position=after)


def activation_records(
    p: ProvisionStage, header: objects.ObjectHeader, rows: Any, position: int
) -> tuple[bytes, memoryview]:
    """The next stage's rows of ``header``'s step (from ``position``), in the
    edge's dtype, a part flagged MORE where ``header`` is one."""
    edge = p.outbound
    return objects.activation_record(
        p.run_id,
        edge.edge_id,
        header.sequence,
        rows,
        edge.object_spec.dtype,
        position=position,
        more=header.more,
    )


def sent_part(p: ProvisionStage, rows: Any, position: int, body: memoryview) -> SentPart:
    """Activation ``rows`` (as sent: ``body``, in the edge's dtype) as the
    sender keeps them (llama/sent.py)."""
    count, width = rows.shape
    return SentPart(position, count, width, objects.DTYPE_CODES[p.outbound.object_spec.dtype], bytes(body))


def rebuild_records(p: ProvisionStage, parts: Iterable[SentPart]) -> Iterator[tuple[bytes, memoryview]]:
    """The parts a stage sent of an interrupted run, again, for the rebuilt
    next stage: header and payload of each, sequence 0, flagged MORE and
    REBUILD, at its position, in its first shape (docs/recovery.md)."""
    for part in parts:
        head = objects.ObjectHeader(
            objects.KIND_ACTIVATION,
            part.dtype,
            p.run_id,
            p.outbound.edge_id,
            0,
            part.rows,
            part.cols,
            len(part.payload),
            part.position,
            more=True,
            rebuild=True,
        )
        yield head.pack(), memoryview(part.payload)


class Counters:
    """A run's step counters as they grow (:class:`StepCounters`, the record
    the orchestrator is sent, is frozen: each count makes the next one)."""

    def __init__(self) -> None:
        self._now = StepCounters()
        self.sent_at = 0.0

    def received(self, nbytes: int) -> None:
        self._now = replace(self._now, bytes_in=self._now.bytes_in + nbytes)

    def count(self, sequence: int, elapsed_ms: float, sent: int, rows: int, position: int) -> None:
        now = replace(self._now, last_ms=elapsed_ms, bytes_out=self._now.bytes_out + sent)
        if sequence == 0:  # the prompt, or one of its parts: the first says where it starts
            kept = position if now.prefill_rows == 0 else now.kept
            self._now = replace(
                now, prefill_ms=now.prefill_ms + elapsed_ms, prefill_rows=now.prefill_rows + rows, kept=kept
            )
        else:
            self._now = replace(now, steps=now.steps + 1, total_ms=now.total_ms + elapsed_ms)

    def snapshot(self) -> StepCounters:
        return self._now
