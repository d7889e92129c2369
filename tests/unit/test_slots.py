"""Slot choice (core/slots.py), as a table: the longest shared prefix wins,
then the least recently used, then the lowest slot."""

from __future__ import annotations

import pytest

from ggufpipe_tui.core.slots import choose_slot

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
