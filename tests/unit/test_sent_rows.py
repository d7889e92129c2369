"""The rows a stage keeps of what it sent (llama/sent.py) and the
orchestrator's half of a replay in proportion (core/reuse.py: Resume)."""

from __future__ import annotations

from ggufpipe_agent.llama.sent import SentPart, SentRows
from ggufpipe_agent.wire import objects
from ggufpipe_agent.wire.protocol import PrefixHeld
from ggufpipe_tui.core.reuse import Resume, rebuild_parts, resume_problem


def part(position: int, rows: int, width: int = 2) -> SentPart:
    payload = bytes(range(position, position + rows)) * width  # rows * width bytes
    return SentPart(position, rows, width, 1, payload[: rows * width])


def test_parts_are_kept_in_order_and_cut_where_a_run_keeps_less():
    sent = SentRows()
    sent.opened(0, 0)
    for p in (part(0, 4), part(4, 4), part(8, 1), part(9, 1)):
        sent.add(0, p)
    assert sent.covered(0) == 10
    assert [(p.position, p.rows) for p in sent.parts(0, 9)] == [(0, 4), (4, 4), (8, 1)]
    sent.opened(0, 6)  # the next run keeps 6 positions: the part over 6 is cut
    assert [(p.position, p.rows, len(p.payload)) for p in sent.parts(0, 100)] == [(0, 4, 8), (4, 2, 4)]
    assert sent.covered(0) == 6
    sent.opened(0, 0)
    assert sent.covered(0) == 0


def test_a_slot_that_would_pass_the_bound_keeps_nothing_until_it_starts_again():
    sent = SentRows(limit=20)
    sent.opened(0, 0)
    sent.add(0, part(0, 4))  # 8 bytes
    sent.opened(1, 0)
    sent.add(1, part(0, 4))
    sent.add(1, part(4, 4))  # 24 in all: slot 1 gives up
    assert sent.covered(1) == 0 and sent.covered(0) == 4
    sent.add(1, part(8, 1))
    assert sent.covered(1) == 0
    sent.opened(1, 0)
    sent.add(1, part(0, 1))
    assert sent.covered(1) == 1
    sent.forget(0, "aborted")
    assert sent.covered(0) == 0 and list(sent.parts(0, 10)) == []


def test_the_rebuild_flag_travels_in_the_header():
    record = objects.tokens_record(5, 7, 0, [1, 2, 3], position=9, more=True, rebuild=True)
    header = objects.unpack_header(record[: objects.HEADER_SIZE], 1 << 20)
    assert header.more and header.rebuild and header.position == 9
    assert "rebuild" in header.describe()
    plain = objects.unpack_header(objects.tokens_record(5, 7, 0, [1])[: objects.HEADER_SIZE], 1 << 20)
    assert not plain.rebuild and not plain.more


def holds(*positions: int, sent: int = 0, run: int = 9) -> list[PrefixHeld]:
    return [PrefixHeld(run, p, 32, "", sent) for p in positions]


def test_a_resume_needs_every_other_stage_to_hold_its_positions():
    resume = Resume(9, (5, 6, 7), positions=12, rebuild=1)
    assert resume.offer().resume and resume.offer().positions == 12
    assert resume_problem(resume, holds(12, 0, 12, sent=12)) == ""
    assert "stage 2 holds 11 of its 12" in resume_problem(resume, holds(12, 0, 11, sent=12))
    assert "stage 0 holds the rows it sent of 3 of 12" in resume_problem(resume, holds(12, 0, 12, sent=3))
    assert "stage 0 holds 12" in resume_problem(resume, holds(12, 0, 12, sent=12, run=8))
    link = Resume(9, (5,), positions=10)  # a link re-made: every stage holds its cache
    assert resume_problem(link, holds(10, 10)) == ""


def test_a_rebuilt_stage_0_is_fed_the_prompt_then_each_token_but_the_last():
    resume = Resume(9, (5, 6, 7), positions=6, rebuild=0)
    assert rebuild_parts(resume, [1, 2, 3, 4]) == [([1, 2, 3, 4], 0), ([5], 4), ([6], 5)]
    assert rebuild_parts(Resume(9, (5,), 4, rebuild=2), [1, 2, 3, 4]) == []
