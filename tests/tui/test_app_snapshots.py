"""Snapshots of the TUI's layout, from fixed event sequences (no agents).

The app replays a scripted list of orchestrator events (``script=``) instead
of starting a pipeline, so each picture is exact: the plan before anything
loads, a run streaming, and a fault, each at 80x24 and at 160x48. Update with
``pytest tests/test_app_snapshots.py --snapshot-update`` after a deliberate
change, and look at the pictures before committing them.
"""

from __future__ import annotations

import pytest
from textual.app import App, ComposeResult

from ggufpipe_tui.core.events import (
    Notice,
    RunFinished,
    RunPhaseChanged,
    RunResult,
    StageStateChanged,
    Timings,
)
from ggufpipe_tui.core.inventory import Inventory
from ggufpipe_tui.views.app import GgufpipeApp, ScriptItem
from ggufpipe_tui.views.widgets import StageRow, StageTable
from tests.support.app import REPLY, RUN_ID, inventory, planned, running


def faulted(inv: Inventory) -> list[ScriptItem]:
    items = running(inv)
    reason = "stage 1 on gpu-b (infer@10.0.0.12): step 11 failed: llama_decode returned -3 (out of memory)"
    items += [
        StageStateChanged(RUN_ID, 1, "Faulted", "step 11 failed: llama_decode returned -3 (out of memory)"),
        RunPhaseChanged(RUN_ID, "Faulted", reason),
        Notice("error", f"run {RUN_ID:016x} faulted: {reason}"),
        RunPhaseChanged(RUN_ID, "TearingDown", reason),
        StageStateChanged(RUN_ID, 0, "Stopping"),
        StageStateChanged(RUN_ID, 0, "Stopped"),
        StageStateChanged(RUN_ID, 2, "Stopping"),
        StageStateChanged(RUN_ID, 2, "Stopped"),
        RunPhaseChanged(RUN_ID, "Done", reason),
        2.6,
        RunFinished(
            RunResult(
                run_id=RUN_ID,
                outcome="faulted",
                stop_reason="",
                failure=reason,
                prompt_tokens=(1, 2, 3),
                tokens=tuple(range(1000, 1000 + len(REPLY))),
                text="".join(REPLY),
                timings=Timings(ttft_ms=300.0, prefill_ms=250.0, decode_ms=450.0, decode_tokens_per_s=20.0),
            )
        ),
    ]
    return items


@pytest.mark.parametrize("size", [(80, 24), (160, 48)], ids=["80x24", "160x48"])
@pytest.mark.parametrize("scene", [planned, running, faulted])
def test_layout(snap_compare, scene, size) -> None:
    inv = inventory()
    app = GgufpipeApp(inv, script=scene(inv))
    assert snap_compare(app, terminal_size=size)


class StageTableApp(App[None]):
    """The stage table alone, with the plan's memory figures: what each stage
    needs where its layers go and what its host has for it."""

    def compose(self) -> ComposeResult:
        rows = [
            StageRow(0, "gpu-a", "infer@10.0.0.11", (0, 8), 9_863_000_000, 40_265_318_400, "NVIDIA A100"),
            StageRow(1, "gpu-b", "infer@10.0.0.12", (8, 21), 22_548_578_304, 23_622_320_128, "NVIDIA L4"),
            StageRow(2, "here", "local", (21, 30), 3_221_225_472, 2_147_483_648),  # over: red
            StageRow(3, "spare", "local", None, 734_003_200),  # what the host has is unknown
        ]
        for row in rows:
            row.connected = True
        yield StageTable(rows)


@pytest.mark.parametrize("size", [(80, 24), (160, 48)], ids=["80x24", "160x48"])
def test_stage_table_memory(snap_compare, size) -> None:
    assert snap_compare(StageTableApp(), terminal_size=size)


def test_scripted_app_renders_and_exits_with_its_result() -> None:
    """The pictures above are worth something only if the app exits as Textual
    expects (an app method once shadowed App._shutdown and every snapshot was
    an empty file)."""
    from textual._doc import take_svg_screenshot

    inv = inventory()
    svg = take_svg_screenshot(app=GgufpipeApp(inv, script=running(inv)), terminal_size=(80, 24))
    assert isinstance(svg, str) and svg.lstrip().startswith("<svg")
    assert "Pipelines" in svg and "Running" in svg
