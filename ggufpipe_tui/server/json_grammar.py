"""A JSON schema's GBNF as llama-server's converter writes it.

llama-cpp-python's ``json_schema_to_gbnf`` is an older port of llama.cpp's
common/json-schema-to-grammar: it lets a single space follow every value
(``space ::= " "?`` after each string, number, object, ...), while the
llama.cpp our llama-server is built from lets whitespace stand only between
tokens of the structure (after ``{``, ``[``, ``:`` and ``,`` and before ``}``
and ``]``), and that whitespace may be a space or one or two newlines and an
indent. Its strings also refuse raw control characters and the ``\\/``
escape. A model held to the older grammar writes ``{ "a": 1 }`` where under
llama-server's it writes its own indented JSON, so a schema's reply differed
from llama-server's at the first newline. :func:`as_llama_server` rewrites
the older grammar to the language of the newer one: the same replies, token
for token, for the same schema.
"""

from __future__ import annotations

import re

#: Whitespace between JSON tokens: nothing, a space, or newlines and an indent.
SPACE = 'space ::= | " " | "\\n"{1,2} [ \\t]{0,20}'
#: A string's character: no quote, backslash, DEL or control character
#: unescaped; the escapes JSON has, but the solidus's.
CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F] | [\\\\] (["\\\\bfnrt] | "u" [0-9a-fA-F]{4})'

_RULE = re.compile(r"^([A-Za-z0-9-]+) ::= (.*)$")
_TRAILING_SPACE = re.compile(r"\s+space$")
_CLOSER = re.compile(r'\s+("[}\]]")$')


def as_llama_server(grammar: str) -> str:
    """``grammar`` (llama-cpp-python's json_schema_to_gbnf output) with
    llama.cpp's whitespace: no value carries a space after it; an object or
    array may have whitespace before its closing bracket instead."""
    lines = []
    for line in grammar.splitlines():
        found = _RULE.match(line)
        if found is None:
            lines.append(line)
            continue
        name, body = found.groups()
        if name == "space":
            lines.append(SPACE)
            continue
        if name == "char":
            lines.append(CHAR)
            continue
        body = _TRAILING_SPACE.sub("", body)
        closer = _CLOSER.search(body)
        if closer is not None:
            before = body[: closer.start()]
            gap = "" if before.endswith("space") else " space"
            body = f"{before}{gap} {closer.group(1)}"
        lines.append(f"{name} ::= {body}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------- the chat form

#: What llama-server's chat path (a Jinja template's "peg-native" format)
#: holds a schema's reply to: whitespace, then the JSON alone or in a
#: ```json fence, then whitespace. The content it answers is the JSON inside.
FENCE = "```json"
_TOKEN = re.compile(r'("(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\])')
_ROOT = re.compile(r"(?<![A-Za-z0-9-])root(?![A-Za-z0-9-])")


def chat_form(grammar: str) -> str:
    """``grammar`` (a schema's, :func:`as_llama_server`) as llama-server's
    chat path holds it: ``space ("```json" space SCHEMA space "```" | space
    SCHEMA space)``; its root renamed ``response-format-schema``."""
    lines = []
    for line in grammar.strip().splitlines():
        parts = _TOKEN.split(line)  # literals and classes at the odd places: left alone
        lines.append(
            "".join(p if i % 2 else _ROOT.sub("response-format-schema", p) for i, p in enumerate(parts))
        )
    if not any(line.startswith("space ::= ") for line in lines):
        lines.append(SPACE)
    top = (
        'root ::= space ( "```json" space response-format-schema space "```" '
        "| space response-format-schema space )"
    )
    return "\n".join([top, *lines]) + "\n"


class ChatFormText:
    """The content of a reply held to :func:`chat_form`, as it streams: the
    leading whitespace and fence are held back until the JSON begins, and a
    trailing run of whitespace and backticks until more follows (or dropped
    at :meth:`end`). ``feed`` gives what may be shown now."""

    def __init__(self) -> None:
        self._head = ""  # before the JSON, while it may still be whitespace or the fence
        self._started = False
        self._tail = ""  # held back: whitespace and backticks that may end the reply

    def feed(self, text: str) -> str:
        if not self._started:
            self._head += text
            stripped = self._head.lstrip()
            if stripped.startswith(FENCE):
                stripped = stripped[len(FENCE) :].lstrip()
                if not stripped:
                    return ""
            elif not stripped or FENCE.startswith(stripped):
                return ""
            self._started, text = True, stripped
        text = self._tail + text
        kept = text.rstrip(" \t\n`")
        self._tail = text[len(kept) :]
        return kept

    def end(self) -> str:
        """What is left to show when the reply ends: nothing (the held
        whitespace and fence close the form), but a reply cut before its JSON
        began shows what it wrote."""
        if not self._started:
            return self._head.strip()
        return ""


def unwrap_chat_form(text: str) -> str:
    """A whole reply's content, as :class:`ChatFormText` streams it."""
    reader = ChatFormText()
    return reader.feed(text) + reader.end()
