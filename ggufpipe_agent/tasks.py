"""One owner for background tasks, with one error policy, on both sides.

Every coroutine the agent or the orchestrator runs in the background is
spawned through a :class:`TaskOwner`. A task that ends with an exception is
never dropped: the owner hands it to its ``on_failure`` callback, which turns
it into a fault (the orchestrator faults the run, a stage run faults the
stage). :meth:`TaskOwner.close` cancels what is left and waits for it, so
nothing outlives the object that started it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger("ggufpipe.tasks")
T = TypeVar("T")

#: Called with the failed task's name and its exception.
OnFailure = Callable[[str, BaseException], None]


class TaskOwner:
    def __init__(self, on_failure: OnFailure, name: str = "") -> None:
        self._on_failure = on_failure
        self.name = name
        self._tasks: set[asyncio.Task[Any]] = set()
        self.closed = False

    def spawn(self, coroutine: Coroutine[Any, Any, T], name: str = "") -> asyncio.Task[T]:
        task = asyncio.ensure_future(coroutine)
        if name:
            task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is None:
            return
        log.error("%s task %s failed", self.name or "background", task.get_name(), exc_info=error)
        try:
            self._on_failure(task.get_name(), error)
        except Exception:  # noqa: BLE001 - the policy itself failing must not hide the first error
            log.exception("the failure handler of %s failed", self.name or "a task owner")

    def pending(self) -> list[asyncio.Task[Any]]:
        return [task for task in self._tasks if not task.done()]

    async def settle(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the running tasks to end by themselves."""
        pending = self.pending()
        if pending:
            await asyncio.wait(pending, timeout=timeout)

    async def close(self, timeout: float = 2.0) -> None:
        """Cancel every task still running and wait (bounded) until each has ended."""
        self.closed = True
        current = asyncio.current_task()
        pending = [task for task in self.pending() if task is not current]
        for task in pending:
            task.cancel()
        if pending:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait(pending, timeout=timeout)
