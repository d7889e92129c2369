"""Slot choice (core/slots.py), as a table: the longest shared prefix wins,
then (runs batched) the slot next to those in flight, then the least recently
used, then the lowest slot; and a server's churn played through it."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from ggufpipe_tui.core.slots import choose_slot, ranges

HELD = [(1, 2, 3), (1, 2, 3, 4, 5), (), (9,)]
USED = [3.0, 2.0, 1.0, 0.0]


@pytest.mark.parametrize(
    ("free", "held", "used", "prompt", "slot"),
    [
        ([0, 1, 2, 3], HELD, USED, [1, 2, 3, 4, 5, 6], 1),  # the longest shared prefix
        ([0, 2, 3], HELD, USED, [1, 2, 3, 4, 5, 6], 0),  # slot 1 is busy: the next longest
        ([0, 1, 2, 3], HELD, USED, [7], 3),  # none shares: the least recently used
        ([0, 2], HELD, USED, [7], 2),
        ([0, 1, 2, 3], HELD, USED, [9, 9], 3),  # one token shared beats none
        ([0, 1], [(), ()], [0.0, 0.0], [1], 0),  # all equal: the lowest slot
        ([1, 0], [(), ()], [0.0, 0.0], [1], 0),  # whatever order the free slots come in
        ([2], HELD, USED, [1, 2, 3], 2),  # the only free slot, whatever it holds
        ([0, 1], HELD, USED, [1, 2, 3], 1),  # a tie on the prefix: the least recently used
        ([0, 1], [(), ()], USED, [], 1),  # an empty prompt: the least recently used
    ],
)
def test_choose_slot(free, held, used, prompt, slot):
    assert choose_slot(free, held, used, prompt) == slot


def test_no_free_slot_is_no_choice():
    with pytest.raises(ValueError, match="no free slot"):
        choose_slot([], HELD, USED, [1])


@pytest.mark.parametrize(
    ("free", "batched", "slot"),
    [
        ([0, 1, 2, 3], [], 3),  # nothing in flight: the least recently used
        ([0, 1, 2, 3, 6, 7], [4, 5], 6),  # next to the slots in flight, not the least recently used 7
        ([0, 2, 5, 6, 7], [1, 3, 4], 2),  # the hole between two ranges
        ([0, 6, 7], [1, 2, 3, 4, 5], 6),  # both ends as good: the least recently used (USED8)
    ],
)
def test_among_equals_the_slot_next_to_those_in_flight(free, batched, slot):
    assert choose_slot(free, [()] * 8, USED8, [7], batched) == slot


USED8 = [8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0]  # slot 7 the least recently used


def test_a_longer_prefix_still_beats_a_neighbour():
    held = [(), (), (), (), (), (), (), (7, 8)]
    assert choose_slot([0, 3, 7], held, USED8, [7, 8, 9], [1, 2]) == 7


@pytest.mark.parametrize(("a", "n"), [([], 0), ([3], 1), ([0, 1, 2], 1), ([0, 2, 3], 2), ([5, 1, 3], 3)])
def test_ranges(a, n):
    assert ranges(a) == n


def churn(batched: bool, slots: int = 32, in_flight: int = 16, steps: int = 4000) -> float:
    """A server's requests coming and going (16-256 tokens each, always
    ``in_flight`` of them): the mean number of ranges of neighbouring slots in
    each of the two stages' groups (the decoding slots in order, cut in two,
    as the agent's StepBatcher.groups cuts them): the ubatches a batch is."""
    rnd = random.Random(38)
    used = [0.0] * slots
    left: dict[int, int] = {}
    seen = []
    for step in range(steps):
        left = {slot: n for slot, n in left.items() if n > 0}
        while len(left) < in_flight:
            free = [slot for slot in range(slots) if slot not in left]
            slot = choose_slot(free, [()] * slots, used, [1], list(left) if batched else ())
            used[slot] = step + rnd.random()
            left[slot] = rnd.randint(16, 256)
        live = sorted(left)
        size = math.ceil(len(live) / 2)
        seen.append(statistics.mean([ranges(live[:size]), ranges(live[size:])]))
        left = {slot: n - 1 for slot, n in left.items()}
    return statistics.mean(seen)


def test_the_slots_in_flight_stay_neighbours_as_requests_come_and_go():
    """docs/worker.md, "Batched decode": least recently used alone scatters
    the slots in flight (a group several ubatches); next to those in flight,
    a group stays about one."""
    assert churn(batched=True) < 1.5
    assert churn(batched=False) > 3
