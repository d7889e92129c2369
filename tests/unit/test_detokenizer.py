"""Token pieces to text: a character split over two tokens prints once
whole, and a run cut between its two tokens ends before it (no U+FFFD)."""

from __future__ import annotations

import asyncio

from ggufpipe_tui.core.events import TokenStreamed
from ggufpipe_tui.session.driver import Detokenizer
from tests.support.fakes import PIECES, Rig, settle

# "é" is b"\xc3\xa9": token 12 holds its first byte, token 13 its second;
# "€" is b"\xe2\x82\xac" over 14 and 15; token 11 a lone continuation byte.
TABLE = (*PIECES[:9], b"a", b"b", b"\xa9", b"\xc3", b"\xa9", b"\xe2\x82", b"\xac")


def text_of(tokens: list[int]) -> tuple[list[str], str]:
    detokenizer = Detokenizer(TABLE)
    streamed = [detokenizer.feed(token) for token in tokens]
    return streamed, "".join(streamed) + detokenizer.flush()


def test_a_character_over_two_tokens_prints_once_whole():
    assert text_of([9, 12, 13, 10]) == (["a", "", "é", "b"], "aéb")
    assert text_of([14, 15]) == (["", "€"], "€")


def test_a_text_cut_inside_a_character_ends_before_it():
    assert text_of([9, 12]) == (["a", ""], "a")
    assert text_of([9, 14]) == (["a", ""], "a")


def test_bytes_that_are_no_character_are_replaced_where_they_are():
    assert text_of([9, 11, 10]) == (["a", "\ufffd", "b"], "a\ufffdb")
    # A character's start followed by a byte that cannot go on it.
    assert text_of([12, 9]) == (["", "\ufffda"], "\ufffda")


async def test_a_run_cut_by_max_tokens_inside_a_character_ends_before_it():
    # The autopilot-free rig: tokens 9, 12 are the last stage's two tokens
    # ("a" and the first byte of "é"); max_tokens 2 cuts the run between
    # the character's two tokens.
    rig = Rig(max_tokens=2)
    rig.driver.detokenizer = Detokenizer(TABLE)
    await rig.prompted([5])
    await rig.tokens(9, 12)
    await settle()
    rig.answer_stops()
    await asyncio.wait_for(rig.driver.done.wait(), 2)
    result = rig.driver.result
    assert result is not None and result.stop_reason == "max_tokens"
    assert result.tokens == (9, 12) and result.text == "a"
    streamed = "".join(e.text for e in rig.events if isinstance(e, TokenStreamed))
    assert streamed == "a" and "\ufffd" not in streamed
