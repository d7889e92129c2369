"""The server's operator endpoints (/tokenize, /detokenize, /props, /slots,
/metrics), CORS and the 404's list of what is served, against an aiohttp
test client on a Server over the fake pipeline (tests/support/fakes.py): no
agents, no llama.cpp."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from ggufpipe_agent.ids import SlotId
from ggufpipe_agent.wire.protocol import ChatMessage, StepCounters
from ggufpipe_tui.core.events import Event, RunFinished, RunResult, StageStats, Timings
from ggufpipe_tui.core.inventory import RunOptions
from ggufpipe_tui.core.recovery import Counts
from ggufpipe_tui.server.http import Server
from ggufpipe_tui.server.metrics import Metrics
from ggufpipe_tui.session.driver import RunDriver
from ggufpipe_tui.session.runs import Prompt, RunHandle
from tests.support.fakes import FACTS, PIECES, FakePipeline, served
from tests.support.prometheus import parse

# Token 1 is BOS; "a" 9, "b" 10; "é" is b"\xc3\xa9" over 12 and 13.
TABLE = (*PIECES[:1], b"", *PIECES[2:9], b"a", b"b", b"\xa9", b"\xc3", b"\xa9", b"\xe2\x82", b"\xac")
WORDS = {"a": [9], "b": [10], "é": [12, 13]}
KEY = "sk-operator"
ORIGIN = "http://localhost:5173"


class Counted:
    """The recovery counts a real pipeline's Recovery keeps."""

    def __init__(self) -> None:
        self.counts = Counts()


class Pipeline(FakePipeline):
    """The fake pipeline with what the server reads of a real one."""

    def __init__(self, slots: int = 2, delay: float = 0.0) -> None:
        super().__init__(slots=slots, delay=delay)
        self.facts = replace(FACTS, bos_token_id=1, add_bos=True, chat_template="{{ messages }}")
        self.pieces = TABLE
        self.parallel = max(1, slots)
        self.on_slot: list[Any] = [None] * self.parallel
        self.recovery = Counted()
        self.recovering = False
        self.subscribers: list[Callable[[Event], None]] = []

    def subscribe(self, callback: Callable[[Event], None]) -> Callable[[], None]:
        self.subscribers.append(callback)
        return lambda: self.subscribers.remove(callback)

    async def prepare_run(
        self, options: RunOptions | None = None, *, slot: int = 0, reuse: bool = True
    ) -> RunDriver:
        driver = await super().prepare_run(options, slot=slot, reuse=reuse)
        driver.plan = replace(driver.plan, slot=SlotId(slot))
        self.on_slot[slot] = driver  # the last run of each slot, as Pipeline keeps it
        return driver

    def submit(self, prompt: Prompt, stream: bool = False) -> RunHandle:
        return self.queue.submit(prompt, stream)

    async def tokenize(
        self, text: str, chat: bool, messages: Sequence[ChatMessage] = (), tools: str = "", template: str = ""
    ) -> tuple[list[int], str]:
        return [1, *(token for char in text for token in WORDS.get(char, [3]))], text


async def client_for(
    pipeline: Pipeline, api_key: str = "", origins: Sequence[str] = ()
) -> tuple[Server, TestClient[Any, Any]]:
    server = Server(pipeline, pipeline.inventory, api_key=api_key, err=io.StringIO(), cors_origins=origins)  # type: ignore[arg-type]
    server.ready = True
    client: TestClient[Any, Any] = TestClient(TestServer(server.app))
    await client.start_server()
    return server, client


@pytest.fixture
async def operator() -> AsyncIterator[tuple[Server, TestClient[Any, Any]]]:
    server, client = await client_for(Pipeline())
    yield server, client
    await client.close()


async def test_tokenize_as_llama_server(operator: tuple[Server, TestClient[Any, Any]]):
    _, client = operator
    reply = await client.post("/tokenize", json={"content": "ab"})
    assert reply.status == 200 and await reply.json() == {"tokens": [9, 10]}, "no BOS unless add_special"
    reply = await client.post("/tokenize", json={"content": "ab", "add_special": True})
    assert await reply.json() == {"tokens": [1, 9, 10]}
    reply = await client.post("/tokenize", json={"content": "aé", "with_pieces": True})
    pieces = (await reply.json())["tokens"]
    # A piece that is no UTF-8 text by itself is its byte values, as llama-server gives it.
    assert pieces == [{"id": 9, "piece": "a"}, {"id": 12, "piece": [0xC3]}, {"id": 13, "piece": [0xA9]}]
    reply = await client.post("/tokenize", json={"content": ["a", 10, "b"]})
    assert await reply.json() == {"tokens": [9, 10, 10]}, "a mixed prompt: text and token ids"
    assert await (await client.post("/tokenize", json={})).json() == {"tokens": []}


async def test_detokenize_and_bad_tokens(operator: tuple[Server, TestClient[Any, Any]]):
    _, client = operator
    reply = await client.post("/detokenize", json={"tokens": [9, 12, 13, 10]})
    assert reply.status == 200 and await reply.json() == {"content": "aéb"}
    assert await (await client.post("/detokenize", json={"tokens": []})).json() == {"content": ""}
    reply = await client.post("/detokenize", json={"tokens": [9, 99]})
    assert reply.status == 400
    assert (await reply.json())["error"]["message"] == "tokens[1]: 99 is not a token id of this model"
    reply = await client.post("/tokenize", json={"content": "a", "with_pieces": "yes"})
    assert reply.status == 400 and "with_pieces" in (await reply.json())["error"]["message"]
    reply = await client.post("/tokenize", data=b"{not json")
    assert reply.status == 400 and "not JSON" in (await reply.json())["error"]["message"]


async def test_props_names_the_defaults_the_slots_and_the_template(
    operator: tuple[Server, TestClient[Any, Any]],
):
    server, client = operator
    props = await (await client.get("/props")).json()
    settings = props["default_generation_settings"]
    run = server.inventory.run
    assert settings["n_ctx"] == server.pipeline.model_plan().max_seq_len
    assert settings["params"]["temperature"] == run.temperature and settings["params"]["top_k"] == run.top_k
    assert settings["params"]["n_predict"] == run.max_tokens == settings["params"]["max_tokens"]
    assert props["total_slots"] == 2 and props["model_path"] == server.inventory.model_path
    assert props["chat_template"] == "{{ messages }}" and props["build_info"].startswith("ggufpipe ")


async def test_slots_say_which_run_each_slot_runs():
    pipeline = Pipeline(slots=2, delay=0.5)
    server, client = await client_for(pipeline)
    try:
        async with served(pipeline):
            idle = await (await client.get("/slots")).json()
            assert [(s["id"], s["is_processing"]) for s in idle] == [(0, False), (1, False)]
            assert all("id_task" not in s for s in idle)
            answer = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "ab"}))
            for _ in range(100):
                busy = await (await client.get("/slots")).json()
                if any(s["is_processing"] for s in busy):
                    break
                await asyncio.sleep(0.01)
            (slot,) = [s for s in busy if s["is_processing"]]
            assert slot["run"] == f"{slot['id_task']:016x}" and slot["n_ctx"] > 0
            reply = await answer
            assert reply.status == 200, await reply.text()
            run = reply.headers["X-Ggufpipe-Run"]
            after = await (await client.get("/slots")).json()
            assert not any(s["is_processing"] for s in after)
            (last,) = [s for s in after if s.get("run") == run]
            assert last["next_token"][0]["n_decoded"] == 3 and last["n_prompt_tokens"] == 3
            text = await (await client.get("/metrics")).text()
    finally:
        await client.close()
    samples = parse(text)
    assert samples[("llamacpp:tokens_predicted_total", ())] == 3
    assert samples[("llamacpp:prompt_tokens_total", ())] == 3
    assert samples[("ggufpipe_slots_total", ())] == 2
    ok = ("ggufpipe_requests_total", (("endpoint", "/v1/completions"), ("method", "POST"), ("status", "200")))
    assert samples[ok] == 1
    assert (
        samples[("ggufpipe_requests_total", (("endpoint", "/slots"), ("method", "GET"), ("status", "200")))]
        >= 3
    )


# ----------------------------------------------------------------- metrics


async def test_metrics_is_prometheus_text_with_llama_servers_names(
    operator: tuple[Server, TestClient[Any, Any]],
):
    server, client = operator
    await client.get("/nowhere")
    reply = await client.get("/metrics")
    assert reply.status == 200
    assert reply.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    samples = parse(await reply.text())
    for name in (
        "llamacpp:prompt_tokens_total",
        "llamacpp:tokens_predicted_total",
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
        "llamacpp:predicted_tokens_seconds",
        "ggufpipe_tokens_per_second",
        "ggufpipe_requests_waiting",
        "ggufpipe_slots_busy",
        "ggufpipe_recoveries_total",
        "ggufpipe_stage_losses_total",
    ):
        assert (name, ()) in samples, name
    assert samples[("ggufpipe_slots_busy", ())] == 0 and samples[("ggufpipe_ready", ())] == 1
    missed = ("ggufpipe_requests_total", (("endpoint", "other"), ("method", "GET"), ("status", "404")))
    assert samples[missed] == 1, "a path not served is 'other': scanners make no new series"


def test_stage_step_times_add_up_over_runs_from_their_reports():
    metrics = Metrics()
    # A report holds the run's totals so far: each adds what is new.
    metrics.on_event(StageStats(0x11, 0, StepCounters(steps=2, total_ms=20.0, prefill_ms=50.0)))
    metrics.on_event(StageStats(0x11, 0, StepCounters(steps=5, total_ms=60.0, prefill_ms=50.0)))
    metrics.on_event(StageStats(0x11, 1, StepCounters(steps=5, total_ms=100.0)))
    metrics.on_event(RunFinished(result(0x11)))
    metrics.on_event(StageStats(0x12, 0, StepCounters(steps=1, total_ms=8.0)))
    stage0, stage1 = metrics.stages[0], metrics.stages[1]
    assert (stage0.steps, stage0.seconds, stage0.last_mean_ms, stage0.prefill_seconds) == (
        6,
        0.068,
        8.0,
        0.05,
    )
    assert (stage1.steps, stage1.seconds, stage1.last_mean_ms) == (5, 0.1, 20.0)


def result(run_id: int, **fields: Any) -> RunResult:
    timings = Timings(ttft_ms=30, prefill_ms=20, decode_ms=100, decode_tokens_per_s=40.0)
    base = RunResult(run_id, "completed", "eos", "", (1, 2, 3), (9, 10), "ab", timings, "llama", "m")
    return replace(base, **fields)


async def test_the_metrics_page_shows_stage_steps_and_recoveries(
    operator: tuple[Server, TestClient[Any, Any]],
):
    server, client = operator
    pipeline = server.pipeline
    (feed,) = pipeline.subscribers  # type: ignore[attr-defined]
    feed(StageStats(0x11, 1, StepCounters(steps=4, total_ms=10.0)))
    pipeline.recovery.counts = Counts(stages_lost=1, repairs=1, runs_replayed=2)  # type: ignore[attr-defined]
    samples = parse(await (await client.get("/metrics")).text())
    assert samples[("ggufpipe_stage_step_seconds_count", (("stage", "1"),))] == 4
    assert samples[("ggufpipe_stage_step_seconds_sum", (("stage", "1"),))] == 0.01
    assert samples[("ggufpipe_stage_step_ms", (("stage", "1"),))] == 2.5
    assert samples[("ggufpipe_stage_losses_total", ())] == 1
    assert samples[("ggufpipe_repairs_total", ())] == 1
    assert samples[("ggufpipe_runs_replayed_total", ())] == 2
    assert samples[("ggufpipe_recoveries_total", ())] == 2, "the old name of runs replayed"


# -------------------------------------------------------------------- CORS


async def test_cors_is_off_by_default(operator: tuple[Server, TestClient[Any, Any]]):
    _, client = operator
    headers = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    reply = await client.options("/v1/chat/completions", headers=headers)
    assert reply.status == 405 and "Access-Control-Allow-Origin" not in reply.headers
    reply = await client.get("/health", headers={"Origin": ORIGIN})
    assert "Access-Control-Allow-Origin" not in reply.headers


async def test_a_preflight_is_answered_before_the_api_key_is_asked_for():
    server, client = await client_for(Pipeline(), api_key=KEY, origins=[ORIGIN])
    try:
        asked = "authorization, content-type, anthropic-version, x-api-key"
        headers = {
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": asked,
        }
        reply = await client.options("/v1/chat/completions", headers=headers)
        assert reply.status == 204, await reply.text()
        assert reply.headers["Access-Control-Allow-Origin"] == ORIGIN
        assert "Origin" in reply.headers["Vary"]
        assert "POST" in reply.headers["Access-Control-Allow-Methods"]
        assert reply.headers["Access-Control-Allow-Headers"] == asked
        assert int(reply.headers["Access-Control-Max-Age"]) > 0
        # The request itself: a 401 without the key, still readable by the page.
        reply = await client.post("/v1/chat/completions", json={}, headers={"Origin": ORIGIN})
        assert reply.status == 401 and reply.headers["Access-Control-Allow-Origin"] == ORIGIN
        assert reply.headers["Vary"] == "Origin"
        reply = await client.get("/props", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
        assert reply.status == 200 and reply.headers["Access-Control-Allow-Origin"] == ORIGIN
        assert "X-Ggufpipe-Run" in reply.headers["Access-Control-Expose-Headers"]
        assert (await client.get("/props")).status == 401, "the operator's endpoints need the key"
        assert (await client.get("/metrics", headers={"x-api-key": KEY})).status == 200
        # Another origin: a preflight refused by name, and no CORS headers on anything.
        other = {**headers, "Origin": "http://evil.example"}
        reply = await client.options("/v1/chat/completions", headers=other)
        assert reply.status == 403 and "http://evil.example" in (await reply.json())["error"]["message"]
        assert "Access-Control-Allow-Origin" not in reply.headers
        reply = await client.get("/health", headers={"Origin": "http://evil.example"})
        assert reply.status == 200 and "Access-Control-Allow-Origin" not in reply.headers
    finally:
        await client.close()


async def test_any_origin_and_a_stream_carry_the_header():
    pipeline = Pipeline(slots=1)
    server, client = await client_for(pipeline, origins=["*"])
    try:
        async with served(pipeline):
            headers = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
            reply = await client.options("/v1/completions", headers=headers)
            assert reply.status == 204 and reply.headers["Access-Control-Allow-Origin"] == "*"
            assert "Vary" not in reply.headers
            body = {"prompt": "ab", "stream": True}
            reply = await client.post("/v1/completions", json=body, headers={"Origin": "https://app.example"})
            assert reply.status == 200 and reply.headers["Content-Type"] == "text/event-stream"
            assert reply.headers["Access-Control-Allow-Origin"] == "*"
            assert (await reply.text()).endswith("data: [DONE]\n\n")
            reply = await client.get("/nowhere", headers={"Origin": "https://app.example"})
            assert reply.status == 404 and reply.headers["Access-Control-Allow-Origin"] == "*"
    finally:
        await client.close()


# --------------------------------------------------------------------- 404


async def test_a_404_lists_what_is_served(operator: tuple[Server, TestClient[Any, Any]]):
    _, client = operator
    reply = await client.get("/v1/embedding")
    assert reply.status == 404
    message = (await reply.json())["error"]["message"]
    assert message.startswith("GET /v1/embedding: Not Found; this server serves ")
    for route in ("GET /health", "POST /v1/chat/completions", "POST /tokenize", "GET /metrics"):
        assert route in message
    assert "HEAD" not in message
