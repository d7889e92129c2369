"""``--serve`` survives a lost stage (docs/recovery.md): four
requests in flight, a stage's agent SIGKILLed while the first streams; every
request completes with its unbroken answer (the whole model's greedy tokens),
``/health`` said "recovering" meanwhile, and the server goes on serving."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from ggufpipe_agent.llama.vocabulary import vocabulary
from tests.support.common import agent_pids, wait_no_new_agents, whole_model_greedy
from tests.support.served import raw, start_server

pytestmark = [pytest.mark.model, pytest.mark.slow]

MAX_TOKENS = 32
PROMPTS = [
    [1, 504, 2365, 282, 4649, 314],  # token ids: the oracle runs exactly these
    [1, 9690, 2118, 253, 655, 28],
    [1, 378, 1345, 1288, 30],
    [1, 2683, 314, 253, 1453, 282],
]


def expected_text(model_path: Path, prompt: list[int]) -> str:
    vocab = vocabulary(str(model_path))
    pieces, eog = vocab.pieces(), set(vocab.eog_tokens())
    out = []
    for token in whole_model_greedy(model_path, prompt, MAX_TOKENS, n_ctx=512, n_ubatch=32):
        if token in eog:
            break
        out.append(pieces[token])
    return b"".join(out).decode("utf-8", "replace")


def test_four_requests_survive_a_killed_stage(tmp_path: Path, model_path: Path) -> None:
    before = agent_pids()
    served = start_server(tmp_path, model_path)
    try:
        agents = sorted(agent_pids() - before)
        assert len(agents) == 3
        client = served.client()
        answers: dict[int, str] = {}
        errors: list[BaseException] = []
        health: list[str] = []
        done = threading.Event()

        def ask(index: int) -> None:
            try:
                if index == 0:  # streamed: the stage dies while it streams
                    parts = []
                    stream = client.completions.create(
                        model="m", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True
                    )
                    for number, chunk in enumerate(stream):
                        if number == 6:
                            os.kill(agents[1], signal.SIGKILL)
                        if chunk.choices:
                            parts.append(chunk.choices[0].text)
                    answers[index] = "".join(parts)
                else:
                    answer = client.completions.create(
                        model="m", prompt=PROMPTS[index], max_tokens=MAX_TOKENS, temperature=0
                    )
                    answers[index] = answer.choices[0].text
            except BaseException as error:  # noqa: BLE001 - said by the assertion below
                errors.append(error)

        def watch() -> None:
            while not done.is_set():
                status, body = raw(served, "GET", "/health")
                health.append(str(body.get("status", status)))
                time.sleep(0.02)

        watcher = threading.Thread(target=watch)
        watcher.start()
        threads = [threading.Thread(target=ask, args=(0,))]
        threads[0].start()
        time.sleep(0.3)  # the streamed one first
        for index in (1, 2, 3):
            threads.append(threading.Thread(target=ask, args=(index,)))
            threads[-1].start()
        for thread in threads:
            thread.join(300)
        done.set()
        watcher.join()
        assert not errors, errors
        for index, prompt in enumerate(PROMPTS):
            assert answers[index] == expected_text(model_path, prompt), f"request {index}"
        assert "recovering" in health, sorted(set(health))
        assert health[-1] == "ok"
        served.wait_line(
            lambda line: "lost at token" in line and "restarted" in line, 10, "the recovery line"
        )
        # And it goes on serving.
        again = client.completions.create(model="m", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
        assert again.choices[0].text == answers[1]
        status, body = raw(served, "GET", "/health")
        assert status == 200 and body["recoveries"] == 1
        assert (body["stages_lost"], body["repairs"], body["runs_replayed"]) == (1, 1, 1)
    finally:
        code = served.stop()
    assert code == 0, "".join(served.lines)
    assert not wait_no_new_agents(before), "no agent left"


def test_health_counts_a_loss_apart_from_the_runs_it_replayed(tmp_path: Path, model_path: Path) -> None:
    """Two runs in flight (``--parallel 2``) when a stage is killed: one
    stage lost, one repair, two runs replayed (``recoveries``, the old name
    of ``runs_replayed``, says 2 too); both replies are the unbroken ones."""
    before = agent_pids()
    served = start_server(tmp_path, model_path, "--parallel", "2")
    try:
        agents = sorted(agent_pids() - before)
        assert len(agents) == 3
        client = served.client()
        answers: dict[int, str] = {}
        errors: list[BaseException] = []
        streaming = [threading.Event(), threading.Event()]

        def ask(index: int) -> None:
            try:
                parts = []
                stream = client.completions.create(
                    model="m", prompt=PROMPTS[index], max_tokens=MAX_TOKENS, temperature=0, stream=True
                )
                for number, chunk in enumerate(stream):
                    if number == 4:
                        streaming[index].set()
                    if chunk.choices:
                        parts.append(chunk.choices[0].text)
                answers[index] = "".join(parts)
            except BaseException as error:  # noqa: BLE001 - said by the assertion below
                errors.append(error)
            finally:
                streaming[index].set()

        threads = [threading.Thread(target=ask, args=(index,)) for index in (0, 1)]
        for thread in threads:
            thread.start()
        for event in streaming:
            assert event.wait(120)
        assert not errors and not answers, "both in flight at the kill"
        os.kill(agents[1], signal.SIGKILL)
        for thread in threads:
            thread.join(300)
        assert not errors, errors
        for index in (0, 1):
            assert answers[index] == expected_text(model_path, PROMPTS[index]), f"request {index}"
        status, body = raw(served, "GET", "/health")
        assert status == 200 and body["status"] == "ok", body
        counts = (body["stages_lost"], body["repairs"], body["runs_replayed"], body["recoveries"])
        assert counts == (1, 1, 2, 2), body
    finally:
        code = served.stop()
    assert code == 0, "".join(served.lines)
    assert not wait_no_new_agents(before), "no agent left"
