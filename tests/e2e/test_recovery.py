"""Recovery of a lost stage (docs/recovery.md), over the local
transport with the real model: an agent killed, stopped or lost during
prefill is started again, the run is replayed and goes on, and its greedy
output is the unbroken run's token for token (the whole model's, in one
llama.cpp context); past ``recovery.attempts`` the run faults with one reason
naming the first loss and what recovery tried. No agent is left behind."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from ggufpipe_tui.core.events import (
    AgentConnected,
    RunFinished,
    RunInterrupted,
    RunPhaseChanged,
    RunRecovered,
    StageRecovery,
    TokenStreamed,
)
from ggufpipe_tui.core.inventory import load_inventory
from ggufpipe_tui.core.recovery import recovery_line
from ggufpipe_tui.session.pipeline import Pipeline
from ggufpipe_tui.session.runs import Prompt
from tests.support.common import LONG_PROMPT, MODES, mode_yaml, whole_model_greedy
from tests.support.local import write_inventory
from tests.support.sabotage import Saboteur, assert_carried_on, on_token, run_with, signal_agent

pytestmark = pytest.mark.model

MAX_TOKENS = 40


def inventory_file(
    tmp_path: Path,
    model_path: Path,
    mode: str = "direct",
    attempts: int = 2,
    run: str = "",
    **timeouts: float,
) -> Path:
    limits = {"connect": 30, "ready": 60, "step": 30, "teardown": 5, **timeouts}
    data, feedback = mode_yaml(mode)
    ranges = [(0, 7), (7, 23), (23, 30)]
    stages = "".join(f"- {{host: here, layers: [{a}, {b}]}}\n" for a, b in ranges)
    return write_inventory(
        tmp_path,
        model_path,
        stages,
        f"max_tokens: {MAX_TOKENS}, ignore_eos: true, chat: false, {feedback}{run}",
        data,
        timeouts=", ".join(f"{k}: {v}" for k, v in limits.items()),
        extra=f"recovery: {{attempts: {attempts}, deadline: 120}}\n",
    )


def unbroken(model_path: Path, result: Any) -> list[int]:
    return whole_model_greedy(model_path, list(result.prompt_tokens), MAX_TOKENS, n_ctx=512, n_ubatch=32)


def streamed(saboteur: Saboteur) -> tuple[list[int], str]:
    tokens = [e.token for e in saboteur.events if isinstance(e, TokenStreamed) and e.sequence >= 0]
    text = "".join(e.text for e in saboteur.events if isinstance(e, TokenStreamed))
    return tokens, text


def of(saboteur: Saboteur, kind: type) -> list[Any]:
    return [e for e in saboteur.events if isinstance(e, kind)]


def assert_recovered(
    saboteur: Saboteur, result: Any, model_path: Path, stage: int, recoveries: int = 1
) -> None:
    assert result.outcome == "completed", result.failure
    assert list(result.tokens) == unbroken(model_path, result), "the output differs from an unbroken run"
    tokens, text = streamed(saboteur)
    assert tokens == list(result.tokens), "every token streamed once, in order"
    assert text == result.text
    recovered = of(saboteur, RunRecovered)
    assert len(recovered) == recoveries
    assert recovered[0].stages.startswith(f"stage {stage} on here")
    states = [e.state for e in of(saboteur, StageRecovery) if e.stage == stage]
    assert states[:3] == ["Lost", "Recovering", "Ready"], states
    assert len(of(saboteur, RunFinished)) == 1, "one RunFinished: the interrupted run has none"
    assert len(of(saboteur, RunInterrupted)) == recoveries


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stage", [0, 1, 2])
async def test_agent_killed_mid_decode_is_restarted(tmp_path, model_path, no_agent_left, mode, stage):
    saboteur = Saboteur(on_token(8), signal_agent(stage, signal.SIGKILL))
    result = await run_with(saboteur, inventory_file(tmp_path, model_path, mode=mode))
    assert saboteur.fired
    assert_recovered(saboteur, result, model_path, stage)
    (event,) = of(saboteur, RunRecovered)
    assert event.at_token >= 9 and event.replayed == len(result.prompt_tokens) + event.at_token
    line = recovery_line(event)
    assert line.startswith(
        f"stage {stage} on here (local) lost at token {event.at_token}; restarted; replayed "
    )
    pids = {e.hello.pid for e in of(saboteur, AgentConnected) if e.stage == stage}
    assert len(pids) == 2, "a new agent process for the stage"
    # In proportion: the other stages kept their caches, only this one was rebuilt.
    assert_carried_on(saboteur.events, f"stage {stage} rebuilt")


@pytest.mark.parametrize("stage", [0, 1, 2])
async def test_a_late_loss_after_a_long_prompt_is_rebuilt_exactly(tmp_path, model_path, no_agent_left, stage):
    """A ~400-token prompt (13 ubatch chunks) and a loss at token 30 of 40:
    the restarted stage's cache is computed again from its neighbour's kept
    parts (or, for stage 0, the prompt and the fed-back tokens), and the reply
    is the whole model's token for token."""
    saboteur = Saboteur(on_token(30), signal_agent(stage, signal.SIGKILL))
    result = await run_with(
        saboteur, inventory_file(tmp_path, model_path), prompt=" ".join([LONG_PROMPT] * 5)
    )
    assert saboteur.fired
    assert len(result.prompt_tokens) > 400
    assert_recovered(saboteur, result, model_path, stage)
    assert_carried_on(saboteur.events, f"stage {stage} rebuilt")


@pytest.mark.parametrize("stage", [0, 2])
async def test_a_seeded_run_carries_on_as_it_would_have_gone(tmp_path, model_path, no_agent_left, stage):
    """Sampled (temperature 1, a seed), the run carried on in proportion
    after a loss samples what the unbroken run samples: its new sampler
    makes the seeded draws the old one made for the tokens streamed."""
    path = inventory_file(tmp_path, model_path, run=", temperature: 1.0, seed: 7, top_k: 0, top_p: 1.0")
    plain = await run_with(Saboteur(lambda e: False, lambda p: None), path)
    saboteur = Saboteur(on_token(12), signal_agent(stage, signal.SIGKILL))
    result = await run_with(saboteur, path)
    assert saboteur.fired and result.outcome == "completed", result.failure
    assert_carried_on(saboteur.events, f"stage {stage} rebuilt")
    assert list(result.tokens) == list(plain.tokens), "the seeded reply differs from the unbroken one"
    assert streamed(saboteur)[0] == list(result.tokens)


async def test_agent_killed_during_prefill(tmp_path, model_path, no_agent_left):
    saboteur = Saboteur(
        lambda e: isinstance(e, RunPhaseChanged) and e.phase == "Running", signal_agent(2, signal.SIGKILL)
    )
    result = await run_with(saboteur, inventory_file(tmp_path, model_path))
    assert_recovered(saboteur, result, model_path, 2)
    assert of(saboteur, RunRecovered)[0].at_token == 0


async def test_a_stopped_agent_is_lost_by_its_heartbeat(tmp_path, model_path, no_agent_left):
    """SIGSTOP: the agent says nothing, not even a heartbeat; after
    timeouts.heartbeat it is lost, killed and started again."""
    saboteur = Saboteur(on_token(5), signal_agent(1, signal.SIGSTOP))
    path = inventory_file(tmp_path, model_path, step=60, heartbeat=3)
    result = await run_with(saboteur, path)
    assert_recovered(saboteur, result, model_path, 1)
    (lost, *_) = of(saboteur, StageRecovery)
    assert lost.state == "Lost" and "no answer from stage 1 on here (local) for 3 s" in lost.detail


async def test_a_second_loss_is_recovered_then_a_third_is_the_end(tmp_path, model_path, no_agent_left):
    """attempts: 2: two losses in one run are both recovered; a third ends the
    run with one reason naming the first loss and what recovery tried."""
    kills = {"count": 0}

    class Repeated(Saboteur):
        def __call__(self, event: Any) -> None:
            self.events.append(event)
            # Each time the reply reaches a new 6 tokens, another agent dies.
            due = isinstance(event, TokenStreamed) and event.sequence in (6, 14, 22)
            if due and self.pipeline is not None and kills["count"] < 3:
                kills["count"] += 1
                stage = kills["count"] % 3
                hello = self.pipeline.links[stage].hello
                assert hello is not None
                os.kill(hello.pid, signal.SIGKILL)

    saboteur = Repeated(lambda e: False, lambda p: None)
    result = await run_with(saboteur, inventory_file(tmp_path, model_path))
    assert kills["count"] == 3
    assert result.outcome == "faulted"
    assert result.failure.startswith(
        "stage 1 on here (local): the agent exited (killed by signal 9) (recovery gave up"
    )
    assert "2 of recovery.attempts 2 used" in result.failure
    assert "attempt 1: restarted stage 1 on here" in result.failure
    assert "attempt 2: restarted stage 2 on here" in result.failure
    assert len(of(saboteur, RunRecovered)) == 2
    tokens, text = streamed(saboteur)
    assert tokens == list(result.tokens) == unbroken(model_path, result)[: len(tokens)]
    assert len(of(saboteur, RunFinished)) == 1


async def test_recovery_off_faults_as_before(tmp_path, model_path, no_agent_left):
    saboteur = Saboteur(on_token(5), signal_agent(1, signal.SIGKILL))
    result = await run_with(saboteur, inventory_file(tmp_path, model_path, attempts=0))
    assert result.outcome == "faulted"
    assert result.failure == "stage 1 on here (local): the agent exited (killed by signal 9)"
    assert not of(saboteur, StageRecovery)


async def test_a_prompt_tokenized_while_stage_0_is_lost_waits_for_the_repair(
    tmp_path, model_path, no_agent_left
):
    """Stage 0's agent tokenizes: a prompt sent to it as it dies, or while it
    is started again, is tokenized once it is back (not refused, and not an
    error that ends the server, as the chaos benchmark once found)."""
    events: list[Any] = []
    pipeline = Pipeline(load_inventory(inventory_file(tmp_path, model_path)), events.append)
    try:
        await pipeline.start()
        expected, _ = await pipeline.tokenize("Once upon a time", False)
        signal_agent(0, signal.SIGKILL)(pipeline)
        during = [asyncio.create_task(pipeline.tokenize("Once upon a time", False)) for _ in range(3)]
        await asyncio.sleep(0.2)  # the loss reported, the repair under way
        during.append(asyncio.create_task(pipeline.tokenize("Once upon a time", False)))
        for task in during:
            tokens, _ = await task
            assert tokens == expected
        assert not pipeline.broken
    finally:
        await pipeline.close()


async def test_a_stage_lost_between_runs_is_restarted_before_the_next(tmp_path, model_path, no_agent_left):
    events: list[Any] = []
    pipeline = Pipeline(load_inventory(inventory_file(tmp_path, model_path)), events.append)
    try:
        await pipeline.start()
        first = await pipeline.generate("Once upon a time")
        signal_agent(2, signal.SIGKILL)(pipeline)
        second = await pipeline.generate("Once upon a time")
    finally:
        await pipeline.close()
    assert first.ok and second.ok, second.failure
    assert second.tokens == first.tokens
    states = [e.state for e in events if isinstance(e, StageRecovery)]
    assert states == ["Lost", "Recovering", "Ready"]


async def test_a_follow_up_turn_is_recovered_exactly_at_the_default_ubatch(
    tmp_path, model_path, no_agent_left
):
    """run.reuse: cache at ubatch 512, where llama.cpp's CPU kernels are not
    batch-invariant: a stage lost during the third turn of a conversation is
    restarted, the conversation's earlier turns are replayed (quietly) in the
    batches they had, then the third turn, which goes on: every turn equals
    one llama.cpp context that kept its cache (a cold replay of the third
    turn alone would compute its prefix in other batches)."""
    from tests.support.common import whole_model_turns
    from tests.support.local import tokenize

    path = tmp_path / "inventory.yaml"
    stages = "".join(f"  - {{host: here, layers: [{a}, {b}]}}\n" for a, b in [(0, 7), (7, 23), (23, 30)])
    path.write_text(
        f"model: {{path: {model_path}}}\nhosts:\n  here: {{local: true}}\nstages:\n{stages}"
        "run: {context: 1024, max_tokens: 24, ignore_eos: true, chat: false}\n"
        "timeouts: {connect: 30, ready: 60, step: 30, teardown: 5}\n"
    )
    saboteur = Saboteur(lambda e: False, signal_agent(1, signal.SIGKILL))
    pipeline = Pipeline(load_inventory(path), saboteur)
    saboteur.pipeline = pipeline
    results = []
    try:
        await pipeline.start()
        prompt = tokenize(model_path, "The history of the Roman empire is long.", bos=True)
        for index, words in enumerate(("", " Name the first emperor.", " And the second?")):
            if results:
                prompt = prompt + list(results[-1].tokens) + tokenize(model_path, words, bos=False)
            if index == 2:  # the kill lands in the third turn's decode
                saboteur.when = on_token(6)
            results.append(await pipeline.generate_tokens(prompt))
    finally:
        await pipeline.close()
    assert saboteur.fired
    for result in results:
        assert result.outcome == "completed", result.failure
    assert results[2].prompt_reused > 0, "the third turn kept the conversation so far"
    oracle = whole_model_turns(
        model_path, [list(r.prompt_tokens) for r in results], 24, n_ctx=1024, n_ubatch=512
    )
    assert [list(r.tokens) for r in results] == oracle
    assert len(of(saboteur, RunRecovered)) == 1
    third = [e for e in saboteur.events if isinstance(e, TokenStreamed) and e.run_id != results[0].run_id]
    assert len([e for e in of(saboteur, TokenStreamed) if e.sequence >= 0]) == 3 * 24, (
        "every turn's tokens streamed once; the replayed turns streamed nothing",
        len(third),
    )


async def test_every_run_in_flight_is_replayed_on_its_slot(tmp_path, model_path, no_agent_left):
    """Two runs in flight (run.parallel 2) when stage 1's agent is
    killed: both are interrupted, replayed on their slots and complete with
    their unbroken tokens."""
    path = inventory_file(tmp_path, model_path)
    path.write_text(path.read_text().replace("chat: false,", "chat: false, parallel: 2,"))
    both_streaming = {"seen": set()}

    def when(event: Any) -> bool:
        if isinstance(event, TokenStreamed) and event.sequence >= 0:
            both_streaming["seen"].add(event.run_id)
            return len(both_streaming["seen"]) == 2 and event.sequence >= 6
        return False

    saboteur = Saboteur(when, signal_agent(1, signal.SIGKILL))
    pipeline = Pipeline(load_inventory(path), saboteur)
    saboteur.pipeline = pipeline
    try:
        await pipeline.start()
        first = pipeline.submit(Prompt(text="The history of the Roman empire"))
        second = pipeline.submit(Prompt(text="Once upon a time, in a land far away"))
        results = [await first.result(), await second.result()]
    finally:
        await pipeline.close()
    assert saboteur.fired
    for result in results:
        assert result.outcome == "completed", result.failure
        assert list(result.tokens) == unbroken(model_path, result)
    assert len(of(saboteur, RunInterrupted)) == 2, "both runs in flight were interrupted"
    assert len(of(saboteur, RunRecovered)) == 2, "and both replayed"


async def test_with_slots_a_stage_lost_while_idle_is_repaired_at_once(tmp_path, model_path, no_agent_left):
    """The server's way (runs prepared ahead on every slot): a stage
    lost while no request runs is repaired then, not when the next request
    comes, and the next request runs."""
    path = inventory_file(tmp_path, model_path)
    path.write_text(path.read_text().replace("chat: false,", "chat: false, parallel: 2,"))
    events: list[Any] = []
    pipeline = Pipeline(load_inventory(path), events.append, prepare_ahead=True)
    try:
        await pipeline.start()
        first = await pipeline.generate("Once upon a time")
        signal_agent(2, signal.SIGKILL)(pipeline)
        for _ in range(600):  # no prompt meanwhile
            if [e.state for e in events if isinstance(e, StageRecovery)][-1:] == ["Ready"]:
                break
            await asyncio.sleep(0.05)
        states = [e.state for e in events if isinstance(e, StageRecovery)]
        assert states == ["Lost", "Recovering", "Ready"], states
        second = await pipeline.generate("Once upon a time")
    finally:
        await pipeline.close()
    assert first.ok and second.ok, second.failure
    assert second.tokens == first.tokens
