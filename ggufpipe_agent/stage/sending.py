"""A stage run's step written on its edges: the next stage's activation rows,
or (the last stage) the sampled token to the orchestrator and, on a token
ring, stage 0's next input first; and the rows kept of what went to the next
stage, for a rebuild of it (llama/sent.py).

The records are built by stage/outputs.py; the writers are the run's
(process/data_streams.py and process/peer_links.py set them). An edge that
fails names its peer and faults the stage (``OutputFault``); the step's
caller then stops, since the stage's fault is reported already.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from ggufpipe_agent.errors import GgufpipeError
from ggufpipe_agent.ids import RunId, SlotId
from ggufpipe_agent.llama.sent import SentRows
from ggufpipe_agent.stage.fsm import FeedToken, OutputFault, StageEvent, TokenSampled
from ggufpipe_agent.stage.outputs import (
    activation_records,
    rebuild_records,
    ring_record,
    sent_part,
    token_record,
)
from ggufpipe_agent.stage.writers import RecordSink
from ggufpipe_agent.wire import objects
from ggufpipe_agent.wire.protocol import ProvisionStage

log = logging.getLogger("ggufpipe.stage")


class PartNotSent(GgufpipeError):
    """A prompt's part could not be sent on (the stage faulted already)."""


class SendingRun(Protocol):
    """What sending reads of a stage run (stage/job.py's StageJob), and what
    it sets: the peer a fault names, and the ring's next input."""

    provision: ProvisionStage
    outbound: RecordSink | None
    ring_out: RecordSink | None
    outbound_peer: int
    ring_peer: int
    fault_peer: int
    feed: FeedToken | None

    @property
    def run_id(self) -> RunId: ...

    @property
    def index(self) -> int: ...

    @property
    def slot(self) -> SlotId: ...

    @property
    def last(self) -> bool: ...

    @property
    def sent(self) -> SentRows: ...

    def apply(self, event: StageEvent) -> None: ...

    def apply_if_alive(self, event: StageEvent) -> None: ...


async def send_step(run: SendingRun, header: objects.ObjectHeader, result: Any, position: int) -> int | None:
    """The outputs of a step for ``header``: the next stage's activation rows
    (from ``position``), or the sampled token (to stage 0 by the ring and to
    the orchestrator). The payload bytes sent, or None where an edge failed
    (the stage faulted)."""
    p = run.provision
    sent = 0
    if run.last and p.ring is not None and p.ring.produce:
        # The token ring: the next input goes to stage 0 first (it is the
        # critical path), then the token to the orchestrator.
        run.feed = None
        run.apply(TokenSampled(header.sequence, int(result[0])))  # sets run.feed (FeedToken)
        feed = run.feed
        if feed is not None:
            # Stage 0's next input, at the position after the rows that made it.
            record = ring_record(p, feed.sequence, feed.token, header.position + header.rows)
            try:
                if run.ring_out is None:
                    raise ConnectionError("the token ring is not connected")
                await run.ring_out.write(record)
            except (ConnectionError, OSError) as error:
                run.fault_peer = run.ring_peer
                run.apply_if_alive(OutputFault(f"token ring edge {p.ring.edge_id}: {error}"))
                return None
            sent += len(record) - objects.HEADER_SIZE
    try:
        if run.outbound is None:
            raise ConnectionError("outbound edge is not connected")
        if run.last:
            record = token_record(p, header, result)
            await run.outbound.write(record)
            sent += len(record) - objects.HEADER_SIZE
        else:
            head, body = activation_records(p, header, result, position)
            await run.outbound.write(head, body)
            sent += len(body)
            run.sent.add(run.slot, sent_part(p, result, position, body))
    except (ConnectionError, OSError) as error:
        run.fault_peer = run.outbound_peer
        run.apply_if_alive(OutputFault(f"outbound edge {p.outbound.edge_id}: {error}"))
        return None
    return sent


async def resend(run: SendingRun, before: int) -> None:
    """The next stage was started again (the offer says resend): the rows this
    stage sent of the offered run, positions before ``before``, go to it
    first, in the parts they went in, flagged REBUILD."""
    p = run.provision
    parts = list(run.sent.parts(run.slot, before))
    log.info(
        "run %016x stage %d: sending the rebuilt next stage %d parts (%d positions)",
        run.run_id,
        run.index,
        len(parts),
        before,
    )
    try:
        if run.outbound is None:
            raise ConnectionError("outbound edge is not connected")
        for head, payload in rebuild_records(p, parts):
            await run.outbound.write(head, payload)
    except (ConnectionError, OSError) as error:
        run.fault_peer = run.outbound_peer
        run.apply_if_alive(OutputFault(f"outbound edge {p.outbound.edge_id}: {error}"))
        raise PartNotSent() from error


def keep_sent(run: SendingRun, header: objects.ObjectHeader, result: Any, position: int) -> None:
    """The next stage's rows of ``header``'s step kept, as if sent, for a
    rebuild of that stage (llama/sent.py)."""
    _, body = activation_records(run.provision, header, result, position)
    run.sent.add(run.slot, sent_part(run.provision, result, position, body))
