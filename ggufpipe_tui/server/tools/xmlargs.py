"""Arguments written as one tag per parameter (Qwen3-Coder, GLM, MiniMax):
the grammar of the tags and the JSON object read back from them.

A string parameter is raw text; any other type is JSON. The grammar holds
each value to its schema as far as the tag form can: a non-string value is
JSON held to its schema by llama.cpp's conversion; a string's ``enum`` or
``const`` is held to those words; but a string's ``pattern``, ``format``
and length cannot be, since the raw text only has to avoid the closing tag,
so such a value may come out invalid (the server checks the parsed
arguments with :func:`validate_arguments`). Parameters come in the
schema's order, optional ones may be left out; a schema without
``properties`` (and not closed by ``additionalProperties: false``) takes
any names, as text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ggufpipe_tui.server.request import Tool
from ggufpipe_tui.server.tools.grammar import Gbnf, literal, tool_schema
from ggufpipe_tui.server.tools.schema import value_types

#: The text around a parameter's name before its value: (before, after).
Opener = tuple[str, str]


def value_rule(g: Gbnf, schema: Mapping[str, Any], close: str, name: str) -> str:
    """A parameter value held to ``schema``, ending before ``close``."""
    types = value_types(schema)
    if "string" in types:
        words = [schema["const"]] if "const" in schema else list(schema.get("enum") or [])
        if words and all(isinstance(w, str) for w in words):
            return g.rule(f"{name}-words", " | ".join(literal(w) for w in words))
        return g.excluding(close, "raw")
    return g.json(schema, name)


def params_rule(g: Gbnf, tool: Tool, index: int, opener: Opener, close: str, after: str = "") -> str:
    """The parameters of ``tool``: each ``before name after-name value close after``."""
    before, behind = opener
    schema = tool_schema(tool)
    props = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    parts = []
    for k, (pname, pschema) in enumerate(props.items()):
        value = value_rule(g, pschema if isinstance(pschema, Mapping) else {}, close, f"p{index}-{k}")
        one = f"{literal(before + pname + behind)} {value} {literal(close + after)}"
        parts.append(one if pname in required else f"( {one} )?")
    if not props and schema.get("additionalProperties", True) is not False:
        key = g.rule("param-name", "[a-zA-Z0-9_.-]+")
        raw = g.excluding(close, "raw")
        parts.append(f"( {literal(before)} {key} {literal(behind)} {raw} {literal(close + after)} )*")
    return g.rule(f"params-{index}", " ".join(parts) if parts else '""')
