"""How long a peer has been silent, for the heartbeats of both sides.

Each side sends a Heartbeat every ``interval`` seconds once the orchestrator
has sent its first; a side that hears nothing at all for ``timeout`` seconds
takes the other for gone. :class:`Silence` is that clock. It is not a
``wait_for`` around each read on purpose: after this process itself was
held up (a loaded machine, a worker thread holding the GIL), a read timeout
would fire before the frames that arrived meanwhile were read, and call a
live peer silent. :meth:`Silence.expired` lets the loop read what has
arrived before it decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

#: Loop turns given to readers before a silence is believed.
_SETTLE_TURNS = 8


class Silence:
    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self.last = time.monotonic()
        self._changed = asyncio.Event()

    @property
    def timeout(self) -> float:
        return self._timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        """A new bound applies at once (a waiter asleep on the old one wakes)."""
        self._timeout = seconds
        self._changed.set()

    def heard(self) -> None:
        """Something arrived from the peer."""
        self.last = time.monotonic()

    def quiet_for(self) -> float:
        return time.monotonic() - self.last

    async def expired(self) -> float:
        """Return (the bound, in seconds) once the peer has said nothing for
        :attr:`timeout` seconds (which may change meanwhile)."""
        while True:
            remaining = self.timeout - self.quiet_for()
            if remaining > 0:
                self._changed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), min(remaining, max(self.timeout / 4, 0.05)))
                continue
            for _ in range(_SETTLE_TURNS):  # frames that came in while we were held up
                await asyncio.sleep(0)
            if self.quiet_for() >= self.timeout:
                return self.timeout
