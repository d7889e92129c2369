"""Prefix reuse across runs (docs/worker.md, "Prefix reuse") with real agents, real llama.cpp and the
real models: the next turn of a conversation keeps the positions every stage
holds of the previous run and prefills only the rest, and its greedy tokens
are those of the whole model run cold on the same tokens. A stage that cannot
keep them (its engine reloaded, a prompt that shares nothing, another run in
its cache) makes the run prefill everything, still exactly."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ggufpipe_agent.errors import EngineError
from ggufpipe_agent.wire import objects
from ggufpipe_agent.wire.framing import FrameReader
from ggufpipe_agent.wire.protocol import (
    EngineOptions,
    PrefixHeld,
    PrefixOffer,
    StageFault,
    StageReady,
    StageStopped,
    StopRun,
)
from ggufpipe_tui.core.events import Notice, RunResult, StageStats
from ggufpipe_tui.core.inventory import Inventory, load_inventory
from ggufpipe_tui.session.pipeline import Pipeline
from tests.support import local
from tests.support.agent_client import AgentClient, provision
from tests.support.common import LONG_PROMPT, mode_yaml, whole_model_greedy
from tests.support.local import tokenize
from tests.support.stage_chain import Chain

pytestmark = pytest.mark.model

CONTEXT, UBATCH, STEPS = 512, 32, 24
SMOLLM_SPLIT = [(0, 7), (7, 23), (23, 30)]
GEMMA3_SPLIT = [(0, 5), (5, 11), (11, 18)]  # off the sliding-window period, as in test_architectures


def write_inventory(
    tmp_path: Path,
    model: Path,
    splits: list[tuple[int, int]],
    hosts: list[str],
    mode: str = "direct",
    reuse: str = "cache",
) -> Path:
    stages = "".join(
        f"- {{host: {host}, layers: [{a}, {b}]}}\n" for host, (a, b) in zip(hosts, splits, strict=True)
    )
    data, feedback = mode_yaml(mode)
    return local.write_inventory(
        tmp_path,
        model,
        stages,
        f"max_tokens: {STEPS}, ignore_eos: true, chat: false, reuse: {reuse}, {feedback}",
        data,
        here="{local: true, threads: 1}",
        hosts="  there: {local: true, threads: 1}\n",
        timeouts="connect: 60, ready: 300, step: 60, teardown: 10",
        context=CONTEXT,
        ubatch=UBATCH,
    )


def prefill(events: list[Any], result: RunResult) -> list[tuple[int, int]]:
    """(kept, prefilled rows) of each stage in the run, from its final counters."""
    final: dict[int, tuple[int, int]] = {}
    for event in events:
        if isinstance(event, StageStats) and event.run_id == result.run_id:
            final[event.stage] = (event.counters.kept, event.counters.prefill_rows)
    return [final[stage] for stage in sorted(final)]


def reuse_notice(events: list[Any], result: RunResult) -> str:
    lines = [
        e.text for e in events if isinstance(e, Notice) and f"run {result.run_id:016x}: reused" in e.text
    ]
    assert len(lines) == 1, lines
    return lines[0]


FOLLOW_UP = " Now do the same for the second century, in two sentences."
UNRELATED = "Write a haiku about rain."


async def follow_up(
    inventory: Inventory, model: Path, events: list[Any], between: Callable[[Pipeline], None] | None = None
) -> tuple[list[int], RunResult, list[int], RunResult]:
    """A run on LONG_PROMPT, then the conversation's next turn (that prompt,
    its reply and FOLLOW_UP) on the same pipeline; ``between`` acts on the
    pipeline between the two runs. The prompts and the results."""
    pipeline = Pipeline(inventory, events.append)
    try:
        await pipeline.start()
        first_prompt = tokenize(model, LONG_PROMPT, bos=True)
        first = await pipeline.generate_tokens(first_prompt)
        if between is not None:
            between(pipeline)
        second_prompt = first_prompt + list(first.tokens) + tokenize(model, FOLLOW_UP, bos=False)
        second = await pipeline.generate_tokens(second_prompt)
    finally:
        await pipeline.close()
    return first_prompt, first, second_prompt, second


def cold_run(model: Path, prompt: list[int]) -> list[int]:
    """The whole model's greedy tokens on ``prompt``, at the inventories' context and ubatch."""
    return whole_model_greedy(model, prompt, STEPS, n_ctx=CONTEXT, n_ubatch=UBATCH)


@pytest.mark.parametrize(
    "mode", ["direct", "relay-loop"]
)  # the token ring, and the orchestrator feeding tokens back
async def test_follow_up_turns_keep_the_prefix_and_match_a_cold_run(
    tmp_path, model_path, no_agent_left, mode
):
    inventory = load_inventory(write_inventory(tmp_path, model_path, SMOLLM_SPLIT, ["here"] * 3, mode))
    events: list[Any] = []
    pipeline = Pipeline(inventory, events.append)
    try:
        await pipeline.start()
        first_prompt = tokenize(model_path, LONG_PROMPT, bos=True)
        first = await pipeline.generate_tokens(first_prompt)
        # The next turn: everything so far, then the new words.
        second_prompt = first_prompt + list(first.tokens) + tokenize(model_path, FOLLOW_UP, bos=False)
        second = await pipeline.generate_tokens(second_prompt)
        third_prompt = (
            second_prompt + list(second.tokens) + tokenize(model_path, " And the third?", bos=False)
        )
        third = await pipeline.generate_tokens(third_prompt)
        # A prompt that repeats the start of the last one (a system prompt, say),
        # then one that shares nothing.
        partial_prompt = first_prompt[:40] + tokenize(model_path, " Just name them.", bos=False)
        partial = await pipeline.generate_tokens(partial_prompt)
        unrelated_prompt = tokenize(model_path, UNRELATED, bos=True)
        nothing = await pipeline.generate_tokens(unrelated_prompt)
    finally:
        await pipeline.close()
    for result in (first, second, third, partial, nothing):
        assert result.outcome == "completed", result.failure
    assert first.prompt_reused == 0 and prefill(events, first) == [(0, len(first_prompt))] * 3
    # The KV cache of a run holds its prompt and every generated token but the last.
    kept = len(first_prompt) + STEPS - 1
    assert second.prompt_reused == kept
    assert prefill(events, second) == [(kept, len(second_prompt) - kept)] * 3, "only the new tokens"
    assert f"reused {kept} of {len(second_prompt)} prompt tokens" in reuse_notice(events, second)
    kept = len(second_prompt) + STEPS - 1
    assert third.prompt_reused == kept and prefill(events, third) == [(kept, len(third_prompt) - kept)] * 3
    assert partial.prompt_reused == 40 and prefill(events, partial) == [(40, len(partial_prompt) - 40)] * 3
    assert nothing.prompt_reused == 0 and prefill(events, nothing) == [(0, len(unrelated_prompt))] * 3
    assert "shares no prefix" in reuse_notice(events, nothing)
    for result in (second, third, partial, nothing):
        cold = cold_run(model_path, list(result.prompt_tokens))
        assert list(result.tokens) == cold, f"run {result.run_id:016x} differs from a cold run"


async def test_a_reloaded_stage_makes_the_run_prefill_everything(tmp_path, model_path, no_agent_left):
    inventory = load_inventory(write_inventory(tmp_path, model_path, SMOLLM_SPLIT, ["here", "there", "here"]))

    def reload_there(pipeline: Pipeline) -> None:
        # Other engine options for the host of stage 1: its agent loads the range again.
        there = dataclasses.replace(inventory.hosts["there"], threads=2)
        pipeline.inventory = dataclasses.replace(inventory, hosts={**inventory.hosts, "there": there})

    events: list[Any] = []
    _, _, second_prompt, second = await follow_up(inventory, model_path, events, reload_there)
    assert second.outcome == "completed", second.failure
    assert second.prompt_reused == 0 and prefill(events, second) == [(0, len(second_prompt))] * 3
    assert "stage 1: its engine was loaded for this run" in reuse_notice(events, second)
    assert list(second.tokens) == cold_run(model_path, second_prompt)


async def test_gemma3_keeps_only_what_a_cold_run_computes_alike(tmp_path, gemma3_path, no_agent_left):
    """run.reuse: exact. Gemma 3 270M's CPU kernels give a decode step other bits than a prefill
    (the stages' batch-invariance probe finds it), so a stage keeps only the
    positions prefilled in whole ubatches, and the run keeps a multiple of
    the ubatch: exact, and less than everything."""
    inventory = load_inventory(
        write_inventory(tmp_path, gemma3_path, GEMMA3_SPLIT, ["here"] * 3, reuse="exact")
    )
    events: list[Any] = []
    first_prompt, _, second_prompt, second = await follow_up(inventory, gemma3_path, events)
    assert second.outcome == "completed", second.failure
    kept = second.prompt_reused
    assert kept == len(first_prompt) // UBATCH * UBATCH > 0, (kept, len(first_prompt))
    assert prefill(events, second) == [(kept, len(second_prompt) - kept)] * 3
    assert "in whole ubatches" in reuse_notice(events, second)
    assert list(second.tokens) == cold_run(gemma3_path, second_prompt)


@pytest.mark.ssh
async def test_follow_up_turn_over_ssh(tmp_path, sshd, cache_dir, model_path):
    """Three stages through the loopback sshd (two hosts, one connection each):
    the same reuse, the same exactness, nothing left on the host."""
    from tests.support.ssh_hosts import host_entry, wait_no_session_agents
    from tests.support.ssh_hosts import write_inventory as ssh_inventory

    hosts = {"gpu-a": host_entry(sshd, cache_dir), "gpu-b": host_entry(sshd, cache_dir)}
    stages = [("gpu-a", [0, 7]), ("gpu-a", [7, 20]), ("gpu-b", [20, 30])]
    path = ssh_inventory(tmp_path / "inv.yaml", model_path, hosts, stages, max_tokens=STEPS, ignore_eos=True)
    events: list[Any] = []
    first_prompt, _, second_prompt, second = await follow_up(load_inventory(path), model_path, events)
    assert second.outcome == "completed", second.failure
    kept = len(first_prompt) + STEPS - 1
    assert second.prompt_reused == kept
    assert prefill(events, second) == [(kept, len(second_prompt) - kept)] * 3, "only the new tokens"
    assert list(second.tokens) == cold_run(model_path, second_prompt)
    assert wait_no_session_agents(sshd, 10) == {}, "no agent or bridge left on the host"


# ------------------------------------------------------ engines in-process


def test_the_probe_leaves_the_cache_as_it_was(model_path):
    """Asking a stage what it can keep probes its kernels (once) with its cache
    saved and put back: the run it holds goes on as if nothing happened."""
    prompt = tokenize(model_path, LONG_PROMPT, bos=True)
    chain = Chain(
        model_path, SMOLLM_SPLIT, EngineOptions(CONTEXT, CONTEXT, UBATCH, threads=1, exact_reuse=True)
    )
    try:
        tokens = chain.generate(prompt, 8)
        held = [engine.n_past for engine in chain.engines]
        assert [engine.keepable() for engine in chain.engines] == [(len(prompt) + 7, "")] * 3
        assert [engine.batch_invariant for engine in chain.engines] == [True] * 3
        assert [engine.n_past for engine in chain.engines] == held
        while len(tokens) < 16:
            tokens.append(chain.step(len(tokens), [tokens[-1]]))
        engine = chain.engines[0]
        with pytest.raises(EngineError, match="cannot keep 999 positions"):
            engine.keep(999)
        with pytest.raises(EngineError, match="an object at position 3, this stage is at position"):
            engine.step([1], position=3)
    finally:
        chain.close()
    assert tokens == whole_model_greedy(model_path, prompt, 16, n_ctx=CONTEXT, n_ubatch=UBATCH)


# ------------------------------------------------- one agent, driven by hand


@pytest.fixture
async def agent(no_agent_left):
    client = AgentClient()
    await client.start()
    await client.attach_data()
    yield client
    assert await client.close() == 0
    assert b"Traceback" not in client.stderr, client.stderr.decode()


OPTIONS = EngineOptions(256, 256, UBATCH, threads=1)  # SmolLM2 at this ubatch: exact at any batch size


async def start_run(
    agent: AgentClient, model_path: Path, run_id: int, offer: PrefixOffer
) -> tuple[Any, PrefixHeld]:
    message = dataclasses.replace(provision(run_id, str(model_path)), engine=OPTIONS, reuse=offer)
    await agent.send(message)
    await agent.open_edges(message)
    ready = await agent.expect(StageReady)
    return message, ready.held


async def step(agent: AgentClient, message: Any, sequence: int, tokens: list[int], position: int) -> int:
    record = objects.tokens_record(
        message.run_id, message.inbound.edge_id, sequence, tokens, position=position
    )
    await agent.send_data(record)
    got = await FrameReader(agent.data_reader).record(1 << 20)
    assert got is not None
    header, payload = got
    assert (header.sequence, header.position) == (sequence, position + len(tokens))
    return objects.decode_tokens(header, payload)[0]


async def stop(agent: AgentClient, run_id: int) -> StageStopped:
    await agent.send(StopRun(run_id, "done"))
    return await agent.expect(StageStopped)


async def test_a_stage_says_what_it_holds_and_keeps_it(agent, model_path):
    prompt = tokenize(model_path, "The capital of France is", bos=True)
    message, held = await start_run(agent, model_path, 0x11, PrefixOffer())
    assert held == PrefixHeld()
    token = await step(agent, message, 0, prompt, 0)
    second = await step(agent, message, 1, [token], len(prompt))
    await stop(agent, 0x11)
    fed = len(prompt) + 1  # the prompt and the first token; the second was never fed
    # Offered everything the last run fed: it holds all of it, at any position.
    message, held = await start_run(agent, model_path, 0x12, PrefixOffer(0x11, fed))
    assert held == PrefixHeld(0x11, fed, 1, "")
    # The same prompt again: keep all but its last token, compute that one.
    assert await step(agent, message, 0, prompt[-1:], len(prompt) - 1) == token
    assert await step(agent, message, 1, [token], len(prompt)) == second
    stopped = await stop(agent, 0x12)
    assert (stopped.counters.kept, stopped.counters.prefill_rows) == (len(prompt) - 1, 1)
    # Offered a run it does not hold: it holds nothing of it, and says why.
    message, held = await start_run(agent, model_path, 0x13, PrefixOffer(0x11, fed))
    assert held.positions == 0 and held.reason == "its cache holds run 0000000000000012"
    await stop(agent, 0x13)
    # Offered nothing, it empties its cache; a later offer finds nothing.
    message, held = await start_run(agent, model_path, 0x14, PrefixOffer(0x12, fed))
    assert held.positions == 0 and "emptied for run 0000000000000013" in held.reason
    await stop(agent, 0x14)


async def test_positions_that_do_not_match_fault_the_stage(agent, model_path):
    prompt = tokenize(model_path, "The capital of France is", bos=True)
    message, _ = await start_run(agent, model_path, 0x21, PrefixOffer())
    token = await step(agent, message, 0, prompt, 0)
    await agent.send_data(
        objects.tokens_record(0x21, message.inbound.edge_id, 1, [token], position=len(prompt) + 3)
    )
    fault = await agent.expect(StageFault)
    assert f"an object at position {len(prompt) + 3}, this stage is at position {len(prompt)}" in fault.reason
    await stop(agent, 0x21)
    # A faulted run leaves nothing to keep; a prompt that starts past what a stage holds faults it.
    message, held = await start_run(agent, model_path, 0x22, PrefixOffer(0x21, len(prompt)))
    assert held.positions == 0 and "failed or was aborted" in held.reason
    await agent.send_data(objects.tokens_record(0x22, message.inbound.edge_id, 0, [1], position=4))
    fault = await agent.expect(StageFault)
    assert "the prompt starts at position 4, but this stage holds 0 positions" in fault.reason
    await stop(agent, 0x22)
