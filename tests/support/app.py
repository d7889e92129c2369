"""Driving the Textual app in tests: inventories, waiting for states, typing prompts."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from textual.pilot import Pilot

from ggufpipe_agent.wire.protocol import Device, Hello, StepCounters
from ggufpipe_tui.core.events import (
    AgentConnected,
    AgentLog,
    ModelInspected,
    PlanMade,
    RunPhaseChanged,
    StageLoadProgress,
    StageStateChanged,
    StageStats,
    TokenStreamed,
)
from ggufpipe_tui.core.inventory import Inventory, load_inventory, parse_inventory
from ggufpipe_tui.core.plan import build_plan
from ggufpipe_tui.core.refusal import place_stages
from ggufpipe_tui.views.app import GgufpipeApp, ScriptItem, UserPrompt
from ggufpipe_tui.views.entries import Exchange
from ggufpipe_tui.views.transcript import Transcript
from tests.support.model_facts import SMOL

READY_TIMEOUT = 180.0  # agents start and load; generous, the test machine is shared


RUN_TIMEOUT = 180.0


def write_inventory(tmp_path: Path, model_path: Path, run: str) -> Inventory:
    path = tmp_path / "inventory.yaml"
    path.write_text(
        f"model: {{path: '{model_path}'}}\n"
        "hosts: {here: {local: true}}\n"
        "stages:\n"
        "  - {host: here, layers: [0, 13]}\n"
        "  - {host: here, layers: [13, 30]}\n"
        f"run: {run}\n"
    )
    return load_inventory(path)


async def wait_for(pilot: Pilot, condition: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await pilot.pause(0.05)


async def type_prompt(pilot: Pilot, text: str) -> Exchange:
    app = pilot.app
    assert isinstance(app, GgufpipeApp)
    transcript = app.query_one(Transcript)
    before = len(transcript.exchanges)
    await pilot.press(*text, "enter")
    await wait_for(pilot, lambda: len(transcript.exchanges) > before, 10, "the prompt in the output pane")
    return transcript.exchanges[-1]


def ready_for_prompt(app: GgufpipeApp, after_run: int | None = None) -> bool:
    """Every stage of a freshly prepared run is loaded and waits for its prompt."""
    return (
        app.run_phase == "WaitingReady"
        and app.run_id != after_run
        and all(row.state == "Ready" for row in app.rows)
    )


RUN_ID = 0x5BC0184F62E1E619


REPLY = ["Pipelines", " hum", " softly", ",\n", "layers", " pass", " the", " torch", " along", "—"]


def inventory() -> Inventory:
    return parse_inventory(INVENTORY, Path("inventory.yaml"))


def running(inv: Inventory) -> list[ScriptItem]:
    items = planned(inv)
    items += [StageLoadProgress(RUN_ID, 2, "loading into llama.cpp", 1.0), 1.0]
    for stage in range(3):
        items.append(StageStateChanged(RUN_ID, stage, "Ready"))
    items += [UserPrompt(RUN_ID, "Write a haiku about pipelines"), 1.5, RunPhaseChanged(RUN_ID, "Running")]
    for sequence, piece in enumerate(REPLY):
        items += [1.8 + 0.05 * sequence, TokenStreamed(RUN_ID, sequence, 1000 + sequence, piece)]
    for stage, (last, total, inbytes, outbytes) in enumerate(
        [(6.1, 120.0, 176, 101_376), (15.3, 181.0, 101_376, 101_376), (12.4, 160.5, 101_376, 44)]
    ):
        items.append(StageStats(RUN_ID, stage, StepCounters(11, last, total, inbytes, outbytes)))
    items.append(2.4)
    return items


INVENTORY = """\
model:
  path: models/SmolLM2-135M-Instruct.Q4_1.gguf
hosts:
  gpu-a: {address: 10.0.0.11, user: infer}
  gpu-b: {address: 10.0.0.12, user: infer}
  here: {local: true}
stages:
  - {host: gpu-a, layers: [0, 8]}
  - {host: gpu-b, layers: [8, 21]}
  - {host: here, layers: [21, 30]}
run: {max_tokens: 64}
"""


def planned(inv: Inventory) -> list[ScriptItem]:
    placement = place_stages(inv, FACTS, [hello(stage) for stage in range(3)])
    plan = build_plan(inv, FACTS, list(placement.ranges), RUN_ID, edge_base=0x100, placement=placement)
    items: list[ScriptItem] = [0.0]
    for stage in range(3):
        items.append(
            AgentConnected(
                stage, inv.stages[stage].host, inv.hosts[inv.stages[stage].host].where, hello(stage)
            )
        )
    items += [ModelInspected(FACTS), PlanMade(plan, ("gpu-a", "gpu-b", "here")), 0.2]
    items += [RunPhaseChanged(RUN_ID, "Provisioning"), RunPhaseChanged(RUN_ID, "WaitingReady")]
    for stage in range(3):
        items.append(
            AgentLog(
                stage,
                "gpu",
                f"INFO ggufpipe.stage: run {RUN_ID:016x} stage {stage}: Unprovisioned -> Preparing",
            )
        )
        items.append(StageStateChanged(RUN_ID, stage, "Preparing"))
    items += [
        StageLoadProgress(RUN_ID, 0, "writing stage file", 1.0),
        StageLoadProgress(RUN_ID, 0, "loading into llama.cpp", 0.62),
        StageLoadProgress(RUN_ID, 1, "writing stage file", 0.35),
    ]
    return items


def hello(stage: int) -> Hello:
    devices = (Device("CUDA0", DEVICES[stage], 40 << 30, 38 << 30),) if DEVICES[stage] else ()
    return Hello(
        protocol=1,
        version="0.1.0",
        hostname=f"host{stage}",
        pid=4100 + stage,
        python="3.11.7",
        llama_cpp="0.3.36",
        backend="cuda" if devices else "cpu",
        gpu_offload=bool(devices),
        devices=devices,
        memory_total=64 << 30,
        memory_available=60 << 30,
        data_endpoint="unix:/tmp/x",
        data_token="t",
    )


FACTS = SMOL


DEVICES = ("NVIDIA A100-SXM4-40GB", "NVIDIA L4", "")
