"""A conversation as a model's chat template takes it: ``messages`` and
``tools`` in the OpenAI shape that templates are written for, with what a
family's templates insist on (Mistral's 9-character call ids, Kimi's
``functions.NAME:INDEX`` ids, arguments as an object or as JSON text)."""

from __future__ import annotations

import hashlib
import json
import re
import string
from collections.abc import Sequence
from typing import Any

from ggufpipe_tui.server.request import Message, Tool
from ggufpipe_tui.server.tools.base import Family
from ggufpipe_tui.server.tools.grammar import tool_schema

_ALNUM = string.ascii_letters + string.digits
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
_KIMI_ID = re.compile(r"functions\.[^:]+:\d+")
#: Templates that join arguments to strings (``arguments + '...'``) need JSON text,
_CONCATENATED = re.compile(r"arguments['\"]?\]?\s*\+|\+\s*[\w.\[\]'\"]*arguments\b")
#: unless they write them with ``tojson`` or test for a string themselves.
_HANDLED = re.compile(r"arguments['\"]?\]?\s*\|\s*tojson|arguments['\"]?\]?\s+is\s+(not\s+)?string")


def template_tools(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """``tools`` as a template's ``tools`` variable."""
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": dict(tool_schema(t)),
            },
        }
        for t in tools
    ]


def object_arguments(template: str) -> bool:
    """Whether ``template`` takes a call's arguments as an object (most do,
    writing them with ``tojson`` or by key); False when it joins them to
    strings as they are, so they must be JSON text."""
    return bool(_HANDLED.search(template)) or not _CONCATENATED.search(template)


def _mistral_id(call_id: str) -> str:
    if _MISTRAL_ID.fullmatch(call_id):
        return call_id
    digest = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    out = []
    for _ in range(9):
        digest, k = divmod(digest, len(_ALNUM))
        out.append(_ALNUM[k])
    return "".join(out)


def template_messages(
    messages: Sequence[Message], family: Family, object_args: bool = True
) -> list[dict[str, Any]]:
    """``messages`` as a template's ``messages`` variable. Call ids are made
    to the family's form where its templates require one (the same id in the
    call and in its result); a tool result without a ``name`` gets its
    call's; arguments are objects, or JSON text with ``object_args`` False."""
    ids: dict[str, str] = {}
    names: dict[str, str] = {}
    count = 0

    def fix(call_id: str, name: str) -> str:
        nonlocal count
        if call_id not in ids:
            if family.name == "mistral":
                ids[call_id] = _mistral_id(call_id)
            elif family.name == "kimi-k2" and not _KIMI_ID.fullmatch(call_id):
                ids[call_id] = f"functions.{name}:{count}"
            else:
                ids[call_id] = call_id
            names[call_id] = name
            count += 1
        return ids[call_id]

    out: list[dict[str, Any]] = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                try:
                    args: Any = json.loads(c.arguments) if c.arguments.strip() else {}
                except ValueError:
                    args = c.arguments
                calls.append(
                    {
                        "id": fix(c.id, c.name),
                        "type": "function",
                        "function": {
                            "name": c.name,
                            "arguments": args if object_args else c.arguments,
                        },
                    }
                )
            d["tool_calls"] = calls
        if m.role == "tool":
            d["tool_call_id"] = ids.get(m.tool_call_id, m.tool_call_id)
            d["name"] = m.name or names.get(m.tool_call_id, "")
        out.append(d)
    return out
