"""A test client that speaks the protocol to a real agent process, byte by byte,
so tests can send what a well-behaved orchestrator never would."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import Any

from ggufpipe_agent.wire.framing import read_message
from ggufpipe_agent.wire.protocol import (
    DataAttach,
    EngineOptions,
    Hello,
    InboundEdgeProvision,
    Message,
    ObjectSpec,
    OpenEdge,
    OutboundEdgeProvision,
    ProvisionStage,
    RingSpec,
    SamplingParams,
    StageModelFacts,
    StageProgress,
    StepStats,
    encode_message,
)

HIDDEN = 576
SEQ = 256


def provision(
    run_id: int,
    model_path: str,
    stage_index: int = 0,
    stage_count: int = 1,
    layers: tuple[int, int] = (0, 30),
    edge_base: int = 100,
    dtype: str = "float32",
) -> ProvisionStage:
    tokens = ObjectSpec("tokens", "int32", 1, SEQ)
    activation = ObjectSpec("activation", dtype, HIDDEN, SEQ)
    inbound_spec = tokens if stage_index == 0 else activation
    last = stage_index == stage_count - 1
    outbound_spec = ObjectSpec("tokens", "int32", 1, 1) if last else activation
    return ProvisionStage(
        run_id=run_id,
        stage_index=stage_index,
        stage_count=stage_count,
        node_id="test",
        gguf_source=model_path,
        layer_start=layers[0],
        layer_end_exclusive=layers[1],
        inbound=InboundEdgeProvision(
            edge_base + stage_index,
            "TokenIn" if stage_index == 0 else "Activation",
            inbound_spec,
            RingSpec(2, inbound_spec.max_extent + 44),
        ),
        outbound=OutboundEdgeProvision(
            edge_base + stage_index + 1,
            "TokenOut" if last else "Activation",
            "orchestrator",
            outbound_spec,
            RingSpec(2, outbound_spec.max_extent + 44),
        ),
        model=StageModelFacts(
            "smollm2", "llama", 30, HIDDEN, 49152, "float", 4 if dtype == "float32" else 2, SEQ
        ),
        engine=EngineOptions(SEQ, SEQ, 64, threads=1),
        sampling=SamplingParams(),
    )


class AgentConversation:
    """Speaking the protocol to an agent as an orchestrator does: control
    messages on its control stream (:meth:`_control_in`, :meth:`_control_out`,
    given by a subclass), objects on its data socket."""

    #: How long an expected message may take.
    wait = 30.0

    def __init__(self) -> None:
        self.hello: Hello | None = None
        self.data_reader: asyncio.StreamReader | None = None
        self.data_writer: asyncio.StreamWriter | None = None

    def _control_in(self) -> asyncio.StreamReader:
        raise NotImplementedError

    def _control_out(self) -> asyncio.StreamWriter:
        raise NotImplementedError

    async def send(self, message: Message) -> None:
        await self.send_raw(encode_message(message))

    async def send_raw(self, data: bytes) -> None:
        writer = self._control_out()
        writer.write(data)
        await writer.drain()

    async def expect(self, kind: type, timeout: float | None = None) -> Any:
        """The next control message of ``kind``, skipping progress and stats."""
        while True:
            message = await asyncio.wait_for(read_message(self._control_in()), timeout or self.wait)
            if message is None:
                raise EOFError(f"the agent closed its control stream while waiting for {kind.__name__}")
            if isinstance(message, kind):
                return message
            if not isinstance(message, StageProgress | StepStats):
                raise AssertionError(f"expected {kind.__name__}, got {message}")

    async def expect_state(self, state: str, timeout: float | None = None) -> StageProgress:
        """The stage FSM's report of entering ``state``."""
        while True:
            message = await asyncio.wait_for(read_message(self._control_in()), timeout or self.wait)
            if isinstance(message, StageProgress) and message.state == state and message.fraction < 0:
                return message
            if message is None or not isinstance(message, StageProgress | StepStats):
                raise AssertionError(f"expected the stage to enter {state}, got {message}")

    async def attach_data(self, token: str | None = None) -> None:
        assert self.hello is not None
        path = self.hello.data_endpoint.removeprefix("unix:")
        self.data_reader, self.data_writer = await asyncio.open_unix_connection(path)
        self.data_writer.write(encode_message(DataAttach(token or self.hello.data_token)))
        await self.data_writer.drain()

    async def send_data(self, data: bytes | Message) -> None:
        assert self.data_writer is not None
        self.data_writer.write(encode_message(data) if isinstance(data, Message) else data)
        await self.data_writer.drain()

    async def open_edges(self, message: ProvisionStage) -> None:
        """Edge setup, after the agent acknowledged the provision (docs/rings.md)."""
        await self.expect_state("Preparing")
        await self.send_data(OpenEdge(message.run_id, message.inbound.edge_id, "inbound"))
        await self.send_data(OpenEdge(message.run_id, message.outbound.edge_id, "outbound"))


class AgentClient(AgentConversation):
    """An agent process on stdio, as the orchestrator starts one locally."""

    def __init__(self) -> None:
        super().__init__()
        self.process: asyncio.subprocess.Process | None = None
        self.stderr = b""

    def _control_in(self) -> asyncio.StreamReader:
        assert self.process and self.process.stdout
        return self.process.stdout

    def _control_out(self) -> asyncio.StreamWriter:
        assert self.process and self.process.stdin
        return self.process.stdin

    async def start(self) -> Hello:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "ggufpipe_agent",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        hello = await asyncio.wait_for(read_message(self.process.stdout), 30)  # type: ignore[arg-type]
        assert isinstance(hello, Hello)
        self.hello = hello
        return hello

    async def close(self) -> int:
        """Close stdin (the orchestrator leaving) and wait for the agent to exit."""
        process = self.process
        if process is None:
            return 0
        if self.data_writer is not None:
            self.data_writer.close()
        with contextlib.suppress(Exception):
            assert process.stdin
            process.stdin.close()
        try:
            await asyncio.wait_for(process.wait(), 15)
        except asyncio.TimeoutError:
            process.kill()
            await process.wait()
            raise AssertionError("the agent did not exit when its stdin closed") from None
        assert process.stderr
        self.stderr = await process.stderr.read()
        return process.returncode or 0
