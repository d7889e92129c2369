"""The event loop: uvloop when it is installed (less overhead per wake-up on
the per-token path), asyncio's own otherwise or with GGUFPIPE_NO_UVLOOP=1;
and the cyclic garbage collector kept off what lives as long as the process."""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    if not os.environ.get("GGUFPIPE_NO_UVLOOP"):
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(main)
    return asyncio.run(main)


def freeze_heap() -> None:
    """What is alive now (the imports, a loaded model's metadata, a session's
    set-up) lives as long as the process: :func:`gc.freeze` leaves it out of
    every later pass of the cyclic collector. Without it each full collection
    walks all of it on the thread that runs the event loop: 13-30 ms with the
    tokens of every run in flight waiting (measured in the agents and the
    server on 2 cores), the largest of the gaps a stream sees. Collections
    still run, over what the runs allocate since."""
    gc.freeze()
