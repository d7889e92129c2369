"""The session policy every view shares: prompts become runs, one at a time
(session/parallel.py keeps several in flight, each on its own slot).

A view calls :meth:`Pipeline.submit <ggufpipe_tui.session.pipeline.Pipeline.submit>`
with a :class:`Prompt` and gets a :class:`RunHandle`: it can stop the run (or
withdraw the prompt while it waits), follow its events and await its result.
:class:`RunQueue` serves the handles in submission order, one run at a time;
with ``prepare_ahead`` (the interactive views) it keeps the next run
provisioned and loaded so a prompt starts the moment it is given. A run that
faults stops the queue: the pipeline cannot carry another run, and every
prompt still waiting is failed with the reason.

A prompt may carry run options of its own (:class:`RunOverrides`: an HTTP
request's temperature, seed, max_tokens). The sampling is part of each
stage's provision, so a run prepared ahead with other sampling is torn down
and one is prepared with the prompt's (the next run is prepared ahead as the
last prompt sampled); max_tokens is the orchestrator's alone and is given
with the prompt. Each prompt's tokens are its whole context (a
conversation's every turn so far), and runs go in submission order, so
whatever a run leaves in the stages is what the next one starts from.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Protocol

from ggufpipe_agent.errors import GgufpipeError
from ggufpipe_agent.wire.codec import MAX_PROMPT_BYTES, MAX_PROMPT_TURNS, text_problem
from ggufpipe_agent.wire.protocol import ChatMessage, SamplingParams
from ggufpipe_tui.core.events import Event, PromptAssigned, RunResult
from ggufpipe_tui.core.inventory import Inventory, RunOptions, check_run_options
from ggufpipe_tui.core.plan import GgufModelPlan, RunPlan
from ggufpipe_tui.session.driver import RunDriver
from ggufpipe_tui.session.stages import PipelineError


class QueuePipeline(Protocol):
    """What the run queue needs of the pipeline it serves (session/pipeline.py's
    Pipeline; tests/test_run_queue.py's FakePipeline)."""

    @property
    def inventory(self) -> Inventory: ...

    @property
    def broken(self) -> str: ...

    async def prepare_run(
        self, options: RunOptions | None = None, *, slot: int = 0, reuse: bool = True
    ) -> RunDriver: ...

    async def tokenize(
        self, text: str, chat: bool, messages: Sequence[ChatMessage] = ()
    ) -> tuple[list[int], str]: ...

    def model_plan(self) -> GgufModelPlan:
        """The model as every run's plan has it (vocabulary, context)."""
        ...

    def route(self, driver: RunDriver, handle: RunHandle) -> None: ...

    async def run_prompt(
        self, driver: RunDriver, tokens: list[int], submitted: float, max_tokens: int = 0
    ) -> RunResult: ...

    # Recovery of a lost stage (docs/recovery.md).
    def take_interrupted(self, run_id: int) -> RunResult | None: ...

    async def recover(self) -> None: ...

    def replaying(self, replay: RunDriver, old: RunResult) -> None: ...

    def give_up(self, old: RunResult, reason: str) -> RunResult: ...

    def remember(self, tokens: list[int], options: RunOptions, result: RunResult) -> None: ...

    async def replay_history(self, old: RunResult) -> None: ...


#: What a prompt whose tokens and max_tokens do not fit the context gets.
RUN_ANYWAY = "run"  # it runs; it may fault when the context fills (headless)
REFUSE = "refuse"  # refused before it runs: ContextOverflow (the TUI, an explicit max_tokens)
SHORTEN = "shorten"  # it runs with max_tokens cut to the room left (a server default)
OVERFLOW_POLICIES = (RUN_ANYWAY, REFUSE, SHORTEN)


@dataclass(frozen=True, slots=True)
class RunOverrides:
    """One prompt's run options over the inventory's ``run:`` (None: the
    inventory's). Checked like the inventory's when the prompt's turn comes."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    ignore_eos: bool | None = None


@dataclass(frozen=True, slots=True)
class Prompt:
    """What to run: text (through the model's chat template unless ``chat``
    is False; None means the inventory's ``run.chat``), a conversation
    (``messages``, rendered whole by the chat template; ``text`` is then only
    what views show of it), or token ids as is (``tokens`` wins over both)."""

    text: str = ""
    tokens: tuple[int, ...] | None = None
    chat: bool | None = None
    messages: tuple[ChatMessage, ...] = ()
    options: RunOverrides = field(default_factory=RunOverrides)
    overflow: str = RUN_ANYWAY  # one of OVERFLOW_POLICIES
    # False: the run keeps nothing the stages hold (llama-server's cache_prompt).
    cache_prompt: bool = True
    submitted: float = field(default_factory=time.perf_counter)  # for the time to first token


class ContextOverflow(PipelineError):
    """The prompt and the reply it may take do not fit the context; said
    before the run starts, never found out in the middle of it."""

    def __init__(self, prompt_tokens: int, max_tokens: int, context: int) -> None:
        self.prompt_tokens, self.max_tokens, self.context = prompt_tokens, max_tokens, context
        if prompt_tokens >= context:
            said = (
                f"the prompt is {prompt_tokens} tokens, the context holds {context} "
                "(raise run.context or --context)"
            )
        else:
            said = (
                f"the prompt is {prompt_tokens} tokens and the reply may take {max_tokens} more: "
                f"{prompt_tokens + max_tokens} do not fit the context of {context} tokens"
            )
        super().__init__(said)


def run_options(base: RunOptions, overrides: RunOverrides) -> RunOptions:
    """The inventory's run options with a prompt's overrides, range-checked
    as the inventory's are."""
    given = {f.name: getattr(overrides, f.name) for f in fields(overrides)}
    options = replace(base, **{name: value for name, value in given.items() if value is not None})

    def fail(key: str, message: str) -> PipelineError:
        return PipelineError(f"{key}: {message}")

    check_run_options(options, fail)
    return options


def serves(plan: RunPlan, options: RunOptions) -> bool:
    """Whether a run prepared with ``plan`` samples (and stops) as ``options``
    ask. Greedy is greedy whatever the other sampling parameters say."""
    wanted = SamplingParams(options.temperature, options.top_k, options.top_p, options.seed)
    if plan.ignore_eos != options.ignore_eos:
        return False
    return plan.sampling == wanted or (plan.sampling.temperature <= 0 and wanted.temperature <= 0)


def reply_limit(prompt: Prompt, prompt_tokens: int, options: RunOptions, context: int) -> int:
    """The most tokens the prompt's reply may take, by its overflow policy.
    A prompt of P tokens and a reply of M fit when P + M <= context."""
    if prompt.overflow not in OVERFLOW_POLICIES:
        raise PipelineError(f"unknown overflow policy {prompt.overflow!r}")
    if prompt_tokens >= context:
        raise ContextOverflow(prompt_tokens, options.max_tokens, context)
    room = context - prompt_tokens
    if prompt.overflow == REFUSE and options.max_tokens > room:
        raise ContextOverflow(prompt_tokens, options.max_tokens, context)
    if prompt.overflow == SHORTEN:
        return min(options.max_tokens, room)
    return options.max_tokens


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
    def __init__(self, pipeline: QueuePipeline, prepare_ahead: bool) -> None:
        self.pipeline = pipeline
        self.prepare_ahead = prepare_ahead
        self.waiting: deque[RunHandle] = deque()
        self._arrived = asyncio.Event()
        self._tickets = itertools.count(1)
        self.stopped = ""  # why the queue serves no more prompts
        self._stopped = asyncio.Event()
        self.taking: RunHandle | None = None  # taken from the queue, not finished yet
        self.last_options: RunOptions | None = None  # the last run's (None: the inventory's)

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
                    # Sampled as the last prompt asked: a client that keeps its
                    # settings finds its next run ready.
                    prepared = await pipeline.prepare_run(self.last_options)
                handle = self.taking = await self._next(prepared)
                if handle is None:
                    if prepared is not None and prepared.done.is_set():
                        if pipeline.take_interrupted(prepared.plan.run_id) is not None:
                            # A stage lost while the run waited for its prompt:
                            # repaired, and the next run is prepared afresh.
                            prepared = None
                            await pipeline.recover()
                            continue
                        # The run ended before its prompt: it faulted while preparing or waiting.
                        reason = prepared.result.failure if prepared.result else ""
                        break
                    continue
                try:
                    options = run_options(pipeline.inventory.run, handle.prompt.options)
                except PipelineError as error:
                    handle.fail(error)
                    continue
                keep = handle.prompt.cache_prompt
                if prepared is not None and (
                    not serves(prepared.plan, options) or (not keep and prepared.plan.reuse.run_id)
                ):
                    # Prepared with other sampling, or offering what the prompt
                    # keeps nothing of: the stages must be provisioned again.
                    prepared.stop("the next prompt asks for other options")
                    await prepared.done.wait()
                    prepared = None
                    if pipeline.broken:
                        break
                driver, prepared = prepared or await pipeline.prepare_run(options, reuse=keep), None
                try:
                    tokens, limit = await self._tokens(handle.prompt, options, driver.plan.model)
                except GgufpipeError as error:
                    # Not run (tokenizing failed, too long for the context): the
                    # prompt fails alone and the prepared run waits for the next.
                    handle.fail(error if isinstance(error, PipelineError) else PipelineError(str(error)))
                    prepared = driver
                    continue
                if handle.done:  # withdrawn while it was tokenized
                    prepared = driver
                    continue
                if driver.plan.ring is not None and limit != driver.plan.max_tokens:
                    # On the token ring the last stage stops at the max_tokens
                    # of its provision (no step runs past the stop), so a reply
                    # limit other than the prepared run's needs a run
                    # provisioned with it, as other sampling does.
                    driver.stop("the next prompt has another reply limit")
                    await driver.done.wait()
                    if pipeline.broken:
                        break
                    driver = await pipeline.prepare_run(replace(options, max_tokens=limit), reuse=keep)
                self.last_options = options
                result = await self._run(handle, driver, tokens, limit, replace(options, max_tokens=limit))
                if pipeline.broken or result.outcome == "faulted":
                    reason = result.failure or pipeline.broken
                    break
        except GgufpipeError as error:
            reason = str(error)
        except Exception as error:  # a bug: said, and every prompt fails instead of waiting forever
            logging.getLogger(__name__).exception("the run queue failed")
            reason = f"internal error in the run queue: {type(error).__name__}: {error}"
        finally:
            # Cancelled (the pipeline closing) or stopped: the prompt taken
            # from the queue must not be left waiting for its result.
            taken, self.taking = self.taking, None
            if taken is not None and not taken.done:
                running = taken.driver
                if running is not None and running.result is not None:
                    taken.finish(running.result)
                else:
                    taken.fail(PipelineError(f"not run: {self.stopped or reason or 'the pipeline closed'}"))
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

    async def _tokens(
        self, prompt: Prompt, options: RunOptions, model: GgufModelPlan
    ) -> tuple[list[int], int]:
        """The prompt's tokens and the most its reply may take; raises when it cannot run."""
        if prompt.tokens is not None:
            tokens = list(prompt.tokens)
            vocabulary = model.vocab_size
            wrong = next((token for token in tokens if not 0 <= token < vocabulary), None)
            if wrong is not None:
                last = vocabulary - 1
                raise PipelineError(f"not run: token id {wrong} is not in the vocabulary (0 to {last})")
        else:
            if len(prompt.messages) > MAX_PROMPT_TURNS:
                raise PipelineError(f"not run: {len(prompt.messages)} messages, at most {MAX_PROMPT_TURNS}")
            size = 0  # each text encoded once: whether UTF-8 carries it, and its bytes
            for what, text in (("the prompt", prompt.text), *(
                (f"message {index} ({message.role})", message.content)
                for index, message in enumerate(prompt.messages)
            )):
                try:
                    size += len(text.encode("utf-8"))
                except UnicodeEncodeError:
                    raise PipelineError(f"not run: {what}: {text_problem(text)}") from None
            if size > MAX_PROMPT_BYTES:
                limit = MAX_PROMPT_BYTES
                raise PipelineError(f"not run: the prompt is {size} bytes of text, at most {limit}")
            chat = self.pipeline.inventory.run.chat if prompt.chat is None else prompt.chat
            tokens, _ = await self.pipeline.tokenize(prompt.text, chat, prompt.messages)
        return tokens, reply_limit(prompt, len(tokens), options, model.max_seq_len)

    async def _run(
        self,
        handle: RunHandle,
        driver: RunDriver,
        tokens: list[int],
        limit: int,
        options: RunOptions,
        slot: int = 0,
    ) -> RunResult:
        pipeline = self.pipeline
        prompt = handle.prompt
        handle.driver, handle.run_id = driver, driver.plan.run_id
        pipeline.route(driver, handle)
        driver.emit(PromptAssigned(driver.plan.run_id, prompt.text, handle.ticket))
        try:
            result = await pipeline.run_prompt(driver, tokens, prompt.submitted, limit)
            # A stage lost mid-run: once the pipeline is repaired, the prompt
            # runs again with the same sampling (and seed), cold, and the
            # tokens already streamed are regenerated, checked and not
            # streamed again (docs/recovery.md). Bounded by recovery.attempts.
            while (old := pipeline.take_interrupted(driver.plan.run_id)) is not None:
                try:
                    if handle.done:
                        raise PipelineError("the prompt was withdrawn")
                    await pipeline.recover()
                    await pipeline.replay_history(old)
                    driver = await pipeline.prepare_run(options, slot=slot)
                except GgufpipeError as error:
                    result = pipeline.give_up(old, str(error))
                    break
                pipeline.replaying(driver, old)
                handle.driver, handle.run_id = driver, driver.plan.run_id
                pipeline.route(driver, handle)
                result = await pipeline.run_prompt(driver, tokens, prompt.submitted, limit)
        except GgufpipeError as error:  # refused at the last moment: the run is torn down
            if not driver.done.is_set():
                driver.stop(f"no prompt: {error}")
            await driver.done.wait()
            assert driver.result is not None
            handle.fail(error if isinstance(error, PipelineError) else PipelineError(str(error)))
            return driver.result
        handle.finish(result)
        pipeline.remember(tokens, options, result)
        return result
