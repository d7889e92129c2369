"""The orchestrator's choice of a kept prefix (ggufpipe_tui.core.reuse), as a
table: what every stage holds, what the last run fed, what the new prompt is."""

from __future__ import annotations

import pytest

from ggufpipe_agent.wire.protocol import PrefixHeld
from ggufpipe_tui.core.reuse import ReuseSource, choose_kept, common_prefix

RUN = 0x51
FED = (1, 2, 3, 4, 5, 6, 7, 8)  # a prompt 1..5 and the fed-back tokens 6, 7, 8
SOURCE = ReuseSource(RUN, FED)


def holds(*positions: int, granularity: int = 1, run: int = RUN) -> list[PrefixHeld]:
    return [
        PrefixHeld(run, count, granularity, "" if count >= 8 else f"holds {count}") for count in positions
    ]


CASES = {
    # name: (source, prompt, holds, kept, words in the reason)
    "the next turn keeps what was fed": (SOURCE, [*FED, 9, 9], holds(8, 8, 8), 8, ""),
    "the same prompt again computes its last token": (
        SOURCE,
        [1, 2, 3, 4, 5],
        holds(8, 8),
        4,
        "last prompt token",
    ),
    "a shorter shared prefix": (SOURCE, [1, 2, 3, 0, 0], holds(8, 8), 3, ""),
    "the stage that holds least decides": (SOURCE, [*FED, 9], holds(8, 5, 8), 5, "stage 1: holds 5"),
    "nothing shared": (SOURCE, [9, 1, 2], holds(8, 8), 0, "shares no prefix"),
    "a stage that holds nothing": (SOURCE, [*FED, 9], holds(8, 0), 0, "stage 1: holds 0"),
    "no earlier run": (None, [1, 2, 3], [PrefixHeld(), PrefixHeld()], 0, "no earlier run"),
    "an earlier run that fed nothing": (ReuseSource(RUN, ()), [1, 2], holds(8), 0, "no earlier run"),
    "a stage offered another run": (SOURCE, [*FED, 9], [*holds(8), *holds(8, run=0x99)], 0, "not offered"),
    "kept down to the granularity": (SOURCE, [*FED, 9], holds(8, 8, granularity=3), 6, "multiple of 3"),
    "granularity of every stage": (
        SOURCE,
        [*FED, 9],
        [PrefixHeld(RUN, 8, 2), PrefixHeld(RUN, 8, 3)],
        6,
        "multiple of 6",
    ),
    "nothing left after rounding": (SOURCE, [1, 2, 3, 0], holds(8, granularity=4), 0, "multiple of 4"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_choice(name):
    source, prompt, stage_holds, kept, words = CASES[name]
    reuse = choose_kept(source, prompt, stage_holds)
    assert reuse.kept == kept
    assert words in reuse.reason
    if kept:
        assert 0 < kept < len(prompt), "at least one prompt token is computed"
        assert list(prompt[:kept]) == list(FED[:kept]), "only tokens the stages hold are kept"


def test_common_prefix_and_offer():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([1, 2], [1, 2]) == 2
    assert SOURCE.offer().run_id == RUN and SOURCE.offer().positions == len(FED)
