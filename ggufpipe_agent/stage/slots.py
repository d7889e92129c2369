"""Which runs a stage holds, and on which slots (docs/architecture.md, "Runs in flight"). Pure: no I/O.

A stage's engine has ``parallel`` slots (llama.cpp sequences, each its own KV
cache). Each provision names its slot; the stage takes it when no live run
(one not stopped) holds that slot and the run id is not live already. A
stopped run stays known (a retried StopRun is answered again) until a new run
takes its slot. Each run's own lifecycle is the stage FSM (docs/design.md, "Stage state machine") of
:mod:`ggufpipe_agent.stage.fsm`, one per run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ggufpipe_agent.ids import RunId, SlotId


@dataclass(frozen=True, slots=True)
class Held:
    """A run the stage knows: its id, its slot, whether it has stopped."""

    run_id: RunId
    slot: SlotId
    stopped: bool = False


def refusal(held: Iterable[Held], run_id: RunId, slot: SlotId, parallel: int) -> str:
    """Why the stage cannot take run ``run_id`` on ``slot`` now ('' if it can)."""
    for run in held:
        if run.stopped:
            continue
        if run.run_id == run_id:
            return f"run {run_id:016x} is already provisioned (StopRun it first)"
        if run.slot == slot:
            return f"stage is busy with run {run.run_id:016x} on slot {slot} (of {parallel})"
    return ""


def replaced(held: Iterable[Held], slot: SlotId) -> list[int]:
    """The stopped runs a new run on ``slot`` makes the stage forget."""
    return [run.run_id for run in held if run.stopped and run.slot == slot]
