"""Model delivery over the local transport: real agent processes receiving
their stage files on their data sockets, real llama.cpp, the real model."""

from __future__ import annotations

import asyncio
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from ggufpipe_agent.delivery.sender import StageChunk, StageSender
from ggufpipe_agent.gguf.files import read_model_files
from ggufpipe_tui.core.events import RunFinished, StageDelivery
from ggufpipe_tui.core.inventory import HostSpec, Timeouts, load_inventory
from ggufpipe_tui.session.delivery import DeliveryError, deliver_stage
from ggufpipe_tui.session.pipeline import Pipeline
from ggufpipe_tui.session.stages import StageHandle
from ggufpipe_tui.transports.local import LocalAgent
from tests.support.common import whole_model_greedy
from tests.support.local import STEPS, send_inventory
from tests.support.splitset import write_split_set

pytestmark = pytest.mark.model


async def run_once(path: Path, prompt: str = "Once upon a time") -> tuple[Pipeline, Any, list[Any]]:
    events: list[Any] = []
    pipeline = Pipeline(load_inventory(path), events.append)
    try:
        await pipeline.start()
        result = await pipeline.generate(prompt)
    finally:
        await pipeline.close()
    return pipeline, result, events


async def test_a_split_set_is_sent_as_slices(tmp_path, model_path, no_agent_left):
    """The model as a 3-part split set on this machine: each local stage is
    sent its slice, read across the parts, and the tokens are the single
    file's in one llama.cpp context."""
    parts = write_split_set(model_path, tmp_path, "smol", max_tensors=120)
    caches = [tmp_path / "cache-0", tmp_path / "cache-1"]
    pipeline, result, events = await run_once(send_inventory(tmp_path, parts[1], caches))
    assert result.outcome == "completed", result.failure
    reference = whole_model_greedy(model_path, list(result.prompt_tokens), STEPS, n_ctx=512, n_ubatch=32)
    assert list(result.tokens) == reference
    assert [done.outcome for done in pipeline.delivered] == ["sent", "sent"]
    for done, cache in zip(pipeline.delivered, caches, strict=True):
        assert (cache / done.ref.key.file_name).stat().st_size == done.ref.size == done.sent
    shown = [event for event in events if isinstance(event, StageDelivery)]
    assert {event.state for event in shown} >= {"checking", "sending", "done"}
    assert all(a.done <= b.done for a, b in zip(shown, shown[1:], strict=False) if a.stage == b.stage)
    finished = [event for event in events if isinstance(event, RunFinished)]
    assert finished and not (tmp_path / "smol.gguf").exists(), "nothing is written here"


def local_stage(index: int, cache: Path) -> StageHandle:
    host = HostSpec(name=f"h{index}", line=0, local=True, cache_dir=str(cache))
    return StageHandle(index, LocalAgent(host, index, lambda line: None), lambda *_: None, lambda *_: None)


async def started(stages: list[StageHandle]) -> list[asyncio.Task[None]]:
    for stage in stages:
        await stage.start(30)
    return [asyncio.ensure_future(stage.read_control()) for stage in stages]


async def stopped(stages: list[StageHandle], readers: list[asyncio.Task[None]]) -> None:
    for reader in readers:
        reader.cancel()
    for stage in stages:
        await stage.close(3)


async def test_stages_on_one_machine_share_what_one_received(tmp_path, model_path, no_agent_left):
    """Two agents with one cache offered the same stage at once: one
    receives it, the other waits (busy) and then finds it there."""
    cache = tmp_path / "shared"
    stages = [local_stage(0, cache), local_stage(1, cache)]
    readers = await started(stages)
    events: list[StageDelivery] = []
    files = read_model_files(model_path)
    try:
        done = await asyncio.gather(
            *(deliver_stage(stage, files, (8, 21), events.append, Timeouts()) for stage in stages)
        )
    finally:
        await stopped(stages, readers)
    assert sorted(d.outcome for d in done) == ["cached", "sent"]
    assert sum(d.sent for d in done) == done[0].ref.size, "the file crossed once"
    assert any(event.state == "waiting" for event in events), "the second offer met the first transfer"
    assert [p.name for p in cache.glob("*.partial*")] == []


async def test_a_chunk_that_does_not_verify_is_refused_and_the_rest_resumes(
    tmp_path, model_path, monkeypatch, no_agent_left
):
    """A chunk whose digest does not match (a sender bug, a flipped bit) is
    refused before it is written: the delivery fails with the host's reason,
    the verified chunks before it stay, and the next delivery sends the rest."""
    original = StageSender.chunks

    def damaged(self: StageSender, first: int = 0) -> Any:
        for chunk in original(self, first):
            if chunk.index == 2:  # one bit flipped after the digest was taken
                chunk = StageChunk(chunk.index, bytes([chunk.data[0] ^ 1]) + chunk.data[1:], chunk.digest)
            yield chunk

    monkeypatch.setattr(StageSender, "chunks", damaged)
    cache = tmp_path / "cache"
    stages = [local_stage(0, cache)]
    readers = await started(stages)
    files = read_model_files(model_path)
    chunk = 1 << 20
    try:
        with pytest.raises(DeliveryError) as refused:
            await deliver_stage(stages[0], files, (8, 21), lambda event: None, Timeouts(), chunk_size=chunk)
        monkeypatch.setattr(StageSender, "chunks", original)
        done = await deliver_stage(
            stages[0], files, (8, 21), lambda event: None, Timeouts(), chunk_size=chunk
        )
    finally:
        await stopped(stages, readers)
    assert str(refused.value).startswith("stage 0 on h0 (local): ")
    assert "chunk 2 does not match its digest; rejected" in str(refused.value)
    assert done.outcome == "resumed" and done.sent == done.ref.size - 2 * chunk


async def test_a_stage_file_gone_before_loading_is_the_stage_fault(tmp_path, model_path, no_agent_left):
    """The provision names the delivered file by key and digest: removed from
    the host's cache before the run, the stage faults saying so."""
    caches = [tmp_path / "cache-0", tmp_path / "cache-1"]
    events: list[Any] = []
    pipeline = Pipeline(load_inventory(send_inventory(tmp_path, model_path, caches)), events.append)
    try:
        await pipeline.start()
        gone = caches[1] / pipeline.delivered[1].ref.key.file_name
        gone.unlink()
        start, end = pipeline.ranges[1]
        result = await pipeline.generate("Once upon a time")
    finally:
        await pipeline.close()
    assert result.outcome == "faulted"
    assert result.failure == (
        f"stage 1 on h1 (local): {gone}: the stage file sent for layers [{start}, {end}) is not in the cache "
        "as it was sent (removed or damaged since); start the pipeline again to send it"
    ), result.failure


def test_headless_reports_the_delivery(tmp_path, model_path, no_agent_left):
    from tests.support.local import run_cli

    path = send_inventory(tmp_path, model_path, [tmp_path / "c0", tmp_path / "c1"])
    first = run_cli(str(path), "--prompt", "Hello", "--json")
    assert first.returncode == 0, first.stderr
    rows = json.loads(first.stdout)["delivery"]
    assert [(row["stage"], row["host"], row["outcome"]) for row in rows] == [
        (0, "h0", "sent"),
        (1, "h1", "sent"),
    ]
    assert all(row["bytes_sent"] == row["size"] and row["seconds"] > 0 for row in rows)
    progress = [line for line in first.stderr.splitlines() if " on h0: " in line or " on h1: " in line]
    assert any(": sent " in line for line in progress), first.stderr
    quiet = run_cli(str(path), "--prompt", "Hello", "--json", "-q")
    assert quiet.returncode == 0 and quiet.stderr.strip() == "", quiet.stderr
    assert [row["outcome"] for row in json.loads(quiet.stdout)["delivery"]] == ["cached", "cached"]


def test_inventory_send_is_read_and_checked(tmp_path):
    from ggufpipe_tui.core.inventory import InventoryError, parse_inventory

    text = textwrap.dedent(
        """\
        model: {path: models/m.gguf, send: true}
        hosts:
          gpu: {address: 10.0.0.1}
        stages:
          - {host: gpu}
        """
    )
    inventory = parse_inventory(text, tmp_path / "inv.yaml")
    assert inventory.send and inventory.local_model_path() == str(tmp_path / "models" / "m.gguf")
    assert inventory.model_path_for(inventory.hosts["gpu"]) == str(tmp_path / "models" / "m.gguf")
    with pytest.raises(InventoryError, match=r"inv.yaml:3: hosts.gpu.model_path: has no use with model.send"):
        parse_inventory(
            text.replace("{address: 10.0.0.1}", "{address: 10.0.0.1, model_path: /m.gguf}"),
            tmp_path / "inv.yaml",
        )
    with pytest.raises(InventoryError, match=r"inv.yaml:1: model.send: expected true or false"):
        parse_inventory(text.replace("send: true", "send: yes please"), tmp_path / "inv.yaml")


def test_the_plan_sends_nothing(tmp_path, model_path, no_agent_left):
    from tests.support.local import run_cli

    caches = [tmp_path / "c0", tmp_path / "c1"]
    done = run_cli(str(send_inventory(tmp_path, model_path, caches)), "--plan")
    assert done.returncode == 0, done.stderr
    rows = [line.split()[:2] for line in done.stdout.splitlines() if line[:5].strip().isdigit()]
    assert rows == [["0", "h0"], ["1", "h1"]], done.stdout  # the plan's stage table, one row a stage
    assert not any(cache.exists() for cache in caches), "no cache was made: nothing was sent"


@pytest.mark.slow
async def test_the_tui_shows_the_stage_files_being_sent(tmp_path, model_path, no_agent_left):
    from ggufpipe_tui.views.app import GgufpipeApp
    from ggufpipe_tui.views.widgets import LogPane
    from tests.support.app import READY_TIMEOUT, ready_for_prompt, wait_for

    caches = [tmp_path / "c0", tmp_path / "c1"]
    app = GgufpipeApp(load_inventory(send_inventory(tmp_path, model_path, caches)), log_dir=tmp_path / "runs")
    async with app.run_test(size=(120, 30)) as pilot:
        await wait_for(pilot, lambda: ready_for_prompt(app), READY_TIMEOUT, "the stages to load")
        for row in app.rows:
            assert row.delivery is not None and (row.delivery.state, row.delivery.outcome) == ("done", "sent")
        logged = [line.plain for _, line in app.query_one(LogPane).entries]
        for stage in (0, 1):
            steps = [
                line for line in logged if line.startswith(f"[{stage}] stage {stage}: ") and ".gguf: " in line
            ]
            assert [line.split(".gguf: ")[1].split(" ")[0] for line in steps] == [
                "checking",
                "sending",
                "sent",
            ], steps
        await pilot.press("ctrl+q")
        await wait_for(pilot, lambda: app.return_code is not None, 60, "the app to quit")


async def test_a_conversation_is_tokenized_here_as_stage_0_would(tmp_path, model_path, no_agent_left):
    """With send: true prompts are tokenized on this machine: a whole
    conversation (Tokenize.messages, the TUI's turns and the server's chat
    requests) renders and tokenizes exactly as stage 0's agent does it from
    its own copy."""
    from ggufpipe_agent.wire.protocol import ChatMessage

    turns = (
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "Hi"),
        ChatMessage("assistant", "Hello!"),
        ChatMessage("user", "What is 2+2?"),
    )
    sent = send_inventory(tmp_path, model_path, [tmp_path / "c0"])
    own = tmp_path / "own.yaml"
    own.write_text(sent.read_text().replace(", send: true}", "}"))
    answers = []
    for path in (sent, own):
        pipeline = Pipeline(load_inventory(path), lambda event: None)
        try:
            await pipeline.start()
            answers.append(await pipeline.tokenize("", True, turns))
        finally:
            await pipeline.close()
    assert answers[0] == answers[1]
    tokens, rendered = answers[0]
    assert "What is 2+2?" in rendered and len(tokens) > 10
