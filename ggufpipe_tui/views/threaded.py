"""The TUI's pipeline on an event loop of its own, in a second thread.

The app composes its frames on its event loop; a frame takes milliseconds.
On direct links and the token ring nothing of a token's path runs in the
orchestrator, but a pair of stages relayed through it (hosts that cannot
reach each other) has each of its objects cross the orchestrator's loop: in
the app's loop, every object that arrives while a frame is drawn waits for
the frame. :class:`ThreadedPipeline` runs the
:class:`~ggufpipe_tui.session.pipeline.Pipeline` (agents, data plane, runs)
on a loop of its own (uvloop when installed) and gives the app the part of
its API the app uses: ``submit`` returns a handle at once, the app's calls
run on the pipeline's loop, the events come back on the app's loop.

Both threads share the interpreter lock, so the switch interval is made
short (:data:`SWITCH_SECONDS`): an object that arrives while the app draws
gets the pipeline thread running within half a millisecond, not five.

Events cross to the app's loop in batches, one wake-up of that loop a batch.
A subscriber may also say which events can wait for it (``defer``, e.g. the
tokens that come while a frame is due, which draws them anyway): those wake
nothing and wait until the app fetches them (:meth:`ThreadedPipeline.fetch`)
or an event that cannot wait takes them along, in order. At ~60 tokens a
second that is the app's thread woken for each frame, not for each token.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, TypeVar

from ggufpipe_tui.core.events import Emit, Event, RunResult
from ggufpipe_tui.core.inventory import Inventory
from ggufpipe_tui.session.pipeline import Pipeline
from ggufpipe_tui.session.runs import Prompt, RunHandle, RunQueue
from ggufpipe_tui.transports.connection import AgentConnection
from ggufpipe_tui.views.priority import start_thread

T = TypeVar("T")

#: The interpreter's thread switch interval while a threaded pipeline runs.
SWITCH_SECONDS = 0.0005
#: How long the app waits for a call the pipeline's loop answers at once.
CALL_SECONDS = 10.0


class AppHandle(Protocol):
    """What the app holds of a submitted prompt (a RunHandle, or its proxy)."""

    @property
    def ticket(self) -> int: ...

    @property
    def done(self) -> bool: ...

    @property
    def started(self) -> bool: ...

    @property
    def run_id(self) -> int | None: ...

    def stop(self, reason: str = "stopped by the user") -> None: ...

    async def result(self) -> RunResult: ...


class AppPipeline(Protocol):
    """What the app uses of its session (a Pipeline, or a ThreadedPipeline)."""

    @property
    def queue(self) -> RunQueue: ...

    @property
    def links(self) -> list[AgentConnection]: ...

    async def start(self) -> None: ...

    async def wait_stopped(self) -> str: ...

    async def close(self) -> None: ...

    def submit(self, prompt: Prompt, stream: bool = False) -> AppHandle: ...


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class ThreadedHandle:
    """A :class:`~ggufpipe_tui.session.runs.RunHandle` seen from the app's
    thread: its plain attributes are read as they are, its calls go to the
    pipeline's loop."""

    def __init__(self, handle: RunHandle, loop: asyncio.AbstractEventLoop) -> None:
        self._handle = handle
        self._loop = loop
        self.ticket = handle.ticket

    @property
    def done(self) -> bool:
        return self._handle.done

    @property
    def started(self) -> bool:
        return self._handle.started

    @property
    def run_id(self) -> int | None:
        return self._handle.run_id

    def stop(self, reason: str = "stopped by the user") -> None:
        self._loop.call_soon_threadsafe(self._handle.stop, reason)

    async def result(self) -> RunResult:
        """The run's result, awaited on the pipeline's loop (its errors too:
        PipelineError, ContextOverflow)."""
        future = asyncio.run_coroutine_threadsafe(self._handle.result(), self._loop)
        return await asyncio.wrap_future(future)


class ThreadedPipeline:
    """A Pipeline on its own thread's event loop, with the app's view of it.
    Same constructor as :class:`Pipeline` (a ``pipeline_factory`` of the app)."""

    def __init__(self, inventory: Inventory, emit: Emit | None = None, log_dir: Any = None, **options: Any):
        self._app_loop = asyncio.get_running_loop()
        self._emit = emit
        self._loop = _new_loop()
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_SECONDS)
        # At the process's own priority, not the UI's (views/priority.py):
        # the local agents are spawned from this thread and inherit it.
        self._thread = start_thread(self._loop.run_forever, "ggufpipe-pipeline")
        self._closed = False
        # Events on their way to the app's loop, and whether a wake-up of
        # that loop is already on its way (one a batch, not one an event).
        self._pending: deque[Event] = deque()
        self._wake_sent = False
        self._defer: Callable[[Event], bool] | None = getattr(emit, "defer", None)

        async def make() -> Pipeline:
            return Pipeline(inventory, self._post, log_dir=log_dir, **options)

        self.pipeline: Pipeline = self._wait(make())

    def _post(self, event: Event) -> None:
        """A pipeline event, on the pipeline's thread: to the app's loop. A
        wake-up of the app's loop (a write to its self-pipe, a loop turn, a
        thread switch) costs more than handing it an event, so the events
        that come while one wake-up is on its way go with it."""
        if self._emit is None or self._app_loop.is_closed():
            return
        # Appended before the subscriber is asked: an app that stops deferring
        # and then fetches finds it, or it sends a wake-up of its own.
        self._pending.append(event)
        if self._wake_sent or (self._defer is not None and self._defer(event)):
            return
        self._wake_sent = True
        self._app_loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        """On the app's loop: every event posted so far, in order. The flag
        is cleared before draining, so an event posted meanwhile is either
        drained here or sends a wake-up of its own (deque appends and pops
        are atomic under the interpreter lock)."""
        assert self._emit is not None
        self._wake_sent = False
        pending = self._pending
        while pending:
            self._emit(pending.popleft())

    def fetch(self) -> None:
        """On the app's loop: the events posted so far, deferred ones too, now."""
        if self._emit is not None:
            self._deliver()

    def _wait(self, work: Coroutine[Any, Any, T]) -> T:
        """Run ``work`` on the pipeline's loop and wait for it here (short calls only)."""
        return asyncio.run_coroutine_threadsafe(work, self._loop).result(CALL_SECONDS)

    async def _call(self, work: Coroutine[Any, Any, T]) -> T:
        """Run ``work`` on the pipeline's loop; the app's loop goes on meanwhile."""
        future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(work, self._loop)
        return await asyncio.wrap_future(future)

    # ---------------------------------------------------- what the app uses

    @property
    def queue(self) -> RunQueue:
        return self.pipeline.queue  # read only: its counters are plain attributes

    @property
    def links(self) -> list[AgentConnection]:
        return self.pipeline.links

    async def start(self) -> None:
        await self._call(self.pipeline.start())

    async def wait_stopped(self) -> str:
        return await self._call(self.pipeline.wait_stopped())

    def submit(self, prompt: Prompt, stream: bool = False) -> ThreadedHandle:
        async def submit() -> RunHandle:
            return self.pipeline.submit(prompt, stream)

        return ThreadedHandle(self._wait(submit()), self._loop)

    async def close(self) -> None:
        """Close the pipeline (every agent ends), then its loop and thread."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._call(self.pipeline.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10)
            if not self._loop.is_running():
                self._loop.close()
            sys.setswitchinterval(self._switch)
            self.fetch()  # its last events, deferred or not
