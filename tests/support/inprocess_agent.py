"""An agent in the test's own process, with llama.cpp replaced by a fake.

The runtime is the agent's own (:class:`ggufpipe_agent.process.runtime.Agent`:
its data socket, worker thread and private directory) and so is the control
session (:class:`ggufpipe_agent.process.control.ControlChannel`), served on one end
of a socket pair; only the engine slot differs: it builds a
:class:`FakeEngine` (records its calls, returns fixed tokens or activations)
where the agent would load a stage into llama.cpp. A test speaks the
protocol to it byte by byte, as :class:`tests.support.agent_client.AgentClient`
does to an agent process, but in milliseconds and without the real model: the
stage files it prepares are written from a tiny synthetic GGUF
(:mod:`tests.support.synthetic`). Fit for the unit lane.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ggufpipe_agent.llama.engine import StageShape
from ggufpipe_agent.llama.loaded import LoadedEngine
from ggufpipe_agent.process.control import ControlChannel
from ggufpipe_agent.process.runtime import Agent
from ggufpipe_agent.wire.protocol import (
    Hello,
    ProvisionStage,
    RingSpec,
    SamplingParams,
)
from tests.support import agent_client, synthetic
from tests.support.agent_client import AgentConversation

#: The synthetic llama model's facts (tests/support/synthetic.py).
HIDDEN = synthetic.HIDDEN
BLOCKS = synthetic.SPECS["llama"].blocks
VOCAB = synthetic.VOCAB
SEQ = agent_client.SEQ


def write_tiny_model(path: Path) -> Path:
    """The synthetic llama GGUF the in-process agent's stages are cut from."""
    return synthetic.write_model(path, "llama")


def provision(
    run_id: int,
    model_path: str,
    stage_index: int = 0,
    stage_count: int = 1,
    layers: tuple[int, int] = (0, BLOCKS),
    edge_base: int = 100,
    dtype: str = "float32",
) -> ProvisionStage:
    """:func:`tests.support.agent_client.provision`, for the synthetic llama
    model instead of SmolLM2 (its block count, width and vocabulary)."""
    message = agent_client.provision(run_id, model_path, stage_index, stage_count, layers, edge_base, dtype)

    def narrowed(edge: Any) -> Any:
        spec = edge.object_spec
        if spec.kind == "activation":
            spec = dataclasses.replace(spec, width=HIDDEN)
        return dataclasses.replace(
            edge, object_spec=spec, ring_spec=RingSpec(edge.ring_spec.slots, spec.max_extent + 44)
        )

    model = dataclasses.replace(
        message.model, model_id="synthetic-llama", block_count=BLOCKS, hidden_dim=HIDDEN, vocab_size=VOCAB
    )
    return dataclasses.replace(
        message, inbound=narrowed(message.inbound), outbound=narrowed(message.outbound), model=model
    )


def no_crash(caplog: pytest.LogCaptureFixture) -> None:
    """What an agent process would print as a traceback on stderr: a logged
    exception (a failed task, a handler that raised)."""
    crashed = [record for record in caplog.records if record.exc_info]
    assert not crashed, [caplog.handler.format(record) for record in crashed]


class FakeEngine:
    """A stand-in for one llama.cpp context running a stage file
    (:class:`ggufpipe_agent.llama.engine.StageEngine`'s methods): every call is
    recorded in :attr:`calls`; a step of the last stage samples
    :attr:`TOKEN`, any other returns its rows of :attr:`ACTIVATION`."""

    TOKEN = 7
    ACTIVATION = 0.5
    keep_granularity = 1

    def __init__(self, path: str, shape: StageShape, options: Any) -> None:
        self.path = path
        self.shape = shape
        self.options = options
        self.calls: list[tuple[Any, ...]] = []
        self.slot = 0
        self.past: dict[int, int] = {}  # positions each slot holds
        self.closed = False
        self.n_batch = options.n_batch
        self.n_ubatch = options.n_ubatch

    @property
    def n_past(self) -> int:
        return self.past.get(self.slot, 0)

    @n_past.setter
    def n_past(self, value: int) -> None:
        self.past[self.slot] = value

    def use(self, slot: int) -> None:
        self.slot = slot

    def reset(self, sampling: SamplingParams, keep: bool = False) -> None:
        self.calls.append(("reset", keep))
        if not keep:
            self.n_past = 0

    def keepable(self) -> tuple[int, str]:
        return self.n_past, ""

    def keep(self, positions: int) -> None:
        self.calls.append(("keep", positions))
        assert 0 <= positions <= self.n_past, (positions, self.n_past)
        self.n_past = positions

    def abort(self, slot: int = -1) -> None:
        self.calls.append(("abort",))

    def step(self, inputs: Any, position: int | None = None, sample: bool = True) -> Any:
        rows = len(inputs)
        start = self.n_past if position is None else position
        self.calls.append(("step", rows, start))
        self.n_past = start + rows
        if self.shape.last:
            return self.TOKEN if sample else None
        return np.full((rows, self.shape.hidden), self.ACTIVATION, np.float32)

    def step_batch(self, rows: list[tuple[int, Any]]) -> list[Any]:
        results = []
        for slot, inputs in rows:
            self.use(slot)
            value = self.step(inputs)
            results.append((value, None) if self.shape.last else value)
        return results

    def sampled_logprobs(self) -> Any:
        return None

    def row_problem(self, slot: int, inputs: Any) -> Any:
        return None

    def close(self) -> None:
        self.calls.append(("close",))
        self.closed = True

    def steps(self) -> list[tuple[Any, ...]]:
        return [call for call in self.calls if call[0] == "step"]


class FakeLoadedEngine(LoadedEngine):
    """The agent's engine slot (which run its cache holds, prefix offers) with
    a :class:`FakeEngine` where llama.cpp would be loaded; :attr:`loaded`
    lists every engine it built, in order."""

    def __init__(self) -> None:
        super().__init__(self._build)
        self.loaded: list[FakeEngine] = []

    def _build(self, path: str, shape: StageShape, options: Any, progress: Callable[[float], None]) -> Any:
        progress(1.0)
        engine = FakeEngine(path, shape, options)
        self.loaded.append(engine)
        return engine


class InProcessAgent(AgentConversation):
    """An agent in this process, spoken to like an agent process
    (:class:`tests.support.agent_client.AgentClient`'s methods)."""

    wait = 10.0

    def __init__(self, cache_dir: Path) -> None:
        super().__init__()
        self.runtime = Agent(cache_dir)
        self.engines = FakeLoadedEngine()
        self.runtime.engines = self.engines
        self.session: ControlChannel | None = None
        self.serving: asyncio.Task[str] | None = None
        self.control_reader: asyncio.StreamReader | None = None
        self.control_writer: asyncio.StreamWriter | None = None
        # The runtime's data connections, each served by a task of the
        # socket server's: close() lets them end before the loop does.
        self._data_tasks: set[asyncio.Task[Any]] = set()
        self._session_writer: asyncio.StreamWriter | None = None
        serve_data_connection = self.runtime._data_connection

        async def tracked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            self._data_tasks.add(task)
            try:
                await serve_data_connection(reader, writer)
            finally:
                self._data_tasks.discard(task)

        self.runtime._data_connection = tracked  # type: ignore[method-assign]

    def _control_in(self) -> asyncio.StreamReader:
        assert self.control_reader is not None
        return self.control_reader

    def _control_out(self) -> asyncio.StreamWriter:
        assert self.control_writer is not None
        return self.control_writer

    async def start(self) -> Hello:
        await self.runtime.start()
        ours, theirs = socket.socketpair()
        self.control_reader, self.control_writer = await asyncio.open_connection(sock=ours)
        reader, writer = await asyncio.open_connection(sock=theirs, limit=1 << 20)
        self._session_writer = writer  # the process's stdout: closed when the session has ended
        self.session = ControlChannel(self.runtime, reader, writer)
        self.serving = asyncio.create_task(self.session.serve())
        hello = await self.expect(Hello)
        self.hello = hello
        return hello

    async def ended(self, timeout: float = 10) -> str:
        """Why the session ended (by itself, or after :meth:`close`)."""
        assert self.serving is not None
        return await asyncio.wait_for(asyncio.shield(self.serving), timeout)

    async def close(self) -> str:
        """The orchestrator leaves (its control stream closes): the session
        ends, as an agent process on stdio then exits. Returns why it ended."""
        writers = [w for w in (self.data_writer, self.control_writer) if w is not None]
        for writer in writers:
            writer.close()
        try:
            return await self.ended(15) if self.serving is not None else ""
        finally:
            self.runtime.close()
            if self._session_writer is not None:
                self._session_writer.close()
                writers.append(self._session_writer)
            if self._data_tasks:
                await asyncio.wait(set(self._data_tasks), timeout=5)
            for writer in writers:
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
            self.runtime.worker.shutdown(wait=True)
            self.runtime.helper.shutdown(wait=True)
