"""The TUI driving a real pipeline: real agents, real llama.cpp on SmolLM2.

Pilot tests (``App.run_test()``) type into the prompt as a person would and
read what the app shows. Two local stages split the model at layer 13.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from ggufpipe_tui.views.app import GgufpipeApp
from ggufpipe_tui.views.widgets import LogPane, StatusBar
from tests.support.app import (
    READY_TIMEOUT,
    RUN_TIMEOUT,
    ready_for_prompt,
    type_prompt,
    wait_for,
    write_inventory,
)
from tests.support.common import whole_model_greedy

pytestmark = [pytest.mark.model, pytest.mark.slow]


def stage_files(cache: Path) -> dict[Path, tuple[int, int]]:
    return {p: (p.stat().st_mtime_ns, p.stat().st_ino) for p in cache.rglob("*.gguf")}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_prompts_stream_one_after_another_without_reloading(
    tmp_path: Path, model_path: Path, monkeypatch: pytest.MonkeyPatch, no_agent_left: None
) -> None:
    cache = tmp_path / "stages"
    monkeypatch.setenv("GGUFPIPE_CACHE_DIR", str(cache))  # the agents inherit it
    inventory = write_inventory(tmp_path, model_path, "{max_tokens: 16}")
    app = GgufpipeApp(inventory, log_dir=tmp_path / "runs")
    async with app.run_test(size=(100, 30)) as pilot:
        # Startup connects and provisions at once: the plan shows, every stage loads.
        await wait_for(pilot, lambda: ready_for_prompt(app), READY_TIMEOUT, "the stages to load")
        for row in app.rows:
            assert row.history[:2] == ["Preparing", "Ready"], row.history
            assert row.estimated_bytes > 0
        assert [row.layers for row in app.rows] == [(0, 13), (13, 30)]
        assert "llama" in app.model_line
        pids = dict(app.agent_pids)
        assert len(pids) == 2
        files = stage_files(cache)
        assert len(files) == 2

        first = await type_prompt(pilot, "Say hello to the pipeline")
        await wait_for(pilot, lambda: len(app.results) == 1, RUN_TIMEOUT, "the first run")
        result = app.results[0]
        assert result.ok, result.failure
        assert 0 < len(result.tokens) <= 16
        assert first.run_id == result.run_id
        assert first.text == result.text and result.text.strip()
        assert len(first.parts) >= 2, "the reply arrived in one piece, not streamed"
        assert first.appended_at[-1] > first.appended_at[0], "every token was shown at the same moment"
        assert first.finished
        logged = [line.plain for _, line in app.query_one(LogPane).entries]
        assert f"[·] run log {result.log_path}" in logged and Path(result.log_path).exists()

        # The next run is prepared at once; the stages keep their loaded model.
        await wait_for(pilot, lambda: ready_for_prompt(app, result.run_id), READY_TIMEOUT, "the next run")
        second = await type_prompt(pilot, "Now say goodbye")
        await wait_for(pilot, lambda: len(app.results) == 2, RUN_TIMEOUT, "the second run")
        again = app.results[1]
        assert again.ok, again.failure
        assert again.run_id not in (result.run_id, 0)
        assert second.text == again.text and again.text.strip()
        assert app.agent_pids == pids, "the agents were restarted"
        assert stage_files(cache) == files, "a stage file was written again"
        assert all(alive(pid) for pid in pids.values())

        await pilot.press("ctrl+q")
        await wait_for(pilot, lambda: app.return_code is not None, 60, "the app to quit")
    assert app.pipeline is None
    assert not any(alive(pid) for pid in pids.values()), "an agent outlived the app"


async def test_stop_fault_and_start_again(tmp_path: Path, model_path: Path, no_agent_left: None) -> None:
    # recovery off: a lost stage faults the run, as it did before recovery.
    inventory = write_inventory(
        tmp_path, model_path, "{max_tokens: 400, ignore_eos: true}\nrecovery: {attempts: 0}"
    )
    app = GgufpipeApp(inventory, log_dir=tmp_path / "runs")
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: ready_for_prompt(app), READY_TIMEOUT, "the stages to load")

        # A key stops the generation; the run completes with what it has.
        stopped = await type_prompt(pilot, "Count from one to one hundred")
        await wait_for(pilot, lambda: len(stopped.parts) >= 3, RUN_TIMEOUT, "some tokens")
        await pilot.press("escape")
        await wait_for(pilot, lambda: len(app.results) == 1, RUN_TIMEOUT, "the stopped run")
        result = app.results[0]
        assert result.ok and result.stop_reason == "stopped"
        assert 3 <= len(result.tokens) < 400
        assert stopped.text == result.text

        # An agent dies mid-run: the fault shows in its row and in the header,
        # the output so far stays.
        await wait_for(pilot, lambda: ready_for_prompt(app, result.run_id), READY_TIMEOUT, "the next run")
        broken = await type_prompt(pilot, "Tell me a long story")
        await wait_for(pilot, lambda: len(broken.parts) >= 3, RUN_TIMEOUT, "some tokens")
        old_pids = dict(app.agent_pids)
        os.kill(old_pids[1], signal.SIGKILL)
        await wait_for(pilot, lambda: len(app.results) == 2, RUN_TIMEOUT, "the faulted run")
        await wait_for(pilot, lambda: app.session_phase == "Faulted", 30, "the session to stop")
        faulted = app.results[1]
        assert faulted.outcome == "faulted"
        assert "stage 1" in faulted.failure
        assert app.fault == faulted.failure
        assert app.rows[1].state == "Lost" and "signal 9" in app.rows[1].fault
        assert broken.text == faulted.text and len(broken.parts) >= 3
        status = app.query_one(StatusBar).view
        assert status.phase == "Faulted" and faulted.failure in status.fault

        # ctrl+r closes the broken pipeline and starts a fresh one.
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: ready_for_prompt(app), READY_TIMEOUT, "the fresh pipeline")
        assert set(app.agent_pids.values()).isdisjoint(old_pids.values())
        assert not alive(old_pids[0]), "the broken pipeline's other agent is still running"
        assert app.fault == "" and app.rows[1].state == "Ready"
        fresh = await type_prompt(pilot, "Hello again")
        await wait_for(pilot, lambda: len(fresh.parts) >= 2, RUN_TIMEOUT, "tokens from the fresh pipeline")
        await pilot.press("escape")
        await wait_for(pilot, lambda: len(app.results) == 3, RUN_TIMEOUT, "the third run")
        assert app.results[2].ok
        assert broken.text == faulted.text, "the faulted run's output left the screen"

        await pilot.press("ctrl+q")
        await wait_for(pilot, lambda: app.return_code is not None, 60, "the app to quit")


async def test_a_lost_stage_recovers_and_the_reply_goes_on(
    tmp_path: Path, model_path: Path, no_agent_left: None
) -> None:
    """Recovery on (the default): the row goes Lost -> Recovering -> Ready,
    a line under the reply says what happened, the reply completes and is
    the whole model's."""
    inventory = write_inventory(tmp_path, model_path, "{max_tokens: 48, ignore_eos: true, chat: false}")
    app = GgufpipeApp(inventory, log_dir=tmp_path / "runs")
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: ready_for_prompt(app), READY_TIMEOUT, "the stages to load")
        reply = await type_prompt(pilot, "The history of the Roman empire")
        await wait_for(pilot, lambda: len(reply.parts) >= 8, RUN_TIMEOUT, "some tokens")
        old = dict(app.agent_pids)
        os.kill(old[1], signal.SIGKILL)
        await wait_for(pilot, lambda: len(app.results) == 1, RUN_TIMEOUT, "the recovered run")
        result = app.results[0]
        assert result.ok and len(result.tokens) == 48, result.failure
        history = app.rows[1].history
        assert history[history.index("Lost") :][:3] == ["Lost", "Recovering", "Ready"], history
        assert app.fault == ""  # (the row's state moves on with the next run, prepared at once)
        assert reply.text == result.text, "the reply went on where it was, nothing streamed twice"
        recovered = app.state.exchanges[result.run_id].recovered
        assert any("lost at token" in line and "replayed" in line for line in recovered), recovered
        assert result.tokens == tuple(
            whole_model_greedy(model_path, list(result.prompt_tokens), 48, n_ctx=2048, n_ubatch=512)
        )
        await pilot.press("ctrl+q")
        await wait_for(pilot, lambda: app.return_code is not None, 60, "the app to quit")


async def test_a_prepared_run_waits_for_its_prompt_past_the_ready_timeout(
    tmp_path: Path, model_path: Path, no_agent_left: None
) -> None:
    """The app keeps a run prepared while the user thinks; the readiness
    timeout bounds the loading, not the user."""
    ready_timeout = 15.0
    inventory = write_inventory(
        tmp_path, model_path, f"{{max_tokens: 4}}\ntimeouts: {{ready: {ready_timeout}}}"
    )
    app = GgufpipeApp(inventory, log_dir=tmp_path / "runs")
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: app.run_phase == "WaitingReady", READY_TIMEOUT, "the first run")
        waiting_since = time.monotonic()
        await wait_for(pilot, lambda: ready_for_prompt(app), ready_timeout, "the stages to load")
        prepared = app.run_id
        await pilot.pause(ready_timeout + 2 - (time.monotonic() - waiting_since))
        assert app.fault == "" and app.run_id == prepared and ready_for_prompt(app)
        await type_prompt(pilot, "Hi")
        await wait_for(pilot, lambda: len(app.results) == 1, RUN_TIMEOUT, "the run")
        assert app.results[0].ok and app.results[0].run_id == prepared
        await pilot.press("ctrl+q")
        await wait_for(pilot, lambda: app.return_code is not None, 60, "the app to quit")


async def test_setup_error_shows_in_the_header(tmp_path: Path, no_agent_left: None) -> None:
    inventory = write_inventory(tmp_path, tmp_path / "missing.gguf", "{max_tokens: 4}")
    app = GgufpipeApp(inventory, log_dir=tmp_path / "runs")
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: app.session_phase == "Faulted", READY_TIMEOUT, "the setup error")
        assert "missing.gguf" in app.fault
        assert all(row.state == "Unprovisioned" for row in app.rows)
        assert app.query_one(StatusBar).view.fault.startswith(app.fault)
        await pilot.press("ctrl+q")
        await wait_for(pilot, lambda: app.return_code is not None, 60, "the app to quit")
