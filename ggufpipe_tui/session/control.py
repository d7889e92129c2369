"""A stage's control message to the run it is about.

What the data plane does not take of a stage's control stream goes to its
run's :class:`~ggufpipe_tui.session.driver.RunDriver`; a refusal while the
run sets up faults the run at once (not at the readiness timeout), and a
message for a run that has ended is only logged.
"""

from __future__ import annotations

from ggufpipe_agent.wire.protocol import Message, Refused
from ggufpipe_tui.core import run_fsm as fsm
from ggufpipe_tui.core.events import AgentLog, Emit
from ggufpipe_tui.session.driver import RunDriver
from ggufpipe_tui.session.stages import StageHandle


def to_run(stage: StageHandle, message: Message, driver: RunDriver | None, emit: Emit) -> None:
    """``message`` of ``stage`` to ``driver``, the run it names (None: none
    in flight); ``emit``: the session's events."""
    if isinstance(message, Refused):
        emit(AgentLog(stage.index, stage.host.name, f"refused {message.what}: {message.reason}"))
        setting_up = (fsm.RunPhase.PROVISIONING, fsm.RunPhase.WAITING_READY)
        if (
            driver is not None
            and message.run_id == driver.plan.run_id  # not about a run replaced since
            and driver.run.phase in setting_up
            and message.what in ("ProvisionStage", "OpenEdge", "LinkEdge")
            # A stage that faulted refuses its later edge ends; its own
            # fault (which may wait for a peer's loss report) is the reason.
            and driver.stage_states.get(stage.index) != "Faulted"
        ):
            # The stage will never become ready: say why now, not at the readiness timeout.
            reason = f"{stage.label} refused {message.what}: {message.reason}"
            if message.what == "ProvisionStage":
                driver.provision_refused(stage.index, reason)
            else:
                driver.feed(fsm.StageFaultEvent(stage.index, reason))
        return
    if driver is None:
        emit(AgentLog(stage.index, stage.host.name, f"ignored {message.tag} for an old run"))
        return
    driver.on_stage_message(stage.index, message)
