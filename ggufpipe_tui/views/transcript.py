"""The transcript: prompts, replies and notes in one line-API widget
(:class:`Transcript`, a ScrollView drawing lines wrapped once), so streaming
text repaints the lines it changed and never lays the screen out again.

It renders from the app's plain data (the exchanges of
:mod:`ggufpipe_tui.views.viewstate`); it does not know the orchestrator.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.content import Content
from textual.events import Resize
from textual.geometry import Size
from textual.reactive import Reactive
from textual.scroll_view import ScrollView
from textual.selection import Selection
from textual.strip import Strip
from textual.visual import RenderOptions

from ggufpipe_tui.views.entries import Entry, Exchange, Line, Note

#: While a reply streams and the view follows it, the text that runs past the
#: bottom scrolls the view by this share of its height at once (as xterm's
#: jump scroll): a scroll repaints the whole transcript and its scrollbar, a
#: new line below the last one only that line, so most frames draw a line or
#: two and a whole repaint comes once a block, not with every line. When the
#: run ends the text settles at the bottom again.
JUMP = 1 / 2


def _offset(strip: Strip) -> tuple[int, int]:
    for segment in strip:
        style = segment.style
        if style is not None and style._meta:
            offset = style.meta.get("offset")
            if offset is not None:
                return offset[1], offset[0]
    return -1, 0


class Transcript(ScrollView, can_focus=False):
    """The prompts and their replies, newest at the bottom, kept in view.

    One widget draws every line through the line API (``render_line``) from
    lines wrapped once: streamed text changes neither the screen's layout nor
    the lines above it. New text re-wraps the reply's last paragraph and
    repaints the lines that changed; a taller transcript changes its
    scrollbar, not the screen (a layout pass of this screen costs tens of
    milliseconds and draws every widget on it again). The view follows the
    newest text while it is at the bottom; scrolled up, it stays. Text can be
    selected with the mouse and copied, as in a Static."""

    ALLOW_SELECT = True
    COMPONENT_CLASSES = {"transcript--muted", "transcript--summary"}
    DEFAULT_CSS = """
    Transcript { height: 1fr; overflow-x: hidden; }
    Transcript > .transcript--muted { color: $text-muted; }
    Transcript > .transcript--summary { color: $text-muted; }
    """

    # Set by the transcript itself (:meth:`update`): Textual's reactive asks
    # for a layout pass of the whole screen on each change, i.e. each new line.
    virtual_size: Reactive[Size] = Reactive(Size(0, 0), layout=False, repaint=False)

    def __init__(self, welcome: str = "", id: str | None = None) -> None:
        super().__init__(id=id)
        self.entries: list[Entry] = []
        if welcome:
            self.entries.append(Note(welcome, "transcript--muted", kind="welcome"))
        self._width = 0
        self._height = 0  # lines of text
        self._virtual = 0  # lines scrolled over: the text and, while following a reply, room below it
        # Per entry: its first line and first source line (for selection),
        # and its parts as (first line, first source line, lines), all
        # relative to the entry.
        self._starts: list[int] = []
        self._sources: list[int] = []
        self._parts: list[list[tuple[int, int, list[Line]]]] = []
        self._laid: dict[int, int] = {}  # id(entry) -> its index in the lists above
        self._rewrapping = False
        self._blank: Strip | None = None  # a line below the text

    # ------------------------------------------------------------ content

    @property
    def exchanges(self) -> list[Exchange]:
        return [entry for entry in self.entries if isinstance(entry, Exchange)]

    def notes(self, kind: str) -> list[Note]:
        return [entry for entry in self.entries if isinstance(entry, Note) and entry.kind == kind]

    def add(self, exchange: Exchange) -> Exchange:
        self._drop_welcome()
        self.entries.append(exchange)
        self.update([exchange])
        return exchange

    def divide(self, text: Text) -> None:
        """A line across the transcript: a new conversation starts below it."""
        self._drop_welcome()
        note = Note(text, kind="divider")
        self.entries.append(note)
        self.update([note])

    def discard(self, exchange: Exchange) -> None:
        """An exchange scrolled out of a long session."""
        if exchange in self.entries:
            self.entries.remove(exchange)
            self.update(everything=True)

    def _drop_welcome(self) -> None:
        welcome = self.notes("welcome")
        if welcome:
            self.entries = [entry for entry in self.entries if entry not in welcome]
            self._width = 0  # everything moves up: lay it all out again

    # ----------------------------------------------------------- wrapping

    def wrap(self, content: Content, style: str, width: int) -> list[Line]:
        """``content`` wrapped to ``width`` as a Static draws it."""
        visual_style = self.get_visual_style(style) if style else self.visual_style
        options = RenderOptions(self._get_style, self.styles)  # type: ignore[arg-type]  # as Textual's own
        strips = content.render_strips(width, None, visual_style, options) or [Strip([])]
        lines: list[Line] = []
        for strip in strips:
            source, x = _offset(strip)
            if source < 0:  # nothing says where it is: the next source line
                source, x = (lines[-1].source + 1 if lines else 0), 0
            lines.append(Line(strip, source, x))
        return lines

    def _layout(self, entry: Entry, width: int) -> list[tuple[int, int, list[Line]]]:
        parts = []
        line = source = 0
        for part in entry.pieces():
            lines = part.lines(self, width)
            parts.append((line, source, lines))
            line += len(lines)
            source += len(part.sources)
        return parts

    def update(
        self, changed: Iterable[Entry] = (), everything: bool = False, follow: bool | None = None
    ) -> None:
        """Lay out the ``changed`` entries again (after their ``sync``), or
        all of them: only lines that changed are repainted; a new height
        changes the scrollbar and, while following the newest text, the
        scroll position."""
        width = self.scrollable_content_region.width
        if width <= 0:
            return  # not laid out yet: on_resize lays the lines out
        if follow is None:
            follow = self.is_vertical_scroll_end and not self.is_vertical_scrollbar_grabbed
        first_changed = None
        added = [entry for entry in changed if id(entry) not in self._laid]
        if everything or width != self._width or any(entry is not self.entries[-1] for entry in added):
            self._width = width
            self._parts = [self._layout(entry, width) for entry in self.entries]
            self._laid = {id(entry): index for index, entry in enumerate(self.entries)}
            first_changed = 0
        for entry in changed:
            index = self._laid.get(id(entry))
            first: int | None = 0
            if index is None:  # new, at the end
                index = self._laid[id(entry)] = len(self._parts)
                self._parts.append(self._layout(entry, width))
            elif first_changed == 0:
                continue
            else:
                before, after = self._parts[index], self._layout(entry, width)
                self._parts[index] = after
                first = _first_change(before, after)
            if first is None:
                continue
            line = self._starts[index] if index < len(self._starts) else self._height
            first_changed = line + first if first_changed is None else min(first_changed, line + first)
        if first_changed is None:
            return
        self._starts, self._sources = [], []
        line = source = 0
        for parts in self._parts:
            self._starts.append(line)
            self._sources.append(source)
            if parts:
                start, source_start, lines = parts[-1]
                line += start + len(lines)
                source += source_start + (lines[-1].source + 1 if lines else 1)
        old_height, self._height = self._height, line
        virtual = self._virtual_height(line, follow, everything or first_changed == 0)
        if virtual != self.virtual_size.height:  # the scrollbar moves (a repaint of it): only then
            self._virtual = virtual
            self.set_reactive(Transcript.virtual_size, Size(0, virtual))  # wrapped: never wider
            self._scroll_update(self.virtual_size)
            if self.scrollable_content_region.width != width and not self._rewrapping:
                self._rewrapping = True  # the scrollbar came or went: wrap to the new width
                try:
                    self.update(everything=True, follow=follow)
                finally:
                    self._rewrapping = False
                return
        if follow and self.max_scroll_y > self.scroll_y:
            self.scroll_to(y=self.max_scroll_y, animate=False, immediate=True)  # repaints it all
        else:
            # The lines from the first that changed to the last that was or
            # is there (not the blank ones below), on screen.
            top = self.scroll_offset.y
            bottom = min(top + self.scrollable_content_region.height, max(old_height, line))
            first = max(first_changed, top)
            if bottom > first:
                self.refresh_lines(first, bottom - first)

    def _virtual_height(self, lines: int, follow: bool, anew: bool) -> int:
        """How many lines the view scrolls over for ``lines`` of text: while
        following a reply that streams, text past the bottom makes room of
        :data:`JUMP` of the view below it; following once the reply has
        ended, the text alone (its end at the bottom); scrolled up, the room
        stays until the view follows again (``anew``: laid out again, none kept)."""
        kept = 0 if anew else self._virtual
        height = self.scrollable_content_region.height
        if not follow or height <= 0:
            return max(lines, kept)
        last = self.entries[-1] if self.entries else None
        if not isinstance(last, Exchange) or last.finished:
            return lines
        if lines > self.scroll_offset.y + height:  # past the bottom: a jump
            return lines + max(1, min(height - 1, round(height * JUMP)))
        return max(lines, kept)

    def on_resize(self, event: Resize) -> None:
        self.update(everything=True)

    @property
    def line_texts(self) -> list[str]:
        """The text of every line as laid out (for tests)."""
        return [line.strip.text for parts in self._parts for _, _, lines in parts for line in lines]

    # ------------------------------------------------------------- drawing

    def render_line(self, y: int) -> Strip:
        number = self.scroll_offset.y + y
        if number >= self._height or not self._starts:
            width = self.scrollable_content_region.width
            if self._blank is None or self._blank.cell_length != width:
                self._blank = Strip.blank(width, self.visual_style.rich_style)
            return self._blank
        index = bisect.bisect_right(self._starts, number) - 1
        within = number - self._starts[index]
        for start, source_start, lines in reversed(self._parts[index]):
            if within >= start:
                line = lines[within - start]
                source = self._sources[index] + source_start + line.source
                break
        strip = line.strip
        selection = self.text_selection
        if selection is not None and (span := selection.get_span(source)) is not None:
            style = self.screen.get_component_rich_style("screen--selection")
            end = None if span[1] == -1 else span[1] - line.x
            strip = _select(strip, span[0] - line.x, end, style)
        return strip.apply_offsets(line.x, source)

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._blank = None
        for entry in self.entries:  # new colours: every part is drawn again
            for part in entry.pieces():
                part.forget()
        if self.is_mounted:
            self.update(everything=True)
            self.refresh()

    # ----------------------------------------------------------- selection

    def get_selection(self, selection: Selection) -> tuple[str, str] | None:
        sources: list[str] = []
        for entry in self.entries:
            for part in entry.pieces():
                sources += part.sources
        return selection.extract("\n".join(sources)), "\n"

    def selection_updated(self, selection: Selection | None) -> None:
        self.refresh()


def _first_change(
    old: list[tuple[int, int, list[Line]]], new: list[tuple[int, int, list[Line]]]
) -> int | None:
    """The first line of an entry that is drawn differently, None for none."""
    for (start, _, before), (new_start, _, after) in zip(old, new, strict=False):
        if start != new_start:
            return min(start, new_start)
        if before is after:
            continue
        for number, (a, b) in enumerate(zip(before, after, strict=False)):
            if a.strip is not b.strip:
                return start + number
        if len(before) != len(after):
            return start + min(len(before), len(after))
    if len(old) != len(new):
        return 0
    return None


def _select(strip: Strip, start: int, end: int | None, style: Style) -> Strip:
    """``strip`` with the characters ``start`` to ``end`` (None: the end) in ``style``."""
    start = max(start, 0)
    if end is not None and end <= start:
        return strip
    segments: list[Segment] = []
    position = 0
    for segment in strip:
        text, seg_style, control = segment
        stop = position + len(text)
        a, b = max(start - position, 0), len(text) if end is None else min(end - position, len(text))
        if control or a >= b or stop <= start:
            segments.append(segment)
        else:
            if a:
                segments.append(Segment(text[:a], seg_style))
            segments.append(Segment(text[a:b], (seg_style or Style()) + style))
            if b < len(text):
                segments.append(Segment(text[b:], seg_style))
        position = stop
    return Strip(segments, strip.cell_length)
