"""What the transcript holds (:mod:`ggufpipe_tui.views.transcript`): its
entries (an exchange of a prompt and its streamed reply, a note) as parts
of text, each wrapped to a width once and kept as lines drawn once.

It renders from the app's plain data (the exchanges of
:mod:`ggufpipe_tui.views.rows`); it does not know the orchestrator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from rich.text import Text
from textual.content import Content
from textual.strip import Strip

from ggufpipe_tui.views.rows import ExchangeView

# Colours as hex: Rich's names (grey50, dodger_blue1) are not Textual's, and
# a style string that reaches Textual's parser (Content.styled, a Text's base
# style through Content.from_rich_text) with one of them is dropped whole:
# the prompt's mark and the placeholders were drawn unstyled.
PROMPT_MARK = "bold #0087ff"  # Rich's dodger_blue1
MUTED_ITALIC = "#7f7f7f italic"  # Rich's grey50


@dataclass(frozen=True)
class Line:
    """One line of the transcript on screen, wrapped and drawn once: its
    strip, and where its text starts in the part it comes from (the source
    line, the character offset in it) for mouse selection."""

    strip: Strip
    source: int
    x: int


class Wraps(Protocol):
    """What wraps a part's text to lines: the transcript, in its styles."""

    def wrap(self, content: Content, style: str, width: int) -> list[Line]: ...


class Part:
    """A run of text in the transcript (a prompt, a reply, a summary, a line
    of its own) and the style it is drawn on, wrapped to a width once, the
    way a Static would draw it."""

    def __init__(self, content: Content, style: str = "") -> None:
        self.content = content
        self.style = style  # a component class of the transcript; "" for its own style
        self._lines: tuple[int, list[Line]] | None = None

    def lines(self, transcript: Wraps, width: int) -> list[Line]:
        if self._lines is None or self._lines[0] != width:
            self._lines = (width, transcript.wrap(self.content, self.style, width))
        return self._lines[1]

    def forget(self) -> None:
        """Wrap again when next drawn (new colours)."""
        self._lines = None

    @property
    def sources(self) -> list[str]:
        """The part's text, one source line (of the selection's) a line break."""
        return self.content.plain.split("\n")


class Reply(Part):
    """A reply as it streams: whole paragraphs are wrapped once, and new text
    re-wraps only the last paragraph."""

    def __init__(self) -> None:
        super().__init__(Content(""))
        self.text = ""
        self._forget(0)

    def _forget(self, width: int) -> None:
        self._width = width
        self._done: list[Line] = []  # the lines of whole paragraphs
        self._start = 0  # where the last paragraph starts in the text
        self._source = 0  # its source line
        self._wrapped = -1  # how much of the text the lines show
        self._lines = None

    def forget(self) -> None:
        self._forget(0)

    def append(self, text: str) -> None:
        self.text += text

    @property
    def sources(self) -> list[str]:
        return self.text.split("\n")

    def lines(self, transcript: Wraps, width: int) -> list[Line]:
        if width != self._width:
            self._forget(width)
        elif self._lines is not None and self._wrapped == len(self.text):
            return self._lines[1]
        head, newline, tail = self.text[self._start :].rpartition("\n")
        if newline:
            for index, paragraph in enumerate(head.split("\n")):
                source = self._source + index
                self._done += [
                    Line(line.strip, source, line.x)
                    for line in transcript.wrap(Content(paragraph), "", width)
                ]
            self._source += head.count("\n") + 1
            self._start += len(head) + 1
        live = [Line(line.strip, self._source, line.x) for line in transcript.wrap(Content(tail), "", width)]
        if not newline and self._lines is not None:
            # The same paragraph grew: its lines drawn as before stay the
            # same objects, so only the lines that changed are repainted.
            before = self._lines[1][len(self._done) :]
            for number, (old, new) in enumerate(zip(before, live, strict=False)):
                if (old.source, old.x) != (new.source, new.x) or old.strip != new.strip:
                    break
                live[number] = old
        self._lines, self._wrapped = (width, self._done + live), len(self.text)
        return self._lines[1]


class Exchange:
    """One prompt, its streamed reply and how the run ended, as lines of the
    transcript: a view of an :class:`~ggufpipe_tui.views.rows.ExchangeView`."""

    def __init__(self, view: ExchangeView) -> None:
        self.view = view
        self._run_id = view.run_id
        self._shown_parts = 0
        self._prompt = Part(Content.from_rich_text(self._prompt_text()))
        self._reply = Reply()
        self._placeholder: Part | None = Part(Content.styled("waiting for the first token…", MUTED_ITALIC))
        self._summary = Part(Content(""), "transcript--summary")
        self._margin = Part(Content(""))

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

    @property
    def shown(self) -> str:
        """The reply as the transcript shows it."""
        return self._reply.text

    def _prompt_text(self) -> Text:
        text = Text()
        text.append("› ", style=PROMPT_MARK)
        text.append(self.view.prompt, style="bold")
        if self.view.run_id is not None:
            text.append(f"  run {self.view.run_id:016x}", style="grey50")
        return text

    def pieces(self) -> list[Part]:
        reply = self._placeholder if self._placeholder is not None else self._reply
        return [self._prompt, reply, self._summary, self._margin]

    def sync(self) -> None:
        """Take what the view gained since the last call (once per frame,
        however many tokens arrived meanwhile)."""
        view = self.view
        if view.run_id != self._run_id:
            self._run_id = view.run_id
            self._prompt = Part(Content.from_rich_text(self._prompt_text()))
        if len(view.parts) != self._shown_parts:
            self._reply.append("".join(view.parts[self._shown_parts :]))
            self._shown_parts = len(view.parts)
            self._placeholder = None
        if view.finished:
            if not view.parts:
                self._placeholder = Part(Content.styled("(no output)", MUTED_ITALIC))
            summary = view.summary or Text("")
            if summary.plain != self._summary.content.plain or summary.spans:
                self._summary = Part(Content.from_rich_text(summary), "transcript--summary")


class Note:
    """A line of the transcript of its own: the welcome, a new conversation's divider."""

    def __init__(self, text: Text | str, style: str = "", kind: str = "") -> None:
        content = Content.from_rich_text(text) if isinstance(text, Text) else Content(text)
        self.kind = kind
        self.text = content.plain
        self._part = Part(content, style)

    def pieces(self) -> list[Part]:
        return [self._part]


Entry = Exchange | Note
