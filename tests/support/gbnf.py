"""A small GBNF recogniser for tests: does a grammar accept a whole string?

Reads the GBNF llama.cpp reads (literals, character classes, ``.``, rule
references, groups, ``* + ?`` and ``{m,n}``, ``#`` comments) and matches by
memoised recursive descent, each node giving the set of positions it can
end at. Only for checking our grammars on short samples; llama.cpp's own
parser is what checks that a grammar compiles.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cache
from typing import Any

Node = tuple[
    Any, ...
]  # ("lit", s) | ("cls", neg, ranges) | ("any",) | ("ref", n) | ("alt", [seq]) | ("rep", node, lo, hi)


def _escape(text: str, i: int) -> tuple[str, int]:
    c = text[i + 1]
    simple = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-", "^": "^"}
    if c in simple:
        return simple[c], i + 2
    width = {"x": 2, "u": 4, "U": 8}[c]
    return chr(int(text[i + 2 : i + 2 + width], 16)), i + 2 + width


@dataclass
class Grammar:
    rules: dict[str, Node]

    @classmethod
    def parse(cls, text: str) -> Grammar:
        p = _Parser(text)
        return cls(p.rules())

    def accepts(self, s: str, root: str = "root") -> bool:
        rules = self.rules
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 50000))

        @cache
        def rule(name: str, pos: int) -> frozenset[int]:
            return frozenset(match(rules[name], pos))

        def match(node: Node, pos: int) -> set[int]:
            kind = node[0]
            if kind == "lit":
                return {pos + len(node[1])} if s.startswith(node[1], pos) else set()
            if kind == "any":
                return {pos + 1} if pos < len(s) else set()
            if kind == "cls":
                if pos >= len(s):
                    return set()
                inside = any(lo <= s[pos] <= hi for lo, hi in node[2])
                return {pos + 1} if inside != node[1] else set()
            if kind == "ref":
                return set(rule(node[1], pos))
            if kind == "alt":
                out: set[int] = set()
                for seq in node[1]:
                    ends = {pos}
                    for el in seq:
                        ends = {e for p in ends for e in match(el, p)}
                        if not ends:
                            break
                    out |= ends
                return out
            if kind == "rep":
                _, el, lo, hi = node
                reached = {pos} if lo == 0 else set()
                frontier, count = {pos}, 0
                while frontier and (hi is None or count < hi):
                    nxt = {e for p in frontier for e in match(el, p)}
                    count += 1
                    if count < lo:
                        frontier = nxt
                    elif hi is None:
                        frontier = nxt - reached
                        reached |= nxt
                    else:
                        frontier = nxt
                        reached |= nxt
                return reached
            raise ValueError(kind)

        try:
            return len(s) in rule(root, 0)
        finally:
            sys.setrecursionlimit(limit)


class _Parser:
    def __init__(self, text: str) -> None:
        self.t, self.i = text, 0

    def ws(self, newlines: bool = True) -> None:
        t = self.t
        while self.i < len(t):
            c = t[self.i]
            if c == "#":
                while self.i < len(t) and t[self.i] != "\n":
                    self.i += 1
            elif c in " \t" or (newlines and c in "\r\n"):
                self.i += 1
            else:
                break

    def name(self) -> str:
        start = self.i
        while self.i < len(self.t) and (self.t[self.i].isalnum() or self.t[self.i] in "-_"):
            self.i += 1
        if self.i == start:
            raise ValueError(f"a name expected at {self.i}: {self.t[self.i : self.i + 20]!r}")
        return self.t[start : self.i]

    def rules(self) -> dict[str, Node]:
        out: dict[str, Node] = {}
        self.ws()
        while self.i < len(self.t):
            name = self.name()
            self.ws(newlines=False)
            if not self.t.startswith("::=", self.i):
                raise ValueError(f"::= expected after {name}")
            self.i += 3
            out[name] = self.alternatives(top=True)
            self.ws()
        for node in out.values():
            self._check(node, out)
        return out

    def _check(self, node: Node, rules: dict[str, Node]) -> None:
        if node[0] == "ref" and node[1] not in rules:
            raise ValueError(f"undefined rule {node[1]}")
        if node[0] == "alt":
            for seq in node[1]:
                for el in seq:
                    self._check(el, rules)
        if node[0] == "rep":
            self._check(node[1], rules)

    def alternatives(self, top: bool = False) -> Node:
        seqs = [self.sequence(top)]
        while self.i < len(self.t) and self.t[self.i] == "|":
            self.i += 1
            seqs.append(self.sequence(top))
        return ("alt", seqs)

    def sequence(self, top: bool) -> list[Node]:
        seq: list[Node] = []
        while True:
            # a rule's body may go on over a newline only inside a group
            self.ws(newlines=not top)
            if top and self.i < len(self.t) and self.t[self.i] in "\r\n":
                # a newline then an indented or continuing element is still the rule
                j = self.i
                while j < len(self.t) and self.t[j] in "\r\n \t":
                    j += 1
                rest = self.t[j:]
                if rest.startswith("|") or not rest or _starts_rule(rest):
                    if rest.startswith("|"):
                        self.i = j
                    return seq
                self.i = j
            if self.i >= len(self.t) or self.t[self.i] in "|)":
                return seq
            seq.append(self.postfix(self.atom()))

    def atom(self) -> Node:
        t, c = self.t, self.t[self.i]
        if c == '"':
            self.i += 1
            out = []
            while t[self.i] != '"':
                if t[self.i] == "\\":
                    ch, self.i = _escape(t, self.i)
                else:
                    ch, self.i = t[self.i], self.i + 1
                out.append(ch)
            self.i += 1
            return ("lit", "".join(out))
        if c == "[":
            self.i += 1
            neg = t[self.i] == "^"
            if neg:
                self.i += 1
            ranges = []
            while t[self.i] != "]":
                lo, self.i = _escape(t, self.i) if t[self.i] == "\\" else (t[self.i], self.i + 1)
                hi = lo
                if t[self.i] == "-" and t[self.i + 1] != "]":
                    self.i += 1
                    hi, self.i = _escape(t, self.i) if t[self.i] == "\\" else (t[self.i], self.i + 1)
                ranges.append((lo, hi))
            self.i += 1
            return ("cls", neg, tuple(ranges))
        if c == ".":
            self.i += 1
            return ("any",)
        if c == "(":
            self.i += 1
            node = self.alternatives()
            self.ws()
            if t[self.i] != ")":
                raise ValueError(f") expected at {self.i}")
            self.i += 1
            return node
        return ("ref", self.name())

    def postfix(self, node: Node) -> Node:
        t = self.t
        while self.i < len(t) and t[self.i] in "*+?{":
            c = t[self.i]
            if c == "{":
                end = t.index("}", self.i)
                lo_s, _, hi_s = t[self.i + 1 : end].partition(",")
                lo = int(lo_s)
                hi = lo if "," not in t[self.i + 1 : end] else (int(hi_s) if hi_s.strip() else None)
                self.i = end + 1
                node = ("rep", node, lo, hi)
            else:
                self.i += 1
                node = ("rep", node, *{"*": (0, None), "+": (1, None), "?": (0, 1)}[c])
        return node


def _starts_rule(text: str) -> bool:
    j = 0
    while j < len(text) and (text[j].isalnum() or text[j] in "-_"):
        j += 1
    rest = text[j:].lstrip(" \t")
    return j > 0 and rest.startswith("::=")
