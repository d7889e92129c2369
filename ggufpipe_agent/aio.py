"""The event loop: uvloop when it is installed (less overhead per wake-up on
the per-token path), asyncio's own otherwise or with GGUFPIPE_NO_UVLOOP=1."""

from __future__ import annotations

import asyncio
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
