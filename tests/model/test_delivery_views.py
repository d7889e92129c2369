"""Model delivery without processes: the wire messages, the wording, the
TUI's reducer and stage table, headless progress."""

from __future__ import annotations

import dataclasses
import io

import pytest

from ggufpipe_agent.delivery.receiver import ReceiveStatus
from ggufpipe_agent.delivery.sender import StageOffer
from ggufpipe_agent.gguf.identity import model_identity
from ggufpipe_agent.stagefiles.admin import CacheEntry
from ggufpipe_agent.stagefiles.cache import StageKey
from ggufpipe_agent.wire import delivery_messages as messages
from ggufpipe_agent.wire.protocol import StageFileRef, decode_message, encode_message
from ggufpipe_tui.core import format as fmt
from ggufpipe_tui.core import printer as printing
from ggufpipe_tui.core.events import StageDelivery
from ggufpipe_tui.core.plan import provision_message
from ggufpipe_tui.session.delivery import with_stage_files
from ggufpipe_tui.views.viewstate import ViewState
from ggufpipe_tui.views.widgets import StageTable
from tests.support.fakes import FACTS, inventory, plan_for

GIB = 2**30
KEY = StageKey("ab" * 32, "tiny", 0, 2, 4, 3)


def event(state: str, done: int, size: int = int(12.4 * GIB), rate: float = 240e6, **extra) -> StageDelivery:
    fields = {
        "stage": 0,
        "host": "a",
        "state": state,
        "name": "tiny.blk0-2of4.x.gguf",
        "size": size,
        "done": done,
        "sent": done,
        "seconds": 3.0,
        "rate": rate,
    }
    return StageDelivery(**(fields | extra))


MESSAGES = [
    messages.ReceiveStage(StageOffer(KEY, 123, 1 << 23), replace=True),
    messages.ReceiveAnswer(ReceiveStatus("partial", "n.gguf", verified_bytes=8, verified_chunks=1), "/c", 99),
    messages.StageData(3, "d" * 64, 1 << 23),
    messages.StageDataEnd("e" * 64),
    messages.StageStored("n.gguf", 123, "f" * 64),
    messages.ReceiveFailed("no space left for /c/n.gguf: ...", "disk_full", "/c/n.gguf", 123, 4),
    messages.CacheRequest(7, "remove", ("a.gguf", "b.gguf"), every=False),
    messages.CacheReport(
        7, "/c", 5, (CacheEntry("a.gguf", "complete", "ab" * 32, "tiny", 0, 2, 4, 10, 10, 1.5),), ("b.gguf",)
    ),
]


@pytest.mark.parametrize("message", MESSAGES, ids=[m.tag for m in MESSAGES])
def test_delivery_messages_round_trip(message):
    assert decode_message(encode_message(message)) == message


def test_a_provision_names_the_delivered_file_and_model_info_carries_the_identity(model_path):
    plan = plan_for(inventory(stages=2))
    ref = StageFileRef(KEY, 123, "c" * 64)
    sent = provision_message(with_stage_files(plan, {0: ref}), 0)
    assert decode_message(encode_message(sent)).stage_file == ref
    assert provision_message(with_stage_files(plan, {0: ref}), 1).stage_file is None
    from ggufpipe_agent.wire.protocol import ModelInfo

    info = ModelInfo(1, FACTS, (), model_identity(model_path))
    assert decode_message(encode_message(info)) == info


def test_the_wording_of_a_delivery():
    assert fmt.delivery_line(event("sending", int(3.1 * GIB))) == "sending 3.1/12.4 GiB, 240 MB/s, ETA 42 s"
    assert fmt.delivery_line(event("sending", 41 << 20, size=62 << 20, rate=0)) == "sending 41.0/62.0 MiB"
    assert fmt.delivery_line(event("checking", 0)) == "checking what the host has of 12.4 GiB"
    assert fmt.delivery_line(event("waiting", 0)).startswith("waiting: another transfer")
    done = event("done", 62 << 20, size=62 << 20, outcome="sent", seconds=2.0)
    assert fmt.delivery_line(done) == "sent 62.0 MiB in 2.0 s, 33 MB/s"
    cached = dataclasses.replace(done, sent=0, outcome="cached")
    assert fmt.delivery_line(cached) == "on the host already (62.0 MiB), nothing sent"
    resumed = dataclasses.replace(done, sent=20 << 20, outcome="resumed")
    assert (
        fmt.delivery_line(resumed)
        == "resumed: sent 20.0 MiB of 62.0 MiB in 2.0 s, 10 MB/s (42.0 MiB were there)"
    )


def test_the_stage_table_shows_a_stage_file_being_sent():
    state = ViewState(inventory(stages=2))
    state.apply(event("checking", 0), 0.0)
    state.apply(event("sending", int(3.1 * GIB)), 1.0)
    state.apply(event("sending", int(3.5 * GIB)), 1.2)
    row = state.rows[0]
    assert row.delivery is not None and row.delivery.done == int(3.5 * GIB)
    notes = [line.plain for stage, line in state.log if stage == 0]
    assert len(notes) == 2, "one log line per step, not per update"
    assert state.hint(2.0) == "sending stage files · 3.5 GiB of 12.4 GiB"
    table = StageTable(state.rows)
    wide = table._detail(row, compact=False).plain
    assert wide.endswith(" sending 3.5/12.4 GiB, 240 MB/s, ETA 40 s") and wide.startswith("██")
    assert table._detail(row, compact=True).plain == "sending 3.5/12.4 GiB, 240 MB/s, ETA 40 s"
    state.apply(event("done", int(12.4 * GIB), outcome="cached", sent=0), 3.0)
    assert table._detail(state.rows[0], compact=True).plain == "on the host already (12.4 GiB), nothing sent"
    assert state.hint(3.0).endswith("agents up · 3.0 s")


def test_headless_prints_a_few_lines_a_second_and_nothing_with_quiet(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(printing.time, "monotonic", lambda: clock[0])
    err = io.StringIO()
    printer = printing.Printer(
        inventory(stages=2), io.StringIO(), err, as_json=True, verbose=False, quiet=False
    )
    printer(event("checking", 0))
    for step in range(1, 41):  # four seconds of updates, ten a second, for two stages
        clock[0] = step / 10
        for stage in (0, 1):
            printer(dataclasses.replace(event("sending", step << 20), stage=stage))
    printer(event("done", 40 << 20, outcome="sent"))
    lines = err.getvalue().splitlines()
    sending = [line for line in lines if ": sending " in line]
    assert 6 <= len(sending) <= 10, lines  # at most one a second per stage
    assert lines[0] == "ggufpipe: stage 0 on a: checking what the host has of 12.4 GiB"
    assert lines[-1].startswith("ggufpipe: stage 0 on a: sent 40.0 MiB in 3.0 s")
    assert printer.delivery_json()[0] | {"seconds": 0} == {
        "stage": 0,
        "host": "a",
        "file": "tiny.blk0-2of4.x.gguf",
        "size": int(12.4 * GIB),
        "bytes_sent": 40 << 20,
        "seconds": 0,
        "outcome": "sent",
    }
    quiet = io.StringIO()
    silent = printing.Printer(
        inventory(stages=2), io.StringIO(), quiet, as_json=False, verbose=False, quiet=True
    )
    silent(event("sending", 1))
    silent(event("done", 40 << 20, outcome="sent"))
    assert quiet.getvalue() == ""
