"""Stages that share one agent process (``share_process: true``): real agents,
real llama.cpp on SmolLM2, locally and over the loopback sshd."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ggufpipe_agent.wire.framing import FrameReader, FrameWriter
from ggufpipe_agent.wire.protocol import Hello, ShareAttach
from ggufpipe_tui.core.events import AgentConnected, AgentLog, Notice, TokenStreamed
from ggufpipe_tui.core.inventory import InventoryError, load_inventory, parse_inventory
from ggufpipe_tui.session.pipeline import Pipeline
from tests.support import local
from tests.support.common import DATA_MODES, LONG_PROMPT, MODES, REPO, mode_yaml, whole_model_greedy
from tests.support.local import tokenize
from tests.support.one_run import generate_once
from tests.support.sabotage import Saboteur, on_token, run_with, signal_agent
from tests.support.ssh_hosts import host_entry, wait_no_session_agents, wait_session_agents, write_inventory
from tests.support.sshd import Sshd

pytestmark = pytest.mark.model

RANGES = ((0, 7), (7, 23), (23, 30))


def local_inventory(
    tmp_path: Path, model_path: Path, mode: str = "direct", max_tokens: int = 48, extra: str = ""
) -> Path:
    data, feedback = mode_yaml(mode)
    stages = "".join(f"- {{host: here, layers: [{a}, {b}]}}\n" for a, b in RANGES)
    run = f"max_tokens: {max_tokens}, ignore_eos: true, chat: false, {feedback}"
    return local.write_inventory(
        tmp_path, model_path, stages, run, data, here="{local: true, share_process: true}", extra=extra
    )


def pids(pipeline: Pipeline) -> list[int]:
    return [link.hello.pid for link in pipeline.links if link.hello is not None]


@pytest.mark.parametrize("mode", MODES)
async def test_three_stages_in_one_process_match_the_whole_model(tmp_path, model_path, no_agent_left, mode):
    inventory = load_inventory(local_inventory(tmp_path, model_path, mode))
    events: list[Any] = []
    pipeline = Pipeline(inventory, events.append)
    try:
        await pipeline.start()
        assert len(set(pids(pipeline))) == 1 and len(pids(pipeline)) == 3, "one agent process for 3 stages"
        result = await pipeline.generate(LONG_PROMPT)
        again = await pipeline.generate(LONG_PROMPT) if mode == "direct" else result
    finally:
        await pipeline.close()
    assert result.outcome == "completed" and result.stop_reason == "max_tokens", result.failure
    reference = whole_model_greedy(model_path, list(result.prompt_tokens), 48, n_ctx=512, n_ubatch=32)
    assert list(result.tokens) == reference
    assert again.ok and again.tokens == result.tokens, "a second run in the shared process (engines kept)"
    streamed = "".join(e.text for e in events if isinstance(e, TokenStreamed) and e.run_id == result.run_id)
    assert streamed == result.text
    hellos = [e.hello for e in events if isinstance(e, AgentConnected)]
    assert [bool(h.share_endpoint) for h in hellos].count(True) == 1, "only the first stage offers to share"
    assert len({h.data_token for h in hellos}) == 3, "each stage has its own data token"


CHAINED = "decode steps run on the worker right after the previous stage's"


@pytest.mark.parametrize("chain", ["on", "off"])
async def test_a_shared_process_chains_its_stages_steps(
    tmp_path, model_path, no_agent_left, monkeypatch, chain
):
    """On the direct links of one process, the worker runs stage i+1's decode
    step right after stage i's (ggufpipe_agent/stage/handover.py); GGUFPIPE_NO_CHAIN=1
    turns it off. Either way the tokens are the whole model's."""
    if chain == "off":
        monkeypatch.setenv("GGUFPIPE_NO_CHAIN", "1")  # the agent process inherits it
    inventory = load_inventory(local_inventory(tmp_path, model_path, "direct"))
    events: list[Any] = []
    result = await generate_once(inventory, events)
    assert result.outcome == "completed", result.failure
    reference = whole_model_greedy(model_path, list(result.prompt_tokens), 48, n_ctx=512, n_ubatch=32)
    assert list(result.tokens) == reference
    # One process, one stderr (shown as stage 0's); the line names its stage.
    lines = [e.line for e in events if isinstance(e, AgentLog) and CHAINED in e.line]
    chained = sorted(int(line.split(" stage ")[1].split(":")[0]) for line in lines)
    assert chained == ([1, 2] if chain == "on" else []), "stages 1 and 2 take their steps from the chain"


@pytest.mark.parametrize("mode", MODES)
async def test_sigkilled_shared_process_is_one_fault(tmp_path, model_path, no_agent_left, mode):
    """Recovery off: the process of all three stages dies mid-decode: one
    reason naming the process, a full teardown, the output so far kept
    (with recovery on it is started again: tests/e2e/test_shared_recovery.py)."""

    def kill(pipeline: Pipeline) -> None:
        os.kill(pids(pipeline)[0], signal.SIGKILL)

    saboteur = Saboteur(on_token(5), kill)
    off = "recovery: {attempts: 0}\n"
    result = await run_with(saboteur, local_inventory(tmp_path, model_path, mode, max_tokens=40, extra=off))
    assert saboteur.fired and result.outcome == "faulted"
    assert result.failure == (
        "stages 0, 1, 2 on here (local), one agent process: the agent exited (killed by signal 9)"
    )
    assert 6 <= len(result.tokens) < 40 and result.text.strip()
    streamed = "".join(e.text for e in saboteur.events if isinstance(e, TokenStreamed))
    assert streamed == result.text
    errors = [e.text for e in saboteur.events if isinstance(e, Notice) and e.level == "error"]
    assert errors.count(result.failure) == 1, "the loss is said once, not once per stage"
    assert all(result.failure in error for error in errors), errors
    assert saboteur.phases()[-3:] == ["Faulted", "TearingDown", "Done"]
    assert saboteur.close_seconds < 10


def test_headless_json_names_the_shared_process(tmp_path, model_path, no_agent_left):
    inventory = local_inventory(tmp_path, model_path, max_tokens=8)
    done = subprocess.run(
        [sys.executable, "-m", "ggufpipe_tui.cli", str(inventory), "--prompt", "Hi", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    [process] = report["processes"]
    assert process["host"] == "here" and process["stages"] == [0, 1, 2]
    assert f"stage 2: agent on here (local), pid {process['pid']}" in done.stderr
    assert "the process of stage 0 (share_process)" in done.stderr


async def test_share_socket_refuses_a_connection_without_the_secret(tmp_path, model_path, no_agent_left):
    agent = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "ggufpipe_agent",
        "--share-process",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert agent.stdout is not None and agent.stdin is not None and agent.stderr is not None
    try:
        hello = await asyncio.wait_for(FrameReader(agent.stdout, "agent").message(1 << 20), 60)
        assert isinstance(hello, Hello) and hello.share_endpoint.startswith("unix:") and hello.share_token
        socket_path = Path(hello.share_endpoint[len("unix:") :])
        assert oct(socket_path.stat().st_mode & 0o777) == "0o600"
        assert oct(socket_path.parent.stat().st_mode & 0o777) == "0o700"
        for token in ("0" * 32, hello.data_token):
            reader, writer = await asyncio.open_unix_connection(str(socket_path))
            await FrameWriter(writer).send(ShareAttach(token))
            assert await asyncio.wait_for(FrameReader(reader, "share").message(), 10) is None, (
                "closed unanswered"
            )
            writer.close()
        reader, writer = await asyncio.open_unix_connection(str(socket_path))
        await FrameWriter(writer).send(ShareAttach(hello.share_token))
        guest = await asyncio.wait_for(FrameReader(reader, "share").message(1 << 20), 60)
        assert isinstance(guest, Hello) and guest.pid == hello.pid and not guest.share_endpoint
        assert guest.data_token != hello.data_token
        writer.close()
    finally:
        agent.stdin.close()  # the first session ends: the process exits
        await asyncio.wait_for(agent.wait(), 30)
    assert agent.returncode == 0
    logged = (await agent.stderr.read()).decode()
    assert logged.count("refused a share connection without the share token") == 2


def test_share_process_is_refused_with_a_hand_started_agent(tmp_path):
    text = (
        "model: {path: m.gguf}\n"
        "hosts:\n  h: {local: true, listen: 'unix:/tmp/x.sock', share_process: true}\n"
        "stages:\n  - {host: h}\n"
    )
    with pytest.raises(InventoryError, match=r"hosts.h.share_process: is for agents the orchestrator starts"):
        parse_inventory(text, tmp_path / "inv.yaml")


# ------------------------------------------------------------------- SSH


@pytest.mark.ssh
@pytest.mark.parametrize("mode", ["direct", "relay"])
async def test_three_stages_over_ssh_in_one_process(tmp_path, sshd: Sshd, cache_dir, model_path, mode):
    """One host, three stages, one agent process under sshd: the first
    stage's exec session, an exec bridge each for the other two stages'
    control sessions, and the data bridges of the relay (none with links)."""
    hosts = {"gpu": host_entry(sshd, cache_dir, share_process=True)}
    stages = [("gpu", list(layers)) for layers in RANGES]
    path = write_inventory(
        tmp_path / "inv.yaml", model_path, hosts, stages, mode=mode, max_tokens=40, ignore_eos=True
    )

    def started(pipeline: Pipeline) -> None:
        assert len(set(pids(pipeline))) == 1
        bridges = 2 + 3  # 2 control bridges; the data streams (used by the relay, opened in both modes)
        assert wait_session_agents(sshd, 1, bridges) == (1, bridges), "one agent process under sshd"

    result = await generate_once(load_inventory(path), started=started)
    assert result.outcome == "completed", result.failure
    reference = whole_model_greedy(model_path, list(result.prompt_tokens), 40, n_ctx=512, n_ubatch=32)
    assert list(result.tokens) == reference
    assert DATA_MODES[mode]["data"] in ("direct", "relay")
    assert wait_no_session_agents(sshd, 10) == {}


@pytest.mark.ssh
async def test_sigkilled_shared_process_over_ssh_is_one_fault(tmp_path, sshd: Sshd, cache_dir, model_path):
    """Recovery off: stages 0 and 2 share gpu-a's process, stage 1 runs on
    gpu-b (TLS links both ways): killing the shared process mid-decode is one
    fault naming both its stages; gpu-b's stage stops; nothing is left on the host."""
    hosts = {"gpu-a": host_entry(sshd, cache_dir, share_process=True), "gpu-b": host_entry(sshd, cache_dir)}
    stages = [("gpu-a", list(RANGES[0])), ("gpu-b", list(RANGES[1])), ("gpu-a", list(RANGES[2]))]
    path = write_inventory(
        tmp_path / "inv.yaml",
        model_path,
        hosts,
        stages,
        mode="direct",
        recovery={"attempts": 0},
        max_tokens=40,
        ignore_eos=True,
    )
    saboteur = Saboteur(on_token(5), signal_agent(2, signal.SIGKILL))
    result = await run_with(saboteur, path)
    where = f"{sshd.user}@127.0.0.1:{sshd.port}"
    assert result.outcome == "faulted"
    assert result.failure == (
        f"stages 0, 2 on gpu-a ({where}), one agent process: the agent exited (killed by signal KILL)"
    )
    assert 6 <= len(result.tokens) < 40 and result.text.strip()
    assert saboteur.stopped() == {1}, "the other host's stage stopped"
    assert wait_no_session_agents(sshd, 10) == {}


async def test_a_run_stopped_mid_decode_leaves_a_prefix_the_next_turn_keeps_exactly(
    tmp_path, model_path, no_agent_left
):
    """The worker runs a stage's step ahead of its object (ggufpipe_agent/stage/handover.py), so a
    run stopped mid-decode may leave a stage's engine a position further on
    than the others. The next turn keeps only what every stage holds of the
    tokens the orchestrator got, and its tokens are a cold run's."""
    inventory = load_inventory(local_inventory(tmp_path, model_path, "direct", max_tokens=40))
    pipeline = Pipeline(inventory, lambda event: None)

    def stop_at_token_8(event: Any) -> None:
        if isinstance(event, TokenStreamed) and event.sequence == 8:
            for driver in pipeline.live_drivers():
                driver.stop("esc")

    unsubscribe = pipeline.subscribe(stop_at_token_8)
    try:
        await pipeline.start()
        first = await pipeline.generate(LONG_PROMPT)
        unsubscribe()
        prompt = list(first.prompt_tokens) + list(first.tokens) + tokenize(model_path, " Go on.", bos=False)
        second = await pipeline.generate_tokens(prompt)
    finally:
        await pipeline.close()
    assert (first.outcome, first.stop_reason) == ("completed", "stopped"), (first.outcome, first.failure)
    assert 8 <= len(first.tokens) < 40
    assert second.outcome == "completed", second.failure
    assert 0 < second.prompt_reused <= len(first.prompt_tokens) + len(first.tokens)
    reference = whole_model_greedy(model_path, prompt, 40, n_ctx=512, n_ubatch=32)
    assert list(second.tokens) == reference
