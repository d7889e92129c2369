"""Which slot of the stages a prompt runs on. Pure: no I/O.

Each stage has K slots (a llama.cpp sequence each, with its own KV cache);
a run keeps what its slot's last run left there when its prompt starts with
it (core/reuse.py). So a prompt goes to the free slot whose cached tokens
share the longest prefix with it (a conversation's next turn finds its own
cache, as llama-server's slots do); the least recently used among equals,
and the lowest slot among those.
"""

from __future__ import annotations

from collections.abc import Sequence

from ggufpipe_agent.ids import SlotId
from ggufpipe_tui.core.reuse import common_prefix


def choose_slot(
    free: Sequence[SlotId], held: Sequence[tuple[int, ...]], used: Sequence[float], prompt: Sequence[int]
) -> SlotId:
    """The free slot whose cached tokens (``held``, by slot) share the longest
    prefix with ``prompt``; among equals the least recently used (``used``:
    when each slot last took a run), then the lowest."""
    if not free:
        raise ValueError("no free slot to choose from")
    return max(free, key=lambda slot: (common_prefix(held[slot], prompt), -used[slot], -slot))
