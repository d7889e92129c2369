"""The session policy every view shares: prompts become runs, one at a time.

A view calls :meth:`Pipeline.submit <ggufpipe_tui.session.pipeline.Pipeline.submit>`
with a :class:`Prompt` and gets a :class:`RunHandle`: it can stop the run (or
withdraw the prompt while it waits), follow its events and await its result.
:class:`RunQueue` serves the handles in submission order, one run at a time;
with ``prepare_ahead`` (the interactive views) it keeps the next run
provisioned and loaded so a prompt starts the moment it is given. A run that
faults stops the queue: the pipeline cannot carry another run, and every
prompt still waiting is failed with the reason.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ggufpipe_agent.errors import GgufpipeError
from ggufpipe_tui.core.events import Event, PromptAssigned, RunResult
from ggufpipe_tui.session.driver import RunDriver
from ggufpipe_tui.session.stages import PipelineError

if TYPE_CHECKING:
    from ggufpipe_tui.session.pipeline import Pipeline


@dataclass(frozen=True, slots=True)
class Prompt:
    """What to run: text (through the model's chat template unless ``chat``
    is False; None means the inventory's ``run.chat``) or token ids as is."""

    text: str = ""
    tokens: tuple[int, ...] | None = None
    chat: bool | None = None
    submitted: float = field(default_factory=time.perf_counter)  # for the time to first token


class RunHandle:
    """One submitted prompt and, once it has one, its run."""

    def __init__(self, prompt: Prompt, ticket: int, stream: bool) -> None:
        self.prompt = prompt
        self.ticket = ticket
        self.run_id: int | None = None
        self.driver: RunDriver | None = None
        self.withdrawn = ""  # why the prompt was withdrawn before its run
        self._events: asyncio.Queue[Event | None] | None = asyncio.Queue() if stream else None
        self._subscribers: list[Callable[[Event], None]] = []
        self._result: asyncio.Future[RunResult] = asyncio.get_running_loop().create_future()

    @property
    def started(self) -> bool:
        return self.driver is not None

    @property
    def done(self) -> bool:
        return self._result.done()

    def subscribe(self, callback: Callable[[Event], None]) -> None:
        """``callback(event)`` for every event of this run, as it happens."""
        self._subscribers.append(callback)

    def stop(self, reason: str = "stopped by the user") -> None:
        """Stop the run (it completes with what it has), or withdraw the prompt
        if its run has not started."""
        if self.driver is not None:
            self.driver.stop(reason)
        elif not self.done:
            self.withdrawn = reason
            self.fail(PipelineError(f"not run: {reason}"))

    async def result(self) -> RunResult:
        """The run's result, whatever its outcome. Raises PipelineError when
        the prompt was never run (withdrawn, too long, or the pipeline broke)."""
        return await asyncio.shield(self._result)

    async def events(self) -> AsyncIterator[Event]:
        """The run's events up to and including RunFinished (``stream=True``)."""
        if self._events is None:
            raise RuntimeError("submit(..., stream=True) to follow a run's events")
        while True:
            event = await self._events.get()
            if event is None:
                return
            yield event

    # ------------------------------------------------------ the queue's side

    def push(self, event: Event) -> None:
        for callback in self._subscribers:
            callback(event)
        if self._events is not None:
            self._events.put_nowait(event)

    def finish(self, result: RunResult) -> None:
        if not self._result.done():
            self._result.set_result(result)
        if self._events is not None:
            self._events.put_nowait(None)

    def fail(self, error: GgufpipeError) -> None:
        if not self._result.done():
            self._result.set_exception(error)
            self._result.exception()  # retrieved: a prompt nobody awaits is no warning
        if self._events is not None:
            self._events.put_nowait(None)


class RunQueue:
    def __init__(self, pipeline: Pipeline, prepare_ahead: bool) -> None:
        self.pipeline = pipeline
        self.prepare_ahead = prepare_ahead
        self.waiting: deque[RunHandle] = deque()
        self._arrived = asyncio.Event()
        self._tickets = itertools.count(1)
        self.stopped = ""  # why the queue serves no more prompts
        self._stopped = asyncio.Event()

    @property
    def queued(self) -> int:
        return sum(1 for handle in self.waiting if not handle.done)

    def submit(self, prompt: Prompt, stream: bool = False) -> RunHandle:
        handle = RunHandle(prompt, next(self._tickets), stream)
        if self.stopped:
            handle.fail(PipelineError(f"not run: {self.stopped}"))
            return handle
        self.waiting.append(handle)
        self._arrived.set()
        return handle

    async def wait_stopped(self) -> str:
        await self._stopped.wait()
        return self.stopped

    def stop(self, reason: str) -> None:
        """Serve nothing more; every prompt still waiting fails with ``reason``."""
        if not self.stopped:
            self.stopped = reason
        while self.waiting:
            self.waiting.popleft().fail(PipelineError(f"not run: {self.stopped}"))
        self._arrived.set()
        self._stopped.set()

    async def serve(self) -> None:
        """Prompts to runs until the pipeline breaks or closes."""
        pipeline = self.pipeline
        reason = ""
        prepared: RunDriver | None = None
        try:
            while not self.stopped:
                if self.prepare_ahead and prepared is None:
                    prepared = await pipeline.prepare_run()
                handle = await self._next(prepared)
                if handle is None:
                    if prepared is not None and prepared.done.is_set():
                        # The run ended before its prompt: it faulted while preparing or waiting.
                        reason = prepared.result.failure if prepared.result else ""
                        break
                    continue
                driver, prepared = prepared or await pipeline.prepare_run(), None
                result = await self._run(handle, driver)
                if pipeline.broken or (result is not None and result.outcome == "faulted"):
                    reason = (result.failure if result is not None else "") or pipeline.broken
                    break
        except GgufpipeError as error:
            reason = str(error)
        if prepared is not None and not prepared.done.is_set():
            prepared.stop("the session is stopping")
        self.stop(reason or pipeline.broken or "the pipeline closed")

    async def _next(self, prepared: RunDriver | None) -> RunHandle | None:
        """The next prompt still wanted, or None when the prepared run ended first."""
        while not self.stopped:
            while self.waiting:
                handle = self.waiting.popleft()
                if not handle.done:
                    return handle
            self._arrived.clear()
            waiters = [asyncio.ensure_future(self._arrived.wait())]
            if prepared is not None:
                waiters.append(asyncio.ensure_future(prepared.done.wait()))
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()
            if prepared is not None and prepared.done.is_set():
                return None
        return None

    async def _run(self, handle: RunHandle, driver: RunDriver) -> RunResult | None:
        pipeline = self.pipeline
        prompt = handle.prompt
        handle.driver, handle.run_id = driver, driver.plan.run_id
        pipeline.route(driver, handle)
        driver.emit(PromptAssigned(driver.plan.run_id, prompt.text, handle.ticket))
        try:
            if prompt.tokens is not None:
                tokens = list(prompt.tokens)
            else:
                chat = pipeline.inventory.run.chat if prompt.chat is None else prompt.chat
                tokens, _ = await pipeline.tokenize(prompt.text, chat)
            await pipeline.run_prompt(driver, tokens, prompt.submitted)
        except GgufpipeError as error:
            # Not run (tokenizing failed, too long for the context): the
            # prepared run is torn down and the queue goes on.
            if not driver.done.is_set():
                driver.stop(f"no prompt: {error}")
            await driver.done.wait()
            handle.fail(error if isinstance(error, PipelineError) else PipelineError(str(error)))
            return None
        assert driver.result is not None
        handle.finish(driver.result)
        return driver.result

