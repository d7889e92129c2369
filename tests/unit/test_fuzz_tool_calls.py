"""Generated calls of every family, with any text in their string arguments
(markers, quotes, backslashes, braces), cut at random places: the parser
gives back exactly the calls and the text before them."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggufpipe_tui.server.request import CallArguments, CallStart, Piece, Text
from ggufpipe_tui.server.tools import family_for
from tests.support.tool_templates import TEMPLATES
from tests.unit.test_tool_calls import TOOLS, counter, merged
from tests.unit.test_tool_grammars import write

XML = ("qwen3-coder", "glm", "minimax")
#: families whose calls may follow text (the others' calls open the reply)
AFTER_TEXT = (
    "hermes",
    "qwen3-coder",
    "glm",
    "minimax",
    "kimi",
    "deepseek-v31",
    "deepseek-r1",
    "mistral-args",
    "mistral-list",
)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
ANY_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)
#: XML values: no "<" (a closing tag in a value is read as its end), no edge newlines
XML_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="<"), max_size=30).map(
    lambda s: s.strip("\n")
)
PROSE = st.text(
    st.characters(whitelist_categories=("L", "N", "Zs"), whitelist_characters=".,!?'"), max_size=20
)


def call(key: str) -> st.SearchStrategy[tuple[str, dict[str, Any]]]:
    text = XML_TEXT if key in XML else ANY_TEXT
    write_args = st.fixed_dictionaries(
        {"path": text}, optional={"data": st.dictionaries(st.text(max_size=5), JSON_VALUES, max_size=3)}
    )
    weather = st.fixed_dictionaries({"city": text}, optional={"days": st.integers(0, 30)})
    return st.one_of(
        st.tuples(st.just("write"), write_args),
        st.tuples(st.just("get_weather"), weather),
        st.just(("get_time", {})),
    )


@st.composite
def replies(draw: st.DrawFn) -> tuple[str, str, str, list[tuple[str, dict[str, Any]]], list[int], bool]:
    key = draw(st.sampled_from(sorted(k for k in TEMPLATES if k != "mistral-call-id")))
    many = key not in ("harmony", "plain", "mistral-call-id")
    calls = draw(st.lists(call(key), min_size=1, max_size=3 if many else 1))
    if key == "plain":
        calls = draw(st.lists(call(key), min_size=1, max_size=3))
    prose = draw(PROSE) if key in AFTER_TEXT else ""
    if prose.strip() == "":
        prose = ""
    cuts = draw(st.lists(st.integers(1, 9), min_size=1, max_size=6))
    return key, prose, prose + write(key, *calls), calls, cuts, draw(st.booleans())


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(replies())
def test_generated_calls_come_back_whatever_the_cuts(
    reply: tuple[str, str, str, list[tuple[str, dict[str, Any]]], list[int], bool],
) -> None:
    key, prose, text, calls, cuts, stream = reply
    parser = family_for(TEMPLATES[key][0]).parser(TOOLS, ids=counter(), stream=stream)
    pieces: list[Piece] = []
    i = n = 0
    while i < len(text):
        size = cuts[n % len(cuts)]
        pieces += parser.feed(text[i : i + size])
        i, n = i + size, n + 1
    got = merged(pieces + parser.close())
    texts = [p.text for p in got if isinstance(p, Text)]
    assert texts == ([prose] if prose else [])
    assert [p.name for p in got if isinstance(p, CallStart)] == [name for name, _ in calls]
    assert [json.loads(p.arguments) for p in got if isinstance(p, CallArguments)] == [
        args for _, args in calls
    ]
