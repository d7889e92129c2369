"""The operator's endpoints and CORS on a real ``--serve`` (three stages of
SmolLM2, real agents): /tokenize and /detokenize through the pipeline's own
tokenizer and pieces, equal to llama.cpp's vocabulary here; /props, /slots;
/metrics scraped as Prometheus text; a browser's preflight."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from ggufpipe_agent.llama.vocabulary import vocabulary
from tests.support.prometheus import parse
from tests.support.served import KEY, start_server

pytestmark = [pytest.mark.model, pytest.mark.slow]

ORIGIN = "http://localhost:5173"
TEXT = "Héllo wörld, 東京 🙂"


def test_operator_endpoints_and_a_preflight(tmp_path: Path, model_path: Path) -> None:
    served = start_server(tmp_path, model_path, "--cors-origin", ORIGIN, "--parallel", "2")
    auth = {"Authorization": f"Bearer {KEY}"}

    async def main() -> None:
        async with aiohttp.ClientSession(base_url=served.url, headers=auth) as http:
            async with http.post("/tokenize", json={"content": TEXT, "with_pieces": True}) as reply:
                assert reply.status == 200, await reply.text()
                pieces = (await reply.json())["tokens"]
            ids = [piece["id"] for piece in pieces]
            assert ids == vocabulary(str(model_path)).tokenize(TEXT, add_special=False)
            raw = b"".join(
                piece["piece"].encode() if isinstance(piece["piece"], str) else bytes(piece["piece"])
                for piece in pieces
            )
            assert raw.decode() == TEXT
            async with http.post("/tokenize", json={"content": TEXT}) as reply:
                assert (await reply.json())["tokens"] == ids
            async with http.post("/detokenize", json={"tokens": ids}) as reply:
                assert await reply.json() == {"content": TEXT}
            async with http.get("/props") as reply:
                props = await reply.json()
            assert props["total_slots"] == 2 and props["default_generation_settings"]["n_ctx"] > 0
            assert props["chat_template"], "SmolLM2 has a chat template"
            async with http.get("/slots") as reply:
                slots = await reply.json()
            assert [slot["id"] for slot in slots] == [0, 1]
            assert not any(slot["is_processing"] for slot in slots)
            # A browser page on ORIGIN: its preflight carries no key and is answered.
            preflight = {
                "Origin": ORIGIN,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            }
            async with aiohttp.ClientSession(base_url=served.url) as bare:
                async with bare.options("/v1/chat/completions", headers=preflight) as reply:
                    assert reply.status == 204
                    assert reply.headers["Access-Control-Allow-Origin"] == ORIGIN
                    assert reply.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
                async with bare.get("/health", headers={"Origin": ORIGIN}) as reply:
                    assert reply.headers["Access-Control-Allow-Origin"] == ORIGIN
            async with http.get("/metrics") as reply:
                assert reply.status == 200
                assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                samples = parse(await reply.text())
        tokenized = (
            "ggufpipe_requests_total",
            (("endpoint", "/tokenize"), ("method", "POST"), ("status", "200")),
        )
        assert samples[tokenized] == 2
        assert samples[("ggufpipe_slots_total", ())] == 2 and samples[("ggufpipe_stages", ())] == 3
        assert samples[("llamacpp:requests_processing", ())] == 0
        assert samples[("ggufpipe_ready", ())] == 1

    try:
        asyncio.run(main())
    finally:
        code = served.stop()
    assert code == 0, "".join(served.lines)
