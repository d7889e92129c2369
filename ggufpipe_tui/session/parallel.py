"""Several prompts in flight at once (issue 29; ``--serve --parallel K``).

:class:`ParallelQueue` serves the same handles as :class:`~.runs.RunQueue`,
in submission order, but keeps up to K runs in flight: each run is
provisioned on its own slot of every stage (a llama.cpp sequence with its
own KV cache), so while one run's token is in stage 1, another's is in stage
0, and with K >= N every stage of an N-stage chain is busy. A prompt beyond
K waits in the queue until a slot is free.

Which slot: a free one whose last run left the longest prefix of this
prompt in the stages (a conversation's next turn finds its own cache, as
llama-server's slots do); the least recently used among equals. A prompt
with ``cache_prompt`` False keeps nothing and takes the least recently used.

Each run is its own: its own run id, sampling and ``max_tokens``, stopped
and faulted alone. With ``prepare_ahead`` (the server) every free slot keeps
a run provisioned and loaded, sampled as the last prompt asked, so a prompt
starts at once; one that asks for other sampling or another reply limit on
the token ring gets a run provisioned for it instead (as RunQueue does). A run
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
from ggufpipe_agent.tasks import TaskOwner
from ggufpipe_tui.core.inventory import RunOptions
from ggufpipe_tui.core.reuse import common_prefix
from ggufpipe_tui.session.driver import RunDriver
from ggufpipe_tui.session.runs import QueuePipeline, RunHandle, RunQueue, run_options, serves
from ggufpipe_tui.session.stages import PipelineError

log = logging.getLogger(__name__)


def choose_slot(free: list[int], held: list[tuple[int, ...]], used: list[float], prompt: list[int]) -> int:
    """The free slot whose cached tokens share the longest prefix with
    ``prompt``; among equals the least recently used. Pure."""
    return max(free, key=lambda slot: (common_prefix(held[slot], prompt), -used[slot], -slot))


class ParallelQueue(RunQueue):
    def __init__(self, pipeline: QueuePipeline, slots: int, prepare_ahead: bool = False) -> None:
        super().__init__(pipeline, prepare_ahead)
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
        self.stop(f"internal error in the run queue ({name}): {type(error).__name__}: {error}")

    async def serve(self) -> None:
        """Prompts to runs, up to ``slots`` at once, until the pipeline breaks or closes."""
        pipeline = self.pipeline
        reason = ""
        if self.prepare_ahead:
            for slot in range(self.slots):
                self._prepare_ahead(slot)
        try:
            while not self.stopped:
                handle = await self._next(None)
                if handle is None:
                    continue
                self.taking = handle
                while len(self.busy) >= self.slots and not self.stopped:
                    self._freed.clear()
                    await self._freed.wait()
                self.taking = None
                if self.stopped:
                    handle.fail(PipelineError(f"not run: {self.stopped}"))
                    break
                if handle.done:  # withdrawn while it waited for a slot
                    continue
                try:
                    options = run_options(pipeline.inventory.run, handle.prompt.options)
                    model = pipeline.model_plan()
                    tokens, limit = await self._tokens(handle.prompt, options, model)
                except GgufpipeError as error:
                    handle.fail(error if isinstance(error, PipelineError) else PipelineError(str(error)))
                    continue
                if handle.done:
                    continue
                free = [slot for slot in range(self.slots) if slot not in self.busy]
                keep = handle.prompt.cache_prompt
                slot = choose_slot(free, self.held if keep else [()] * self.slots, self.used, tokens)
                self.busy.add(slot)
                self.used[slot] = time.monotonic()
                self.held[slot] = ()  # changing from now on
                self.runs.spawn(self._run_on(slot, handle, tokens, options, limit), f"run on slot {slot}")
        except GgufpipeError as error:
            reason = str(error)
        except Exception as error:  # a bug: said, and every prompt fails instead of waiting forever
            log.exception("the run queue failed")
            reason = f"internal error in the run queue: {type(error).__name__}: {error}"
        finally:
            taken, self.taking = self.taking, None
            if taken is not None and not taken.done:
                taken.fail(PipelineError(f"not run: {self.stopped or reason or 'the pipeline closed'}"))
            self.stop(reason or self._failure or pipeline.broken or "the pipeline closed")
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
        self, slot: int, handle: RunHandle, tokens: list[int], options: RunOptions, limit: int
    ) -> None:
        pipeline = self.pipeline
        options = replace(options, max_tokens=limit)  # provisioned with its own limit
        try:
            try:
                driver = await self._driver_for(slot, handle, options, limit)
            except GgufpipeError as error:
                handle.fail(error if isinstance(error, PipelineError) else PipelineError(str(error)))
                if pipeline.broken:  # no run can be prepared: the session serves no more
                    self._failure = pipeline.broken
                    self.stop(pipeline.broken)
                return
            if handle.done:  # withdrawn while its run was prepared: the run waits for the next
                if not driver.done.is_set():
                    self.prepared[slot] = driver
                return
            self.last_options = options
            result = await self._run(handle, driver, tokens, limit, options, slot)
            source = driver.next_source()
            self.held[slot] = source.fed if source is not None else ()
            if pipeline.broken or result.outcome == "faulted":
                self._failure = result.failure or pipeline.broken
                self.stop(self._failure)
        finally:
            if not handle.done:  # cancelled: the pipeline is closing
                handle.fail(PipelineError(f"not run: {self.stopped or 'the pipeline closed'}"))
            self.busy.discard(slot)
            self._freed.set()
            if self.prepare_ahead and not self.stopped:
                self._prepare_ahead(slot)

    def _prepare_ahead(self, slot: int) -> None:
        kept = self.prepared.get(slot)
        if kept is not None and not kept.done.is_set():
            return  # a prompt withdrawn in time left its run prepared

        async def prepare() -> None:
            try:
                self.prepared[slot] = await self.pipeline.prepare_run(self.last_options, slot=slot)
            except GgufpipeError as error:  # the prompt that takes the slot prepares its own
                log.info("slot %d: no run prepared ahead: %s", slot, error)

        self.preparing[slot] = self.runs.spawn(prepare(), f"run prepared on slot {slot}")

    async def _driver_for(self, slot: int, handle: RunHandle, options: RunOptions, limit: int) -> RunDriver:
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
            if pipeline.take_interrupted(prepared.plan.run_id) is not None:
                await pipeline.recover()  # a stage lost while the run waited: repaired first
        return await pipeline.prepare_run(options, slot=slot, reuse=handle.prompt.cache_prompt)

    def stop(self, reason: str) -> None:
        super().stop(reason)
        self._freed.set()
