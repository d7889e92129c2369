"""Typed access to an inventory's YAML nodes, each error naming the file,
the line and the key (``inventory.yaml:7: run.top_k: expected an integer``),
and the sizes it gives (``12GiB``)."""

from __future__ import annotations

import math
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from ggufpipe_tui.core.errors import InventoryError


class NodeReader:
    """Typed access to YAML nodes, with the line of each for errors."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, node: yaml.Node | None, key: str, message: str) -> InventoryError:
        line = node.start_mark.line + 1 if node is not None else 1
        return InventoryError(f"{self.path}:{line}: {key}: {message}")

    def mapping(self, node: yaml.Node, key: str, allowed: tuple[str, ...]) -> dict[str, yaml.Node]:
        if not isinstance(node, yaml.MappingNode):
            raise self.fail(node, key, "expected a mapping")
        result: dict[str, yaml.Node] = {}
        for key_node, value_node in node.value:
            name = key_node.value
            full = name if key == "inventory" else f"{key}.{name}"
            if not isinstance(key_node, yaml.ScalarNode) or name not in allowed:
                known = ", ".join(allowed)
                raise self.fail(key_node, full, f"unknown key (known: {known})")
            if name in result:
                raise self.fail(key_node, full, "given twice")
            result[name] = value_node
        return result

    def scalar(self, node: yaml.Node, key: str, kind: type) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            raise self.fail(node, key, f"expected {kind_name(kind)}")
        try:
            value = yaml.safe_load(yaml.serialize(node)) if node.value != "" else None
        except (yaml.YAMLError, ValueError, KeyError, AttributeError, TypeError, IndexError):
            # A tag that does not fit its text (!!bool maybe, !!int abc) or
            # that safe_load does not construct (!custom, !!python/...), or that
            # its constructor trips over (!!int -).
            got = f"{node.tag} {node.value!r}"
            raise self.fail(node, key, f"expected {kind_name(kind)}, got {got}") from None
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            try:
                value = float(value)
            except OverflowError:
                raise self.fail(node, key, f"{node.value!r} is too large a number") from None
        if kind is str and isinstance(value, int | float) and not isinstance(value, bool):
            value = str(node.value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.fail(node, key, f"expected {kind_name(kind)}, got {node.value!r}")
        return value

    def strings(self, node: yaml.Node, key: str) -> tuple[str, ...]:
        if isinstance(node, yaml.SequenceNode):
            return tuple(self.scalar(item, f"{key}[{i}]", str) for i, item in enumerate(node.value))
        return (self.scalar(node, key, str),)


def kind_name(kind: type) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[kind]


def fill(reader: NodeReader, cls: type, node: yaml.Node, key: str, **extra: Any) -> Any:
    """A frozen dataclass from a mapping node whose keys are its scalar fields."""
    known = {f.name: f for f in fields(cls) if f.name not in extra}
    values = dict(extra)
    for name, value_node in reader.mapping(node, key, tuple(known)).items():
        values[name] = reader.scalar(value_node, f"{key}.{name}", field_type(known[name]))
    return cls(**values)


def field_type(f: Any) -> type:
    text = f.type if isinstance(f.type, str) else f.type.__name__
    return {"int": int, "float": float, "str": str, "bool": bool}[text]


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_size(text: str) -> int:
    """Bytes from ``12GiB``, ``12 GB``, ``512MiB``, ``1.5T`` or a plain integer.
    GiB/MiB/KiB/TiB are powers of 1024; GB/MB/KB/TB (and G/M/K/T) of 1000, as
    written on the box. Raises ValueError."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a size (e.g. 12GiB, 16GB, 512MiB or bytes)")
    number, unit = match.group(1), (match.group(2) or "").lower()
    binary = "i" in unit
    scale = 1024 ** "bkmgt".index(unit[0]) if binary else _UNITS[unit[:1]]
    value = float(number) * scale
    if value < 1:
        raise ValueError(f"{text!r} is less than one byte")
    if not math.isfinite(value) or value >= 1 << 62:
        raise ValueError(f"{text!r} is more bytes than any host has")
    return int(value)


def size_of(reader: NodeReader, node: yaml.Node, key: str) -> int:
    if not isinstance(node, yaml.ScalarNode):
        raise reader.fail(node, key, "expected a size such as 12GiB")
    try:
        return parse_size(node.value)
    except ValueError as error:
        raise reader.fail(node, key, str(error)) from None
