"""The rows a stage sent of each slot's cache, kept to rebuild the next stage.

When a stage is lost, the stages around it still hold their KV caches; only
the lost stage's must be computed again, from the rows its predecessor sent
it, in the parts (shapes) it first computed them in (docs/recovery.md,
"Replay in proportion"). :class:`SentRows` keeps, per slot, each part a
non-last stage sent on (its first position, its payload in the edge's dtype)
as long as the slot's cache holds it: a run that keeps a prefix of the one
before drops what lies past it, as the cache does.

The memory is bounded: ``GGUFPIPE_KEEP_SENT_MIB`` (default 512) over all a
stage's slots (the stage's loaded engine holds it). A slot whose rows would
pass it keeps none (its next loss is replayed whole, as without this), so the
bound holds whatever the runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field

#: Bytes of sent rows a stage keeps at most, over all its slots.
DEFAULT_LIMIT = int(float(os.environ.get("GGUFPIPE_KEEP_SENT_MIB", "512")) * (1 << 20))


@dataclass(frozen=True, slots=True)
class SentPart:
    """One part as it was sent: ``rows`` rows from ``position``, ``cols``
    wide, the payload in dtype code ``dtype``."""

    position: int
    rows: int
    cols: int
    dtype: int
    payload: bytes

    @property
    def end(self) -> int:
        return self.position + self.rows

    def before(self, position: int) -> SentPart:
        """This part cut to the rows before ``position``."""
        keep = max(0, min(self.rows, position - self.position))
        width = len(self.payload) // self.rows if self.rows else 0
        return SentPart(self.position, keep, self.cols, self.dtype, self.payload[: keep * width])


@dataclass
class _Slot:
    parts: list[SentPart] = field(default_factory=list)
    nbytes: int = 0
    gone: str = ""  # why the slot keeps nothing ("" while it does)


class SentRows:
    """Per slot, the parts a stage sent, in order, position 0 on."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self.limit = limit
        self._slots: dict[int, _Slot] = {}

    @property
    def nbytes(self) -> int:
        return sum(slot.nbytes for slot in self._slots.values())

    def opened(self, slot: int, position: int) -> None:
        """A run's prompt starts on ``slot`` at ``position``: the cache keeps
        the positions before it, and so do the rows."""
        held = self._slots.setdefault(slot, _Slot())
        if position == 0:
            self._slots[slot] = _Slot()
            return
        parts = [part if part.end <= position else part.before(position) for part in held.parts]
        held.parts = [part for part in parts if part.rows]
        held.nbytes = sum(len(part.payload) for part in held.parts)

    def add(self, slot: int, part: SentPart) -> None:
        """``part`` was sent from ``slot``'s run: kept, unless it would pass
        the bound (then the slot keeps nothing until its next run opens at 0)."""
        held = self._slots.setdefault(slot, _Slot())
        if held.gone:
            return
        if self.nbytes + len(part.payload) > self.limit:
            self.forget(slot, f"its sent rows would pass {self.limit >> 20} MiB (GGUFPIPE_KEEP_SENT_MIB)")
            return
        held.parts.append(part)
        held.nbytes += len(part.payload)

    def forget(self, slot: int, why: str) -> None:
        self._slots[slot] = _Slot(gone=why or "nothing kept")

    def covered(self, slot: int) -> int:
        """How many positions, from 0 and without a gap, the slot's rows cover."""
        held = self._slots.get(slot)
        if held is None or held.gone:
            return 0
        end = 0
        for part in held.parts:
            if part.position != end:
                break
            end = part.end
        return end

    def parts(self, slot: int, before: int) -> Iterator[SentPart]:
        """The slot's parts for the positions before ``before``, in order."""
        held = self._slots.get(slot)
        if held is None or held.gone:
            return
        for part in held.parts:
            if part.position >= before:
                return
            yield part if part.end <= before else part.before(before)
