"""gpt-oss's harmony format: the reply is messages on channels::

    <|channel|>analysis<|message|>reasoning<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>

(the first ``<|start|>assistant`` is the prompt's). ``final`` content, and a
``commentary`` message to no one (a preamble), come out as Text as they are
generated; a message to ``functions.NAME`` (the recipient in the channel
header or the role header) is a call, its content the JSON arguments; the
``analysis`` channel (reasoning) is dropped. Text outside any header (a
model that forgets the format) is Text. The grammar forces one call: after
``<|call|>`` the model stops, so ``parallel`` cannot give more; it lets an
analysis message come first."""

from __future__ import annotations

import json
from collections.abc import Sequence

from ggufpipe_tui.server.request import CallArguments, CallStart, Piece, Text, Tool
from ggufpipe_tui.server.tools.base import Family, IdFactory, Parser, compact, holdback
from ggufpipe_tui.server.tools.grammar import Gbnf, alternatives, choose, literal
from ggufpipe_tui.server.tools.scan import WHITESPACE, JsonStream

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
TERMINATORS = (END, CALL, RETURN, START)
HEADERS = (START, CHANNEL)
ROLE_TO = " to="


class HarmonyParser(Parser):
    def __init__(self, ids: IdFactory, stream: bool = False) -> None:
        self.ids, self.stream = ids, stream
        self.args: JsonStream | None = None  # a streamed call's arguments, while they come
        self.buf = ""
        self.kind = "text"  # outside a message; header: reading one; in one: show, drop, call
        self.name = ""
        self.index = 0
        self.fresh = True  # the reply's start: " to=..." ends the prompt's role header
        self.whole = False  # this call's arguments are no JSON object: read them whole

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        return self._run(final=False)

    def close(self) -> list[Piece]:
        out = self._run(final=True)
        if self.args is not None:  # cut off: the call ends as far as it came
            self.args = None
            self.index += 1
        return out

    def _run(self, final: bool) -> list[Piece]:
        out: list[Piece] = []
        if self.fresh and self.buf:
            head = self.buf[: len(ROLE_TO)]
            if ROLE_TO.startswith(head) and len(head) < len(ROLE_TO) and not final:
                return out
            self.fresh = False
            if head == ROLE_TO:
                self.kind = "header"
        while self.buf:
            if self.kind == "header":
                if not self._header(final):
                    break
            elif self.kind in ("text", "show", "drop"):
                stops = HEADERS if self.kind == "text" else TERMINATORS
                found = [i for i in (self.buf.find(s) for s in stops) if i >= 0]
                i = min(found) if found else -1
                cut = i if i >= 0 else len(self.buf) - (0 if final else holdback(self.buf, stops))
                if cut and self.kind != "drop":
                    out.append(Text(self.buf[:cut]))
                self.buf = self.buf[cut:]
                if i < 0:
                    break
                if self.kind == "text":
                    self.kind = "header"
                else:
                    self._terminate()
            elif self.kind == "args":
                text, used = self.args.feed(self.buf) if self.args else ("", 0)
                if text:
                    out.append(CallArguments(self.index, text))
                self.buf = self.buf[used:]
                if self.args is None or not self.args.done:
                    break
                self.args, self.kind = None, "drop"  # to the message's end
                self.index += 1
            else:  # call
                if self.stream and not self.whole:
                    rest = self.buf.lstrip(WHITESPACE)
                    if not rest and not final:
                        break
                    if rest.startswith("{"):
                        out.append(CallStart(self.index, self.ids(), self.name))
                        self.buf, self.args, self.kind = rest, JsonStream(), "args"
                        continue
                    self.whole = True
                found = [i for i in (self.buf.find(s) for s in TERMINATORS) if i >= 0]
                if not found and not final:
                    break
                i = min(found) if found else len(self.buf)
                self._call(out, self.buf[:i])
                self.buf = self.buf[i:]
                self._terminate()
        return out

    def _terminate(self) -> None:
        """Past a message's end marker (a new header is no end to consume)."""
        for t in (END, CALL, RETURN):
            if self.buf.startswith(t):
                self.buf = self.buf[len(t) :]
                break
        self.kind = "text"

    def _header(self, final: bool) -> bool:
        """Read the header at the buffer's start; False: wait for more."""
        i = self.buf.find(MESSAGE)
        if i < 0:
            if final:
                self.buf = ""  # a header never finished: markup, not text
            return False
        header, self.buf = self.buf[:i], self.buf[i + len(MESSAGE) :]
        channel = header.partition(CHANNEL)[2].split(" ")[0].split("<|")[0].strip()
        recipient = ""
        if " to=" in header:
            recipient = header.split(" to=", 1)[1].split(" ")[0].split("<|")[0].strip()
        if recipient and recipient != "assistant":
            self.kind, self.name = "call", recipient.removeprefix("functions.")
            self.whole = False
        elif channel == "analysis":
            self.kind = "drop"
        else:
            self.kind = "show"
        return True

    def _call(self, out: list[Piece], content: str) -> None:
        try:
            args = json.loads(content) if content.strip() else {}
        except ValueError:
            args = None
        if not isinstance(args, dict):
            if content:
                out.append(Text(content))
            return
        out.append(CallStart(self.index, self.ids(), self.name))
        out.append(CallArguments(self.index, compact(args)))
        self.index += 1


def grammar(tools: Sequence[Tool], name: str | None, parallel: bool, thinking: bool) -> str:
    g = Gbnf()
    calls = []
    for i, tool in choose(tools, name):
        head = literal(f"{CHANNEL}commentary to=functions.{tool.name} {CONSTRAIN}json{MESSAGE}")
        calls.append(g.rule(f"call-{i}", f"{head} {g.arguments(tool, i)}"))
    call = alternatives(g, calls)
    opening, closing = literal(CHANNEL + "analysis" + MESSAGE), literal(END + START + "assistant")
    analysis = f"{opening} {g.excluding(END, 'analysis')} {closing}"
    return g.render(f"( {analysis} )? {call}")


def _parser(tools: Sequence[Tool], ids: IdFactory, thinking: bool, stream: bool) -> Parser:
    return HarmonyParser(ids, stream)


FAMILY = Family("harmony", True, _parser, grammar)
