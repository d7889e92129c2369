"""A cursor to read one call region of generated text (:class:`Scan`), and
what it reads: a :class:`Call`. A read that cannot be decided yet raises
:class:`NeedMore`; text that is no call raises :class:`NoMatch`."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

WHITESPACE = " \t\r\n"


@dataclass(frozen=True, slots=True)
class Call:
    """A call read from the text; ``id`` when the model wrote one of its own."""

    name: str
    arguments: Mapping[str, Any]
    id: str = ""


class NeedMore(Exception):
    """The region cannot be decided before more text comes."""


class NoMatch(Exception):
    """The text is not a call."""


class Scan:
    """A cursor over ``buf`` from ``pos``. ``final``: no more text will come,
    so a missing closer at the very end is forgiven and nothing waits."""

    def __init__(self, buf: str, pos: int, final: bool) -> None:
        self.buf, self.pos, self.final = buf, pos, final

    @property
    def at_end(self) -> bool:
        return self.pos >= len(self.buf)

    def ws(self, chars: str = WHITESPACE) -> None:
        while self.pos < len(self.buf) and self.buf[self.pos] in chars:
            self.pos += 1
        if self.at_end and not self.final:
            raise NeedMore

    def maybe(self, lit: str) -> bool:
        """Consume ``lit`` if it comes next."""
        rest = self.buf[self.pos : self.pos + len(lit)]
        if rest == lit:
            self.pos += len(lit)
            return True
        if lit.startswith(rest) and not self.final:
            raise NeedMore
        return False

    def expect(self, lit: str) -> None:
        if not self.maybe(lit):
            raise NoMatch

    def closer(self, lit: str) -> None:
        """``lit``, or nothing at the very end of a finished reply."""
        if not self.maybe(lit) and not (self.final and self.at_end):
            raise NoMatch

    def until(self, word: str, *, forgive: bool = False) -> str:
        """The text up to ``word`` (not consumed); with ``forgive``, the rest
        of a finished reply when it never comes."""
        i = self.buf.find(word, self.pos)
        if i < 0:
            if not self.final:
                raise NeedMore
            if not forgive:
                raise NoMatch
            i = len(self.buf)
        text, self.pos = self.buf[self.pos : i], i
        return text

    def until_any(self, words: Sequence[str]) -> str:
        """The text up to the first of ``words`` (not consumed)."""
        found = [i for i in (self.buf.find(w, self.pos) for w in words) if i >= 0]
        if not found:
            if not self.final:
                raise NeedMore
            raise NoMatch
        i = min(found)
        text, self.pos = self.buf[self.pos : i], i
        return text

    def ident(self, extra: str = "_.-") -> str:
        """A name: letters, digits and ``extra`` (at least one)."""
        start = self.pos
        while self.pos < len(self.buf) and (self.buf[self.pos].isalnum() or self.buf[self.pos] in extra):
            self.pos += 1
        if self.at_end and not self.final:
            raise NeedMore
        if self.pos == start:
            raise NoMatch
        return self.buf[start : self.pos]

    def peek(self) -> str:
        """The next character ('' at the end of a finished reply)."""
        if self.at_end:
            if not self.final:
                raise NeedMore
            return ""
        return self.buf[self.pos]

    def value_until(self, close: str, nexts: Sequence[str]) -> str:
        """An XML parameter's raw text: up to the first ``close`` that is
        followed (after whitespace) by one of ``nexts``, so a value may hold
        the closing tag itself. ``close`` is consumed. A finished reply
        that never closes it gives its rest."""
        buf, search = self.buf, self.pos
        while True:
            i = buf.find(close, search)
            if i < 0:
                if not self.final:
                    raise NeedMore
                text, self.pos = buf[self.pos :], len(buf)
                return text
            j = i + len(close)
            while j < len(buf) and buf[j] in WHITESPACE:
                j += 1
            rest = buf[j:]
            if j >= len(buf):
                if not self.final:
                    raise NeedMore
            elif not any(rest.startswith(n) for n in nexts):
                if not self.final and any(n.startswith(rest) for n in nexts):
                    raise NeedMore
                search = i + 1
                continue
            text, self.pos = buf[self.pos : i], i + len(close)
            return text

    def string(self) -> str:
        """The JSON string that comes next, decoded."""
        if self.peek() != '"':
            raise NoMatch
        i, esc = self.pos + 1, False
        while i < len(self.buf):
            ch = self.buf[i]
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                try:
                    value = json.loads(self.buf[self.pos : i + 1])
                except ValueError:
                    raise NoMatch from None
                self.pos = i + 1
                return str(value)
            i += 1
        if not self.final:
            raise NeedMore
        raise NoMatch

    def key(self, *names: str) -> str:
        """``"NAME":`` for one of ``names`` (whitespace around), which one."""
        self.ws()
        for name in names:
            if self.maybe(json.dumps(name)):
                self.ws()
                self.expect(":")
                self.ws()
                return name
        raise NoMatch

    def object_next(self) -> None:
        """Whitespace, then the start of a JSON object (not consumed)."""
        self.ws()
        if self.peek() != "{":
            raise NoMatch

    def json(self) -> Any:
        """The JSON object or array that comes next (after whitespace)."""
        self.ws()
        end = json_end(self.buf, self.pos)
        if end is None:
            if not self.final:
                raise NeedMore
            raise NoMatch
        if end < 0:
            raise NoMatch
        try:
            value = json.loads(self.buf[self.pos : end])
        except ValueError:
            raise NoMatch from None
        self.pos = end
        return value


def json_end(buf: str, i: int) -> int | None:
    """Where the JSON object or array at ``buf[i]`` ends; None if it is not
    finished yet; -1 if none starts there."""
    if i >= len(buf):
        return None
    if buf[i] not in "{[":
        return -1
    depth, in_str, esc = 0, False, False
    for j in range(i, len(buf)):
        ch = buf[j]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def arguments_object(value: Any) -> Mapping[str, Any]:
    """A call's arguments: an object, or JSON text of one (some models quote it)."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            raise NoMatch from None
    if not isinstance(value, dict):
        raise NoMatch
    return value


class JsonStream:
    """A JSON value's text as it comes, made compact: whitespace outside
    strings dropped, the rest as the model wrote it (escapes too)."""

    def __init__(self) -> None:
        self.depth, self.in_str, self.esc, self.done = 0, False, False, False

    def feed(self, text: str) -> tuple[str, int]:
        """The compact text of ``text`` and how much of it the value took
        (all, unless the value ends inside it: then :attr:`done`)."""
        out = []
        for i, ch in enumerate(text):
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
            elif ch in WHITESPACE:
                continue
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
            out.append(ch)
            if self.depth == 0 and not self.in_str:
                self.done = True
                return "".join(out), i + 1
        return "".join(out), len(text)
