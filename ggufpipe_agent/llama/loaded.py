"""The engine an agent keeps across runs, and which run its KV cache holds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ggufpipe_agent.aio import freeze_heap
from ggufpipe_agent.errors import EngineError
from ggufpipe_agent.ids import EVERY_SLOT, FIRST_SLOT, NO_RUN, RunId, SlotId
from ggufpipe_agent.llama.engine import StageEngine, StageShape
from ggufpipe_agent.llama.plumbing import stage_threads
from ggufpipe_agent.llama.sent import SentRows
from ggufpipe_agent.llama.threads import ThreadGovernor, governor
from ggufpipe_agent.wire.protocol import PrefixHeld, PrefixOffer


class LoadedEngine:
    """The loaded engine, kept across runs so a new prompt reloads nothing,
    and which run's positions each of its slots' KV caches holds (prefix
    reuse, per slot: a run keeps what its slot's previous run left).

    One engine per agent: a host runs one stage, and a different range evicts
    the old engine (its memory is freed before the new one loads), never
    while another run uses a slot of it. Used from the worker thread, but
    :meth:`claim` and :meth:`release`, which the event loop calls.
    """

    def __init__(self, build: Callable[..., StageEngine] = StageEngine) -> None:
        """``build(path, shape, options, progress)`` loads an engine (a test
        passes a stand-in for llama.cpp)."""
        self.build = build
        self.key: tuple[Any, ...] | None = None
        self.engine: StageEngine | None = None
        self.written: dict[int, int] = {}  # slot -> the run whose positions it holds (absent: none to trust)
        self.unheld: dict[int, str] = {}  # slot -> why it holds none
        self.users: dict[int, int] = {}  # slot -> the live run on it
        self.default_unheld = "its cache holds no earlier run"  # why a slot never written holds none
        self._governed: ThreadGovernor | None = None  # adapts the engine's decode threads
        self._governed_context = 0
        # The rows this stage sent of each slot's cache, to rebuild a next
        # stage that is started again (llama/sent.py).
        self.sent = SentRows()

    def claim(self, slot: SlotId, run_id: RunId) -> str:
        """Run ``run_id`` takes ``slot``; '' or why it cannot (another live run has it)."""
        holder = self.users.get(slot)
        if holder is not None and holder != run_id:
            return f"slot {slot} is busy with run {holder:016x}"
        self.users[slot] = run_id
        return ""

    def release(self, slot: SlotId, run_id: RunId) -> None:
        if self.users.get(slot) == run_id:
            del self.users[slot]

    def get(
        self,
        path: Path,
        shape: StageShape,
        options: Any,
        progress: Callable[[float], None],
        run_id: RunId = NO_RUN,
    ) -> tuple[StageEngine, bool]:
        """The engine, and whether it was (re)loaded now. An engine that
        another live run (not ``run_id``) uses is never replaced."""
        key = (str(path), shape, options)
        if self.key == key and self.engine is not None:
            return self.engine, False  # loaded by an earlier run: nothing to load, nothing to report
        others = sorted(run for run in self.users.values() if run != run_id)
        if self.engine is not None and others:
            raise EngineError(
                f"the stage's engine is in use by run {others[0]:016x} with other options "
                "(a run with another range, context or slots must wait for it)"
            )
        self.close()
        self.engine = self.build(str(path), shape, options, progress)
        self.key = key
        self._govern(self.engine, options)
        freeze_heap()  # the engine and its model's metadata live until the next load
        return self.engine, True

    def _govern(self, engine: StageEngine, options: Any) -> None:
        """A stage whose threads the inventory leaves to ggufpipe (0) decodes
        with the cores other processes leave free (ggufpipe_agent/llama/threads.py)."""
        context = getattr(engine, "context", None)
        if getattr(options, "threads", 0) or not isinstance(context, int) or not context:
            return  # threads given, or a test's stand-in engine
        adapting = governor()
        if adapting is not None:
            adapting.track(context, stage_threads(options))
            self._governed, self._governed_context = adapting, context

    def wrote(self, slot: SlotId, run_id: RunId) -> None:
        """``run_id``'s positions are what slot ``slot`` holds now (0: it is changing)."""
        self.written[slot] = run_id

    def forget(self, why: str, slot: SlotId = EVERY_SLOT) -> None:
        """The slot's KV cache (-1: every slot's) holds nothing a later run may keep."""
        if slot < 0:
            self.written.clear()
            self.unheld.clear()
            self.default_unheld = why
            self.sent = SentRows(self.sent.limit)
        else:
            self.written.pop(slot, None)
            self.unheld[slot] = why
            self.sent.forget(slot, why)

    def held(
        self, engine: StageEngine, offer: PrefixOffer, loaded: bool, slot: SlotId = FIRST_SLOT
    ) -> PrefixHeld:
        """What slot ``slot`` of this engine can keep of the run ``offer`` names."""
        if not offer.run_id:
            return PrefixHeld()
        if loaded:
            return PrefixHeld(offer.run_id, reason="its engine was loaded for this run")
        written = self.written.get(slot, 0)
        if written != offer.run_id:
            unheld = self.unheld.get(slot, self.default_unheld)
            why = f"its cache holds run {written:016x}" if written else unheld
            return PrefixHeld(offer.run_id, reason=why)
        engine.use(slot)
        positions, why = engine.keepable()
        if positions > offer.positions:
            if getattr(engine, "whole_state_only", False):
                return PrefixHeld(
                    offer.run_id, reason="its recurrent state holds more positions than the run fed"
                )
            positions = offer.positions
        sent = min(self.sent.covered(slot), positions)
        return PrefixHeld(offer.run_id, positions, engine.keep_granularity, why, sent)

    def close(self) -> None:
        if self._governed is not None:
            self._governed.untrack(self._governed_context)
            self._governed = None
        if self.engine is not None:
            self.engine.close()
        self.engine = None
        self.key = None
        self.forget("its cache holds no earlier run")
