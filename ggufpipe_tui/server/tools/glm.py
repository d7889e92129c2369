"""GLM-4.5/4.6 calls: the name, then key and value tags::

    <tool_call>NAME
    <arg_key>KEY</arg_key>
    <arg_value>VALUE</arg_value>
    </tool_call>

Values as :mod:`xmlargs` reads and constrains them."""

from __future__ import annotations

from collections.abc import Sequence

from ggufpipe_tui.server.request import Tool
from ggufpipe_tui.server.tools.base import Syntax, markup_family
from ggufpipe_tui.server.tools.grammar import Gbnf, alternatives, choose, literal, repeat, think_prefix
from ggufpipe_tui.server.tools.scan import Call, NoMatch, Scan
from ggufpipe_tui.server.tools.schema import property_schema, xml_value
from ggufpipe_tui.server.tools.xmlargs import params_rule

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY, KEY_END = "<arg_key>", "</arg_key>"
VALUE, VALUE_END = "<arg_value>", "</arg_value>"


class GlmSyntax(Syntax):
    markers = (OPEN,)

    def read(self, scan: Scan) -> list[Call]:
        scan.expect(OPEN)
        name = scan.until_any(("\n", KEY, CLOSE)).strip()
        if not name or len(name.split()) != 1:
            raise NoMatch
        tool = self.tools.get(name)
        args = {}
        while True:
            scan.ws()
            if not scan.maybe(KEY):
                break
            key = scan.until(KEY_END).strip()
            scan.expect(KEY_END)
            scan.ws()
            scan.expect(VALUE)
            raw = scan.value_until(VALUE_END, (KEY, CLOSE))
            args[key] = xml_value(raw, property_schema(tool, key))
        scan.closer(CLOSE)
        return [Call(name, args)]


def grammar(tools: Sequence[Tool], name: str | None, parallel: bool, thinking: bool) -> str:
    g = Gbnf()
    calls = []
    for i, tool in choose(tools, name):
        params = params_rule(g, tool, i, (KEY, KEY_END + "\n" + VALUE), VALUE_END, "\n")
        calls.append(g.rule(f"call-{i}", f"{literal(OPEN + tool.name + chr(10))} {params} {literal(CLOSE)}"))
    call = alternatives(g, calls)
    return g.render(think_prefix(g, thinking) + repeat(call, parallel, literal("\n")))


FAMILY = markup_family("glm", GlmSyntax, grammar)
