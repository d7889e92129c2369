"""Llama 3.x calls: the reply is a JSON object ``{"name": ..., "parameters":
{...}}`` (several may follow one another, apart by ``;`` or whitespace), or
after ``<|python_tag|>`` either such an object or a built-in tool's
``NAME.call(key=value, ...)`` (its arguments Python literals). A JSON object
that is no call stays reply text. The grammar writes the JSON form."""

from __future__ import annotations

import ast
import json
from collections.abc import Sequence

from ggufpipe_tui.server.request import Tool
from ggufpipe_tui.server.tools.base import Syntax, markup_family
from ggufpipe_tui.server.tools.grammar import Gbnf, alternatives, choose, literal, repeat
from ggufpipe_tui.server.tools.scan import WHITESPACE, Call, NoMatch, Scan, arguments_object

PYTHON_TAG, EOM = "<|python_tag|>", "<|eom_id|>"


def builtin_call(text: str) -> Call:
    """``brave_search.call(query="x")`` as a call of brave_search."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        raise NoMatch from None
    if not (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "call"
        and isinstance(node.func.value, ast.Name)
        and not node.args
    ):
        raise NoMatch
    try:
        args = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
    except ValueError:
        raise NoMatch from None
    return Call(node.func.value.id, args)


class Llama3Syntax(Syntax):
    markers = (PYTHON_TAG,)
    json_start = True
    think = None
    between = WHITESPACE + ";"

    def read(self, scan: Scan) -> list[Call]:
        if scan.maybe(PYTHON_TAG):
            scan.ws()
            if scan.peek() != "{":
                text = scan.until(EOM, forgive=True)
                scan.maybe(EOM)
                return [builtin_call(text)]
        obj = scan.json()
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise NoMatch
        if "parameters" not in obj and "arguments" not in obj:
            raise NoMatch
        args = arguments_object(obj.get("parameters", obj.get("arguments")))
        return [Call(obj["name"], args)]

    def opening(self, scan: Scan) -> tuple[str, str]:
        if scan.maybe(PYTHON_TAG):
            scan.ws()
        scan.expect("{")
        if scan.key("type", "name") == "type":
            scan.string()
            scan.ws()
            scan.expect(",")
            scan.key("name")
        name = scan.string()
        scan.ws()
        scan.expect(",")
        scan.key("parameters", "arguments")
        scan.object_next()
        return name, ""

    def closing(self, scan: Scan) -> None:
        scan.ws()
        scan.maybe("}")


def grammar(tools: Sequence[Tool], name: str | None, parallel: bool, thinking: bool) -> str:
    g = Gbnf()
    calls = []
    for i, tool in choose(tools, name):
        head = literal('{"name": ' + json.dumps(tool.name) + ', "parameters": ')
        calls.append(g.rule(f"call-{i}", f'{head} {g.arguments(tool, i)} "}}"'))
    call = alternatives(g, calls)
    return g.render(repeat(call, parallel, literal("; ")))


FAMILY = markup_family("llama3", Llama3Syntax, grammar)
