"""Stages of one shared process: the next stage's decode step runs right
after this one's, on the same worker thread.

In a shared agent process (``share_process: true``) every stage's steps run
on the process's one worker thread, and a direct link between two of its
stages is a Unix socket into the same process (whose records the producer
hands to the consumer's delivery, links.py, rather than through the socket).
Each hand-off of a token's activation went worker -> event loop (the step's
result, the record written to the link) -> event loop (the record checked,
queued, the consumer's FSM stepped) -> worker (the consumer's step): two
thread wake-ups and a few loop turns, 0.8-1.0 ms a hand-off measured here
against 5-8 ms steps, while the stages' OpenMP threads sleep or spin and the
other core goes to the loop.

So when a stage's decode step is done and its consumer is a stage of this
process that waits for it (Ready, nothing queued, the same run), the worker
runs the consumer's step at once, from the same activation the link will
carry (encoded and decoded as the link does, so float16 edges round the
same way), and keeps its result (:class:`Precomputed`). Everything else is
unchanged: the record still goes over the link, the consumer's FSM still
takes it as ever (ObjectLoaded, Executing, StepCompleted), and its
``_execute`` takes the kept result instead of calling the worker when it
is for that object. The chain goes forward only: the last stage's sampled
token goes back to stage 0 through the loop, where the ring's stop rules
(EOS, ``max_tokens``) are applied. (Running stage 0's next step on the worker
too, ahead of the loop, was tried: the loop's bookkeeping of one token then
runs beside the next token's steps, and on this project's 2-core machine it
took a core from the stages' OpenMP team: 0.92 of the serial chain (medians of 4 alternating runs); branch
``issue-16-ring-overlap``.)

Only decode steps (one row) chain: a prompt's steps keep their abort path.
A result kept for an object that never comes (the producer faulted after
the step) is dropped with its run; the consumer's engine then holds one
more position, which the next run's ``keep`` trims like any other.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ggufpipe_agent import objects

if TYPE_CHECKING:
    from ggufpipe_agent.stage_run import StageRun

#: Finds the consumer stage's current run in this process (or None).
ConsumerRun = Callable[[], "StageRun | None"]


@dataclass(frozen=True, slots=True)
class Precomputed:
    """A step the worker ran ahead of its object's arrival."""

    sequence: int
    position: int
    result: Any
    error: BaseException | None
    elapsed_ms: float

    def matches(self, header: objects.ObjectHeader) -> bool:
        return self.sequence == header.sequence and self.position == header.position


def chain_next(run: StageRun, header: objects.ObjectHeader, result: Any) -> None:
    """On the worker thread, after ``run``'s step for ``header`` gave
    ``result`` (activations): the consumer's step, when it is in this
    process and waits for exactly this object."""
    from ggufpipe_agent.stage_fsm import StageState

    find = run.local_next
    if find is None or run.last or header.rows != 1:
        return
    consumer = find()
    if (
        consumer is None
        or consumer is run
        or consumer.run_id != run.run_id
        or consumer.engine is None
        or consumer.precomputed is not None
        or consumer.fsm.state is not StageState.READY
        or not consumer.ring.empty()
    ):
        return
    outbound = run.provision.outbound
    dtype = outbound.object_spec.dtype
    head, body = objects.activation_record(
        run.run_id, outbound.edge_id, header.sequence, result, dtype, position=header.position
    )
    arrived = objects.unpack_header(head, len(body))
    inputs = objects.decode_activation(arrived, body)
    started = time.perf_counter()
    value: Any = None
    error: BaseException | None = None
    chained = 0.0
    try:
        value, chained = consumer.worker_step(consumer.engine, arrived, inputs)
    except BaseException as failure:  # noqa: BLE001 - kept for the consumer's own _execute to raise
        error = failure
    elapsed = (time.perf_counter() - started) * 1000.0 - chained  # the consumer's own step
    consumer.precomputed = Precomputed(header.sequence, header.position, value, error, elapsed)


def chaining_enabled() -> bool:
    """``GGUFPIPE_NO_CHAIN=1`` turns the chain off (to measure what it saves)."""
    return os.environ.get("GGUFPIPE_NO_CHAIN", "") in ("", "0")
