"""Recovery of a shared agent process (``share_process: true``, the bundled
example's shape; docs/recovery.md): the process of all three stages
SIGKILLed mid-reply is started again with its stages, their links made
again, and the run is replayed; in-process, headless (``--prompt`` on
inventory.example.yaml itself) and in ``--serve`` with requests in flight.
A stage of a live shared process whose engine fails is attached to it again
alone. Every reply is the whole model's greedy tokens, as if nothing was lost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ggufpipe_agent.llama.vocabulary import vocabulary
from ggufpipe_tui.core.events import AgentConnected, RunFinished, RunRecovered, StageRecovery, TokenStreamed
from ggufpipe_tui.core.recovery import recovery_line
from ggufpipe_tui.session.pipeline import Pipeline
from tests.support import local
from tests.support.common import LONG_PROMPT, REPO, agent_pids, wait_no_new_agents, whole_model_greedy
from tests.support.local import tokenize
from tests.support.sabotage import Saboteur, on_token, run_with
from tests.support.served import raw, start_server

pytestmark = pytest.mark.model

MAX_TOKENS = 40
EXAMPLE_RANGES = ((0, 8), (8, 21), (21, 30))  # inventory.example.yaml's
SHARED = "{local: true, share_process: true}"
PROCESS = "stages 0, 1, 2 on here (local), one agent process"
FAILING_AGENT = Path(__file__).resolve().parents[1] / "support" / "ggufpipe_agent_failing.py"


def inventory_file(
    tmp_path: Path, model_path: Path, here: str = SHARED, timeouts: str = local.TIMEOUTS
) -> Path:
    stages = "".join(f"- {{host: here, layers: [{a}, {b}]}}\n" for a, b in EXAMPLE_RANGES)
    run = f"max_tokens: {MAX_TOKENS}, ignore_eos: true, chat: false"
    return local.write_inventory(
        tmp_path, model_path, stages, run, "data: direct\n", here=here, timeouts=timeouts
    )


def of(events: list[Any], kind: type) -> list[Any]:
    return [e for e in events if isinstance(e, kind)]


def assert_whole(saboteur: Saboteur, result: Any, model_path: Path) -> RunRecovered:
    """Completed with the unbroken run's tokens, each streamed once; one recovery."""
    assert saboteur.fired
    assert result.outcome == "completed", result.failure
    expected = whole_model_greedy(model_path, list(result.prompt_tokens), MAX_TOKENS, n_ctx=512, n_ubatch=32)
    assert list(result.tokens) == expected, "the output differs from an unbroken run"
    streamed = [e.token for e in of(saboteur.events, TokenStreamed) if e.sequence >= 0]
    assert streamed == list(result.tokens), "every token streamed once, in order"
    assert len(of(saboteur.events, RunFinished)) == 1
    (recovered,) = of(saboteur.events, RunRecovered)
    return recovered


async def test_the_shared_process_killed_mid_reply_is_started_again(tmp_path, model_path, no_agent_left):
    def kill(pipeline: Pipeline) -> None:
        hello = pipeline.links[0].hello
        assert hello is not None
        os.kill(hello.pid, signal.SIGKILL)

    saboteur = Saboteur(on_token(8), kill)
    result = await run_with(saboteur, inventory_file(tmp_path, model_path))
    recovered = assert_whole(saboteur, result, model_path)
    assert recovered.stages == PROCESS, "the process is named once, not stage by stage"
    assert recovered.at_token >= 9
    assert recovery_line(recovered).startswith(f"{PROCESS} lost at token {recovered.at_token}; restarted;")
    ready = {e.stage for e in of(saboteur.events, StageRecovery) if e.state == "Ready"}
    assert ready == {0, 1, 2}, "every stage of the process started again"
    connected = of(saboteur.events, AgentConnected)
    before, after = connected[:3], connected[3:]
    assert len(after) == 3 and len({e.hello.pid for e in before}) == 1 == len({e.hello.pid for e in after})
    assert before[0].hello.pid != after[0].hello.pid, "one new process for the three stages"
    assert [bool(e.hello.share_endpoint) for e in after].count(True) == 1


async def test_a_stopped_shared_process_is_lost_by_its_heartbeat(tmp_path, model_path, no_agent_left):
    """SIGSTOP: the process says nothing for any of its stages; after
    timeouts.heartbeat it is lost, killed and started again whole."""

    def stop(pipeline: Pipeline) -> None:
        hello = pipeline.links[0].hello
        assert hello is not None
        os.kill(hello.pid, signal.SIGSTOP)

    saboteur = Saboteur(on_token(5), stop)
    timeouts = "connect: 30, ready: 120, step: 60, teardown: 10, heartbeat: 3"
    result = await run_with(saboteur, inventory_file(tmp_path, model_path, timeouts=timeouts))
    assert_whole(saboteur, result, model_path)
    (lost, *_) = of(saboteur.events, StageRecovery)
    assert lost.state == "Lost" and "for 3 s" in lost.detail, lost
    ready = sorted(e.stage for e in of(saboteur.events, StageRecovery) if e.state == "Ready")
    assert ready == [0, 1, 2], "every stage of the process started again"
    assert len({e.hello.pid for e in of(saboteur.events, AgentConnected)}) == 2


@pytest.mark.parametrize(("stage", "shared"), [(1, True), (0, True), (1, False)])
async def test_a_stage_whose_engine_fails_is_started_again(
    tmp_path, model_path, no_agent_left, monkeypatch, stage, shared
):
    """A stage's engine raises in a step (tests/support/ggufpipe_agent_failing.py:
    the real agent whose StageEngine.step fails once) while its process
    lives: that stage is lost. Stage 1 (attached to the process) gets a new
    session in the same process; stage 0, whose session the process lives
    by, takes the process with it: it is started again whole; with a process
    per stage, the stage's process is started again. Each time the run is
    replayed and is the unbroken one."""
    prompt = tokenize(model_path, LONG_PROMPT, True)
    position = len(prompt) + 8
    which = "middle" if stage == 1 else "first"
    monkeypatch.setenv("GGUFPIPE_TEST_ENGINE_FAILS", f"{which}:{position}:{tmp_path / 'failed-once'}")
    sharing = "share_process: true, " if shared else ""
    here = f"{{local: true, {sharing}agent: '{sys.executable} {FAILING_AGENT}'}}"
    saboteur = Saboteur(lambda event: False, lambda pipeline: None)
    saboteur.fired = True
    result = await run_with(saboteur, inventory_file(tmp_path, model_path, here))
    assert (tmp_path / "failed-once").exists(), "the engine failed"
    recovered = assert_whole(saboteur, result, model_path)
    assert recovered.stages == f"stage {stage} on here (local)"
    lost = [e for e in of(saboteur.events, StageRecovery) if e.state == "Lost"]
    assert len(lost) == 1 and lost[0].stage == stage, lost
    assert "its engine failed (step " in lost[0].detail and "injected by the test" in lost[0].detail
    ready = [e.stage for e in of(saboteur.events, StageRecovery) if e.state == "Ready"]
    connected = of(saboteur.events, AgentConnected)
    pids = [e.hello.pid for e in connected]
    if not shared:
        stages = [e.stage for e in connected]
        assert ready == [1] and sorted(stages[:3]) == [0, 1, 2] and stages[3:] == [1]
        assert len(set(pids)) == 4, "a new process for stage 1"
    elif stage == 1:
        assert ready == [1], "only stage 1 started again"
        stages = [e.stage for e in connected]  # the first three in the order their hellos came
        assert sorted(stages[:3]) == [0, 1, 2] and stages[3:] == [1]
        assert len(set(pids)) == 1, "the same process throughout"
    else:
        assert ready == [0, 1, 2], "the process started again with its stages"
        stages = [e.stage for e in connected]  # again in the order their hellos came
        assert sorted(stages[3:]) == [0, 1, 2] and len(set(pids)) == 2


def expected_text(model_path: Path, prompt: list[int], steps: int, n_ctx: int, n_ubatch: int) -> str:
    vocab = vocabulary(str(model_path))
    pieces, eog = vocab.pieces(), set(vocab.eog_tokens())
    out = []
    for token in whole_model_greedy(model_path, prompt, steps, n_ctx=n_ctx, n_ubatch=n_ubatch):
        if token in eog:
            break
        out.append(pieces[token])
    return b"".join(out).decode("utf-8", "replace")


def test_the_bundled_example_recovers_headless(model_path, no_agent_left):
    """inventory.example.yaml as a user runs it (--prompt), its one agent
    process SIGKILLed once the reply has begun: the reply completes, the
    whole model's, and stderr says what was lost and how it recovered."""
    before = agent_pids()
    text = "Tell me about the history of Rome, emperor by emperor."
    command = [sys.executable, "-m", "ggufpipe_tui.cli", "inventory.example.yaml", "--prompt", text]
    command += ["--raw", "--max-tokens", str(MAX_TOKENS), "--ignore-eos"]
    # Unbuffered bytes: what is read before the kill is not left in a buffer
    # that communicate() does not read.
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0, cwd=REPO)
    try:
        assert process.stdout is not None
        seen = b""
        while len(seen) < 16:  # the reply has begun ("\nassistant\n" and more)
            byte = process.stdout.read(1)
            assert byte, "the run ended before it produced text"
            seen += byte
        (agent,) = agent_pids() - before
        os.kill(agent, signal.SIGKILL)
        rest, stderr = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    errors = stderr.decode()
    assert process.returncode == 0, errors
    prompt = tokenize(model_path, text, True)
    vocab = vocabulary(str(model_path))
    pieces = vocab.pieces()
    tokens = whole_model_greedy(model_path, prompt, MAX_TOKENS, n_ctx=2048, n_ubatch=512)
    assert (seen + rest).decode().rstrip("\n") == b"".join(pieces[t] for t in tokens).decode(
        "utf-8", "replace"
    )
    assert f"{PROCESS} lost at token " in errors and "; restarted; replayed " in errors, errors


@pytest.mark.slow
def test_serve_recovers_the_shared_process_with_requests_in_flight(tmp_path: Path, model_path: Path) -> None:
    """--serve on the example's shape: the process killed while a streamed
    request is mid-reply and two more wait; all three get their unbroken
    answers, /health said "recovering" meanwhile, and the server serves on."""
    prompts = [[1, 504, 2365, 282, 4649, 314], [1, 9690, 2118, 253, 655, 28], [1, 378, 1345, 1288, 30]]
    stages = "".join(f"- {{host: here, layers: [{a}, {b}]}}\n" for a, b in EXAMPLE_RANGES)
    before = agent_pids()
    served = start_server(tmp_path, model_path, stages=stages, here=SHARED)
    try:
        (agent,) = agent_pids() - before
        client = served.client()
        answers: dict[int, str] = {}
        errors: list[BaseException] = []
        health: list[str] = []
        done = threading.Event()

        def ask(index: int) -> None:
            try:
                if index == 0:
                    parts = []
                    stream = client.completions.create(
                        model="m", prompt=prompts[0], max_tokens=32, temperature=0, stream=True
                    )
                    for number, chunk in enumerate(stream):
                        if number == 6:
                            os.kill(agent, signal.SIGKILL)
                        if chunk.choices:
                            parts.append(chunk.choices[0].text)
                    answers[index] = "".join(parts)
                else:
                    answer = client.completions.create(
                        model="m", prompt=prompts[index], max_tokens=32, temperature=0
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
        time.sleep(0.3)
        for index in (1, 2):
            threads.append(threading.Thread(target=ask, args=(index,)))
            threads[-1].start()
        for thread in threads:
            thread.join(300)
        done.set()
        watcher.join()
        assert not errors, errors
        for index, prompt in enumerate(prompts):
            assert answers[index] == expected_text(model_path, prompt, 32, 512, 32), f"request {index}"
        assert "recovering" in health, sorted(set(health))
        assert health[-1] == "ok"
        served.wait_line(lambda line: f"{PROCESS} lost at token" in line, 10, "the recovery line")
        again = client.completions.create(model="m", prompt=prompts[1], max_tokens=32, temperature=0)
        assert again.choices[0].text == answers[1]
        assert len(agent_pids() - before) == 1, "one agent process again"
    finally:
        code = served.stop()
    assert code == 0, "".join(served.lines)
    assert not wait_no_new_agents(before), "no agent left"
