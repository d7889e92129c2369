"""A session's data streams: the edge connections its runs' objects come in
on, from the orchestrator or over a link from another stage, and the one
that delivers a stage file. Each frame is checked against the run it names
before the run sees it; a frame that cannot be parsed loses its stream."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Container
from pathlib import Path
from typing import Any

from ggufpipe_agent.delivery.service import serve_delivery
from ggufpipe_agent.errors import GgufpipeError, ProtocolError
from ggufpipe_agent.ids import RunId
from ggufpipe_agent.stage.fsm import EdgeEstablished, InboundFault, StageState
from ggufpipe_agent.stage.job import StageJob
from ggufpipe_agent.wire import objects
from ggufpipe_agent.wire.delivery_messages import ReceiveStage
from ggufpipe_agent.wire.framing import FrameReader, FrameWriter, TruncatedFrame
from ggufpipe_agent.wire.protocol import Message, OpenEdge

#: How a refusal is sent: what was refused, why, and the run it names.
Refuse = Callable[..., None]


def live(runs: dict[int, StageJob]) -> list[StageJob]:
    """The runs not stopped yet."""
    return [run for run in runs.values() if run.fsm.state is not StageState.STOPPED]


class DataStreams:
    """The data streams of one session's runs (``runs``, by run id; the run
    ids it has seen end are ``seen_runs``)."""

    def __init__(
        self,
        runs: dict[int, StageJob],
        seen_runs: Container[int],
        refuse: Refuse,
        cache_dir: Callable[[], Path | None],
    ) -> None:
        self.runs = runs
        self.seen_runs = seen_runs
        self.refuse = refuse
        self.cache_dir = cache_dir

    async def serve(self, reader: asyncio.StreamReader, writer: Any, peer: int = -1) -> str:
        """Edge streams: OpenEdge frames and inbound object records, from the
        orchestrator or (``peer`` >= 0) over the link from stage ``peer``. A
        frame that cannot be parsed loses the stream (it cannot be
        resynchronised), and with it every run it carries. Returns why it ended."""
        what = "data connection" if peer < 0 else f"link from stage {peer}"
        frames = FrameReader(reader, what)
        outbound = FrameWriter(writer, what="outbound edge")
        while True:
            extents = {run.provision.inbound.object_spec.max_extent for run in live(self.runs)}
            limit = extents.pop() if len(extents) == 1 else objects.ABSOLUTE_MAX_PAYLOAD
            payload = b""
            try:
                frame = await frames.frame(limit)
                if isinstance(frame, objects.ObjectHeader):
                    problem = self.object_problem(frame)
                    if problem:
                        # Refused at its header; the payload is skipped in
                        # bounded chunks, never held: the stream stays in
                        # step and memory stays flat whatever it claims.
                        self.refuse("object", f"{frame.describe()}: {problem}")
                        async for _chunk in frames.chunks(frame):
                            pass
                        continue
                    payload = await frames.payload(frame)
            except TruncatedFrame:
                await self._fault(f"truncated frame: the {what} ended inside it", peer)
                return "it ended inside a frame"
            except ProtocolError as error:
                await self._fault(str(error), peer)
                return f"a malformed frame ({error})"
            except (ConnectionError, OSError) as error:
                return f"it broke ({error})"
            if frame is None:
                return "it was closed"
            if isinstance(frame, OpenEdge):
                await self.open_edge(frame, outbound, from_link=peer >= 0)
            elif isinstance(frame, ReceiveStage) and peer < 0:
                # A delivery connection (model send: true): a stage file, not edges.
                await serve_delivery(frame, frames, outbound, self.cache_dir())
                return "the stage file was delivered"
            elif isinstance(frame, Message):
                self.refuse(frame.tag, f"not a message for the {what}")
            else:
                await self.inbound_object(frame, payload)

    async def _fault(self, reason: str, peer: int = -1) -> None:
        """A frame that cannot be parsed: the stream is lost, and with it
        every run whose objects it carries."""
        self.refuse("data frame", reason)
        for run in live(self.runs):
            if run.fsm.state in (StageState.READY, StageState.EXECUTING, StageState.PREPARING):
                run.fault_peer = peer
                run.apply(InboundFault(f"malformed frame on the inbound edge: {reason}"))

    async def open_edge(self, message: OpenEdge, writer: Any, from_link: bool = False) -> None:
        problem = self.run_problem(message.run_id)
        if problem:
            self.refuse("OpenEdge", problem, message.run_id)
            return
        run = self.runs[message.run_id]
        expected = run.edge_ids(from_link).get(message.role)
        if expected is None or expected != message.edge_id:
            self.refuse(
                "OpenEdge",
                f"edge {message.edge_id} ({message.role}) is not in the provision message of run "
                f"{run.run_id:016x}",
                message.run_id,
            )
            return
        if run.fsm.state is not StageState.PREPARING:
            self.refuse("OpenEdge", f"edge {message.edge_id} set up outside Preparing", message.run_id)
            return
        if message.role == "outbound":
            run.outbound = writer
        elif message.role == "ring-out":
            run.ring_out = writer
        try:
            run.apply(EdgeEstablished(message.role))
        except GgufpipeError as error:
            self.refuse("OpenEdge", str(error), message.run_id)

    def object_problem(self, header: objects.ObjectHeader) -> str:
        """Why an inbound object is refused ('' when the run it names takes it)."""
        problem = self.run_problem(header.run_id)
        if problem:
            return problem
        run = self.runs[header.run_id]
        ring = run.provision.ring
        ring_edge = ring.edge_id if ring is not None and ring.consume else None
        if header.edge_id not in (run.provision.inbound.edge_id, ring_edge):
            return f"edge {header.edge_id} is not this stage's inbound edge"
        return ""

    async def inbound_object(self, header: objects.ObjectHeader, payload: bytes) -> None:
        problem = self.object_problem(header)  # the run may have stopped since the header
        if problem:
            self.refuse("object", f"{header.describe()}: {problem}")
            return
        await self.runs[header.run_id].forward(header, payload)

    def run_problem(self, run_id: RunId) -> str:
        run = self.runs.get(run_id)
        if run is not None and run.fsm.state is not StageState.STOPPED:
            return ""
        if run_id in self.seen_runs:
            return f"stale run id {run_id:016x}"
        return f"unknown run id {run_id:016x}"
