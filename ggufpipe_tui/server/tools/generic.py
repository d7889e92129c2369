"""The generic form, for a template that knows no tools: the tools are
described in a system message and the model answers with one JSON object,
``{"tool_calls": [{"name": ..., "arguments": {...}}]}`` to call tools or
``{"response": "..."}`` to answer (as llama.cpp's generic format). The
parser takes the object whole once it closes (so an answer comes at the
end, not streamed); a reply that is not such an object is Text."""

from __future__ import annotations

import json
from collections.abc import Sequence

from ggufpipe_tui.server.request import Tool
from ggufpipe_tui.server.tools.base import (
    Call,
    Family,
    IdFactory,
    MarkupParser,
    NoMatch,
    Parser,
    Region,
    Scan,
    Syntax,
    arguments_object,
)
from ggufpipe_tui.server.tools.grammar import Gbnf, alternatives, choose, literal, tool_schema


class GenericSyntax(Syntax):
    json_start = True
    think = None
    answer: str | None = None

    def region(self, buf: str, start: int, final: bool) -> Region | None:
        region = super().region(buf, start, final)
        if region is not None and region.calls is not None and region.text is None:
            region = Region(region.end, region.calls, self.answer)
        return region

    def read(self, scan: Scan) -> list[Call]:
        self.answer = None
        obj = scan.json()
        if not isinstance(obj, dict):
            raise NoMatch
        items = obj.get("tool_calls")
        if items is None and "tool_call" in obj:
            items = [obj["tool_call"]]
        if items is None:
            if not isinstance(obj.get("response"), str):
                raise NoMatch
            self.answer = obj["response"]
            return []
        if not isinstance(items, list):
            raise NoMatch
        calls = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                raise NoMatch
            calls.append(Call(item["name"], arguments_object(item.get("arguments"))))
        return calls


def system_prompt(tools: Sequence[Tool], tool_choice: str = "auto") -> str:
    """The tools and how to answer, for a system message."""
    listed = [{"name": t.name, "description": t.description, "parameters": tool_schema(t)} for t in tools]
    call = '{"tool_calls": [{"name": "<tool name>", "arguments": {<its arguments>}}]}'
    lines = [
        "You can call these tools (each with its JSON schema of arguments):",
        json.dumps(listed, ensure_ascii=False, indent=2),
        "",
    ]
    if tool_choice == "auto":
        lines.append(
            "Reply with one JSON object and nothing else: either "
            f"{call} to call one or more tools, or "
            '{"response": "<your answer>"} to answer the user directly.'
        )
    else:
        which = "one or more of the tools" if tool_choice == "required" else f"the tool {tool_choice}"
        lines.append(f"You must call {which}. Reply with one JSON object and nothing else: {call}")
    return "\n".join(lines)


def _calls(g: Gbnf, tools: Sequence[Tool], name: str | None, parallel: bool) -> str:
    calls = []
    for i, tool in choose(tools, name):
        head = literal('{"name": ' + json.dumps(tool.name) + ', "arguments": ')
        calls.append(g.rule(f"call-{i}", f'{head} {g.arguments(tool, i)} "}}" space'))
    call = alternatives(g, calls)
    items = f'{call} ( "," space {call} )*' if parallel else call
    head = literal('{"tool_calls": [')
    return g.rule("tool-calls", f'{head} {items} "]" space "}}"')


def grammar(tools: Sequence[Tool], name: str | None, parallel: bool, thinking: bool) -> str:
    g = Gbnf()
    return g.render(_calls(g, tools, name, parallel))


def auto_grammar(tools: Sequence[Tool], parallel: bool) -> str:
    """A call of any of ``tools`` or an answer: ``{"response": "..."}``."""
    g = Gbnf()
    answer = g.json(
        {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"]},
        "answer",
    )
    return g.render(f"{_calls(g, tools, None, parallel)} | {answer}")


def _parser(tools: Sequence[Tool], ids: IdFactory, thinking: bool) -> Parser:
    return MarkupParser(GenericSyntax(tools), ids)


FAMILY = Family("generic", False, _parser, grammar, prompt=system_prompt, any_grammar=auto_grammar)
