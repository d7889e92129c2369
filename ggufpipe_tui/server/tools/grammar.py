"""GBNF building blocks for the call grammars: one SchemaConverter per grammar.

A :class:`Gbnf` collects rules: JSON values held to a schema (llama.cpp's own
JSON-schema-to-grammar conversion, as llama-cpp-python ships it), literals,
text that never contains a word (for XML-argument values and reasoning), and
renders them with ``root`` last.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from llama_cpp.llama_grammar import SchemaConverter

from ggufpipe_tui.server.request import Tool

#: An object of any properties: a tool's schema when it gives none.
ANY_OBJECT: Mapping[str, Any] = {"type": "object"}

#: (tools, name or None, parallel, thinking) -> GBNF: a family's call grammar.
GrammarFn = Callable[[Sequence[Tool], "str | None", bool, bool], str]

_NAME = re.compile(r"[^a-zA-Z0-9-]+")


def literal(text: str) -> str:
    """``text`` as a GBNF string literal."""
    out = []
    for c in text:
        if c in '"\\':
            out.append("\\" + c)
        elif c == "\n":
            out.append("\\n")
        elif c == "\r":
            out.append("\\r")
        elif c == "\t":
            out.append("\\t")
        elif ord(c) < 0x20:
            out.append(f"\\x{ord(c):02x}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def _class_char(c: str) -> str:
    o = ord(c)
    if c.isalnum() and o < 0x80:
        return c
    return f"\\x{o:02x}" if o < 0x100 else (f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}")


def tool_schema(tool: Tool) -> Mapping[str, Any]:
    """The tool's parameters schema, an object of anything when it gives none."""
    return tool.parameters if tool.parameters else ANY_OBJECT


class Gbnf:
    """Rules of one grammar; :meth:`render` writes it with ``root``."""

    def __init__(self) -> None:
        self.converter = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
        self.rules: dict[str, str] = {}
        self._schemas = 0

    def rule(self, name: str, body: str) -> str:
        """Add ``name ::= body`` (a fresh name if taken by another body)."""
        base = _NAME.sub("-", name).strip("-") or "r"
        key, i = base, 0
        while (key in self.rules and self.rules[key] != body) or key in self.converter._rules:
            i += 1
            key = f"{base}{i}"
        self.rules[key] = body
        return key

    def json(self, schema: Mapping[str, Any], name: str) -> str:
        """A rule for a JSON value valid against ``schema`` (it allows trailing space)."""
        self._schemas += 1
        # a copy: resolving rewrites the "$ref"s it meets, in place
        schema = self.converter.resolve_refs(copy.deepcopy(dict(schema)), f"schema{self._schemas}")
        return str(self.converter.visit(schema, f"x{self._schemas}-{_NAME.sub('-', name)}"))

    def arguments(self, tool: Tool, index: int) -> str:
        """A rule for the JSON arguments object of ``tool``."""
        return self.json(tool_schema(tool), f"args-{index}")

    def excluding(self, word: str, name: str = "text") -> str:
        """A rule for any text (empty too) that does not contain ``word``.

        Built from the word's KMP automaton: one rule per matched prefix, so
        the text may go on after a partial match (``</para`` in a value
        ending ``</parameter>``) but never completes the word."""
        n = len(word)
        fail = [0] * (n + 1)
        k = 0
        for i in range(1, n):
            while k and word[i] != word[k]:
                k = fail[k]
            if word[i] == word[k]:
                k += 1
            fail[i + 1] = k

        def step(state: int, c: str) -> int:
            while state and (state == n or word[state] != c):
                state = fail[state]
            return state + 1 if word[state] == c else 0

        alphabet = sorted(set(word))
        base = self.rule(f"{name}-0", "placeholder-" + word)
        names = [base] + [f"{base}-{i}" for i in range(1, n)]
        for state in range(n):
            moves = {c: step(state, c) for c in alphabet}
            special = sorted(c for c, nxt in moves.items() if nxt != 0)
            alts = ["[^" + "".join(_class_char(c) for c in special) + f"] {names[0]}"]
            alts += [f"{literal(c)} {names[moves[c]]}" for c in special if moves[c] < n]
            self.rules[names[state]] = "( " + " | ".join(alts) + " )?"
        return base

    def render(self, root: str) -> str:
        """The grammar: the converter's rules, ours, then ``root ::= root``."""
        lines = [self.converter.format_grammar()]
        lines += [f"{k} ::= {v}" for k, v in self.rules.items()]
        lines.append(f"root ::= {root}")
        return "\n".join(lines) + "\n"


def choose(tools: Sequence[Tool], name: str | None) -> list[tuple[int, Tool]]:
    """The tools a call may be of: the one named, or all."""
    chosen = [(i, t) for i, t in enumerate(tools) if name is None or t.name == name]
    if not chosen:
        raise ValueError(f"no tool named {name!r}" if name is not None else "no tools to call")
    return chosen


def repeat(call: str, parallel: bool, separator: str = "") -> str:
    """One call, or with ``parallel`` one or more (``separator`` between)."""
    if not parallel:
        return call
    sep = f"{separator} " if separator else ""
    return f"{call} ( {sep}{call} )*"


def think_prefix(g: Gbnf, thinking: bool, tags: tuple[str, str] = ("<think>", "</think>")) -> str:
    """Reasoning the model may write before its call: an optional
    ``<think>...</think>`` block, or with ``thinking`` (the prompt opened one)
    the rest of it, closed."""
    open_, close = tags
    body = g.excluding(close, "think")
    ws = g.rule("ws", "[ \\t\\n]*")
    if thinking:
        return f"{body} {literal(close)} {ws} "
    return f"( {literal(open_)} {body} {literal(close)} {ws} )? "


def alternatives(g: Gbnf, rules: Sequence[str], name: str = "call") -> str:
    """One rule for any of ``rules``."""
    return rules[0] if len(rules) == 1 else g.rule(name, " | ".join(rules))
