"""What the Anthropic and Responses translations share (pure, no I/O).

:func:`collect` folds a run's :data:`~ggufpipe_tui.server.request.Piece`
stream into the reply's text, its tool calls and its end, for the answers
that are not streamed; the rest are small checks of request fields whose
names differ between the APIs (the OpenAI ones are in
:mod:`ggufpipe_tui.server.openai_api`).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ggufpipe_agent.wire.codec import text_problem
from ggufpipe_tui.server.fields import MAX_STOPS, bad, shown
from ggufpipe_tui.server.request import CallArguments, CallStart, Finish, Piece, Text, Usage
from ggufpipe_tui.server.tools import schema_problem

#: A function name as OpenAI and Anthropic allow it.
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


@dataclass(slots=True)
class Call:
    """One tool call of a reply, its arguments gathered."""

    id: str
    name: str
    arguments: str = ""


@dataclass(slots=True)
class Reply:
    """A whole reply: its text, its calls in order, its end (None while running)."""

    text: str = ""
    calls: list[Call] = field(default_factory=list)
    finish: Finish | None = None

    @property
    def usage(self) -> Usage:
        return self.finish.usage if self.finish else Usage(0, 0)


def collect(pieces: Sequence[Piece]) -> Reply:
    """The reply that ``pieces`` make, whole."""
    reply = Reply()
    texts: list[str] = []
    by_index: dict[int, Call] = {}
    for piece in pieces:
        if isinstance(piece, Text):
            texts.append(piece.text)
        elif isinstance(piece, CallStart):
            by_index[piece.index] = call = Call(piece.id, piece.name)
            reply.calls.append(call)
        elif isinstance(piece, CallArguments):
            if piece.index in by_index:
                by_index[piece.index].arguments += piece.arguments
        elif isinstance(piece, Finish):
            reply.finish = piece
    reply.text = "".join(texts)
    return reply


def arguments_object(arguments: str) -> dict[str, Any]:
    """A call's JSON arguments as an object; ``{}`` where they are not one
    (empty, or cut by the token limit before they closed)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def text(value: object, where: str) -> str:
    """A string that can reach the stages, or a 400 naming ``where``."""
    if not isinstance(value, str):
        raise bad(where, f"a string is required, not {type(value).__name__}")
    problem = text_problem(value)
    if problem:
        raise bad(where, problem)
    return value


def strings(value: object, where: str) -> tuple[str, ...]:
    """Stop strings given as a list (``stop_sequences``): the non-empty ones."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad(where, "a list of strings is required")
    if len(value) > MAX_STOPS:
        raise bad(where, f"at most {MAX_STOPS} stop strings, not {len(value)}")
    return tuple(s for i, item in enumerate(value) if (s := text(item, f"{where}[{i}]")))


def flag(fields: Mapping[str, Any], name: str, default: bool) -> bool:
    value = fields.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, f"true or false is required, not {shown(value)}")
    return value


def obj(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise bad(where, "an object is required")
    return value


def tool_name(value: object, where: str) -> str:
    if not isinstance(value, str) or not TOOL_NAME.match(value):
        raise bad(
            where, f"a function name of 1 to 128 letters, digits, _ or - is required, not {shown(value)}"
        )
    return value


def schema(value: object, where: str) -> Mapping[str, Any]:
    """A tool's parameters: a JSON schema of an object, usable as a grammar
    (absent: an object of no properties)."""
    if value is None:
        return {"type": "object", "properties": {}}
    problem = schema_problem(value)
    if problem:
        raise bad(where, problem)
    assert isinstance(value, dict)
    return value


def unknown(fields: Mapping[str, Any], known: frozenset[str], where: str = "") -> None:
    """A 400 naming the first field that is not in ``known``."""
    for name in fields:
        if name not in known:
            raise bad(f"{where}{name}", "is not supported by this server")
