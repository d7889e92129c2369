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
