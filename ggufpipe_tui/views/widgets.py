"""The TUI's widgets: the run's status line, the stage table, the transcript
of prompts and replies, and the log pane.

Each widget renders from plain data the app hands it (attributes down: the
rows and exchanges of :mod:`ggufpipe_tui.views.viewstate`); none of them knows
the orchestrator.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from rich.console import Group, RenderableType
from rich.segment import SegmentLines
from rich.table import Table
from rich.text import Text
from textual.containers import Vertical, VerticalScroll
from textual.events import Resize
from textual.geometry import Size
from textual.reactive import Reactive
from textual.widget import Widget
from textual.widgets import RichLog, Static

from ggufpipe_tui.core.placement import MARGIN
from ggufpipe_tui.views.format import delivery_line, format_bytes, format_seconds
from ggufpipe_tui.views.viewstate import PHASE_STYLES, STAGE_STYLES, ExchangeView, StageRow

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

    def render(self) -> RenderableType:
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


class StageTable(DrawnOnce):
    """One row per stage: where it runs, its layers, its FSM state and numbers."""

    DEFAULT_CSS = "StageTable { height: auto; }"

    def __init__(self, rows: list[StageRow], id: str | None = None) -> None:
        super().__init__(id=id)
        self.rows = rows
        self.running = False
        self._shape: tuple[object, ...] = ()

    def show(self, rows: list[StageRow], running: bool) -> None:
        """Draw ``rows``. A layout pass (the whole screen) only when the table's
        height can change: new numbers and the spinner repaint the table alone."""
        shape = tuple(
            (row.state, row.fault, row.connected, row.load_fraction is None)
            + (row.delivery.state if row.delivery else None,)  # a sending line can wrap
            for row in rows
        )
        layout, self._shape = shape != self._shape, shape
        self.rows, self.running = rows, running
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
        table = Table(box=None, expand=compact, padding=(0, 1), pad_edge=False, header_style="bold grey70")
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
        if compact:
            cells.append(f"{counters.last_ms:.0f}/{counters.mean_ms:.0f}")
            cells.append(f"{format_bytes(counters.bytes_in, True)}/{format_bytes(counters.bytes_out, True)}")
        else:
            cells.append(f"{counters.last_ms:.1f} / {counters.mean_ms:.1f}")
            cells.append(format_bytes(counters.bytes_in))
            cells.append(format_bytes(counters.bytes_out))
        return cells

    def _detail(self, row: StageRow, compact: bool) -> RenderableType:
        if row.state in ("Faulted", "Lost"):
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
    run_id: int | None = None
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


# ------------------------------------------------------------- transcript


#: A reply's growing tail asks for a layout pass at most this often (the
#: app's panels are drawn as often, in the same screen update when they fall
#: together). A layout pass of this screen costs tens of milliseconds.
LAYOUT_SECONDS = 1 / 4
#: A reply's live tail is frozen (drawn once, never again) at its last line
#: break once it is this long, or has this many line breaks: each frame
#: re-wraps and draws the whole tail (Textual draws a widget's every line, on
#: screen or not), so a long reply costs no more per frame than a short one.
#: A reply of short lines (a list, code, numbers) reaches the line count long
#: before the length.
FREEZE_CHARS = 1000
FREEZE_LINES = 12


def one_layout_pass() -> Reactive[Size]:
    """A ``virtual_size`` without the layout pass Textual's own asks for.

    Textual sets a widget's virtual size during a layout pass; its reactive
    then asks for a second pass of the whole screen, which finds nothing to
    move. The transcript's widgets grow with every line of a reply, so each
    line paid for two passes (tens of milliseconds each here). The
    transcript's scrollbars are updated in the same pass regardless
    (``Widget._size_updated``)."""
    return Reactive(Size(0, 0), layout=False)


class Block(Static):
    """A part of an exchange: its prompt, a block of reply, its summary."""

    virtual_size = one_layout_pass()


class Exchange(Vertical):
    """One prompt, its streamed reply and how the run ended: a view of an
    :class:`~ggufpipe_tui.views.viewstate.ExchangeView`. The reply is frozen
    blocks of whole lines and one live tail that new text is appended to."""

    DEFAULT_CSS = """
    Exchange { height: auto; margin-bottom: 1; }
    Exchange > Static { height: auto; }
    """

    virtual_size = one_layout_pass()

    def __init__(self, view: ExchangeView) -> None:
        super().__init__()
        self.view = view
        self._run_id = view.run_id
        self._shown_parts = 0
        self._tail = ""
        self._tail_lines = (0, 0)  # (width, wrapped lines) the tail was last laid out with
        self._laid_out = 0.0
        self.stale = False  # the tail grew a line it has no room for yet
        self._prompt = Block(self._prompt_text(), classes="prompt")
        self._reply = Block(Text("waiting for the first token…", style="grey50 italic"), classes="reply")
        self._summary = Block("", classes="summary")

    def compose(self) -> Iterable[Widget]:
        yield self._prompt
        yield self._reply
        yield self._summary

    @property
    def prompt(self) -> str:
        return self.view.prompt

    @property
    def run_id(self) -> int | None:
        return self.view.run_id

    @property
    def parts(self) -> list[str]:
        return self.view.parts

    @property
    def appended_at(self) -> list[float]:
        return self.view.appended_at

    @property
    def finished(self) -> bool:
        return self.view.finished

    @property
    def text(self) -> str:
        return self.view.text

    def _show_tail(self) -> None:
        """The live tail. A layout pass (the whole screen, every widget drawn
        again) only when its wrapped height changed, and at most every
        LAYOUT_SECONDS: meanwhile a new line waits below the tail's old
        height (:meth:`relayout` shows it); text that fills a line repaints
        this one widget at once."""
        text = Text(self._tail)
        width = self._reply.content_region.width
        lines = (width, len(text.wrap(self.app.console, width))) if width > 0 else (0, 0)
        grew = lines != self._tail_lines or not width
        now = time.monotonic()
        layout = grew and now - self._laid_out >= LAYOUT_SECONDS
        self._reply.update(text, layout=layout)
        if layout:
            self._laid_out, self._tail_lines = now, lines
        self.stale = grew and not layout

    def relayout(self) -> None:
        """Give the tail its new height now (a line waited for it)."""
        if self.stale:
            self._laid_out = 0.0
            self._show_tail()

    def _prompt_text(self) -> Text:
        text = Text("› ", style="bold dodger_blue1")
        text.append(self.view.prompt, style="bold")
        if self.view.run_id is not None:
            text.append(f"  run {self.view.run_id:016x}", style="grey50")
        return text

    def sync(self) -> None:
        """Show what the view gained since the last call (once per frame,
        however many tokens arrived meanwhile)."""
        view = self.view
        if view.run_id != self._run_id:
            self._run_id = view.run_id
            self._prompt.update(self._prompt_text())
        if len(view.parts) != self._shown_parts:
            self._tail += "".join(view.parts[self._shown_parts :])
            self._shown_parts = len(view.parts)
            breaks = self._tail.count("\n")
            if breaks and (breaks >= FREEZE_LINES or len(self._tail) > FREEZE_CHARS):
                block, _, self._tail = self._tail.rpartition("\n")
                self.mount(Block(Text(block), classes="reply"), before=self._reply)
                self._tail_lines = (0, 0)
            self._show_tail()
        if view.finished:
            if not view.parts:
                self._reply.update(Text("(no output)", style="grey50 italic"))
            self._summary.update(view.summary or "")


class Transcript(VerticalScroll):
    """The prompts and their replies, newest at the bottom, kept in view."""

    DEFAULT_CSS = "Transcript { height: 1fr; }"

    virtual_size = one_layout_pass()

    def add(self, exchange: Exchange) -> Exchange:
        self.query(".welcome").remove()
        self.mount(exchange)
        self.follow()
        return exchange

    def follow(self) -> None:
        """Keep the newest text in view once it no longer fits. (Anchoring
        earlier would push short content to the bottom of the pane.)"""
        if not self.is_anchored:
            self.call_after_refresh(self._anchor_if_full)

    def _anchor_if_full(self) -> None:
        if not self.is_anchored and self.max_scroll_y > 0:
            self.anchor()


# -------------------------------------------------------------------- log


class LogPane(RichLog):
    """Agents' stderr and every state change; shows one stage or all."""

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
