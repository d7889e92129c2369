"""Which slot of the stages a prompt runs on. Pure: no I/O.

Each stage has K slots (a llama.cpp sequence each, with its own KV cache);
a run keeps what its slot's last run left there when its prompt starts with
it (core/reuse.py). So a prompt goes to the free slot whose cached tokens
share the longest prefix with it (a conversation's next turn finds its own
cache, as llama-server's slots do). Among equals, where the runs in flight
decode in batches, the slot that keeps the slots in flight fewest ranges of
neighbours: llama.cpp computes a batch of several KV streams in one ubatch
only where their sequence ids follow one another, so a batch of scattered
slots is several graphs (docs/worker.md, "Batched decode"). Then the least
recently used (it keeps the other conversations' caches longest), then the
lowest slot.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from ggufpipe_agent.ids import SlotId
from ggufpipe_tui.core.reuse import common_prefix


def ranges(slots: Iterable[int]) -> int:
    """How many runs of neighbouring slots ``slots`` make: {0, 1, 2} one,
    {0, 2, 3} two."""
    taken = set(slots)
    return sum(1 for slot in taken if slot - 1 not in taken)


def choose_slot(
    free: Sequence[SlotId],
    held: Sequence[tuple[int, ...]],
    used: Sequence[float],
    prompt: Sequence[int],
    batched: Collection[int] = (),
) -> SlotId:
    """The free slot whose cached tokens (``held``, by slot) share the longest
    prefix with ``prompt``; among equals the one that leaves ``batched`` (the
    slots in flight whose decode steps are batched together; empty where each
    run computes alone) with the fewest ranges of neighbours, then the least
    recently used (``used``: when each slot last took a run), then the lowest."""
    if not free:
        raise ValueError("no free slot to choose from")
    around = set(batched)
    return max(
        free,
        key=lambda slot: (
            common_prefix(held[slot], prompt),
            -ranges(around | {slot}) if around else 0,
            -used[slot],
            -slot,
        ),
    )
