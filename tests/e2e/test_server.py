"""``ggufpipe-tui INVENTORY --serve``: the OpenAI-compatible server as a real
subprocess (real agents, llama.cpp on SmolLM2), driven by the official
``openai`` package and, where a client library would hide what is on the
wire (a body that is not JSON, a missing key, a client that goes away), by
plain HTTP with aiohttp's client."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest

from tests.support.common import agent_pids, wait_no_new_agents, whole_model_greedy
from tests.support.local import run_cli
from tests.support.served import KEY, Served, raw, start_server

pytestmark = [pytest.mark.model, pytest.mark.slow]

FRANCE = "What is the capital of France? Answer in one short sentence."
COUNT = "Count from one to one hundred, one number per line."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[Served]:
    before = agent_pids()
    served = start_server(tmp_path_factory.mktemp("server"), model_path, "--queue", "2", "--parallel", "3")
    try:
        yield served
    finally:
        code = served.stop()
        left = wait_no_new_agents(before)
    assert code == 0, "".join(served.lines)
    assert not left, f"agents left behind: {sorted(left)}"


@pytest.fixture(scope="module")
def headless(server: Served) -> dict[str, dict[str, object]]:
    """The same prompts through headless --prompt, for equality."""
    answers = {}
    for name, args in {
        "chat": ("--prompt", FRANCE, "--max-tokens", "24"),
        "raw": ("--prompt", "Once upon a time", "--raw", "--max-tokens", "24"),
    }.items():
        done = run_cli(str(server.inventory), *args, "--json", "-q")
        assert done.returncode == 0, done.stderr
        answers[name] = json.loads(done.stdout)
    return answers


def reply_tokens(answer: dict[str, object]) -> int:
    """Tokens of the reply text: headless counts the end-of-text token too."""
    tokens = answer["tokens"]
    assert isinstance(tokens, list)
    return len(tokens) - (answer["stop_reason"] == "eos")


def test_models_and_health(server: Served) -> None:
    models = server.client().models.list()
    assert [model.id for model in models.data] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert models.data[0].owned_by == "ggufpipe"
    counts = {"stages_lost": 0, "repairs": 0, "runs_replayed": 0, "recoveries": 0}
    health = (200, {"status": "ok", "requests": 0, "queue": 2, "slots": 3, **counts})
    assert raw(server, "GET", "/health", key=None) == health, "health needs no key"
    assert any(line.startswith("  curl -s http://127.0.0.1:") for line in server.lines), (
        "a curl example at start"
    )


def test_chat_plain_and_streamed_equal_headless(
    server: Served, headless: dict[str, dict[str, object]]
) -> None:
    expected = headless["chat"]
    client = server.client()
    messages: list[dict[str, str]] = [{"role": "user", "content": FRANCE}]
    plain = client.chat.completions.create(model="whatever", messages=messages, max_tokens=24, temperature=0)  # type: ignore[arg-type]
    assert plain.object == "chat.completion" and plain.id.startswith("chatcmpl-")
    assert plain.model == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert plain.choices[0].message.role == "assistant"
    assert plain.choices[0].message.content == expected["text"] and "Paris" in str(expected["text"])
    assert plain.choices[0].finish_reason == ("stop" if expected["stop_reason"] == "eos" else "length")
    assert plain.usage is not None
    assert plain.usage.prompt_tokens == len(expected["prompt_tokens"])  # type: ignore[arg-type]
    assert plain.usage.completion_tokens == reply_tokens(expected)
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens

    chunks = list(
        client.chat.completions.create(
            model="whatever",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({chunk.id for chunk in chunks}) == 1 and all(
        c.object == "chat.completion.chunk" for c in chunks
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == expected["text"]
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 3, (
        "streamed, not in one piece"
    )
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [plain.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        plain.usage.prompt_tokens,
        plain.usage.completion_tokens,
        plain.usage.total_tokens,
    )
    # The same messages again: the stages kept all of the prompt but its last
    # token from the request before (prefix reuse), and the text is the cold run's.
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def test_a_follow_up_request_reuses_the_conversation_so_far(server: Served, model_path: Path) -> None:
    """A chat client sends the whole conversation each time; the stages keep
    what the previous request computed and prefill only the rest, and the
    answer is the one a cold run of the same tokens gives."""
    client = server.client()
    first: list[dict[str, str]] = [{"role": "user", "content": FRANCE}]
    france = client.chat.completions.create(model="m", messages=first, max_tokens=24)  # type: ignore[arg-type]
    assert france.usage is not None and "Paris" in str(france.choices[0].message.content)
    turns = [
        *first,
        {"role": "assistant", "content": str(france.choices[0].message.content)},
        {"role": "user", "content": "And of Italy?"},
    ]
    raw = client.chat.completions.with_raw_response.create(model="m", messages=turns, max_tokens=24)  # type: ignore[arg-type]
    italy = raw.parse()
    assert "Rome" in str(italy.choices[0].message.content), italy.choices[0].message.content
    assert italy.usage is not None and italy.usage.prompt_tokens_details is not None
    cached = italy.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and france.usage.prompt_tokens < cached < italy.usage.prompt_tokens, cached
    run = raw.headers["x-ggufpipe-run"]
    line = server.wait_line(lambda text: run in text and " 200 " in text, 10, "the request's log line")
    assert f"reused {cached} of {italy.usage.prompt_tokens} prompt tokens" in line, line
    (finished,) = [e for e in server.run_log(run) if e["event"] == "RunFinished"]
    result = finished["result"]
    assert isinstance(result, dict) and result["prompt_reused"] == cached
    cold = whole_model_greedy(
        model_path, result["prompt_tokens"], len(result["tokens"]), n_ctx=512, n_ubatch=32
    )
    assert result["tokens"] == cold, "the follow-up differs from a cold run of the same tokens"


def test_a_completion_and_stop_strings(server: Served, headless: dict[str, dict[str, object]]) -> None:
    expected = headless["raw"]
    text = str(expected["text"])
    client = server.client()
    plain = client.completions.create(model="m", prompt="Once upon a time", max_tokens=24)
    assert plain.object == "text_completion" and plain.choices[0].text == text
    assert plain.choices[0].finish_reason == "length" and plain.usage is not None
    assert plain.usage.completion_tokens == 24 and plain.usage.prompt_tokens == len(expected["prompt_tokens"])  # type: ignore[arg-type]

    stop = " " + text.split()[3]  # a word of the greedy continuation: it stops there
    cut = text[: text.index(stop)]
    stopped = client.completions.create(
        model="m", prompt="Once upon a time", max_tokens=24, stop=[stop, "zzz"]
    )
    assert stopped.choices[0].text == cut and stopped.choices[0].finish_reason == "stop"
    assert stopped.usage is not None and stopped.usage.completion_tokens < 24
    pieces = list(
        client.completions.create(model="m", prompt="Once upon a time", max_tokens=24, stop=stop, stream=True)
    )
    assert "".join(p.choices[0].text for p in pieces) == cut
    assert pieces[-1].choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": FRANCE}], max_tokens=24, stop=["Paris"]
    )
    assert (
        chat.choices[0].message.content == "The capital of France is "
        and chat.choices[0].finish_reason == "stop"
    )


def test_each_request_samples_as_it_asks(server: Served) -> None:
    client = server.client()
    messages: list[dict[str, str]] = [{"role": "user", "content": "Write a short poem about the sea."}]

    def ask(**options: object) -> tuple[str, str]:
        raw = client.chat.completions.with_raw_response.create(
            model="m", messages=messages, max_tokens=12, **options
        )  # type: ignore[arg-type]
        return str(raw.parse().choices[0].message.content), raw.headers["x-ggufpipe-run"]

    first, run = ask(temperature=1.0, seed=11)
    again, _ = ask(temperature=1.0, seed=11)
    others = {ask(temperature=1.0, seed=seed)[0] for seed in (12, 13)}
    assert first == again, "the same seed samples the same"
    assert others != {first}, "another seed samples otherwise"
    plans = [e for e in server.run_log(run) if e["event"] == "PlanMade"]
    assert plans[0]["plan"]["sampling"]["temperature"] == 1.0 and plans[0]["plan"]["sampling"]["seed"] == 11  # type: ignore[index]
    greedy, run = ask(temperature=0)
    assert greedy == ask()[0], "greedy again: the inventory's sampling"


def test_malformed_requests_and_api_keys(server: Served) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="m", messages=[])
    assert refused.value.status_code == 400
    assert refused.value.body == {
        "message": "messages: a non-empty list of messages is required",
        "type": "invalid_request_error",
        "param": "messages",
        "code": None,
    }
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], temperature=7)
    with pytest.raises(openai.BadRequestError) as overflow:
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], max_tokens=100_000
        )
    assert isinstance(overflow.value.body, dict) and overflow.value.body["code"] == "context_length_exceeded"
    assert "maximum context length is 512 tokens" in overflow.value.body["message"]

    status, body = raw(server, "POST", "/v1/chat/completions", data=b"{nope")
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}  # type: ignore[arg-type]
    assert raw(server, "GET", "/v1/nothing")[0] == 404

    with pytest.raises(openai.AuthenticationError) as wrong:
        server.client(key="sk-wrong").models.list()
    assert wrong.value.status_code == 401 and isinstance(wrong.value.body, dict)
    assert wrong.value.body["code"] == "invalid_api_key"
    status, body = raw(server, "POST", "/v1/completions", key=None, json={"prompt": "x"})
    assert status == 401 and "missing API key" in body["error"]["message"]  # type: ignore[index]
    assert client.completions.create(model="m", prompt="Hi", max_tokens=2).choices[0].text, "still serving"


def test_a_client_that_goes_away_stops_its_run(server: Served) -> None:
    body = {"messages": [{"role": "user", "content": COUNT}], "max_tokens": 400, "stream": True}

    async def go_away() -> str:
        async with (
            aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as http,
            http.post(f"{server.url}/v1/chat/completions", json=body) as response,
        ):
            assert response.headers["content-type"].startswith("text/event-stream")
            seen = 0
            async for line in response.content:
                seen += line.startswith(b"data: {")
                if seen >= 6:
                    break  # leaving the block closes the connection mid-stream
            return response.headers["x-ggufpipe-run"]

    run = asyncio.run(go_away())
    # The next request is served, and the one that went away stopped early.
    answer = server.client().chat.completions.create(
        model="m", messages=[{"role": "user", "content": FRANCE}], max_tokens=24
    )
    assert "Paris" in str(answer.choices[0].message.content)
    finished = [e for e in server.run_log(run) if e["event"] == "RunFinished"]
    result = finished[0]["result"]
    assert result["stop_reason"] == "stopped" and 5 <= len(result["tokens"]) < 400, result  # type: ignore[index]
    server.wait_line(lambda line: " 499 " in line and run in line, 10, "the request's log line")


def test_concurrent_requests_are_in_flight_together_and_each_equals_it_alone(server: Served) -> None:
    """Three stages, --parallel 3 (docs/architecture.md, "Runs in flight"): three requests run at
    once, and each greedy answer is the one the same request gets alone (both
    cold: cache_prompt false, so both compute the same batches)."""
    prompts = ["Name a colour.", "Name a fruit.", "Name an animal."]

    async def main() -> list[tuple[float, float, str]]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)

        async def one(prompt: str) -> tuple[float, float, str]:
            stream = await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": prompt}],
                max_tokens=16,
                stream=True,
                extra_body={"cache_prompt": False},  # cold, as the lone requests below
            )
            first = last = 0.0
            text = ""
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    last = time.monotonic()
                    first = first or last
                    text += chunk.choices[0].delta.content
            return first, last, text

        try:
            return await asyncio.gather(*(one(prompt) for prompt in prompts))
        finally:
            await client.close()

    served = asyncio.run(main())
    assert max(first for first, _, _ in served) < min(last for _, last, _ in served), "they overlapped"
    client = server.client()
    for prompt, (_, _, text) in zip(prompts, served, strict=True):
        alone = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=16,
            extra_body={"cache_prompt": False},
        )
        assert alone.choices[0].message.content == text, prompt


def test_a_full_queue_is_refused_not_left_hanging(server: Served) -> None:
    # Long enough not to end while the queue fills: no EOS before 400 tokens.
    endless = "Count from one to one thousand, one number per line."
    long = {"messages": [{"role": "user", "content": endless}], "max_tokens": 400, "stream": True}
    short = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    url = f"{server.url}/v1/chat/completions"

    async def main() -> tuple[int, dict[str, object]]:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as http:
            running = [await http.post(url, json=long) for _ in range(3)]  # every slot (3) busy
            for response in running:
                async for line in response.content:
                    if line.startswith(b"data: {"):
                        break  # running: the queue (2) fills behind them
            try:
                waiting = [asyncio.ensure_future(http.post(url, json=short)) for _ in range(2)]
                # Until both wait, admitted behind the running ones (on a busy
                # machine the server's loop may take a while to take them).
                deadline = time.monotonic() + 30
                while True:
                    async with http.get(f"{server.url}/health") as health:
                        if (await health.json())["requests"] == 5:
                            break
                    assert time.monotonic() < deadline, "the two requests never reached the queue"
                    await asyncio.sleep(0.05)
                started = time.monotonic()
                async with http.post(url, json=short) as refused:
                    answer = refused.status, await refused.json()
                assert time.monotonic() - started < 5, "a full queue answers at once"
                for task in waiting:
                    task.cancel()  # they go away: withdrawn from the queue
                await asyncio.gather(*waiting, return_exceptions=True)
            finally:
                for response in running:
                    response.close()  # they go away: their runs stop
            return answer

    status, body = asyncio.run(main())
    assert status == 503
    error = body["error"]
    assert (
        isinstance(error, dict)
        and error["type"] == "unavailable_error"
        and "queue is full" in error["message"]
    )
    assert server.client().completions.create(model="m", prompt="Hi", max_tokens=2).choices[0].text


def test_sigterm_finishes_the_running_request_and_leaves_no_agent(
    tmp_path: Path, model_path: Path, no_agent_left: None
) -> None:
    served = start_server(tmp_path, model_path)
    try:
        client = served.client()
        stream = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": FRANCE}], max_tokens=24, stream=True
        )
        chunks = iter(stream)
        first = next(chunks)
        assert first.choices[0].delta.role == "assistant"
        served.process.send_signal(signal.SIGTERM)
        rest = list(chunks)
        text = "".join(c.choices[0].delta.content or "" for c in rest if c.choices)
        assert "Paris" in text and rest[-1].choices[0].finish_reason == "stop", "the running request finished"
        assert served.process.wait(60) == 0, "".join(served.lines)
    finally:
        served.stop()
    assert any("shutting down: signal received" in line for line in served.lines)
    assert served.lines[-1].strip() == "ggufpipe: every stage is torn down"
    with pytest.raises(aiohttp.ClientConnectionError):
        raw(served, "GET", "/health")


def children(pid: int) -> list[int]:
    out = subprocess.run(
        ["ps", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True
    ).stdout
    return sorted(int(line.split()[0]) for line in out.splitlines() if "ggufpipe_agent" in line)


def test_a_fault_ends_the_server_with_its_reason(
    tmp_path: Path, model_path: Path, no_agent_left: None
) -> None:
    """With recovery off (tests/e2e/test_server_recovery.py has it on)."""
    served = start_server(tmp_path, model_path, data="recovery: {attempts: 0}\n")
    try:
        agents = children(served.process.pid)
        assert len(agents) == 3, agents
        stream = served.client().chat.completions.create(
            model="m", messages=[{"role": "user", "content": COUNT}], max_tokens=400, stream=True
        )
        chunks = iter(stream)
        for _ in range(4):
            next(chunks)
        os.kill(agents[1], signal.SIGKILL)
        with pytest.raises(openai.APIError, match="the pipeline faulted: stage"):
            for _ in chunks:
                pass
        assert served.process.wait(60) == 1, "".join(served.lines)
    finally:
        served.stop()
    assert any("shutting down: the pipeline stopped: stage" in line for line in served.lines), served.lines
    assert any(" 500 " in line and "faulted" in line for line in served.lines)
