"""Several prompts in flight at once (``--serve --parallel K``).

:class:`ParallelRunner` takes the same queue's prompts as
:class:`~.serving.SerialRunner`, in submission order, but keeps up to K runs
in flight: each run is
provisioned on its own slot of every stage (a llama.cpp sequence with its
own KV cache), so while one run's token is in stage 1, another's is in stage
0, and with K >= N every stage of an N-stage chain is busy. A prompt beyond
K is deferred: it waits in the queue, first in line, until a slot is free.

Which slot: core/slots.py's :func:`~ggufpipe_tui.core.slots.choose_slot`
(the longest prefix of this prompt its last run left in the stages; among
equals, with ``run.batching`` on, the one next to the slots in flight, so
that their batches stay one ubatch). A prompt with ``cache_prompt`` False
keeps nothing and takes the free slot by the same rules after the prefix.

Each run is its own: its own run id, sampling and ``max_tokens``, stopped
and faulted alone. With ``prepare_ahead`` (the server) every free slot keeps
a run provisioned and loaded, sampled as the last prompt asked, so a prompt
starts at once; one that asks for other sampling or another reply limit on
the token ring gets a run provisioned for it instead (as SerialRunner does). A run
that faults for good stops the queue as a sequential one does (the prompts
still waiting fail with the reason; the runs in flight finish); a stage lost
and recovered replays each run that was in flight, on its slot, cold.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

from ggufpipe_agent.errors import GgufpipeError
from ggufpipe_agent.ids import SlotId
from ggufpipe_agent.tasks import TaskOwner
from ggufpipe_tui.core.inventory import RunOptions
from ggufpipe_tui.core.slots import choose_slot
from ggufpipe_tui.session.driver import RunDriver
from ggufpipe_tui.session.runs import RunHandle, RunQueue, Turn, first_of, serves, with_history
from ggufpipe_tui.session.serving import Runner, Serving, pipeline_error, queue_failure
from ggufpipe_tui.session.stages import PipelineError

log = logging.getLogger(__name__)


class ParallelRunner(Runner):
    def __init__(self, pipeline: Serving, queue: RunQueue, slots: int, prepare_ahead: bool = False) -> None:
        super().__init__(pipeline, queue, prepare_ahead)
        self.slots = slots
        self.busy: set[int] = set()
        self.held: list[tuple[int, ...]] = [()] * slots  # the tokens each slot's stages hold
        self.used = [0.0] * slots  # when each slot last took a run
        self._freed = asyncio.Event()
        self._failure = ""
        self.runs = TaskOwner(self._run_failed, "parallel runs")
        self.prepared: dict[int, RunDriver] = {}  # by slot: a run waiting for its prompt
        self.preparing: dict[int, asyncio.Task[None]] = {}

    def _run_failed(self, name: str, error: BaseException) -> None:
        self._stop(f"internal error in the run queue ({name}): {type(error).__name__}: {error}")

    def _stop(self, reason: str) -> None:
        self.queue.stop(reason)
        self._freed.set()

    async def serve(self) -> None:
        """Prompts to runs, up to ``slots`` at once, until the pipeline breaks or closes."""
        pipeline, queue = self.pipeline, self.queue
        reason = ""
        if self.prepare_ahead:
            for slot in range(self.slots):
                self._prepare_ahead(SlotId(slot))
        try:
            while not queue.stopped:
                handle = await queue.take()
                if handle is None:
                    continue
                if len(self.busy) >= self.slots:  # it waits for a free slot, first in line
                    queue.defer(handle)
                    self._freed.clear()
                    await first_of(self._freed, queue.stopping())
                    continue
                try:
                    options = self._options(handle)
                    tokens, limit = await self._tokens(handle.prompt, options, pipeline.model_plan())
                except GgufpipeError as error:
                    handle.fail(pipeline_error(error))
                    continue
                if handle.done:
                    continue
                free = [SlotId(slot) for slot in range(self.slots) if slot not in self.busy]
                keep = handle.prompt.cache_prompt
                held = self.held if keep else [()] * self.slots
                batched = self.busy if options.batching else ()
                slot = choose_slot(free, held, self.used, tokens, batched)
                self.busy.add(slot)
                self.used[slot] = time.monotonic()
                self.held[slot] = ()  # changing from now on
                self.runs.spawn(self._run_on(slot, handle, tokens, options, limit), f"run on slot {slot}")
        except Exception as error:
            reason = queue_failure(error)
        finally:
            self._stop(reason or self._failure or pipeline.broken or "the pipeline closed")
            for task in self.preparing.values():
                task.cancel()
            for driver in self.prepared.values():
                if not driver.done.is_set():
                    driver.stop("the session is stopping")
                    self.runs.spawn(driver.done.wait(), "a prepared run's teardown")
            try:
                pending = self.runs.pending()
                if pending:  # the runs in flight finish (the pipeline closing cancels this wait)
                    await asyncio.wait(pending)
            finally:
                await self.runs.close()

    async def _run_on(
        self, slot: SlotId, handle: RunHandle, tokens: list[int], options: RunOptions, limit: int
    ) -> None:
        pipeline = self.pipeline
        # Provisioned with its own limit, and the prompt for the penalties to look back over.
        options = with_history(replace(options, max_tokens=limit), tokens)
        try:
            try:
                driver = await self._driver_for(slot, handle, options, limit)
            except GgufpipeError as error:
                handle.fail(pipeline_error(error))
                if pipeline.broken:  # no run can be prepared: the session serves no more
                    self._failure = pipeline.broken
                    self._stop(pipeline.broken)
                return
            if handle.done:  # withdrawn while its run was prepared: the run waits for the next
                if not driver.done.is_set():
                    self.prepared[slot] = driver
                return
            self.last_options = options
            result = await pipeline.run(driver, Turn(handle, tokens, limit, options, slot))
            source = driver.next_source()
            self.held[slot] = source.fed if source is not None else ()
            if pipeline.broken or result.outcome == "faulted":
                self._failure = result.failure or pipeline.broken
                self._stop(self._failure)
        finally:
            if not handle.done:  # cancelled: the pipeline is closing
                handle.fail(PipelineError(f"not run: {self.queue.stopped or 'the pipeline closed'}"))
            self.busy.discard(slot)
            self._freed.set()
            if self.prepare_ahead and not self.queue.stopped:
                self._prepare_ahead(slot)

    def _prepare_ahead(self, slot: SlotId) -> None:
        kept = self.prepared.get(slot)
        if kept is not None and not kept.done.is_set():
            return  # a prompt withdrawn in time left its run prepared

        async def prepare() -> None:
            try:
                self.prepared[slot] = await self.pipeline.prepare_run(self.last_options, slot=slot)
            except GgufpipeError as error:  # the prompt that takes the slot prepares its own
                log.info("slot %d: no run prepared ahead: %s", slot, error)

        self.preparing[slot] = self.runs.spawn(prepare(), f"run prepared on slot {slot}")

    async def _driver_for(
        self, slot: SlotId, handle: RunHandle, options: RunOptions, limit: int
    ) -> RunDriver:
        """The slot's run prepared ahead when it runs this prompt as asked;
        else (stopped first, if there is one) a run provisioned for it."""
        pipeline = self.pipeline
        preparing = self.preparing.pop(slot, None)
        if preparing is not None:
            await asyncio.wait({preparing})
        prepared = self.prepared.pop(slot, None)
        if prepared is not None:
            ring = prepared.plan.ring is not None
            if (
                not prepared.done.is_set()
                and handle.prompt.cache_prompt
                and serves(prepared.plan, options)
                and (not ring or prepared.plan.max_tokens == limit)
            ):
                return prepared
            if not prepared.done.is_set():
                prepared.stop("the next prompt asks for other options")
                await prepared.done.wait()
            await pipeline.repaired(prepared)  # a stage lost while the run waited: repaired first
        return await pipeline.prepare_run(options, slot=slot, reuse=handle.prompt.cache_prompt)
