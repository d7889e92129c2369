"""Tool calls per template family: detection, the streaming parsers on text in
each family's format cut into pieces of every size, and our own templates
rendered and read back (ggufpipe_tui/server/tools)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence

import pytest

from ggufpipe_tui.server.request import CallArguments, CallStart, Piece, Text, Tool
from ggufpipe_tui.server.tools import NAMES, Family, family_for
from tests.support.tool_templates import TEMPLATES

WEATHER = Tool(
    "get_weather",
    "The weather in a city.",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "unit": {"type": "string", "enum": ["c", "f"]},
        },
        "required": ["city"],
    },
)
TIME = Tool("get_time", "The time now.", {"type": "object", "properties": {}})
WRITE = Tool(
    "write",
    "Write a file.",
    {
        "type": "object",
        "properties": {"path": {"type": "string"}, "data": {"type": "object"}},
        "required": ["path"],
    },
)
TOOLS = (WEATHER, TIME, WRITE)
SIZES = (1, 2, 3, 4, 5, 7, 11, 13, 64, 10_000)


def counter() -> Callable[[], str]:
    n = itertools.count()
    return lambda: f"id{next(n)}"


def merged(pieces: Sequence[Piece]) -> list[Piece]:
    """Adjacent Text joined, adjacent arguments of one call joined."""
    out: list[Piece] = []
    for p in pieces:
        last = out[-1] if out else None
        if isinstance(p, Text) and isinstance(last, Text):
            out[-1] = Text(last.text + p.text)
        elif isinstance(p, CallArguments) and isinstance(last, CallArguments) and last.index == p.index:
            out[-1] = CallArguments(p.index, last.arguments + p.arguments)
        elif not (isinstance(p, Text) and not p.text):
            out.append(p)
    return out


def parse(family: Family, text: str, size: int, thinking: bool = False, stream: bool = False) -> list[Piece]:
    parser = family.parser(TOOLS, ids=counter(), thinking=thinking, stream=stream)
    pieces: list[Piece] = []
    for i in range(0, len(text), size):
        pieces += parser.feed(text[i : i + size])
    return merged(pieces + parser.close())


def family(key: str) -> Family:
    return family_for(TEMPLATES[key][0])


def expect(*items: tuple[str, ...]) -> list[Piece]:
    """("text", s) or ("call", name, arguments-json[, id]) in order."""
    out: list[Piece] = []
    ids = counter()
    index = 0
    for item in items:
        if item[0] == "text":
            out.append(Text(item[1]))
        else:
            call_id = item[3] if len(item) > 3 else ids()  # the model's own id, or the next made
            out += [CallStart(index, call_id, item[1]), CallArguments(index, item[2])]
            index += 1
    return out


PARIS = '{"city":"Paris"}'
TRICKY = '{"path":"a\\"b </tool_call> <tool_call> [TOOL_CALLS] }","data":{"k":[1,{"x":"}"}]}}'
TRICKY_IN = '{"path": "a\\"b </tool_call> <tool_call> [TOOL_CALLS] }", "data": {"k": [1, {"x": "}"}]}}'

H1 = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
H2 = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
Q1 = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
Q2 = "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
G1 = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
K_CALL = "<|tool_call_begin|>functions.{}:{}<|tool_call_argument_begin|>{}<|tool_call_end|>"
K_SEC = "<|tool_calls_section_begin|>{}<|tool_calls_section_end|>"
D_CALL = "<｜tool▁call▁begin｜>{}<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
D_SEC = "<｜tool▁calls▁begin｜>{}<｜tool▁calls▁end｜>"
R1_CALL = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{}\n```json\n{}\n```<｜tool▁call▁end｜>"
HARMONY_CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.{} <|constrain|>json<|message|>{}<|call|>"
)

#: (id, family key, model text, the pieces it must give)
CASES: list[tuple[str, str, str, list[Piece]]] = [
    # hermes
    ("hermes-one", "hermes", H1, expect(("call", "get_weather", PARIS))),
    (
        "hermes-two",
        "hermes",
        H1 + "\n" + H2,
        expect(("call", "get_weather", PARIS), ("call", "get_time", "{}")),
    ),
    (
        "hermes-after-text",
        "hermes",
        "Let me look.\n" + H1,
        expect(("text", "Let me look.\n"), ("call", "get_weather", PARIS)),
    ),
    (
        "hermes-text",
        "hermes",
        "Sunny, 20°C. A <tool_ is no call",
        expect(("text", "Sunny, 20°C. A <tool_ is no call")),
    ),
    (
        "hermes-tricky",
        "hermes",
        '<tool_call>{"name": "write", "arguments": ' + TRICKY_IN + "}</tool_call>",
        expect(("call", "write", TRICKY)),
    ),
    (
        "hermes-think",
        "hermes",
        "<think>maybe <tool_call> here</think>\n\n" + H1,
        expect(("text", "<think>maybe <tool_call> here</think>\n\n"), ("call", "get_weather", PARIS)),
    ),
    ("hermes-unclosed", "hermes", H2[: -len("</tool_call>")], expect(("call", "get_time", "{}"))),
    (
        "hermes-cut",
        "hermes",
        '<tool_call>{"name": "get_time", "argu',
        expect(("text", '<tool_call>{"name": "get_time", "argu')),
    ),
    (
        "hermes-broken",
        "hermes",
        "<tool_call>{name}</tool_call> ok",
        expect(("text", "<tool_call>{name}</tool_call> ok")),
    ),
    (
        "hermes-string-args",
        "hermes",
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>',
        expect(("call", "get_weather", PARIS)),
    ),
    # qwen3-coder
    ("qwen3-one", "qwen3-coder", Q1, expect(("call", "get_weather", '{"city":"Paris","days":3}'))),
    (
        "qwen3-two",
        "qwen3-coder",
        "Checking.\n" + Q1 + "\n" + Q2,
        expect(
            ("text", "Checking.\n"),
            ("call", "get_weather", '{"city":"Paris","days":3}'),
            ("call", "get_time", "{}"),
        ),
    ),
    (
        "qwen3-tricky",
        "qwen3-coder",
        '<tool_call>\n<function=write>\n<parameter=path>\na</parameter>b "q" <tool_call>\n</parameter>\n'
        '<parameter=data>\n{"k": [1, {"x": "}"}]}\n</parameter>\n</function>\n</tool_call>',
        expect(("call", "write", '{"path":"a</parameter>b \\"q\\" <tool_call>","data":{"k":[1,{"x":"}"}]}}')),
    ),
    ("qwen3-text", "qwen3-coder", "No call <function=x> here", expect(("text", "No call <function=x> here"))),
    # glm
    ("glm-one", "glm", G1, expect(("call", "get_weather", '{"city":"Paris","days":3}'))),
    (
        "glm-two",
        "glm",
        "<think>plan</think>" + G1 + "\n<tool_call>get_time\n</tool_call>",
        expect(
            ("text", "<think>plan</think>"),
            ("call", "get_weather", '{"city":"Paris","days":3}'),
            ("call", "get_time", "{}"),
        ),
    ),
    (
        "glm-tricky",
        "glm",
        '<tool_call>write\n<arg_key>path</arg_key>\n<arg_value>x</arg_value> "y"</arg_value>\n<arg_key>data</arg_key>\n<arg_value>{"k": [1, {"x": "}"}]}</arg_value>\n</tool_call>',
        expect(("call", "write", '{"path":"x</arg_value> \\"y\\"","data":{"k":[1,{"x":"}"}]}}')),
    ),
    ("glm-text", "glm", "plain answer", expect(("text", "plain answer"))),
    # minimax
    (
        "minimax-two",
        "minimax",
        'Sure.<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
        '<parameter name="days">3</parameter>\n</invoke>\n<invoke name="get_time">\n</invoke>\n</minimax:tool_call>',
        expect(
            ("text", "Sure."),
            ("call", "get_weather", '{"city":"Paris","days":3}'),
            ("call", "get_time", "{}"),
        ),
    ),
    (
        "minimax-tricky",
        "minimax",
        '<minimax:tool_call><invoke name="write"><parameter name="path">a</parameter> "b"</parameter>'
        '<parameter name="data">{"k": [1, {"x": "}"}]}</parameter></invoke></minimax:tool_call>',
        expect(("call", "write", '{"path":"a</parameter> \\"b\\"","data":{"k":[1,{"x":"}"}]}}')),
    ),
    # kimi
    (
        "kimi-two",
        "kimi",
        "On it."
        + K_SEC.format(
            K_CALL.format("get_weather", 0, '{"city": "Paris"}') + K_CALL.format("get_time", 1, "{}")
        ),
        expect(
            ("text", "On it."),
            ("call", "get_weather", PARIS, "functions.get_weather:0"),
            ("call", "get_time", "{}", "functions.get_time:1"),
        ),
    ),
    (
        "kimi-tricky",
        "kimi",
        K_SEC.format(K_CALL.format("write", 3, TRICKY_IN)),
        expect(("call", "write", TRICKY, "functions.write:3")),
    ),
    (
        "kimi-bare",
        "kimi",
        K_CALL.format("get_time", 0, "{}"),
        expect(("call", "get_time", "{}", "functions.get_time:0")),
    ),
    (
        "kimi-spaced",
        "kimi",
        "Checking.\n\n<|tool_calls_section_begin|>\n<|tool_call_begin|>\nfunctions.get_weather:0 <|tool_call_argument_begin|>\n"
        '{"city": "Paris"}\n<|tool_call_end|>\n<|tool_calls_section_end|>\n\nDone soon.',
        expect(
            ("text", "Checking.\n\n"),
            ("call", "get_weather", PARIS, "functions.get_weather:0"),
            ("text", "Done soon."),
        ),
    ),
    # deepseek
    (
        "deepseek-v31",
        "deepseek-v31",
        "<think>hm</think>"
        + D_SEC.format(D_CALL.format("get_weather", '{"city": "Paris"}') + D_CALL.format("get_time", "{}")),
        expect(("text", "<think>hm</think>"), ("call", "get_weather", PARIS), ("call", "get_time", "{}")),
    ),
    (
        "deepseek-r1",
        "deepseek-r1",
        "Ok. " + D_SEC.format(R1_CALL.format("write", TRICKY_IN)),
        expect(("text", "Ok. "), ("call", "write", TRICKY)),
    ),
    # mistral
    (
        "mistral-list",
        "mistral-list",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcDEF123"}, {"name": "get_time", "arguments": {}}]',
        expect(("call", "get_weather", PARIS, "abcDEF123"), ("call", "get_time", "{}", "id0")),
    ),
    (
        "mistral-args",
        "mistral-args",
        'Hm. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]write[ARGS]' + TRICKY_IN,
        expect(("text", "Hm. "), ("call", "get_weather", PARIS), ("call", "write", TRICKY)),
    ),
    (
        "mistral-call-id",
        "mistral-call-id",
        '[TOOL_CALLS]get_weather[CALL_ID]abcDEF123[ARGS]{"city": "Paris"}',
        expect(("call", "get_weather", PARIS, "abcDEF123")),
    ),
    (
        "mistral-think",
        "mistral-args",
        "[THINK]a [TOOL_CALLS] b[/THINK]ok",
        expect(("text", "[THINK]a [TOOL_CALLS] b[/THINK]ok")),
    ),
    ("mistral-not", "mistral-args", "[TOOL_CALLS] so what", expect(("text", "[TOOL_CALLS] so what"))),
    # llama3
    (
        "llama3-one",
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        expect(("call", "get_weather", PARIS)),
    ),
    (
        "llama3-two",
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"type": "function", "name": "write", "parameters": '
        + TRICKY_IN
        + "}",
        expect(("call", "get_weather", PARIS), ("call", "write", TRICKY)),
    ),
    (
        "llama3-python",
        "llama3",
        '<|python_tag|>brave_search.call(query="weather \\"Paris\\"")',
        expect(("call", "brave_search", '{"query":"weather \\"Paris\\""}')),
    ),
    ("llama3-json-answer", "llama3", '{"answer": 42}', expect(("text", '{"answer": 42}'))),
    (
        "llama3-text",
        "llama3",
        'Hello {"name": "get_time", "parameters": {}}',
        expect(("text", 'Hello {"name": "get_time", "parameters": {}}')),
    ),
    # harmony
    (
        "harmony-call",
        "harmony",
        "<|channel|>analysis<|message|>Need the weather.<|end|>"
        + HARMONY_CALL.format("get_weather", '{"city": "Paris"}'),
        expect(("call", "get_weather", PARIS)),
    ),
    (
        "harmony-final",
        "harmony",
        "<|channel|>analysis<|message|>think <|channel|> hard<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>",
        expect(("text", "It is sunny.")),
    ),
    (
        "harmony-preamble",
        "harmony",
        "<|channel|>commentary<|message|>Checking.<|end|>" + HARMONY_CALL.format("write", TRICKY_IN),
        expect(("text", "Checking."), ("call", "write", TRICKY)),
    ),
    (
        "harmony-role-recipient",
        "harmony",
        " to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>",
        expect(("call", "get_time", "{}")),
    ),
    ("harmony-plain", "harmony", "no channels at all", expect(("text", "no channels at all"))),
    # generic
    (
        "generic-call",
        "plain",
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "write", "arguments": '
        + TRICKY_IN
        + "}]}",
        expect(("call", "get_weather", PARIS), ("call", "write", TRICKY)),
    ),
    ("generic-answer", "plain", '{"response": "Hi \\"there\\" {"}', expect(("text", 'Hi "there" {'))),
    ("generic-text", "plain", "just text", expect(("text", "just text"))),
    (
        "generic-escapes",
        "plain",
        '  { "response" : "caf\\u00e9 \\ud83d\\ude00\\n\\\\ \\/"}',
        expect(("text", "café 😀\n\\ /")),
    ),
    ("generic-response-later", "plain", '{"note": "x", "response": "hi"}', expect(("text", "hi"))),
    (
        "qwen3-bare-function",
        "qwen3-coder",
        "Try <function=x> then <function=get_time>\n</function>",
        expect(("text", "Try <function=x> then "), ("call", "get_time", "{}")),
    ),
]


@pytest.mark.parametrize(("key", "text", "want"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_parser_gives_the_same_pieces_however_the_text_is_cut(
    key: str, text: str, want: list[Piece], size: int, stream: bool
) -> None:
    assert parse(family(key), text, size, stream=stream) == want


@pytest.mark.parametrize("size", SIZES)
def test_a_reply_that_starts_inside_reasoning_finds_no_call_there(size: int) -> None:
    text = "plan: <tool_call> maybe</think>" + H1
    assert parse(family("hermes"), text, size, thinking=True) == [
        Text("plan: <tool_call> maybe</think>"),
        *expect(("call", "get_weather", PARIS))[:2],
    ]


# ------------------------------------------------------------- detection


@pytest.mark.parametrize("key", sorted(TEMPLATES))
def test_each_template_is_recognised_as_its_family(key: str) -> None:
    template, name = TEMPLATES[key]
    found = family_for(template)
    assert found.name == name
    assert found.native == (name != "generic")
    assert found.name in NAMES


def test_a_template_with_tools_in_an_unknown_form_gets_the_generic_family() -> None:
    assert family_for("{% for t in tools %}{{ t }}{% endfor %}{{ messages }}").name == "generic"


def test_variants_follow_the_template() -> None:
    assert "```json" in family("deepseek-r1").call_grammar([WEATHER])
    assert "```json" not in family("deepseek-v31").call_grammar([WEATHER])
    assert "[CALL_ID]" in family("mistral-call-id").call_grammar([WEATHER])
    assert '\\"id\\": ' in family("mistral-list").call_grammar([WEATHER])


def test_a_prompt_that_opens_reasoning_is_told() -> None:
    assert family("deepseek-r1").opens_reasoning("...<｜Assistant｜><think>\n")
    assert not family("deepseek-r1").opens_reasoning("...<｜Assistant｜>")
    assert family("mistral-args").opens_reasoning("[INST]hi[/INST][THINK]")
    assert not family("harmony").opens_reasoning("<think>")


def test_mistral_ids_are_nine_letters_and_digits() -> None:
    call_id = family("mistral-args").new_id()
    assert len(call_id) == 9 and call_id.isalnum()
    assert family("hermes").new_id().startswith("call_")


def test_the_generic_system_prompt_describes_the_tools_and_the_answer() -> None:
    generic = family("plain")
    auto = generic.system_prompt(TOOLS, "auto")
    assert all(t.name in auto and t.description in auto for t in TOOLS)
    assert '"response"' in auto and '"tool_calls"' in auto and '"city"' in auto
    required = generic.system_prompt(TOOLS, "required", parallel=False)
    assert "You must call one tool" in required and '"response"' not in required
    assert "You must call the tool get_time" in generic.system_prompt(TOOLS, "function", "get_time")
    assert generic.system_prompt(TOOLS, "none") == ""
    assert family("hermes").system_prompt(TOOLS) == ""


LONG = '{"path": "notes.txt", "data": {"text": "' + "many words " * 20 + '"}}'
STREAMED = {
    "hermes": '<tool_call>\n{"name": "write", "arguments": ' + LONG + "}\n</tool_call>",
    "llama3": '{"name": "write", "parameters": ' + LONG + "}",
    "kimi": K_SEC.format(K_CALL.format("write", 0, LONG)),
    "deepseek-r1": D_SEC.format(R1_CALL.format("write", LONG)),
    "deepseek-v31": D_SEC.format(D_CALL.format("write", LONG)),
    "mistral-args": "[TOOL_CALLS]write[ARGS]" + LONG,
    "harmony": HARMONY_CALL.format("write", LONG),
}


@pytest.mark.parametrize("key", sorted(STREAMED))
def test_streamed_arguments_come_as_they_are_generated(key: str) -> None:
    text = STREAMED[key]
    parser = family(key).parser(TOOLS, ids=counter(), stream=True)
    seen: list[list[Piece]] = [parser.feed(text[i : i + 4]) for i in range(0, len(text), 4)]
    seen.append(parser.close())
    started = next(i for i, ps in enumerate(seen) if any(isinstance(p, CallStart) for p in ps))
    done = max(i for i, ps in enumerate(seen) if any(isinstance(p, CallArguments) for p in ps))
    assert done - started > 20, "the arguments came in many pieces"
    args = "".join(p.arguments for ps in seen for p in ps if isinstance(p, CallArguments))
    assert args == json.dumps(json.loads(LONG), separators=(",", ":"))
    own = ("functions.write:0",) if key == "kimi" else ()
    assert merged([p for ps in seen for p in ps]) == expect(("call", "write", args, *own))


def test_a_streamed_call_cut_off_stays_as_far_as_it_came() -> None:
    cut = '<tool_call>\n{"name": "write", "arguments": {"path": "a b'
    assert parse(family("hermes"), cut, 3, stream=True) == [
        CallStart(0, "id0", "write"),
        CallArguments(0, '{"path":"a b'),
    ]
    assert parse(family("hermes"), cut, 3) == [Text(cut)]
