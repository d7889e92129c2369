"""The terminal UI's thread at a lower scheduling priority than the stages.

On direct links and the token ring no part of a token's path runs in the
orchestrator, so a frame the UI draws late delays nothing: its next frame
shows more text. Where the machine has fewer cores than stage processes
(local stages, or a laptop that also runs one), every millisecond the UI
takes on a core is taken from a stage; at a lower priority the stages come
first and the UI draws in the gaps between their steps. So ``run_app``
lowers the UI's own thread (the Textual loop, and the driver threads it
starts) by :data:`UI_NICE`, ``$GGUFPIPE_UI_NICE`` overriding it (``0``:
leave it).

Only the UI's threads: a thread inherits its creator's priority, a process
its forking thread's, and an unprivileged thread cannot raise its priority
back. The pipeline's loop (relayed objects cross it; it spawns the local
agents, which inherit its priority) is started by :func:`start_thread`,
which hands the start to a launcher thread made before the priority was
lowered, so a pipeline started later (``ctrl+r``) runs at the priority the
process started with.

Linux only: there the priority (nice value) belongs to each thread and
``setpriority(PRIO_PROCESS, tid)`` sets one thread's. Elsewhere it belongs
to the whole process, which would lower the pipeline and the agents with
the UI, so nothing is done.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import sys
import threading
from collections.abc import Callable

#: How much lower than the process started with the UI's thread runs.
UI_NICE = 10
ENV = "GGUFPIPE_UI_NICE"


class Launcher:
    """A thread that starts threads: they get its priority, not their caller's."""

    def __init__(self) -> None:
        self._requests: queue.SimpleQueue[
            tuple[Callable[[], object], str, concurrent.futures.Future[threading.Thread]]
        ]
        self._requests = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="ggufpipe-launcher", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            target, name, started = self._requests.get()
            try:
                thread = threading.Thread(target=target, name=name, daemon=True)
                thread.start()
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                started.set_exception(error)
            else:
                started.set_result(thread)

    def start(self, target: Callable[[], object], name: str) -> threading.Thread:
        started: concurrent.futures.Future[threading.Thread] = concurrent.futures.Future()
        self._requests.put((target, name, started))
        return started.result(10)


_launcher: Launcher | None = None


def start_thread(target: Callable[[], object], name: str) -> threading.Thread:
    """Start a daemon thread at the priority the process started with (the
    launcher's, once :func:`lower_ui` has run; the caller's before)."""
    if _launcher is None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        return thread
    return _launcher.start(target, name)


def supported() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "setpriority")


def lower_ui(increment: int | None = None) -> int:
    """Lower the calling thread (the UI's) by ``increment`` (default
    ``$GGUFPIPE_UI_NICE`` or :data:`UI_NICE`); threads started later by
    :func:`start_thread` keep the priority it had. Returns the increment
    applied (0 where unsupported, disabled, or refused)."""
    global _launcher
    if increment is None:
        try:
            increment = int(os.environ.get(ENV, UI_NICE))
        except ValueError:
            increment = UI_NICE
    if increment <= 0 or not supported():
        return 0
    if _launcher is None:
        _launcher = Launcher()  # made here, at the priority the UI still has
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
    except OSError:
        return 0
    return increment
