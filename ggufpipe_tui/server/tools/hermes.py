"""Hermes-style calls (Qwen2.5, Qwen3 and many others): a JSON object in tags,
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one per call."""

from __future__ import annotations

import json
from collections.abc import Sequence

from ggufpipe_tui.server.request import Tool
from ggufpipe_tui.server.tools.base import Syntax, markup_family
from ggufpipe_tui.server.tools.grammar import Gbnf, alternatives, choose, literal, repeat, think_prefix
from ggufpipe_tui.server.tools.scan import Call, NoMatch, Scan, arguments_object

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesSyntax(Syntax):
    markers = (OPEN,)

    def read(self, scan: Scan) -> list[Call]:
        scan.expect(OPEN)
        obj = scan.json()
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise NoMatch
        args = arguments_object(obj.get("arguments", obj.get("parameters")))
        scan.ws()
        scan.closer(CLOSE)
        return [Call(obj["name"], args)]

    def opening(self, scan: Scan) -> tuple[str, str]:
        scan.expect(OPEN)
        scan.ws()
        scan.expect("{")
        scan.key("name")
        name = scan.string()
        scan.ws()
        scan.expect(",")
        scan.key("arguments", "parameters")
        scan.object_next()
        return name, ""

    def closing(self, scan: Scan) -> None:
        scan.ws()
        scan.maybe("}")
        scan.ws()
        scan.closer(CLOSE)


def grammar(tools: Sequence[Tool], name: str | None, parallel: bool, thinking: bool) -> str:
    g = Gbnf()
    calls = []
    for i, tool in choose(tools, name):
        head = literal(OPEN + '\n{"name": ' + json.dumps(tool.name) + ', "arguments": ')
        tail = literal("}\n" + CLOSE)
        calls.append(g.rule(f"call-{i}", f"{head} {g.arguments(tool, i)} {tail}"))
    call = alternatives(g, calls)
    return g.render(think_prefix(g, thinking) + repeat(call, parallel, literal("\n")))


FAMILY = markup_family("hermes", HermesSyntax, grammar)
