"""What a recovered run says of its repair (session/recovery.py) when a
resume in proportion is refused after the repair and the run is replayed
whole: the repair's own words ("moved to gpu-c"), not a default."""

from __future__ import annotations

from types import SimpleNamespace

from ggufpipe_tui.core import recovery as rec
from ggufpipe_tui.core.events import RunRecovered, RunResult, Timings
from ggufpipe_tui.core.reuse import RESUME_REFUSED
from ggufpipe_tui.session.recovery import Recovery


class Repairs:
    closing = False
    broken = ""

    def __init__(self) -> None:
        self.events: list[object] = []

    def emit(self, event: object) -> None:
        self.events.append(event)

    async def rebuild(self) -> tuple[str, str]:
        return "moved stage 1 to gpu-c", "moved to gpu-c"


def faulted(run_id: int, failure: str) -> RunResult:
    return RunResult(run_id, "faulted", "", failure, (1, 2, 3), (7, 8), "", Timings())


async def test_a_refused_resume_keeps_the_repairs_how():
    pipeline = Repairs()
    recovery = Recovery(pipeline, rec.Policy(attempts=2, deadline=120), tasks=None)  # type: ignore[arg-type]
    recovery._step(rec.Loss("stage 1 on gpu-b: gone", 1.0))
    recovery._step(rec.Begin(1.0))
    assert recovery.ended(faulted(1, "stage 1 on gpu-b: gone")) is not None
    await recovery._repair()
    assert recovery.state.phase is rec.Phase.READY
    # The resume the repair allowed is refused by a stage; the run is replayed whole.
    refused = faulted(2, RESUME_REFUSED + "stage 2 holds no positions of the run")
    assert recovery.ended(refused) is not None
    emitted: list[object] = []
    replay = SimpleNamespace(resume=None, plan=SimpleNamespace(run_id=3), emit=emitted.append)
    recovery.replaying(replay, refused)  # type: ignore[arg-type]
    replay.caught_up(10.0, 11.0)
    (recovered,) = [event for event in emitted if isinstance(event, RunRecovered)]
    assert recovered.how == "moved to gpu-c"
    assert recovered.restart_s >= 0 and recovered.replayed == 5
