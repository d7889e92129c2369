"""The TUI's widgets: the run's status line, the stage table, the log
pane and the footer (the transcript of prompts and replies is :mod:`ggufpipe_tui.views.transcript`).

Each widget renders from plain data the app hands it (attributes down: the
rows and exchanges of :mod:`ggufpipe_tui.views.viewstate`); none of them knows
the orchestrator.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass
from typing import Any

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.padding import Padding
from rich.segment import Segment, SegmentLines
from rich.style import Style
from rich.table import Column, Table
from rich.text import Text
from textual.events import Resize
from textual.geometry import Size
from textual.reactive import Reactive
from textual.screen import Screen
from textual.widgets import Footer, RichLog, Static
from textual.widgets._footer import FooterKey

from ggufpipe_agent.ids import RunId
from ggufpipe_tui.core.format import delivery_line, format_bytes, format_seconds
from ggufpipe_tui.core.placement import MARGIN
from ggufpipe_tui.views.rows import PHASE_STYLES, STAGE_STYLES, StageRow

SPINNER = "◐◓◑◒"


def bar(fraction: float, width: int, style: str = "yellow") -> Text:
    """A progress bar of ``width`` cells (eighth-cell resolution)."""
    fraction = min(max(fraction, 0.0), 1.0)
    eighths = round(fraction * width * 8)
    full, part = divmod(eighths, 8)
    text = Text("█" * full, style=style)
    if part and full < width:
        text.append(" ▏▎▍▌▋▊▉"[part], style=style)
        full += 1
    text.append("·" * (width - full), style="grey30")
    return text


class DrawnOnce(Static):
    """A Static whose Rich renderable is drawn into segments once per width
    and content: Textual draws every widget again on each layout pass (a
    reply growing a line is one), and a table costs milliseconds to lay out.
    Subclasses give :meth:`content_key` (what they show) and :meth:`draw`."""

    _drawn: tuple[object, SegmentLines] | None = None

    def content_key(self) -> object:
        raise NotImplementedError

    def draw(self) -> RenderableType:
        raise NotImplementedError

    def render(self) -> SegmentLines:
        width = self.content_region.width or self.size.width
        key = (width, self.content_key())
        if self._drawn is None or self._drawn[0] != key:
            console = self.app.console
            options = console.options.update_width(max(1, width))
            self._drawn = (key, SegmentLines(console.render_lines(self.draw(), options, pad=False), True))
        return self._drawn[1]


# ----------------------------------------------------------------- stages


def memory_cell(row: StageRow, compact: bool) -> Text:
    """Needed / available, red when the need (with the plan's margin) is over;
    ``~needed`` while what the host has is unknown."""
    if not row.estimated_bytes:
        return Text("?", style="grey50")
    need = format_bytes(row.estimated_bytes, compact)
    if not row.available_bytes:
        return Text(f"~{need}")
    over = row.estimated_bytes * (1 + MARGIN) > row.available_bytes
    text = Text(need, style="bold red" if over else "")
    text.append("/" if compact else " / ", style="grey50")
    text.append(format_bytes(row.available_bytes, compact), style="grey70")
    return text


def _column_shape(column: Column) -> object:
    """What a Rich table's measurement of ``column`` depends on: for its Text
    cells, the widest of their longest words and of their lines
    (Text.__rich_measure__; the column takes the widest of each); any other
    cell as it is."""
    words = lines = 0
    others = []
    for cell in (column.header, *column._cells):
        if isinstance(cell, Text):
            plain = cell.plain
            widest = max(map(cell_len, plain.splitlines()), default=0)
            words = max(words, max(map(cell_len, plain.split()), default=widest))
            lines = max(lines, widest)
        else:
            others.append(cell)
    return words, lines, tuple(others)


def _cell_key(cell: Any, width: int, column: Column) -> object:
    """What a table cell's lines depend on (its padding, style and content,
    the column's width and options), or None for a cell that is not kept
    (content other than text)."""
    padding = cell.renderable
    if not isinstance(padding, Padding):
        return None
    inner = padding.renderable
    if isinstance(inner, str):
        content: object = inner
    elif isinstance(inner, Text):
        content = (
            inner.plain, tuple(inner.spans), inner.style, inner.justify, inner.overflow,
            inner.no_wrap, inner.end, inner.tab_size,
        )  # fmt: skip
    else:
        return None
    pads = (padding.top, padding.right, padding.bottom, padding.left, padding.style, padding.expand)
    where = (width, column.justify, column.no_wrap, column.overflow, column.highlight)
    return type(inner), content, pads, cell.style, where


class MeasuredOnce(Table):
    """A Rich table that measures its columns once per shape of its cells,
    and draws a cell once per content.

    Measuring every cell of every column is half of what drawing the stage
    table costs, and while a run streams only numbers change, rarely the
    width of the widest in a column. The widths are a function of the
    console's width and each column's measurement, so they are kept by those
    (``cache``, the caller's). Drawing the cells is the other half, and
    between two draws most cells are as they were: with ``cells`` (the
    caller's) a borderless table of one-line rows joins the lines its cells
    drew last time, kept by what they show; anything else (a cell that
    wraps, borders, row styles) is drawn by Rich as it is."""

    def __init__(
        self,
        cache: dict[object, list[int]],
        cells: dict[object, list[list[Segment]]] | None = None,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self._cache = cache
        self._kept = cells

    def _render(self, console: Console, options: ConsoleOptions, widths: list[int]) -> RenderResult:
        kept = self._kept
        if (
            kept is None
            or self.box is not None
            or self.show_footer
            or self.row_styles
            or any(row.style is not None for row in self.rows)
        ):
            yield from super()._render(console, options, widths)
            return
        if len(kept) > 1024:
            kept.clear()
        get_style = console.get_style
        columns = self.columns
        rows: list[list[Segment]] = []  # a line each
        for row in zip(
            *(self._get_cells(console, index, column) for index, column in enumerate(columns)), strict=True
        ):
            line: list[Segment] = []
            for width, cell, column in zip(widths, row, columns, strict=True):
                key = _cell_key(cell, width, column)
                lines = kept.get(key) if key is not None else None
                if lines is None:
                    cell_options = options.update(
                        width=width,
                        justify=column.justify,
                        no_wrap=column.no_wrap,
                        overflow=column.overflow,
                        height=None,
                        highlight=column.highlight,
                    )
                    style = get_style(cell.style) + Style.null()
                    lines = console.render_lines(cell.renderable, cell_options, style=style)
                    if not lines:  # no room inside its padding: Rich fills the cell with blanks
                        lines = [[Segment(" " * width, style)]]
                    if key is not None:
                        kept[key] = lines
                if len(lines) != 1:  # a cell of more lines: Rich aligns the row's cells
                    yield from super()._render(console, options, widths)
                    return
                line += lines[0]
            rows.append(line)
        new_line = Segment.line()
        for segments in rows:
            yield from segments
            yield new_line

    def _calculate_column_widths(self, console: Console, options: ConsoleOptions) -> list[int]:
        key = (
            options.max_width,
            self.expand,
            tuple(map(_column_shape, self.columns)),
        )
        widths = self._cache.get(key)
        if widths is None:
            if len(self._cache) > 64:
                self._cache.clear()
            widths = self._cache[key] = super()._calculate_column_widths(console, options)
        return list(widths)


class StageTable(DrawnOnce):
    """One row per stage: where it runs, its layers, its FSM state and numbers."""

    DEFAULT_CSS = "StageTable { height: auto; }"

    def __init__(self, rows: list[StageRow], id: str | None = None) -> None:
        super().__init__(id=id)
        self.rows = rows
        self.running = False
        self._height: int | None = None  # lines, as last drawn
        self._widths: dict[object, list[int]] = {}  # MeasuredOnce's
        self._kept_cells: dict[object, list[list[Segment]]] = {}  # and its cells'

    def show(self, rows: list[StageRow], running: bool) -> None:
        """Draw ``rows``. A layout pass (the whole screen, tens of milliseconds)
        only when the table's height changed: new numbers, states and the
        spinner repaint the table alone."""
        self.rows, self.running = rows, running
        height = old = None
        if self.is_mounted and self.size.width:
            height = len(self.render().lines)
            old = self._height if self._height is not None else self.content_region.height
        layout, self._height = height is None or height != old, height
        self.refresh(layout=layout)

    def content_key(self) -> object:
        rows = tuple(
            (r.index, r.host, r.where, r.layers, r.estimated_bytes, r.available_bytes, r.device, r.state)
            + (r.connected, r.fault, r.load_detail, r.load_fraction, r.counters, r.activity, r.delivery)
            for r in self.rows
        )
        return self.running, rows

    def draw(self) -> RenderableType:
        compact = self.size.width < 110
        # Narrow: fill the width. Wide: as wide as the content, so the numbers
        # stay next to the state instead of at the far edge of a big screen.
        table = MeasuredOnce(
            self._widths,
            self._kept_cells,
            box=None,
            expand=compact,
            padding=(0, 1),
            pad_edge=False,
            header_style="bold grey70",
        )
        table.add_column("#", justify="right", no_wrap=True)
        table.add_column("host", no_wrap=True, overflow="ellipsis", max_width=24)
        if not compact:
            table.add_column("device", no_wrap=True, overflow="ellipsis", max_width=28)
        table.add_column("layers", no_wrap=True)
        table.add_column("mem" if compact else "mem need / has", justify="right", no_wrap=True)
        table.add_column("state", no_wrap=True)
        if compact:
            table.add_column("", ratio=1, min_width=10)  # load bar, activity or fault
        else:
            table.add_column("", min_width=34, max_width=60)
        table.add_column("step ms" if compact else "step last / mean", justify="right", no_wrap=True)
        if compact:
            table.add_column("in/out", justify="right", no_wrap=True)
        else:
            table.add_column("bytes in", justify="right", no_wrap=True)
            table.add_column("bytes out", justify="right", no_wrap=True)
        for row in self.rows:
            table.add_row(*self._cells(row, compact))
        return table

    def _cells(self, row: StageRow, compact: bool) -> list[RenderableType]:
        host = row.host if compact or not row.where or row.where == row.host else f"{row.host} ({row.where})"
        layers = f"[{row.layers[0]},{row.layers[1]})" if row.layers else "auto"
        mem = memory_cell(row, compact)
        state = Text(row.state, style=STAGE_STYLES.get(row.state, ""))
        cells: list[RenderableType] = [str(row.index), host]
        if not compact:
            cells.append(Text(row.device or "", style="grey70"))
        cells += [layers, mem, state, self._detail(row, compact)]
        counters = row.counters
        if counters is None or counters.steps == 0:
            cells.append(Text("-", style="grey50"))
            cells += [Text("-", style="grey50")] * (1 if compact else 2)
            return cells
        # Text, not str (no markup in numbers): MeasuredOnce measures Text by its shape.
        if compact:
            cells.append(Text(f"{counters.last_ms:.0f}/{counters.mean_ms:.0f}"))
            cells.append(
                Text(f"{format_bytes(counters.bytes_in, True)}/{format_bytes(counters.bytes_out, True)}")
            )
        else:
            cells.append(Text(f"{counters.last_ms:.1f} / {counters.mean_ms:.1f}"))
            cells.append(Text(format_bytes(counters.bytes_in)))
            cells.append(Text(format_bytes(counters.bytes_out)))
        return cells

    def _detail(self, row: StageRow, compact: bool) -> RenderableType:
        if row.state in ("Faulted", "Lost", "Broken"):
            return Text(row.fault or row.state, style="red")
        delivery = row.delivery
        if delivery is not None and row.state == "Unprovisioned":  # its stage file going to its host
            if delivery.state == "done":
                return Text(delivery_line(delivery), style="green")
            if delivery.state != "sending" or compact:
                return Text(delivery_line(delivery), style="yellow")
            text = bar(delivery.done / (delivery.size or 1), 10)
            text.append(f" {delivery_line(delivery)}", style="yellow")
            return text
        if row.state == "Setting up":  # its host being given an agent
            return Text(row.load_detail or "setting up its agent", style="yellow")
        if row.state == "Preparing" and row.load_fraction is not None:
            label = "file" if row.load_detail.startswith("writing") else "load"
            width = 8 if compact else 16
            text = bar(row.load_fraction, width)
            text.append(f" {label} {row.load_fraction * 100:3.0f}%", style="yellow")
            return text
        if row.state == "Preparing":
            return Text("preparing…", style="yellow")
        if self.running and row.state in ("Ready", "Executing") and row.counters is not None:
            glyph = SPINNER[row.activity % len(SPINNER)]
            steps = row.counters.steps
            return Text(f"{glyph} {steps} step{'s' if steps != 1 else ''}", style="cyan")
        if row.state == "Ready":
            return Text("loaded", style="green")
        if not row.connected:
            return Text("connecting…", style="grey50")
        if row.state == "Unprovisioned":
            return Text("agent up", style="grey70")
        if row.counters is not None and row.counters.steps:
            return Text(f"{row.counters.steps} steps", style="grey58")
        return Text("")


# ------------------------------------------------------------- the header


@dataclass
class StatusView:
    phase: str = "Connecting"
    run_id: RunId | None = None
    hint: str = ""
    elapsed: float | None = None
    tokens_per_s: float | None = None
    tokens: int | None = None
    last_run: bool = False  # the numbers are those of a finished run
    model: str = ""
    fault: str = ""


class StatusBar(DrawnOnce):
    DEFAULT_CSS = "StatusBar { height: auto; }"

    def __init__(self, id: str | None = None) -> None:
        super().__init__(id=id)
        self.view = StatusView()

    def show(self, view: StatusView) -> None:
        """Draw ``view`` if it changed; a layout pass only when the fault line
        comes or goes (the bar's height)."""
        if view == self.view:
            return
        layout = bool(view.fault) != bool(self.view.fault)
        self.view = view
        self.refresh(layout=layout)

    def content_key(self) -> object:
        return dataclasses.astuple(self.view)

    def draw(self) -> RenderableType:
        view = self.view
        top = Text(no_wrap=True, overflow="ellipsis")
        top.append(f" {view.phase} ", style=PHASE_STYLES.get(view.phase, "reverse"))
        if view.run_id is not None:
            top.append(" run ", style="grey62")
            top.append(f"{view.run_id:016x}", style="bold")
        if view.hint:
            top.append(f"  {view.hint}", style="grey70")
        numbers = Text(justify="right", no_wrap=True)
        if view.elapsed is not None:
            if view.last_run:
                numbers.append("last run ", style="grey62")
            numbers.append(format_seconds(view.elapsed), style="bold")
            numbers.append(" · ", style="grey50")
            numbers.append("-" if not view.tokens_per_s else f"{view.tokens_per_s:.1f}", style="bold")
            numbers.append(" tok/s", style="grey62")
            if view.tokens is not None:
                numbers.append(" · ", style="grey50")
                numbers.append(str(view.tokens), style="bold")
                numbers.append(" tok", style="grey62")
        second = Table.grid(expand=True)
        second.add_column(ratio=1, no_wrap=True, overflow="ellipsis")
        second.add_column(no_wrap=True, justify="right")
        second.add_row(Text(f" {view.model or '…'}", style="grey70"), numbers)
        parts: list[RenderableType] = [top, second]
        if view.fault:
            parts.append(Text(f" ✖ {view.fault}", style="bold red"))
        return Group(*parts)


# -------------------------------------------------------------------- log


class LogPane(RichLog):
    """Agents' stderr and every state change; shows one stage or all."""

    # RichLog sets its virtual size with each line written, and Textual's
    # reactive then lays the whole screen out again (tens of milliseconds,
    # every widget drawn again; a run logs a few dozen lines). The size only
    # moves the log's scrollbar: that is updated here, without a layout pass
    # (one comes when the scrollbar appears, as for the transcript).
    virtual_size: Reactive[Size] = Reactive(Size(0, 0), layout=False)

    def watch_virtual_size(self, size: Size) -> None:
        self._scroll_update(size)

    def __init__(self, id: str | None = None) -> None:
        # min_width=1: wrap to the pane's width (the default, 78, overflows a
        # narrow pane into a horizontal scrollbar).
        super().__init__(wrap=True, markup=False, highlight=False, max_lines=3000, min_width=1, id=id)
        self.entries: deque[tuple[int | None, Text]] = deque(maxlen=5000)
        self.only: int | None = None
        self._wrapped_at = 0

    def on_resize(self, event: Resize) -> None:
        # RichLog wraps a line once, when written: wrap every kept line again
        # for the new width (a resized terminal, the wide layout switching in).
        width = self.scrollable_content_region.width
        if self._wrapped_at and width != self._wrapped_at:
            self.call_after_refresh(self.show_only, self.only)
        self._wrapped_at = width

    def add(self, stage: int | None, line: Text) -> None:
        self.entries.append((stage, line))
        if self.only is None or stage == self.only:
            self.write(line)

    def show_only(self, stage: int | None) -> None:
        self.only = stage
        self.clear()
        for entry_stage, line in self.entries:
            if stage is None or entry_stage == stage:
                self.write(line)


class SteadyFooter(Footer):
    """Textual's footer, except that a key turning on or off (the stop key,
    when a prompt starts and ends) restyles that key instead of composing the
    footer anew: a new footer is a layout pass of the screen, 5-12 ms of CPU
    that landed in the first tenth of a second of every reply, where it is
    taken from the stages on a machine whose cores they fill. A footer whose
    keys changed (another screen's) is composed anew, as Textual does."""

    def bindings_changed(self, screen: Screen[object]) -> None:
        if not (self._bindings_ready and screen.app.app_focus and self.is_attached and screen is self.screen):
            super().bindings_changed(screen)
            return
        enabled: dict[str, bool] = {}
        for _node, binding, on, _tooltip in screen.active_bindings.values():
            if binding.show:
                enabled.setdefault(binding.action, on)
        keys = list(self.query(FooterKey))
        same = [key.action for key in keys] == list(enabled)
        if not same or not all(hasattr(key, "_disabled") for key in keys):
            super().bindings_changed(screen)
            return
        for key in keys:
            disabled = not enabled[key.action]
            if key._disabled != disabled:
                key._disabled = disabled  # what a click on it does (Textual's FooterKey)
                key.set_class(disabled, "-disabled")
