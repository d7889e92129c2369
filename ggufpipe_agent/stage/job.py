"""One provisioned run of a stage: the stage FSM (docs/design.md, "Stage state
machine") with its effects performed.

The controller is control-path only: it decides when ``ExecuteStep`` runs
(driven by object arrival and local readiness, never by the orchestrator) and
hands payloads between the inbound ring, the engine and the outbound edge.
See docs/rings.md for the ring and pump design.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from dataclasses import replace
from pathlib import Path
from typing import Any

from ggufpipe_agent.errors import GgufpipeError, ProtocolError, StepNotStarted
from ggufpipe_agent.ids import NO_RUN, EdgeId
from ggufpipe_agent.llama.batches import prefill_chunks
from ggufpipe_agent.llama.engine import StageEngine
from ggufpipe_agent.llama.loaded import LoadedEngine
from ggufpipe_agent.llama.sent import SentRows
from ggufpipe_agent.stage.batching import Row, StepBatcher, trace
from ggufpipe_agent.stage.fsm import (
    CancelPrepare,
    EmitFault,
    EmitReady,
    EmitStopped,
    EndGeneration,
    ExecuteStep,
    FeedToken,
    InboundFault,
    ObjectLoaded,
    RejectWork,
    ReleaseInput,
    SetupFailed,
    Stage,
    StageEvent,
    StageState,
    StartPrepare,
    StepCompleted,
    StepFailed,
    StopComplete,
    StopLocal,
    WorkerBound,
    transition,
)
from ggufpipe_agent.stage.handover import ConsumerRun, Precomputed, chain_next
from ggufpipe_agent.stage.outputs import Counters
from ggufpipe_agent.stage.preparation import load_engine, stage_file
from ggufpipe_agent.stage.sending import PartNotSent, keep_sent, resend, send_step
from ggufpipe_agent.stage.writers import RecordSink
from ggufpipe_agent.tasks import TaskOwner
from ggufpipe_agent.wire import objects
from ggufpipe_agent.wire.protocol import (
    Message,
    PrefixHeld,
    ProvisionStage,
    Refused,
    StageFault,
    StageProgress,
    StageReady,
    StageStopped,
    StepStats,
)

log = logging.getLogger("ggufpipe.stage")

#: Queues a message to the orchestrator; messages leave in the order posted.
Post = Callable[[Message], None]
#: Step statistics reach the orchestrator at most this often while running.
STATS_INTERVAL_S = 0.25
PROGRESS_INTERVAL_S = 0.1


class StageJob:
    def __init__(
        self,
        provision: ProvisionStage,
        post: Post,
        worker: Executor,
        engines: LoadedEngine,
        cache_dir: Path | None,
        batcher: StepBatcher | None = None,
    ) -> None:
        self.provision = provision
        self.run_id = provision.run_id
        self.index = provision.stage_index
        self.first = provision.stage_index == 0
        self.slot = provision.slot  # the engine's slot (sequence id) this run's KV cache is in
        self.last = provision.stage_index == provision.stage_count - 1
        self._post = post
        self._worker = worker
        self._engines = engines
        self._cache_dir = cache_dir
        self.fsm = Stage()
        # A full ring stops the reader of the whole data stream (backpressure),
        # and with it the other runs' objects on that stream: so it holds a
        # prompt's every part (one row each at most: the context's rows, what
        # one prompt object may carry anyway) besides the ring's slots, and a
        # prompt arriving never holds up the decode rows of the runs streaming.
        self.ring: asyncio.Queue[tuple[objects.ObjectHeader, bytes]] = asyncio.Queue(
            maxsize=max(1, provision.inbound.ring_spec.slots) + provision.engine.n_ctx
        )
        self.outbound: RecordSink | None = None
        self.ring_out: RecordSink | None = None  # the token ring's writer (the last stage of a ring run)
        # The stage of a direct link each writer goes to (-1: the orchestrator's
        # stream): a fault on it names the peer, which may be the one that died.
        self.outbound_peer = -1
        self.ring_peer = -1
        self.fault_peer = -1
        self.feed: FeedToken | None = None
        self.counters = Counters()
        self.engine: StageEngine | None = None
        self.held = PrefixHeld()  # what this run may keep of the offered run (set by _prepare)
        self._ready = asyncio.Event()
        self._current: tuple[objects.ObjectHeader, bytes] | None = None
        self.tasks = TaskOwner(self._task_failed, f"stage {self.index} run")
        self._prepare_task: asyncio.Task[None] | None = None
        self._step_task: asyncio.Task[None] | None = None
        self._pump_task: asyncio.Task[None] | None = None
        self.stopped = asyncio.Event()
        self._progress_at = 0.0
        # The consumer of the outbound edge when it is a stage of this process
        # (a shared process's direct link), and a step of this stage the
        # worker ran ahead of its object (ggufpipe_agent/stage/handover.py).
        self.local_next: ConsumerRun | None = None
        self.precomputed: Precomputed | None = None
        self.chained = 0  # steps of this run taken from the chain
        # Decode steps batched with the other runs in flight on this stage
        # (stage/batching.py), or None: each step alone (run.batching: off,
        # or one slot).
        self.batcher = batcher if batcher is not None and provision.engine.parallel > 1 else None
        self._prompt_open = False  # a part of the prompt came that another follows

    @property
    def sent(self) -> SentRows:
        """The rows this stage's engine sent on, by slot (a rebuild's source)."""
        return self._engines.sent

    def edge_ids(self, from_link: bool) -> dict[str, EdgeId]:
        """The edge id each role may set up; a link sets up only the
        consumer's ends (a peer never makes a stage write to it)."""
        ring = self.provision.ring
        ids: dict[str, EdgeId] = {"inbound": self.provision.inbound.edge_id}
        if ring is not None and ring.consume:
            ids["ring-in"] = ring.edge_id
        if not from_link:
            ids["outbound"] = self.provision.outbound.edge_id
            if ring is not None and ring.produce:
                ids["ring-out"] = ring.edge_id
        return ids

    # ------------------------------------------------------------ FSM core

    def apply(self, event: StageEvent) -> None:
        before = self.fsm.state
        self.fsm, effects = transition(self.fsm, event)
        after = self.fsm.state
        # Ready <-> Executing flips once per token: reporting it would cost a
        # control message per step per stage. Step statistics say it instead.
        per_step = {before, after} == {StageState.READY, StageState.EXECUTING}
        if after is not before and not per_step:
            log.info("run %016x stage %d: %s -> %s", self.run_id, self.index, before.value, after.value)
            self._progress(after.value, self.fsm.fault, -1.0)
        if self.fsm.state is StageState.READY:
            self._ready.set()
        else:
            self._ready.clear()
        for effect in effects:
            self._perform(effect)

    def _perform(self, effect: Any) -> None:
        p = self.provision
        if isinstance(effect, StartPrepare):
            self._prepare_task = self._spawn(self._prepare())
        elif isinstance(effect, CancelPrepare):
            if self._prepare_task is not None:
                self._prepare_task.cancel()
        elif isinstance(effect, EmitReady):
            self._post(StageReady(self.run_id, self.index, p.node_id, self.held))
            if self._pump_task is None:
                self._pump_task = self._spawn(self._pump())
        elif isinstance(effect, EmitFault):
            log.error("run %016x stage %d faulted: %s", self.run_id, self.index, effect.reason)
            self._post(StageFault(self.run_id, self.index, p.node_id, effect.reason, self.fault_peer))
        elif isinstance(effect, FeedToken):
            self.feed = effect  # written by the step that sampled it, before its token-out
        elif isinstance(effect, EndGeneration):
            log.info("run %016x stage %d: the ring ends here (%s)", self.run_id, self.index, effect.reason)
        elif isinstance(effect, ExecuteStep):
            self._step_task = self._spawn(self._execute(effect.sequence))
        elif isinstance(effect, ReleaseInput):
            self._current = None
        elif isinstance(effect, RejectWork):
            log.warning("run %016x stage %d refused work: %s", self.run_id, self.index, effect.reason)
            self._post(Refused("object", effect.reason))
        elif isinstance(effect, StopLocal):
            self._spawn(self._stop_local())
        elif isinstance(effect, EmitStopped):
            self._engines.release(self.slot, self.run_id)
            self.stopped.set()
            self._post(StageStopped(self.run_id, self.index, p.node_id, self.counters.snapshot()))

    def _spawn(self, coroutine: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        return self.tasks.spawn(coroutine, getattr(coroutine, "__qualname__", ""))

    def _task_failed(self, name: str, error: BaseException) -> None:
        self.internal_fault(f"internal error in the agent ({name}): {type(error).__name__}: {error}")

    def internal_fault(self, reason: str) -> None:
        """A task of this run failed of a bug: fault the stage with the event
        its current state accepts (the orchestrator hears of it)."""
        event: StageEvent
        state = self.fsm.state
        if state is StageState.PREPARING:
            event = SetupFailed(reason)
        elif state is StageState.EXECUTING:
            event = StepFailed(reason)
        elif state is StageState.READY:
            event = InboundFault(reason)
        else:
            log.error("run %016x stage %d: %s", self.run_id, self.index, reason)
            return
        self.apply(event)

    # -------------------------------------------------------------- effects

    def _progress(self, state: str, detail: str, fraction: float) -> None:
        self._post(StageProgress(self.run_id, self.index, state, detail, fraction))

    def _load_progress(self, loop: asyncio.AbstractEventLoop, detail: str) -> Callable[[float], None]:
        def report(fraction: float) -> None:
            now = time.monotonic()
            if fraction < 1.0 and now - self._progress_at < PROGRESS_INTERVAL_S:
                return
            self._progress_at = now
            loop.call_soon_threadsafe(self._progress, "Preparing", detail, fraction)

        return report

    async def _prepare(self) -> None:
        p = self.provision
        loop = asyncio.get_running_loop()
        try:
            stage_path = await stage_file(
                p, self._worker, self._cache_dir, lambda what: self._load_progress(loop, what)
            )
            progress = self._load_progress(loop, "loading into llama.cpp")
            self.engine, self.held = await loop.run_in_executor(
                self._worker, load_engine, self._engines, stage_path, p, progress
            )
            held = self.held
            if held.run_id:
                log.info(
                    "run %016x stage %d: holds %d positions of run %016x (in steps of %d)%s",
                    self.run_id,
                    self.index,
                    held.positions,
                    held.run_id,
                    held.granularity,
                    f": {held.reason}" if held.reason else "",
                )
        except asyncio.CancelledError:
            return
        except GgufpipeError as error:
            self.apply_if_alive(SetupFailed(str(error)))
            return
        except Exception as error:  # noqa: BLE001 - a boundary: any failure is one fault
            log.exception("stage setup failed")
            self.apply_if_alive(SetupFailed(f"{type(error).__name__}: {error}"))
            return
        self.apply_if_alive(WorkerBound())

    def apply_if_alive(self, event: StageEvent) -> None:
        if self.fsm.state is not StageState.STOPPED:
            self.apply(event)

    async def _pump(self) -> None:
        """Inbound ring -> ExecuteStep, one object at a time, only when Ready."""
        while True:
            await self._ready.wait()  # the next object stays in the ring until then
            item = await self.ring.get()
            self._current = item
            self.counters.received(item[0].nbytes)
            self.apply(ObjectLoaded(item[0].sequence))

    async def forward(self, header: objects.ObjectHeader, payload: bytes) -> None:
        """An inbound object from the data connection (the inbound pump)."""
        state = self.fsm.state
        ring = self.provision.ring
        spec = self.provision.inbound.object_spec
        if ring is not None and header.edge_id == ring.edge_id:
            spec = ring.object_spec
        if state in (StageState.READY, StageState.EXECUTING):
            try:
                objects.check_spec(header, spec)
            except ProtocolError as error:
                self.apply(InboundFault(str(error)))
                return
            await self.ring.put((header, payload))  # blocks when full: backpressure
        elif state is StageState.PREPARING:
            self.apply(InboundFault(f"{header.describe()} arrived before the stage was ready"))
        else:
            self.apply(ObjectLoaded(header.sequence))  # Faulted/Stopping: RejectWork

    async def _execute(self, sequence: int) -> None:
        assert self._current is not None and self.engine is not None
        header, payload = self._current
        engine = self.engine
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        ahead, self.precomputed = self.precomputed, None
        position = header.position  # where the rows this step sends on start
        try:
            if ahead is not None and ahead.matches(header):
                # The producer's worker ran this step already (stage/handover.py).
                if not self.chained:
                    log.info(
                        "run %016x stage %d: decode steps run on the worker right after the "
                        "previous stage's (one process)",
                        self.run_id,
                        self.index,
                    )
                self.chained += 1
                if ahead.error is not None:
                    raise ahead.error
                result, ran = ahead.result, ahead.elapsed_ms
            else:
                if self.first:
                    inputs: Any = objects.decode_tokens(header, payload)
                else:
                    inputs = objects.decode_activation(header, payload)
                if sequence == 0:
                    result, position = await self._prompt(engine, header, inputs)
                    ran = (time.perf_counter() - started) * 1000.0
                elif self.batcher is not None:
                    row = Row(
                        self.run_id, self.slot, header.position, inputs, loop.create_future(), self._settle
                    )
                    result, ran = await self.batcher.step(engine, row)
                else:
                    # Every step runs on the one worker thread, decode steps included:
                    # llama.cpp's OpenMP team belongs to the calling thread, and a
                    # second team (decode steps inline on the event loop) measured
                    # half the tokens/s of one team, whatever the thread hops save.
                    step = self.worker_step
                    result, chained = await loop.run_in_executor(self._worker, step, engine, header, inputs)
                    # This stage's step, not the later stages' the worker ran after it.
                    ran = (time.perf_counter() - started) * 1000.0 - chained
        except PartNotSent:
            return  # the edge's fault is the stage's fault already
        except GgufpipeError as error:
            self.apply_if_alive(StepFailed(f"step {sequence}: {error}"))
            return
        except Exception as error:  # noqa: BLE001 - a boundary: any failure is one fault
            log.exception("step failed")
            self.apply_if_alive(StepFailed(f"step {sequence}: {type(error).__name__}: {error}"))
            return
        if self.fsm.state is not StageState.EXECUTING:
            return  # StopRun came while the step ran
        sent = 0
        if result is not None:  # None: the last stage computed a prompt's part another follows
            written = await send_step(self, header, result, position)
            if written is None:
                return
            sent = written
        counters = self.counters
        counters.count(sequence, ran, sent, header.rows, header.position)
        self.apply(StepCompleted(sequence, more=header.more))
        now = time.monotonic()
        if now - counters.sent_at >= STATS_INTERVAL_S:
            counters.sent_at = now
            self._post(StepStats(self.run_id, self.index, counters.snapshot()))

    async def _prompt(
        self, engine: StageEngine, header: objects.ObjectHeader, inputs: Any
    ) -> tuple[Any, int]:
        """A prompt, or a part of one, computed in the chunks one llama.cpp
        context fed it computes (llama/batches.py): each chunk's rows go on
        to the next stage as soon as they are computed, a part flagged MORE
        but the last, while the worker computes the next chunk. Returns the
        last chunk's result (the sampled token in the last stage, None where
        another part follows) and its position."""
        p = self.provision
        loop = asyncio.get_running_loop()
        chunks = deque(
            prefill_chunks(
                header.position, header.rows, engine.n_batch, engine.n_ubatch, p.engine.exact_reuse
            )
        )
        opens = not self._prompt_open  # the prompt's first part: it says where the run starts
        self._prompt_open = header.more
        rebuild = header.rebuild  # computed into the cache only: the stages after hold it
        if opens:
            self.sent.opened(self.slot, header.position)
            if p.reuse.resend and header.position:
                await resend(self, header.position)
        sending: asyncio.Task[int | None] | None = None
        begin, position, result, count = 0, header.position, None, 0
        batcher = self.batcher
        while chunks:
            count = chunks.popleft()
            if batcher is not None:
                if self.first and not rebuild:
                    # Beside runs streaming, stage 0 cuts the chunk finer (the
                    # stages after it compute the parts as they come).
                    rows = batcher.prompt_rows(count)
                    if rows < count:
                        chunks.appendleft(count - rows)
                        count = rows
                await batcher.yield_to_batch()  # a decode batch waiting goes first
            final = not chunks
            chunk = inputs[begin : begin + count]
            sample = final and not header.more
            computing = loop.run_in_executor(
                self._worker, self._step, engine, opens and begin == 0, position, chunk, sample, True
            )
            if sending is not None and await sending is None:
                raise PartNotSent()
            result = await computing
            if rebuild:
                if not self.last:  # kept as if sent, for the next stage's own loss
                    keep_sent(self, replace(header, rows=count, position=position), result, position)
                result = None
            elif not final and not self.last:
                part = replace(header, rows=count, position=position, more=True)
                sending = asyncio.ensure_future(send_step(self, part, result, position))
            begin, position = begin + count, position + count
        if sending is not None and await sending is None:
            raise PartNotSent()
        return result, position - count

    def waiting_for_input(self) -> bool:
        """Ready for its next object, with nothing queued (the chain asks)."""
        return self.fsm.state is StageState.READY and self.ring.empty()

    def worker_step(
        self, engine: StageEngine, header: objects.ObjectHeader, inputs: Any
    ) -> tuple[Any, float]:
        """One decode step on the worker thread; then, on a shared process's
        direct link, the consumer's step (stage/handover.py). Returns the
        result and the milliseconds the chained steps took."""
        result = self._step(engine, False, header.position, inputs)
        if self.local_next is None:
            return result, 0.0
        started = time.perf_counter()
        chain_next(self, header, result)
        return result, (time.perf_counter() - started) * 1000.0

    def _step(
        self,
        engine: StageEngine,
        opens: bool,
        position: int,
        inputs: Any,
        sample: bool = True,
        chunk: bool = False,
    ) -> Any:
        """One step, on the worker thread. The prompt's first chunk (``opens``)
        says where the run starts: at 0, or after a prefix this stage said it
        holds (StageReady), which is kept and the rest of the cache dropped.
        The slot then records that this run wrote the cache; a step that
        fails leaves nothing a later run may keep."""
        slots = self._engines
        engine.use(self.slot)
        try:
            if opens:
                slots.wrote(self.slot, NO_RUN)  # the cache changes now
                held, offer = self.held, self.provision.reuse
                resumed = offer.resume and position == held.positions  # its next step, in its shape
                if position and (position > held.positions or (position % held.granularity and not resumed)):
                    raise ProtocolError(
                        f"the prompt starts at position {position}, but this stage holds "
                        f"{held.positions} positions of run {held.run_id:016x} (in steps of "
                        f"{held.granularity})"
                    )
                engine.keep(position)
                log.info(
                    "run %016x stage %d: prompt after %d kept positions", self.run_id, self.index, position
                )
            started = time.perf_counter()
            result: Any = engine.step(inputs, position, sample)
            if chunk and self.batcher is not None:  # a prompt row's ms here, for the next chunk's size
                self.batcher.timed_chunk(len(inputs), (time.perf_counter() - started) * 1000.0)
            if self.last and result is not None:  # its logprobs, read before another slot's step
                result = (result, engine.sampled_logprobs())
        except StepNotStarted:
            # Queued when StopRun came: nothing computed, so the cache holds what the
            # run's steps before it left (a recovery carries the run on from there).
            if opens:
                self._settle(False)
            raise
        except BaseException:
            self._settle(False)
            raise
        slots.wrote(self.slot, self.run_id)
        composition = [(self.run_id, self.slot, position, len(inputs), int(not sample))]
        trace(self.index, composition, [inputs], started)
        return result

    def _settle(self, done: bool) -> None:
        """After a step of this run (on the worker thread): its slot holds
        this run's positions, or (the step failed) nothing a later run may keep."""
        if done:
            self._engines.wrote(self.slot, self.run_id)
        else:
            self._engines.forget(f"a step of run {self.run_id:016x} failed or was aborted", self.slot)

    async def _stop_local(self) -> None:
        """Stop local edges, let a running step end, then report stopped."""
        if self._step_task is not None and not self._step_task.done():
            if self.engine is not None:
                self.engine.abort(self.slot)
            await asyncio.wait({self._step_task})
        if self._pump_task is not None:
            self._pump_task.cancel()
        while not self.ring.empty():
            self.ring.get_nowait()
        self.outbound = self.ring_out = None
        self._current = None
        self.apply(StopComplete())
