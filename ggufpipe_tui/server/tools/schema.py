"""Tools' parameter schemas: is one usable, are arguments valid, and what a
parameter's raw text means (for the families that write arguments as XML)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import jsonschema

from ggufpipe_tui.server.request import Tool
from ggufpipe_tui.server.tools.grammar import Gbnf, tool_schema

_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


def schema_problem(schema: Any) -> str | None:
    """Why ``schema`` is no usable parameters schema, or None: it must be a
    JSON object schema (or empty), valid as JSON Schema, and expressible as
    a grammar by llama.cpp's conversion."""
    if not isinstance(schema, Mapping):
        return f"parameters must be a JSON object, not {type(schema).__name__}"
    if not schema:
        return None
    kind = schema.get("type")
    if kind is not None and kind != "object":
        if not isinstance(kind, str) or kind not in _TYPES:
            return f"parameters has an unknown type {kind!r}"
        return f'parameters must have type "object", not {kind!r}'
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return "parameters.required must be a list of property names"
    properties = schema.get("properties", {})
    if not isinstance(properties, Mapping):
        return "parameters.properties must be an object"
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        return f"parameters{'.' + where if where else ''}: {e.message}"
    try:
        Gbnf().json(schema, "check")
    except Exception as e:  # the converter asserts and raises what it cannot express
        return f"parameters cannot be expressed as a grammar: {e or type(e).__name__}"
    return None


def validate_arguments(tool: Tool, arguments: str) -> str | None:
    """Why ``arguments`` (JSON text) are no valid call of ``tool``, or None."""
    try:
        value = json.loads(arguments)
    except ValueError as e:
        return f"arguments of {tool.name} are not JSON: {e}"
    if not isinstance(value, dict):
        return f"arguments of {tool.name} must be a JSON object"
    schema = tool_schema(tool)
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        return f"arguments of {tool.name}{' at ' + where if where else ''}: {e.message}"
    except jsonschema.SchemaError as e:
        return f"the schema of {tool.name} is not valid: {e.message}"
    return None


def value_types(schema: Mapping[str, Any]) -> set[str]:
    """The JSON types a value of ``schema`` may have (all when it does not say)."""
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else list(schema["enum"])
        return {_type_of(v) for v in values}
    alts = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(alts, list):
        out: set[str] = set()
        for alt in alts:
            if isinstance(alt, Mapping):
                out |= value_types(alt)
        return out
    if "properties" in schema:
        return {"object"}
    if "items" in schema:
        return {"array"}
    return set(_TYPES)


def _type_of(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    return "array" if isinstance(value, list) else "object"


def property_schema(tool: Tool | None, name: str) -> Mapping[str, Any]:
    """The schema of ``tool``'s parameter ``name`` (empty when unknown)."""
    if tool is None:
        return {}
    props = tool_schema(tool).get("properties") or {}
    prop = props.get(name) if isinstance(props, Mapping) else None
    return prop if isinstance(prop, Mapping) else {}


def xml_value(text: str, schema: Mapping[str, Any]) -> Any:
    """A parameter's raw text as the JSON value its schema asks for: a string
    stays text; other types are read as JSON (text when that fails or
    gives a type the schema does not allow)."""
    types = value_types(schema)
    if types == {"string"}:
        return text
    try:
        value = json.loads(text)
    except ValueError:
        return text
    kind = _type_of(value)
    if kind in types or (kind == "integer" and "number" in types):
        return value
    return text
