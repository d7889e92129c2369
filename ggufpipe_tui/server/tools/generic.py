"""The generic form, for a template that knows no tools: the tools are
described in a system message and the model answers with one JSON object,
``{"tool_calls": [{"name": ..., "arguments": {...}}]}`` to call tools or
``{"response": "..."}`` to answer (as llama.cpp's generic format). An
answer that opens the reply (``{"response": "``) streams out as Text as its
string is generated; calls come once the object closes; a reply that is not
such an object is Text."""

from __future__ import annotations

import json
from collections.abc import Sequence

from ggufpipe_tui.server.request import Piece, Text, Tool
from ggufpipe_tui.server.tools.base import Family, IdFactory, MarkupParser, Parser, Region, Syntax
from ggufpipe_tui.server.tools.grammar import Gbnf, alternatives, choose, literal, tool_schema
from ggufpipe_tui.server.tools.scan import WHITESPACE, Call, NoMatch, Scan, arguments_object


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


def system_prompt(
    tools: Sequence[Tool], tool_choice: str = "auto", name: str = "", parallel: bool = True
) -> str:
    """The tools and how to answer, for a system message. ``tool_choice``:
    auto, required, or function (then ``name`` is the one to call); none:
    no tools, so nothing to say."""
    if tool_choice == "none" or not tools:
        return ""
    listed = [{"name": t.name, "description": t.description, "parameters": tool_schema(t)} for t in tools]
    call = '{"tool_calls": [{"name": "<tool name>", "arguments": {<its arguments>}}]}'
    lines = [
        "You can call these tools (each with its JSON schema of arguments):",
        json.dumps(listed, ensure_ascii=False, indent=2),
        "",
    ]
    some = "one or more tools" if parallel else "one tool"
    if tool_choice == "auto":
        lines.append(
            "Reply with one JSON object and nothing else: either "
            f"{call} to call {some}, or "
            '{"response": "<your answer>"} to answer the user directly.'
        )
    else:
        which = f"the tool {name}" if tool_choice == "function" else some
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


_HEAD = ("{", '"response"', ":", '"')
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f"}


def answer_start(buf: str) -> int | None:
    """Where the answer's string begins in ``{"response": "...``; None if
    ``buf`` may still become that; -1 if it cannot."""
    i = 0
    for part in _HEAD:
        while i < len(buf) and buf[i] in WHITESPACE:
            i += 1
        rest = buf[i : i + len(part)]
        if rest == part:
            i += len(part)
        elif part.startswith(rest):
            return None
        else:
            return -1
    return i


def decode(buf: str, final: bool) -> tuple[str, int, bool]:
    """A JSON string's text from ``buf`` (after its opening quote): the text,
    how much of ``buf`` it used (an escape cut short waits), and whether the
    closing quote came."""
    out: list[str] = []
    i = 0
    while i < len(buf):
        c = buf[i]
        if c == '"':
            return "".join(out), i + 1, True
        if c != "\\":
            out.append(c)
            i += 1
            continue
        if i + 1 >= len(buf):
            break
        e = buf[i + 1]
        if e != "u":
            out.append(_ESCAPES.get(e, e))
            i += 2
            continue
        if i + 6 > len(buf):
            break
        try:
            code = int(buf[i + 2 : i + 6], 16)
        except ValueError:
            out.append(buf[i : i + 6])
            i += 6
            continue
        if 0xD800 <= code < 0xDC00:  # a high surrogate: its low half follows
            if i + 12 > len(buf) and not final:
                break
            low = buf[i + 6 : i + 12]
            if low.startswith("\\u"):
                try:
                    code2 = int(low[2:], 16)
                except ValueError:
                    code2 = 0
                if 0xDC00 <= code2 < 0xE000:
                    out.append(chr(0x10000 + ((code - 0xD800) << 10) + (code2 - 0xDC00)))
                    i += 12
                    continue
        out.append(chr(code) if not 0xD800 <= code < 0xE000 else "\ufffd")
        i += 6
    return "".join(out), i, False


class GenericParser(Parser):
    """An answer streamed from its string; anything else read whole."""

    def __init__(self, tools: Sequence[Tool], ids: IdFactory) -> None:
        self.inner = MarkupParser(GenericSyntax(tools), ids)
        self.buf = ""
        self.state = "start"  # then: answer (in its string), after (past it), whole (inner)

    def feed(self, text: str) -> list[Piece]:
        if self.state == "whole":
            return self.inner.feed(text)
        self.buf += text
        return self._run(final=False)

    def close(self) -> list[Piece]:
        if self.state == "whole":
            return self.inner.close()
        return self._run(final=True)

    def _run(self, final: bool) -> list[Piece]:
        out: list[Piece] = []
        if self.state == "start":
            start = answer_start(self.buf)
            if start is None and not final:
                return out
            if start is None or start < 0:
                self.state = "whole"
                pieces = self.inner.feed(self.buf)
                return pieces + self.inner.close() if final else pieces
            self.state, self.buf = "answer", self.buf[start:]
        if self.state == "answer":
            text, used, closed = decode(self.buf, final)
            if text:
                out.append(Text(text))
            self.buf = self.buf[used:]
            if closed:
                self.state = "after"
        if self.state == "after":
            self.buf = ""  # the object's close
        return out


def _parser(tools: Sequence[Tool], ids: IdFactory, thinking: bool, stream: bool) -> Parser:
    return GenericParser(tools, ids)


FAMILY = Family("generic", False, _parser, grammar, prompt=system_prompt, any_grammar=auto_grammar)
