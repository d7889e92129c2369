"""Nothing cut short looks whole (issue 39): SIGTERM while four long replies
run (``--parallel 4``) past the shutdown's grace. Each streamed one keeps the
text it was sent and ends with its API's error naming the shutdown, as the
real SDKs read it (OpenAI's chat raises an APIError, Anthropic's SDK an
APIError from its ``error`` event, Responses ends with ``response.failed``),
none with a finish; the one not streamed is a 503 with the error body; and
each has one log line that says 503, not 200."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from tests.support.agent_served import TWO_STAGES
from tests.support.served import KEY, Served, start_server

pytestmark = [pytest.mark.model, pytest.mark.slow]

#: Longer than the grace (10 s) at any speed this machine runs four at.
LONG = 1500
PROMPT = "Repeat the word hello 5000 times."  # greedy SmolLM2 does, past any max_tokens
EXTRA = {"ignore_eos": True, "temperature": 0}  # llama-server's field (OpenAI's doors)


def openai_chat(served: Served, started: threading.Event, out: dict[str, Any]) -> None:
    text: list[str] = []
    try:
        stream = served.client().chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=LONG,
            stream=True,
            extra_body=EXTRA,
        )
        for chunk in stream:
            for choice in chunk.choices:
                text.append(choice.delta.content or "")
                out.setdefault("finishes", []).extend([choice.finish_reason] if choice.finish_reason else [])
            if len(text) > 3:
                started.set()
    except openai.APIError as error:
        out["error"] = str(error)
    out["text"] = "".join(text)


def anthropic_messages(served: Served, started: threading.Event, out: dict[str, Any]) -> None:
    client = anthropic.Anthropic(base_url=served.url, api_key=KEY, max_retries=0)
    text: list[str] = []
    try:
        with client.messages.stream(
            model="m",
            max_tokens=LONG,
            messages=[{"role": "user", "content": PROMPT}],
        ) as stream:
            for event in stream:
                if event.type == "text":
                    text.append(event.text)
                    if len(text) > 3:
                        started.set()
                elif event.type == "message_delta":
                    out["stop_reason"] = event.delta.stop_reason
    except anthropic.APIError as error:
        out["error"] = str(error)
    out["text"] = "".join(text)


def responses(served: Served, started: threading.Event, out: dict[str, Any]) -> None:
    text: list[str] = []
    events: list[Any] = []
    stream = served.client().responses.create(model="m", input=PROMPT, max_output_tokens=LONG, stream=True)
    for event in stream:
        events.append(event)
        if event.type == "response.output_text.delta":
            text.append(event.delta)
            if len(text) > 3:
                started.set()
    out["last"] = events[-1]
    out["text"] = "".join(text)


def whole(served: Served, started: threading.Event, out: dict[str, Any]) -> None:
    async def main() -> None:
        body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": LONG, **EXTRA}
        headers = {"Authorization": f"Bearer {KEY}"}
        async with (
            aiohttp.ClientSession(headers=headers) as http,
            http.post(served.url + "/v1/chat/completions", json=body) as response,
        ):
            out["status"], out["body"] = response.status, await response.json()

    asyncio.run(main())


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(word) for word in out.split()]


def test_a_shutdown_cuts_replies_short_and_says_so(tmp_path: Path, model_path: Path) -> None:
    kinds: list[Callable[[Served, threading.Event, dict[str, Any]], None]] = [
        openai_chat,
        anthropic_messages,
        responses,
        whole,
    ]
    served = start_server(
        tmp_path,
        model_path,
        "--parallel",
        "4",
        stages=TWO_STAGES,
        here="{local: true, threads: 1}",
        context=2048,
    )
    agents = children(served.process.pid)
    try:
        outs: list[dict[str, Any]] = [{} for _ in kinds]
        started = [threading.Event() for _ in kinds]
        threads = [
            threading.Thread(target=kind, args=(served, event, out), daemon=True)
            for kind, event, out in zip(kinds, started, outs, strict=True)
        ]
        for thread in threads:
            thread.start()
        for event in started[:3]:
            assert event.wait(120), "".join(served.lines)
        time.sleep(1.0)  # the one not streamed is running too (4 slots)
        served.process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(120)
        assert served.process.wait(60) == 0, "".join(served.lines)
    finally:
        served.stop()
    assert not [pid for pid in agents if Path(f"/proc/{pid}").exists()], "no agent left"
    lines = "".join(served.lines)
    chat, messages, response, plain = outs
    assert "shutting down" in chat.get("error", ""), chat
    assert chat["text"] and not chat.get("finishes"), "the text kept, no finish"
    assert "shutting down" in messages.get("error", ""), messages
    assert messages["text"] and "stop_reason" not in messages, "no message_delta: no stop reason"
    last = response["last"]
    assert last.type == "response.failed" and "shutting down" in last.response.error.message, last
    assert response["text"]
    assert plain["status"] == 503, plain
    assert "shutting down" in plain["body"]["error"]["message"]
    assert plain["body"]["error"]["type"] == "unavailable_error"
    logged = [line for line in served.lines if " POST /v1/" in line]
    assert len(logged) == 4, lines
    for line in logged:
        assert " 503 " in line and ("shutting down" in line or "cut short by the shutdown" in line), line
        assert " 200 " not in line, line
    streamed = [line for line in logged if "cut short by the shutdown" in line and "none sent" not in line]
    assert len(streamed) == 3 and all("completion 0 tokens" not in line for line in streamed), lines
    (unstreamed,) = [line for line in logged if line not in streamed]
    assert "completion 0 tokens" in unstreamed and "none sent (not streamed)" in unstreamed, unstreamed
