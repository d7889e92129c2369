"""The session's events as lines on stdout (the text as it streams) and
stderr (progress), as the front ends without a screen print them: headless
mode (:mod:`ggufpipe_tui.commands.headless`) and the server while it starts
(:mod:`ggufpipe_tui.server.serve`); and their exit statuses."""

from __future__ import annotations

import time
from typing import IO

from ggufpipe_tui.core import format as fmt
from ggufpipe_tui.core.events import (
    AgentConnected,
    AgentLog,
    AgentSetup,
    DataPath,
    Event,
    ModelInspected,
    Notice,
    PlanMade,
    RunRecovered,
    StageDelivery,
    StageRecovery,
    StageStateChanged,
    TokenStreamed,
)
from ggufpipe_tui.core.inventory import Inventory
from ggufpipe_tui.core.recovery import recovery_line, recovery_parts

EXIT_OK = 0
EXIT_FAULTED = 1
EXIT_SETUP = 2


class Printer:
    """The session's events on stdout (text) and stderr (progress)."""

    def __init__(
        self, inventory: Inventory, out: IO[str], err: IO[str], as_json: bool, verbose: bool, quiet: bool
    ) -> None:
        self.inventory = inventory
        self.out, self.err = out, err
        self.as_json, self.verbose, self.quiet = as_json, verbose, quiet
        self.wrote_text = False
        self.paths: list[DataPath] = []
        self.agents: dict[int, AgentConnected] = {}  # each stage's agent, by stage
        self.delivered: dict[int, StageDelivery] = {}  # each stage's last delivery event
        self.setups: dict[int, AgentSetup] = {}  # each stage's last set-up event (hosts given an agent)
        self._shown: dict[int, float] = {}  # when each stage's progress was last printed
        self._last_progress = 0.0
        self.recoveries: list[RunRecovered] = []  # a lost stage's recovery each

    def progress(self, text: str) -> None:
        if not self.quiet:
            print(f"ggufpipe: {text}", file=self.err, flush=True)

    def __call__(self, event: Event) -> None:
        if isinstance(event, TokenStreamed):
            if not self.as_json and event.text:
                self.out.write(event.text)
                self.out.flush()
                self.wrote_text = True
        elif isinstance(event, AgentConnected):
            self.agents[event.stage] = event
            shared = [
                stage
                for stage, other in sorted(self.agents.items())
                if stage != event.stage and other.host == event.host and other.hello.pid == event.hello.pid
            ]
            also = f", the process of stage {shared[0]} (share_process)" if shared else ""
            self.progress(f"stage {event.stage}: {fmt.agent_line(event)}{also}")
        elif isinstance(event, ModelInspected):
            hosts = len({spec.host for spec in self.inventory.stages})
            self.progress(f"model {fmt.model_line(event.facts, len(self.inventory.stages), hosts)}")
        elif isinstance(event, PlanMade):
            for stage in event.plan.stages:
                self.progress(fmt.stage_plan_line(stage))
        elif isinstance(event, DataPath):
            self.paths.append(event)
            self.progress(fmt.data_path_line(event))
        elif isinstance(event, StageDelivery):
            self.delivery(event)
        elif isinstance(event, AgentSetup):
            self.setups[event.stage] = event
            self.progress(f"stage {event.stage} on {event.host}: {fmt.setup_line(event)}")
        elif isinstance(event, StageStateChanged):
            if self.verbose or event.state in ("Ready", "Faulted"):
                self.progress(fmt.stage_state_line(event.stage, event.state, event.detail))
        elif isinstance(event, StageRecovery):
            detail = f": {event.detail}" if event.detail else ""
            self.progress(f"stage {event.stage} on {event.host}: {event.state.lower()}{detail}")
        elif isinstance(event, RunRecovered):
            self.recoveries.append(event)
            self.progress(recovery_line(event))
        elif isinstance(event, AgentLog):
            if self.verbose:
                print(f"[stage {event.stage} {event.host}] {event.line}", file=self.err, flush=True)
        elif isinstance(event, Notice) and (self.verbose or event.level == "warning"):
            print(f"ggufpipe: {event.level}: {event.text}", file=self.err, flush=True)

    def delivery(self, event: StageDelivery) -> None:
        """A stage file's delivery on stderr: each step, and while it is sent
        at most a line a second per stage and a few a second in all."""
        before = self.delivered.get(event.stage)
        self.delivered[event.stage] = event
        now = time.monotonic()
        if event.state == "sending" and before is not None and before.state == "sending":
            if now - self._shown.get(event.stage, 0.0) < 1.0 or now - self._last_progress < 0.3:
                return
        elif before is not None and before.state == event.state:
            return
        self._shown[event.stage] = self._last_progress = now
        self.progress(f"stage {event.stage} on {event.host}: {fmt.delivery_line(event)}")

    def recoveries_json(self) -> list[dict[str, object]]:
        """One entry per lost stage recovered in the run (docs/recovery.md)."""
        return [
            {
                "lost": event.stages,
                "how": event.how,
                "at_token": event.at_token,
                "replayed": event.replayed,
                "interrupted_run": f"{event.interrupted:016x}",
                "run_id": f"{event.run_id:016x}",
                **recovery_parts(event),
            }
            for event in self.recoveries
        ]

    def processes_json(self) -> list[dict[str, object]]:
        """One entry per agent process: the stages it runs (several where
        they share it)."""
        return [
            {"host": host, "pid": pid, "stages": list(stages)}
            for host, pid, stages in fmt.agent_processes(self.agents.values())
        ]

    def setup_json(self) -> list[dict[str, object]]:
        return [
            {
                "stage": e.stage,
                "host": e.host,
                "how": e.how,
                "seconds": round(e.seconds, 3),
                "bytes_sent": e.bytes_sent,
            }
            for _, e in sorted(self.setups.items())
            if e.state == "done"
        ]

    def delivery_json(self) -> list[dict[str, object]]:
        return [
            {
                "stage": event.stage,
                "host": event.host,
                "file": event.name,
                "size": event.size,
                "bytes_sent": event.sent,
                "seconds": round(event.seconds, 3),
                "outcome": event.outcome or event.state,
            }
            for _, event in sorted(self.delivered.items())
        ]
