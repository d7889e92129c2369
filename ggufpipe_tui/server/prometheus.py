"""Prometheus' text exposition format, version 0.0.4, written by hand: a
page of ``# HELP``/``# TYPE`` headers and samples
(https://prometheus.io/docs/instrumenting/exposition_formats/). The server
has some twenty series, which the ``/metrics`` handler
(:mod:`ggufpipe_tui.server.operator`) writes from its counters; a client
library would bring a registry of its own for what it already keeps."""

from __future__ import annotations

import math

#: The Content-Type of a page in this format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def number(value: float) -> str:
    """A sample's value: integers as such, floats in Go's forms for the odd ones."""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def label_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def help_text(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


class Exposition:
    """One page: headers and samples in the order given."""

    def __init__(self) -> None:
        self._lines: list[str] = []

    def header(self, name: str, kind: str, description: str) -> None:
        self._lines.append(f"# HELP {name} {help_text(description)}")
        self._lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, value: float, **labels: str) -> None:
        if labels:
            inner = ",".join(f'{key}="{label_value(text)}"' for key, text in labels.items())
            name = f"{name}{{{inner}}}"
        self._lines.append(f"{name} {number(value)}")

    def counter(self, name: str, description: str, value: float) -> None:
        self.header(name, "counter", description)
        self.sample(name, value)

    def gauge(self, name: str, description: str, value: float) -> None:
        self.header(name, "gauge", description)
        self.sample(name, value)

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"
