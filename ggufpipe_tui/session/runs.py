"""Prompts, their handles and the queue they wait in.

A view calls :meth:`Pipeline.submit <ggufpipe_tui.session.pipeline.Pipeline.submit>`
with a :class:`Prompt` and gets a :class:`RunHandle`: it can stop the run (or
withdraw the prompt while it waits), follow its events and await its result.
The :class:`RunQueue` holds the prompts in submission order until a run
takes them (session/serving.py one at a time, session/parallel.py up to K at
once); it knows nothing of runs, slots or recovery.

A prompt may carry run options of its own (:class:`RunOverrides`: an HTTP
request's temperature, seed, max_tokens), checked as the inventory's are
(:func:`run_options`); :func:`serves` says whether a run prepared ahead
samples as a prompt asks, :func:`prompt_tokens` what a prompt's tokens are
and how long its reply may be.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ggufpipe_agent.errors import GgufpipeError
from ggufpipe_agent.ids import FIRST_SLOT, RunId, SlotId
from ggufpipe_agent.wire.codec import MAX_PROMPT_BYTES, MAX_PROMPT_TURNS, text_problem
from ggufpipe_agent.wire.protocol import ChatMessage, SamplingParams
from ggufpipe_tui.core.events import Event, RunResult
from ggufpipe_tui.core.inventory import RunOptions, check_run_options
from ggufpipe_tui.core.plan import GgufModelPlan, RunPlan, sampling_params
from ggufpipe_tui.session.driver import RunDriver
from ggufpipe_tui.session.stages import PipelineError

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
    #: llama-server's other sampling fields, by its names (``min_p``,
    #: ``repeat_penalty``, ``dry_multiplier``, ``logit_bias``, ...), checked
    #: already (ggufpipe_tui/server/sampling.py); a field absent takes
    #: llama-server's default.
    extra: tuple[tuple[str, Any], ...] = ()


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
    #: The functions the model may call (JSON text of OpenAI's tools list),
    #: rendered by the chat template; and a template instead of the model's.
    tools: str = ""
    template: str = ""
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
    wanted = sampling_params(options)
    if plan.ignore_eos != options.ignore_eos:
        return False
    if plan.sampling == wanted:
        return True

    # Greedy is greedy whatever the seed and the top-k/top-p/min-p cuts say.
    def greedy(s: SamplingParams) -> SamplingParams:
        return replace(s, temperature=0.0, seed=0, top_k=0, top_p=1.0, min_p=0.0)

    return (
        plan.sampling.temperature <= 0 and wanted.temperature <= 0 and greedy(plan.sampling) == greedy(wanted)
    )


def with_history(options: RunOptions, tokens: Sequence[int]) -> RunOptions:
    """``options`` with the prompt's tokens for the penalties and DRY to look
    back over, as llama-server feeds its sampler the prompt; unchanged when
    neither is on (nothing to look back for)."""
    window = sampling_params(options).history_window
    if not window:
        return options
    back = len(tokens) if window == -1 else window
    history = tuple(tokens[len(tokens) - min(back, len(tokens)) :])
    extra = tuple((k, v) for k, v in options.extra if k != "history") + (("history", history),)
    return replace(options, extra=extra)


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


@dataclass(frozen=True, slots=True)
class Turn:
    """A prompt's turn to run: its handle, its tokens, the most its reply may
    take, its run options and the slot it runs on."""

    handle: RunHandle
    tokens: list[int]
    limit: int
    options: RunOptions
    slot: SlotId = FIRST_SLOT


class RunHandle:
    """One submitted prompt and, once it has one, its run."""

    def __init__(self, prompt: Prompt, ticket: int, stream: bool) -> None:
        self.prompt = prompt
        self.ticket = ticket
        self.run_id: RunId | None = None
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


def first_of(*events: asyncio.Event) -> Awaitable[object]:
    """Until the first of ``events`` is set."""

    async def wait() -> None:
        waiters = [asyncio.ensure_future(event.wait()) for event in events]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

    return wait()


class RunQueue:
    """The prompts waiting for a run, in submission order: :meth:`submit`
    posts one, :meth:`take` gives the next still wanted, :meth:`defer` puts
    one back in front (it cannot run yet), :meth:`stop` fails every one
    still waiting and takes no more."""

    def __init__(self) -> None:
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

    def defer(self, handle: RunHandle) -> None:
        """``handle`` waits again, first in line."""
        if self.stopped:
            handle.fail(PipelineError(f"not run: {self.stopped}"))
            return
        self.waiting.appendleft(handle)
        self._arrived.set()

    async def take(self, until: asyncio.Event | None = None) -> RunHandle | None:
        """The next prompt still wanted; None once the queue stopped, or when
        ``until`` was set first."""
        while not self.stopped:
            while self.waiting:
                handle = self.waiting.popleft()
                if not handle.done:
                    return handle
            self._arrived.clear()
            await first_of(self._arrived, *(() if until is None else (until,)))
            if until is not None and until.is_set():
                return None
        return None

    async def wait_stopped(self) -> str:
        await self._stopped.wait()
        return self.stopped

    def stopping(self) -> asyncio.Event:
        """Set once the queue stopped."""
        return self._stopped

    def stop(self, reason: str) -> None:
        """Serve nothing more; every prompt still waiting fails with ``reason``."""
        if not self.stopped:
            self.stopped = reason
        while self.waiting:
            self.waiting.popleft().fail(PipelineError(f"not run: {self.stopped}"))
        self._arrived.set()
        self._stopped.set()


Tokenize = Callable[[str, bool, Sequence[ChatMessage], str, str], Awaitable[tuple[list[int], str]]]


async def prompt_tokens(
    prompt: Prompt, options: RunOptions, model: GgufModelPlan, chat: bool, tokenize: Tokenize
) -> tuple[list[int], int]:
    """The prompt's tokens and the most its reply may take; raises when it
    cannot run. ``chat``: the inventory's run.chat, for a prompt that does not
    say; ``tokenize``: the pipeline's."""
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
        for what, text in (
            ("the prompt", prompt.text),
            *(
                (f"message {index} ({message.role})", message.content)
                for index, message in enumerate(prompt.messages)
            ),
        ):
            try:
                size += len(text.encode("utf-8"))
            except UnicodeEncodeError:
                raise PipelineError(f"not run: {what}: {text_problem(text)}") from None
        if size > MAX_PROMPT_BYTES:
            limit = MAX_PROMPT_BYTES
            raise PipelineError(f"not run: the prompt is {size} bytes of text, at most {limit}")
        chat = chat if prompt.chat is None else prompt.chat
        tokens, _ = await tokenize(prompt.text, chat, prompt.messages, prompt.tools, prompt.template)
    return tokens, reply_limit(prompt, len(tokens), options, model.max_seq_len)
