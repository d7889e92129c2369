"""Stages of one shared process: the next stage's decode step runs right
after this one's, on the same worker thread.

In a shared agent process (``share_process: true``) every stage's steps run
on the process's one worker thread, and a direct link between two of its
stages is a Unix socket into the same process. Handing each token's
activation through the event loop costs two thread wake-ups and a few loop
turns per hand-off (docs/performance.md measures it).

So when a stage's decode step is done and its consumer is a stage of this
process that waits for it (Ready, nothing queued, the same run), the worker
runs the consumer's step at once, from the same activation the link will
carry (encoded and decoded as the link does, so float16 edges round the
same way), and keeps its result (:class:`Precomputed`). Everything else is
unchanged: the record still goes over the link, the consumer's FSM still
takes it as ever (ObjectLoaded, Executing, StepCompleted), and its step
takes the kept result instead of calling the worker when it is for that
object. The chain goes forward only: the last stage's sampled token goes
back to stage 0 through the loop, where the ring's stop rules (EOS,
``max_tokens``) are applied.

Only decode steps (one row) chain: a prompt's steps keep their abort path.
A result kept for an object that never comes (the producer faulted after
the step) is dropped with its run; the consumer's engine then holds one
more position, which the next run's ``keep`` trims like any other.
``GGUFPIPE_NO_CHAIN=1`` turns the chain off.

What the chain needs of a stage run is :class:`ChainedRun`
(:class:`ggufpipe_agent.stage.job.StageJob` is one).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ggufpipe_agent.ids import RunId
from ggufpipe_agent.wire import objects
from ggufpipe_agent.wire.protocol import ProvisionStage

#: Finds the consumer stage's run of a run id in this process (or None).
ConsumerRun = Callable[[int], "ChainedRun | None"]


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


class ChainedRun(Protocol):
    """What the chain reads of a stage run, and the one thing it sets
    (``precomputed``)."""

    precomputed: Precomputed | None

    @property
    def run_id(self) -> RunId: ...

    @property
    def last(self) -> bool: ...

    @property
    def local_next(self) -> ConsumerRun | None: ...

    @property
    def engine(self) -> Any: ...

    @property
    def provision(self) -> ProvisionStage: ...

    def waiting_for_input(self) -> bool:
        """Ready for its next object, with nothing queued."""
        ...

    def worker_step(self, engine: Any, header: objects.ObjectHeader, inputs: Any) -> tuple[Any, float]: ...


def chain_next(run: ChainedRun, header: objects.ObjectHeader, result: Any) -> None:
    """On the worker thread, after ``run``'s step for ``header`` gave
    ``result`` (activations): the consumer's step, when it is in this
    process and waits for exactly this object."""
    find = run.local_next
    if find is None or run.last or header.rows != 1:
        return
    consumer = find(run.run_id)
    if (
        consumer is None
        or consumer is run
        or consumer.run_id != run.run_id
        or consumer.engine is None
        or consumer.precomputed is not None
        or not consumer.waiting_for_input()
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
