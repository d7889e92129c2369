"""Snapshots of the TUI's layout, from fixed event sequences (no agents).

The app replays a scripted list of orchestrator events (``script=``) instead
of starting a pipeline, so each picture is exact: the plan before anything
loads, a run streaming, and a fault, each at 80x24 and at 160x48. Update with
``pytest tests/test_app_snapshots.py --snapshot-update`` after a deliberate
change, and look at the pictures before committing them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.app import App, ComposeResult

from ggufpipe_agent.wire.protocol import Device, Hello, ModelFacts, StepCounters
from ggufpipe_tui.core.events import (
    AgentConnected,
    AgentLog,
    ModelInspected,
    Notice,
    PlanMade,
    RunFinished,
    RunPhaseChanged,
    RunResult,
    StageLoadProgress,
    StageStateChanged,
    StageStats,
    Timings,
    TokenStreamed,
)
from ggufpipe_tui.core.inventory import Inventory, parse_inventory
from ggufpipe_tui.core.placement import place_stages
from ggufpipe_tui.core.plan import build_plan
from ggufpipe_tui.views.app import GgufpipeApp, ScriptItem, UserPrompt
from ggufpipe_tui.views.widgets import StageRow, StageTable

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
RUN_ID = 0x5BC0184F62E1E619
FACTS = ModelFacts(
    path="/models/SmolLM2-135M-Instruct.Q4_1.gguf",
    name="SmolLM2 135M Instruct",
    architecture="llama",
    file_type="Q4_1",
    file_size=98_362_432,
    block_count=30,
    hidden_dim=576,
    context_length=8192,
    vocab_size=49152,
    head_count=9,
    head_count_kv=3,
    key_length=64,
    value_length=64,
    bos_token_id=1,
    eos_token_id=2,
    eog_token_ids=(0, 2),
    add_bos=False,
    chat_template="",
    block_bytes=(2_654_208,) * 30,
    embedding_bytes=15_925_248,
    output_bytes=1_152,
)
DEVICES = ("NVIDIA A100-SXM4-40GB", "NVIDIA L4", "")
REPLY = ["Pipelines", " hum", " softly", ",\n", "layers", " pass", " the", " torch", " along", "—"]


def inventory() -> Inventory:
    return parse_inventory(INVENTORY, Path("inventory.yaml"))


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


def faulted(inv: Inventory) -> list[ScriptItem]:
    items = running(inv)
    reason = "stage 1 on gpu-b (infer@10.0.0.12): step 11 failed: llama_decode returned -3 (out of memory)"
    items += [
        StageStateChanged(RUN_ID, 1, "Faulted", "step 11 failed: llama_decode returned -3 (out of memory)"),
        RunPhaseChanged(RUN_ID, "Faulted", reason),
        Notice("error", f"run {RUN_ID:016x} faulted: {reason}"),
        RunPhaseChanged(RUN_ID, "TearingDown", reason),
        StageStateChanged(RUN_ID, 0, "Stopping"),
        StageStateChanged(RUN_ID, 0, "Stopped"),
        StageStateChanged(RUN_ID, 2, "Stopping"),
        StageStateChanged(RUN_ID, 2, "Stopped"),
        RunPhaseChanged(RUN_ID, "Done", reason),
        2.6,
        RunFinished(
            RunResult(
                run_id=RUN_ID,
                outcome="faulted",
                stop_reason="",
                failure=reason,
                prompt_tokens=(1, 2, 3),
                tokens=tuple(range(1000, 1000 + len(REPLY))),
                text="".join(REPLY),
                timings=Timings(ttft_ms=300.0, prefill_ms=250.0, decode_ms=450.0, decode_tokens_per_s=20.0),
            )
        ),
    ]
    return items


@pytest.mark.parametrize("size", [(80, 24), (160, 48)], ids=["80x24", "160x48"])
@pytest.mark.parametrize("scene", [planned, running, faulted])
def test_layout(snap_compare, scene, size) -> None:
    inv = inventory()
    app = GgufpipeApp(inv, script=scene(inv))
    assert snap_compare(app, terminal_size=size)


class StageTableApp(App[None]):
    """The stage table alone, with the plan's memory figures: what each stage
    needs where its layers go and what its host has for it."""

    def compose(self) -> ComposeResult:
        rows = [
            StageRow(0, "gpu-a", "infer@10.0.0.11", (0, 8), 9_863_000_000, 40_265_318_400, "NVIDIA A100"),
            StageRow(1, "gpu-b", "infer@10.0.0.12", (8, 21), 22_548_578_304, 23_622_320_128, "NVIDIA L4"),
            StageRow(2, "here", "local", (21, 30), 3_221_225_472, 2_147_483_648),  # over: red
            StageRow(3, "spare", "local", None, 734_003_200),  # what the host has is unknown
        ]
        for row in rows:
            row.connected = True
        yield StageTable(rows)


@pytest.mark.parametrize("size", [(80, 24), (160, 48)], ids=["80x24", "160x48"])
def test_stage_table_memory(snap_compare, size) -> None:
    assert snap_compare(StageTableApp(), terminal_size=size)


def test_scripted_app_renders_and_exits_with_its_result() -> None:
    """The pictures above are worth something only if the app exits as Textual
    expects (an app method once shadowed App._shutdown and every snapshot was
    an empty file)."""
    from textual._doc import take_svg_screenshot

    inv = inventory()
    svg = take_svg_screenshot(app=GgufpipeApp(inv, script=running(inv)), terminal_size=(80, 24))
    assert isinstance(svg, str) and svg.lstrip().startswith("<svg")
    assert "Pipelines" in svg and "Running" in svg
