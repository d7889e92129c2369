"""The stage table's MeasuredOnce draws what a plain Rich table draws, for
contents that change the way a streaming run's do (numbers of other widths,
a cell that wraps), with one cache of widths and one of drawn cells kept
across draws."""

from __future__ import annotations

from rich.console import Console
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from ggufpipe_tui.views.widgets import MeasuredOnce


def draw(table: Table, width: int) -> list[str]:
    console = Console(width=width, color_system="truecolor", force_terminal=True, legacy_windows=False)
    with console.capture() as capture:
        console.print(table)
    return capture.get().splitlines()


def fill(table: Table, step: int) -> Table:
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("host", no_wrap=True, overflow="ellipsis", max_width=12)
    table.add_column("", ratio=1, min_width=10)
    table.add_column("step ms", justify="right", no_wrap=True)
    for row in range(3):
        detail = Text(f"◐ {step * (row + 1)} steps", style="cyan")
        if step % 7 == 3 and row == 1:
            detail = Text("step failed: llama_decode returned -3 (out of memory)", style="red")
        table.add_row(
            str(row), f"gpu-{row}" * (1 + row), detail, Text(f"{step * 1.7 % 40:.1f} / {step / 3:.1f}")
        )
    return table


def test_the_same_lines_as_a_plain_table_across_draws() -> None:
    cache: dict[object, list[int]] = {}
    cells: dict[object, list[list[Segment]]] = {}
    for width in (12, 30, 60, 110):  # 12 and 30: columns squeezed to nothing
        for step in (1, 2, 9, 10, 11, 3, 99, 100, 101, 10, 17, 1000):
            for expand in (False, True):
                options = {"box": None, "expand": expand, "padding": (0, 1), "pad_edge": False}
                plain = draw(fill(Table(**options), step), width)
                assert draw(fill(MeasuredOnce(cache, **options), step), width) == plain, (width, step, expand)
                kept = draw(fill(MeasuredOnce(cache, cells, **options), step), width)
                assert kept == plain, ("cells kept", width, step, expand)
    assert 0 < len(cache) < 4 * 2 * 12, "the widths were measured once per shape, not per draw"
    assert cells, "cells were kept"
