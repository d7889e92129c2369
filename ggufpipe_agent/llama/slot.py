"""The engine an agent keeps across runs, and which run its KV cache holds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ggufpipe_agent.llama.engine import StageEngine, StageShape
from ggufpipe_agent.wire.protocol import PrefixHeld, PrefixOffer


class EngineSlot:
    """The loaded engine, kept across runs so a new prompt reloads nothing,
    and which run's positions its KV cache holds (prefix reuse).

    One slot per agent: a host runs one stage, and a different range evicts
    the old engine (its memory is freed before the new one loads). Used from
    the worker thread only.
    """

    def __init__(self, build: Callable[..., StageEngine] = StageEngine) -> None:
        """``build(path, shape, options, progress)`` loads an engine (a test
        passes a stand-in for llama.cpp)."""
        self.build = build
        self.key: tuple[Any, ...] | None = None
        self.engine: StageEngine | None = None
        self.written_by = 0  # the run whose positions the KV cache holds; 0: none to trust
        self.unheld = "its cache holds no earlier run"  # why, when written_by is 0

    def get(
        self, path: Path, shape: StageShape, options: Any, progress: Callable[[float], None]
    ) -> tuple[StageEngine, bool]:
        """The engine, and whether it was (re)loaded now."""
        key = (str(path), shape, options)
        if self.key == key and self.engine is not None:
            return self.engine, False  # loaded by an earlier run: nothing to load, nothing to report
        self.close()
        self.engine = self.build(str(path), shape, options, progress)
        self.key = key
        return self.engine, True

    def forget(self, why: str) -> None:
        """The KV cache holds nothing a later run may keep."""
        self.written_by = 0
        self.unheld = why

    def held(self, engine: StageEngine, offer: PrefixOffer, loaded: bool) -> PrefixHeld:
        """What this engine can keep of the run ``offer`` names."""
        if not offer.run_id:
            return PrefixHeld()
        if loaded:
            return PrefixHeld(offer.run_id, reason="its engine was loaded for this run")
        if self.written_by != offer.run_id:
            why = f"its cache holds run {self.written_by:016x}" if self.written_by else self.unheld
            return PrefixHeld(offer.run_id, reason=why)
        positions, why = engine.keepable()
        if positions > offer.positions:
            if getattr(engine, "whole_state_only", False):
                return PrefixHeld(
                    offer.run_id, reason="its recurrent state holds more positions than the run fed"
                )
            positions = offer.positions
        return PrefixHeld(offer.run_id, positions, engine.keep_granularity, why)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.engine = None
        self.key = None
        self.forget("its cache holds no earlier run")
