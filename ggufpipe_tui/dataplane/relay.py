"""The relay data plane: every stage's data stream ends in the orchestrator.

Stage i's outbound objects are read here, their header checked against the
bound run's edge, and forwarded to stage i+1 with the payload untouched and
streamed in chunks (memory bounded, backpressure kept: nothing more is read
until the consumer has drained). The last stage's token objects are decoded
and handed to the bound run they belong to (several may be in flight, each
with its own run id); in a token-ring run its ring objects (the next
input of stage 0) are forwarded to stage 0. The token-in edge is stage 0's
data stream.

Each stream has one writer (:class:`~ggufpipe_agent.wire.framing.FrameWriter`),
held for a whole object while a relay forwards it, so edge setup for the next
run never lands inside one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence

from ggufpipe_agent.errors import ProtocolError
from ggufpipe_agent.ids import RunId
from ggufpipe_agent.tasks import TaskOwner
from ggufpipe_agent.wire import objects
from ggufpipe_agent.wire.framing import FrameWriter, TruncatedFrame
from ggufpipe_agent.wire.protocol import Message, OpenEdge, encode_message
from ggufpipe_agent.wire.records import LOGPROBS_MAX
from ggufpipe_tui.core.plan import EdgePlan, RunPlan
from ggufpipe_tui.dataplane import DataPlaneEvents, DataStage, DataStream, TokenSink


class RelayPlane:
    def __init__(self, stages: Sequence[DataStage], tasks: TaskOwner, events: DataPlaneEvents) -> None:
        self.stages = stages
        self.tasks = tasks
        self.events = events
        # The runs bound now (several in flight with run.parallel), by run id.
        self.bound: dict[int, tuple[RunPlan, TokenSink]] = {}
        # By stage: the largest object it may send for any bound run (kept
        # as runs are bound and unbound, not worked out per object).
        self._limits: dict[int, int] = {}

    def _stream(self, index: int) -> DataStream:
        data = self.stages[index].data
        if data is None:
            raise ConnectionError(f"stage {index} has no data stream")
        return data

    async def open(self, timeout: float, again: Collection[int] = ()) -> None:
        await asyncio.gather(*(stage.open_data(timeout) for stage in self.stages))
        for index in range(len(self.stages) - 1):
            self.tasks.spawn(self._relay(index), f"relay {index}->{index + 1}")
        self.tasks.spawn(self._token_out(), "token-out reader")

    def bind(self, plan: RunPlan, sink: TokenSink) -> None:
        self.bound[plan.run_id] = (plan, sink)
        self._bound_changed()

    def unbind(self, run_id: RunId) -> None:
        if self.bound.pop(run_id, None) is not None:
            self._bound_changed()

    def _bound_changed(self) -> None:
        self._limits = {}
        for plan, _ in self.bound.values():
            for stage in plan.stages:
                extent = plan.edge(stage.outbound_edge).object_spec.max_extent
                self._limits[stage.stage_index] = max(extent, self._limits.get(stage.stage_index, 0))

    async def open_edges(self, plan: RunPlan, stage: int) -> None:
        ends = self.edge_ends(plan, stage)
        await self._stream(stage).writer.write(*(encode_message(end) for end in ends))

    @staticmethod
    def edge_ends(plan: RunPlan, stage: int) -> list[OpenEdge]:
        """Every edge end of ``stage`` in ``plan``, as the relay sets them up
        on the stage's data stream."""
        entry, last = plan.stages[stage], len(plan.stages) - 1
        ends = [
            OpenEdge(plan.run_id, entry.inbound_edge, "inbound"),
            OpenEdge(plan.run_id, entry.outbound_edge, "outbound"),
        ]
        if plan.ring is not None and stage == 0:
            ends.append(OpenEdge(plan.run_id, plan.ring.edge_id, "ring-in"))
        if plan.ring is not None and stage == last:
            ends.append(OpenEdge(plan.run_id, plan.ring.edge_id, "ring-out"))
        return ends

    async def write_tokens(
        self, plan: RunPlan, sequence: int, tokens: list[int], position: int, rebuild: bool = False
    ) -> None:
        record = objects.tokens_record(
            plan.run_id,
            plan.stages[0].inbound_edge,
            sequence,
            tokens,
            position=position,
            more=rebuild,
            rebuild=rebuild,
        )
        await self._stream(0).writer.write(record)

    def on_message(self, stage: int, message: Message) -> bool:
        return False  # the relay has no links of its own

    def close(self) -> None:
        for stage in self.stages:
            stage.close_data()

    # ------------------------------------------------------------- moving

    def _check(self, index: int, header: objects.ObjectHeader) -> EdgePlan | None:
        """The edge an object stage ``index`` produced belongs to; None when it
        belongs to no bound run (an old one) and is to be dropped."""
        bound = self.bound.get(header.run_id)
        if bound is None:
            self.events.log(index, f"dropped {header.describe()} of an old run")
            return None
        plan = bound[0]
        edge = plan.edge(plan.stages[index].outbound_edge)
        ring = plan.ring
        if ring is not None and index == len(plan.stages) - 1 and header.edge_id == ring.edge_id:
            edge = ring
        elif header.edge_id != edge.edge_id:
            raise ProtocolError(f"{header.describe()}: expected edge {edge.edge_id}")
        objects.check_spec(header, edge.object_spec)
        return edge

    def _limit(self, index: int) -> int:
        """The largest object stage ``index`` may send for any bound run."""
        return self._limits.get(index, objects.ABSOLUTE_MAX_PAYLOAD)

    async def _relay(self, index: int) -> None:
        source = self._stream(index).reader
        target = self._stream(index + 1).writer
        while True:
            try:
                header = await source.header(self._limit(index))
                if header is None:
                    self.events.lost(index, "data stream ended")
                    return
                edge = self._check(index, header)
            except TruncatedFrame:
                self.events.lost(index, "data stream ended inside a header")
                return
            except ProtocolError as error:
                self.events.fault(f"stage {index} sent a bad object: {error}")
                return
            except (ConnectionError, OSError) as error:
                self.events.lost(index, f"data stream broke ({error})")
                return
            async with target.exclusive():
                if not await self._forward(index, header, edge is not None, target):
                    return

    async def _forward(
        self, index: int, header: objects.ObjectHeader, keep: bool, target: FrameWriter
    ) -> bool:
        """One object's payload from stage ``index`` to the next (dropped when
        not ``keep``); False when a stream broke (and was reported)."""
        chunks = self._stream(index).reader.chunks(header)
        head: bytes | None = header.pack() if keep else None
        while True:
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                return True
            except TruncatedFrame:
                self.events.lost(index, "data stream ended inside an object")
                return False
            except (ConnectionError, OSError) as error:
                self.events.lost(index, f"data stream broke ({error})")
                return False
            if not keep:
                continue
            try:
                if head is not None:
                    target.put(head)
                    head = None
                target.put(chunk)
                await target.drain()
            except (ConnectionError, OSError) as error:
                self.events.lost(index + 1, f"data stream broke ({error})")
                return False

    async def _token_out(self) -> None:
        index = len(self.stages) - 1
        source = self._stream(index).reader
        # The reader waits for the next header with the limit of the runs bound
        # then; a run bound while it waits may ask for logprobs: the widest
        # token-out record any run may send is the bound.
        widest = objects.token_out_width(LOGPROBS_MAX) * objects.DTYPES[objects.DTYPE_CODES["int32"]].itemsize
        while True:
            try:
                header = await source.header(max(self._limit(index), widest))
                if header is None:
                    self.events.lost(index, "data stream ended")
                    return
                edge = self._check(index, header)
                payload = await source.payload(header)
            except TruncatedFrame:
                self.events.lost(index, "data stream ended")
                return
            except ProtocolError as error:
                self.events.fault(f"stage {index} sent a bad token object: {error}")
                return
            except (ConnectionError, OSError) as error:
                self.events.lost(index, f"data stream broke ({error})")
                return
            bound = self.bound.get(header.run_id)
            if edge is None or bound is None:
                continue
            if edge.kind == "TokenRing":  # the ring, relayed: stage 0's next input
                try:
                    await self._stream(0).writer.write(header.pack(), payload)
                except (ConnectionError, OSError) as error:
                    self.events.lost(0, f"data stream broke ({error})")
                    return
                continue
            tokens = objects.decode_tokens(header, payload)
            bound[1](header.sequence, tokens)
