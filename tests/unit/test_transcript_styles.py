"""The transcript's own style strings reach Textual's style parser, which
knows fewer colour names than Rich: one it cannot parse drops the style."""

from __future__ import annotations

from rich.text import Text
from textual.content import Content
from textual.style import Style

from ggufpipe_tui.views.entries import MUTED_ITALIC, PROMPT_MARK


def test_the_transcripts_styles_parse_in_textual():
    for style in (PROMPT_MARK, MUTED_ITALIC):
        Style.parse(style)  # raises on a colour name Textual does not know
    [mark] = list(Content.from_rich_text(Text("› ", style=PROMPT_MARK)).render_segments())
    assert mark.style is not None and mark.style.bold
    [placeholder] = list(Content.styled("waiting", MUTED_ITALIC).render_segments())
    assert placeholder.style is not None and placeholder.style.italic
