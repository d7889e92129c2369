"""DeepSeek V3/R1 calls, in a block of calls. R1 (and V3-0324) write
``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` then the arguments in a
```json fence; V3.1 writes ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}``.
The parser reads both; the grammar writes the one the template shows."""

from __future__ import annotations

from collections.abc import Sequence

from ggufpipe_tui.server.request import Tool
from ggufpipe_tui.server.tools.base import Family, Syntax, markup_family
from ggufpipe_tui.server.tools.grammar import Gbnf, GrammarFn, alternatives, choose, literal, think_prefix
from ggufpipe_tui.server.tools.scan import Call, Scan, arguments_object

CALLS, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
FENCE, FENCE_END = "```json", "```"


class DeepseekSyntax(Syntax):
    markers = (CALLS, CALL, CALLS_END)

    def read(self, scan: Scan) -> list[Call]:
        if scan.maybe(CALLS_END):  # the end of a block whose calls streamed
            return []
        block = scan.maybe(CALLS)
        calls = []
        while True:
            scan.ws()
            if not scan.maybe(CALL):
                break
            head = scan.until(SEP).strip()
            scan.expect(SEP)
            if head == "function":
                name = scan.until_any(("\n", FENCE, "{")).strip()
                scan.ws()
                fenced = scan.maybe(FENCE)
                args = arguments_object(scan.json())
                scan.ws()
                if fenced:
                    scan.closer(FENCE_END)
                    scan.ws()
            else:
                name, args = head, arguments_object(scan.json())
                scan.ws()
            scan.closer(CALL_END)
            calls.append(Call(name, args))
            if not block:
                return calls
        scan.closer(CALLS_END)
        return calls

    def opening(self, scan: Scan) -> tuple[str, str]:
        scan.maybe(CALLS)
        scan.ws()
        scan.expect(CALL)
        head = scan.until(SEP).strip()
        scan.expect(SEP)
        name = head
        if head == "function":
            name = scan.until_any(("\n", FENCE, "{")).strip()
            scan.ws()
            scan.maybe(FENCE)
        scan.object_next()
        return name, ""

    def closing(self, scan: Scan) -> None:
        scan.ws()
        if scan.maybe(FENCE_END):
            scan.ws()
        scan.closer(CALL_END)


def grammar_for(fenced: bool) -> GrammarFn:
    def grammar(tools: Sequence[Tool], name: str | None, parallel: bool, thinking: bool) -> str:
        g = Gbnf()
        calls = []
        for i, tool in choose(tools, name):
            args = g.arguments(tool, i)
            if fenced:
                head = literal(f"{CALL}function{SEP}{tool.name}\n{FENCE}\n")
                tail = literal(f"\n{FENCE_END}{CALL_END}")
            else:
                head, tail = literal(f"{CALL}{tool.name}{SEP}"), literal(CALL_END)
            calls.append(g.rule(f"call-{i}", f"{head} {args} {tail}"))
        call = alternatives(g, calls)
        body = f"{call}+" if parallel else call
        return g.render(think_prefix(g, thinking) + f"{literal(CALLS)} {body} {literal(CALLS_END)}")

    return grammar


def family(template: str) -> Family:
    """R1's fenced form when the template writes one, else V3.1's."""
    return markup_family("deepseek", DeepseekSyntax, grammar_for(FENCE in template))
