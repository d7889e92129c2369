"""One ``--serve`` per test module for the agents' end-to-end tests: two
stages of SmolLM2 (a thread each), our own Hermes-style tool template (the
model's own knows no tools) and a CORS origin; and the tools they offer."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.support.common import agent_pids, wait_no_new_agents
from tests.support.served import Served, start_server
from tests.support.tool_templates import HERMES

TWO_STAGES = "- {host: here, layers: [0, 15]}\n- {host: here, layers: [15, 30]}\n"
ORIGIN = "http://example.test"

WEATHER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "the city's name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": WEATHER_PARAMETERS,
    },
}
TIME_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"timezone": {"type": "string"}},
    "required": ["timezone"],
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time now in a timezone.",
        "parameters": TIME_PARAMETERS,
    },
}
PARIS = "What is the weather in Paris right now?"


@contextmanager
def agent_server(tmp_path: Path, model_path: Path, *args: str) -> Iterator[Served]:
    """The server, stopped at the end; it must exit cleanly and leave no agent."""
    template = tmp_path / "hermes.jinja"
    template.write_text(HERMES)
    before = agent_pids()
    served = start_server(
        tmp_path,
        model_path,
        "--chat-template-file",
        str(template),
        "--cors-origin",
        ORIGIN,
        *args,
        stages=TWO_STAGES,
        here="{local: true, threads: 1}",
        context=2048,
    )
    try:
        yield served
    finally:
        code = served.stop()
        left = wait_no_new_agents(before)
    assert code == 0, "".join(served.lines)
    assert not left, f"agents left behind: {sorted(left)}"
