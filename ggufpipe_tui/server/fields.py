"""What every front door of the server checks a request with: the error
answer (:class:`ApiError`, an OpenAI error body), the field checks that name
the field they refuse, and :class:`StopScanner`, which applies stop strings
to text as it streams. Pure."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ggufpipe_agent.errors import GgufpipeError
from ggufpipe_agent.wire.codec import text_problem

#: The most stop strings a request may give (OpenAI allows 4).
MAX_STOPS = 16
INT64 = 1 << 63
#: How much of a refused value an error quotes: a field of a 30-tool agent's
#: request is named, not written back whole.
SHOWN = 80


def shown(value: object) -> str:
    """``repr(value)``, cut to :data:`SHOWN` characters."""
    text = repr(value)
    return text if len(text) <= SHOWN else f"{text[: SHOWN - 20]}... ({len(text)} characters)"


class ApiError(GgufpipeError):
    """An answer that is an error: HTTP status and the OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers or {}  # e.g. Retry-After on a 503 while the pipeline recovers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def text(text: str, where: str) -> str:
    """Text that can reach the stages, or a 400 naming the field."""
    problem = text_problem(text)
    if problem:
        raise bad(where, problem)
    return text


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def number(
    fields: Mapping[str, Any], name: str, low: float, high: float, low_open: bool = False
) -> float | None:
    value = fields.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad(name, f"a number is required, not {shown(value)}")
    try:
        finite = math.isfinite(value)  # Python's JSON reads NaN and Infinity, and integers of any size
    except OverflowError:
        finite = False
    if not finite:
        raise bad(name, f"a finite number is required, not {shown(value)}")
    if value < low or value > high or (low_open and value == low):
        bound = "(" if low_open else "["
        raise bad(name, f"{value!r} is not in {bound}{low:g}, {high:g}]")
    return float(value)


def integer(fields: Mapping[str, Any], name: str, low: int, high: int) -> int | None:
    value = fields.get(name)
    if value is None:
        return None
    if not is_int(value):
        raise bad(name, f"an integer is required, not {shown(value)}")
    if not low <= value <= high:
        raise bad(name, f"{value} is not in [{low}, {high}]")
    return int(value)


def stops(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", "a string or a list of strings is required")
    if len(stops) > MAX_STOPS:
        raise bad("stop", f"at most {MAX_STOPS} stop strings, not {len(stops)}")
    for stop in stops:
        text(stop, "stop")
    return tuple(s for s in stops if s)  # an empty stop string stops nothing (as llama.cpp)


def boolean(fields: Mapping[str, Any], name: str) -> bool | None:
    value = fields.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad(name, f"true or false is required, not {shown(value)}")
    return value


# -------------------------------------------------------------- stop strings


class StopScanner:
    """Applies stop strings to text as it streams: :meth:`feed` returns the
    text that can go out now and holds back any tail that may be the start of
    a stop string; once one appears, :attr:`stopped` is set and neither it
    nor anything after it is returned."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.held = ""
        self.stopped = ""  # the stop string that ended the text

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        text = self.held + piece
        if not self.stops:
            self.held = ""
            return text
        found = [(text.find(stop), stop) for stop in self.stops]
        hits = [(at, stop) for at, stop in found if at >= 0]
        if hits:
            at, stop = min(hits)
            self.stopped, self.held = stop, ""
            return text[:at]
        keep = max((self._overlap(text, stop) for stop in self.stops), default=0)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The end of the text: what was held back goes out."""
        held, self.held = self.held, ""
        return "" if self.stopped else held

    @staticmethod
    def _overlap(text: str, stop: str) -> int:
        """The longest tail of ``text`` that begins ``stop`` (shorter than it)."""
        for length in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:length]):
                return length
        return 0
