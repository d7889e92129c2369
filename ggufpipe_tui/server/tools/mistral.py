"""Mistral calls after ``[TOOL_CALLS]``: a JSON list of ``{"name", "arguments",
"id"}`` (Nemo and older), or ``NAME[ARGS]{...}`` per call (newer; Small 3.2
puts ``[CALL_ID]ID`` before ``[ARGS]``). The parser reads all three; the
grammar writes the one the template shows. Ids are 9 letters and digits, as
Mistral's templates insist; the model's own id is kept when it is one."""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Sequence

from ggufpipe_tui.server.request import Tool
from ggufpipe_tui.server.tools.base import Family, Syntax, markup_family
from ggufpipe_tui.server.tools.grammar import Gbnf, GrammarFn, alternatives, choose, literal, think_prefix
from ggufpipe_tui.server.tools.scan import Call, NoMatch, Scan, arguments_object

MARK, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
THINK = ("[THINK]", "[/THINK]")
_ID = re.compile(r"[A-Za-z0-9]{9}")
_ALNUM = string.ascii_letters + string.digits


def new_id() -> str:
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def _id(value: object) -> str:
    return value if isinstance(value, str) and _ID.fullmatch(value) else ""


class MistralSyntax(Syntax):
    markers = (MARK,)
    think = THINK

    def read(self, scan: Scan) -> list[Call]:
        scan.expect(MARK)
        scan.ws()
        if scan.peek() in ("[", "{"):
            value = scan.json()
            items = value if isinstance(value, list) else [value]
            calls = []
            for item in items:
                if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                    raise NoMatch
                args = arguments_object(item.get("arguments", item.get("parameters")))
                calls.append(Call(item["name"], args, _id(item.get("id"))))
            return calls
        name = scan.ident()
        call_id = ""
        if scan.maybe(CALL_ID):
            call_id = _id(scan.until(ARGS).strip())
        scan.expect(ARGS)
        return [Call(name, arguments_object(scan.json()), call_id)]

    def opening(self, scan: Scan) -> tuple[str, str]:
        scan.expect(MARK)
        scan.ws()
        if scan.peek() in ("[", "{"):
            raise NoMatch  # the JSON list: read whole
        name = scan.ident()
        call_id = ""
        if scan.maybe(CALL_ID):
            call_id = _id(scan.until(ARGS).strip())
        scan.expect(ARGS)
        scan.object_next()
        return name, call_id


def grammar_for(form: str) -> GrammarFn:
    def grammar(tools: Sequence[Tool], name: str | None, parallel: bool, thinking: bool) -> str:
        g = Gbnf()
        calls = []
        ident = g.rule("call-id", "[a-zA-Z0-9]{9}")
        for i, tool in choose(tools, name):
            args = g.arguments(tool, i)
            if form == "list":
                head = literal('{"name": ' + json.dumps(tool.name) + ', "arguments": ')
                id_key, close = literal(', "id": "'), literal('"}')
                body = f"{head} {args} {id_key} {ident} {close}"
            elif form == "call_id":
                body = f"{literal(MARK + tool.name + CALL_ID)} {ident} {literal(ARGS)} {args}"
            else:
                body = f"{literal(MARK + tool.name + ARGS)} {args}"
            calls.append(g.rule(f"call-{i}", body))
        call = alternatives(g, calls)
        if form == "list":
            items = f'{call} ( "," " "? {call} )*' if parallel else call
            root = f'{literal(MARK + "[")} {items} "]"'
        else:
            root = f"{call}+" if parallel else call
        return g.render(think_prefix(g, thinking, THINK) + root)

    return grammar


def family(template: str) -> Family:
    """The call form the template writes: [CALL_ID], [ARGS] or a JSON list."""
    form = "call_id" if CALL_ID in template else "args" if ARGS in template else "list"
    return markup_family("mistral", MistralSyntax, grammar_for(form), new_id)
