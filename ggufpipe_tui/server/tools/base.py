"""What every family shares: the :class:`Family` record, the streaming parser
of call regions in the generated text (read with :mod:`scan`'s cursor).

A family's :class:`Syntax` says which markers open a call region and how to
read one (:meth:`Syntax.region`); :class:`MarkupParser` does the rest the
same way for all: text outside calls comes out as :class:`Text` at once,
less what may be the start of a marker; a region comes out as its calls
(:class:`CallStart` and the whole arguments as one :class:`CallArguments`)
once it is complete, or as text if it turns out not to be a call. Every
decision is taken only when no further text could change it, so the pieces
are the same however the text is cut into chunks.

Reasoning (``<think>...</think>``, or the family's own tags) passes
through as Text, tags included, and no call is looked for inside it.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ggufpipe_tui.server.request import CallArguments, CallStart, Piece, Text, Tool
from ggufpipe_tui.server.tools.grammar import GrammarFn
from ggufpipe_tui.server.tools.scan import WHITESPACE, Call, JsonStream, NeedMore, NoMatch, Scan

IdFactory = Callable[[], str]
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def new_call_id() -> str:
    """A fresh call id, as OpenAI's look."""
    return "call_" + secrets.token_hex(12)


def compact(arguments: Mapping[str, Any]) -> str:
    """Arguments as compact JSON text (non-ASCII kept as is)."""
    return json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class Region:
    """A region read: it ends at ``end``; ``calls`` None when it was no call
    (its text is then reply text)."""

    end: int
    calls: list[Call] | None
    text: str | None = None  # reply text the region stands for (the generic form's answer)


class Syntax:
    """How one family writes calls. ``markers``: text that opens a region;
    ``json_start``: a JSON object at the reply's start (or after a call)
    opens one too; ``between``: what may separate calls (dropped)."""

    markers: tuple[str, ...] = ()
    json_start: bool = False
    think: tuple[str, str] | None = (THINK_OPEN, THINK_CLOSE)
    between: str = WHITESPACE

    def __init__(self, tools: Sequence[Tool]) -> None:
        self.tools = {t.name: t for t in tools}

    def read(self, scan: Scan) -> list[Call]:
        """Read the region at ``scan.pos`` (an opener is there); raise
        NeedMore or NoMatch."""
        raise NotImplementedError

    def opening(self, scan: Scan) -> tuple[str, str]:
        """For streamed arguments: read a call's start up to its JSON
        arguments object (left at its ``{``): the name, and the model's own
        id or "". NoMatch where the call cannot stream (it is then read whole)."""
        raise NoMatch

    def closing(self, scan: Scan) -> None:
        """For streamed arguments: read what follows the arguments object to
        the call's end."""

    def region(self, buf: str, start: int, final: bool) -> Region | None:
        scan = Scan(buf, start, final)
        try:
            calls = self.read(scan)
        except NeedMore:
            if final:  # a read must not wait on a finished reply
                return Region(len(buf), None)
            return None
        except NoMatch:
            opener = next((m for m in self.markers if buf.startswith(m, start)), buf[start])
            return Region(start + len(opener), None)
        return Region(scan.pos, calls)


class Parser:
    """A reply's text in, its pieces out: :meth:`feed` as it is generated,
    :meth:`close` at its end."""

    def feed(self, text: str) -> list[Piece]:
        raise NotImplementedError

    def close(self) -> list[Piece]:
        raise NotImplementedError


def holdback(buf: str, markers: Sequence[str]) -> int:
    """How many of ``buf``'s last characters may begin a marker."""
    longest = max((len(m) for m in markers), default=1)
    for k in range(min(len(buf), longest - 1), 0, -1):
        tail = buf[-k:]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0


class MarkupParser(Parser):
    """Calls as regions in the text, read by a :class:`Syntax`."""

    def __init__(self, syntax: Syntax, ids: IdFactory, thinking: bool = False, stream: bool = False) -> None:
        self.syntax, self.ids, self.stream = syntax, ids, stream
        self.args: JsonStream | None = None  # the streamed call's arguments, while they come
        self.closing = False  # past its arguments, reading to its end
        self.buf = ""
        self.think_open, self.think_close = syntax.think or ("", "")
        self.thinking = thinking and syntax.think is not None
        self.after_call = False
        self.at_start = True
        self.index = 0
        self.markers = syntax.markers + ((self.think_open,) if syntax.think else ())

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        return self._run(final=False)

    def close(self) -> list[Piece]:
        out = self._run(final=True)
        self._end(out)
        return out

    def _text(self, out: list[Piece], text: str) -> None:
        if text:
            if text.strip(WHITESPACE):
                self.at_start = False
            out.append(Text(text))

    def _calls(self, out: list[Piece], calls: list[Call]) -> None:
        for call in calls:
            out.append(CallStart(self.index, call.id or self.ids(), call.name))
            out.append(CallArguments(self.index, compact(call.arguments)))
            self.index += 1

    def _run(self, final: bool) -> list[Piece]:
        out: list[Piece] = []
        while self.buf:
            if self.args is not None or self.closing:
                if not self._streamed(out, final):
                    break
                continue
            if self.thinking:
                i = self.buf.find(self.think_close)
                if i >= 0:
                    cut, self.thinking = i + len(self.think_close), False
                else:
                    cut = len(self.buf) - (0 if final else holdback(self.buf, (self.think_close,)))
                self._text(out, self.buf[:cut])
                self.buf = self.buf[cut:]
                if self.thinking:
                    break
                continue
            if self.after_call:
                rest = self.buf.lstrip(self.syntax.between)
                if not rest:
                    self.buf = ""
                    break
                self.buf, self.after_call = rest, False
            start, opener = self._find()
            if start < 0:
                cut = len(self.buf) - (0 if final else holdback(self.buf, self.markers))
                if self.syntax.json_start and self.at_start and not final and not self.buf.strip(WHITESPACE):
                    cut = 0  # whitespace only: a call may still open the reply
                self._text(out, self.buf[:cut])
                self.buf = self.buf[cut:]
                break
            self._text(out, self.buf[:start])
            self.buf = self.buf[start:]
            if opener == self.think_open:
                self._text(out, opener)
                self.buf, self.thinking = self.buf[len(opener) :], True
                continue
            if self.stream:
                scan = Scan(self.buf, 0, final)
                try:
                    name, call_id = self.syntax.opening(scan)
                except NeedMore:
                    break
                except NoMatch:
                    pass
                else:
                    out.append(CallStart(self.index, call_id or self.ids(), name))
                    self.buf, self.args = self.buf[scan.pos :], JsonStream()
                    continue
            region = self.syntax.region(self.buf, 0, final)
            if region is None:
                break
            if region.calls is None:
                self._text(out, self.buf[: region.end] if region.text is None else region.text)
            else:
                if region.text:
                    out.append(Text(region.text))
                self._calls(out, region.calls)
                self.after_call = True
                self.at_start = True
            self.buf = self.buf[region.end :]
        return out

    def _streamed(self, out: list[Piece], final: bool) -> bool:
        """Go on with a streamed call; False: wait for more text."""
        if self.args is not None:
            text, used = self.args.feed(self.buf)
            if text:
                out.append(CallArguments(self.index, text))
            self.buf = self.buf[used:]
            if not self.args.done:
                return False
            self.args, self.closing = None, True
        scan = Scan(self.buf, 0, final)
        try:
            self.syntax.closing(scan)
        except NeedMore:
            return False
        except NoMatch:
            scan.pos = 0
        self.buf, self.closing = self.buf[scan.pos :], False
        self.index += 1
        self.after_call = self.at_start = True
        return True

    def _end(self, out: list[Piece]) -> None:
        """A finished reply inside a streamed call: the call ends there."""
        if self.args is not None or self.closing:
            self.args, self.closing = None, False
            self.index += 1

    def _find(self) -> tuple[int, str]:
        best, opener = -1, ""
        for m in self.markers:
            i = self.buf.find(m)
            if i >= 0 and (best < 0 or i < best):
                best, opener = i, m
        if self.syntax.json_start and self.at_start:
            j = len(self.buf) - len(self.buf.lstrip(WHITESPACE))
            if j < len(self.buf) and self.buf[j] == "{" and (best < 0 or j < best):
                best, opener = j, "{"
        return best, opener


ParserFactory = Callable[[Sequence[Tool], IdFactory, bool, bool], Parser]


@dataclass(frozen=True)
class Family:
    """A chat-template family's way with tools.

    ``native``: the template itself renders ``tools`` (pass them to it);
    otherwise describe them with :meth:`system_prompt`. ``prefix``: text to
    put after the rendered prompt before generating (none of ours needs any).
    """

    name: str
    native: bool
    make_parser: ParserFactory
    make_grammar: GrammarFn
    new_id: IdFactory = new_call_id
    prefix: str = ""
    prompt: Callable[[Sequence[Tool], str, str, bool], str] | None = field(default=None, repr=False)
    any_grammar: Callable[[Sequence[Tool], bool], str] | None = field(default=None, repr=False)
    think_open: str = ""  # the tag that opens reasoning, where the family reasons in tags

    def opens_reasoning(self, prompt: str) -> bool:
        """Whether the rendered ``prompt`` ends inside an open reasoning block
        (DeepSeek-R1's and some Qwen3 templates start the reply so): pass it
        as ``thinking`` to :meth:`parser` and :meth:`call_grammar`."""
        return bool(self.think_open) and prompt.rstrip().endswith(self.think_open)

    def parser(
        self,
        tools: Sequence[Tool],
        ids: IdFactory | None = None,
        thinking: bool = False,
        stream: bool = False,
    ) -> Parser:
        """A streaming parser of one reply. ``ids`` makes call ids (default
        :attr:`new_id`); ``thinking``: the prompt ends inside an open
        ``<think>`` block, so the reply starts with reasoning.

        ``stream``: a call whose arguments are a JSON object in the text
        (hermes, llama3, kimi, deepseek, mistral's ``[ARGS]``, harmony)
        starts as soon as its name is read and its arguments come as they
        are generated (compact: the model's text less the whitespace outside
        strings), so a long call shows progress; a call cut off by the end
        of the reply then stays as far as it came. Without it a call comes
        whole when it closes (arguments as ``json.dumps`` writes them), and
        a call cut off comes out as its text unless its JSON is complete.
        Calls in XML tags, the generic form and Mistral's JSON list come
        whole either way."""
        return self.make_parser(tools, ids or self.new_id, thinking, stream)

    def call_grammar(
        self,
        tools: Sequence[Tool],
        name: str | None = None,
        parallel: bool = False,
        thinking: bool = False,
    ) -> str:
        """GBNF (root ``root``) whose every sentence is one call (one or more
        with ``parallel``) of ``name`` (any of ``tools`` when None), its
        arguments valid against the function's schema. Reasoning may come
        first where the family reasons (``thinking`` as for :meth:`parser`)."""
        return self.make_grammar(tools, name, parallel, thinking)

    def auto_grammar(self, tools: Sequence[Tool], parallel: bool = False) -> str:
        """GBNF for ``tool_choice`` auto: a call or a plain answer (only the
        generic form has one: a native family samples freely)."""
        return self.any_grammar(tools, parallel) if self.any_grammar else ""

    def system_prompt(
        self, tools: Sequence[Tool], tool_choice: str = "auto", name: str = "", parallel: bool = True
    ) -> str:
        """The tools described in a system message, for a family that is not
        ``native`` (empty for the others). ``tool_choice``: auto, required,
        none, or function with ``name`` the function to call."""
        return self.prompt(tools, tool_choice, name, parallel) if self.prompt else ""


def markup_family(
    name: str,
    syntax: Callable[[Sequence[Tool]], Syntax],
    grammar: GrammarFn,
    new_id: IdFactory = new_call_id,
) -> Family:
    """A native family whose calls are regions read by ``syntax``."""

    def make_parser(tools: Sequence[Tool], ids: IdFactory, thinking: bool, stream: bool) -> Parser:
        return MarkupParser(syntax(tools), ids, thinking, stream)

    think = getattr(syntax, "think", None)
    return Family(name, True, make_parser, grammar, new_id, think_open=think[0] if think else "")
