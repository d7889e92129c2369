"""``ggufpipe-agent`` whose middle stage's engine fails once, for the tests
of a stage lost alone (tests/e2e/test_shared_recovery.py): the real agent,
the real engine, except that ``StageEngine.step`` of a stage that is neither
first nor last raises at the position named by GGUFPIPE_TEST_ENGINE_FAILS
("POSITION:MARKER"), the first time only (it creates the file MARKER; a
process started again, which finds it, steps as ever). Used as a host's
``agent:`` command."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ggufpipe_agent.cli import main  # noqa: E402
from ggufpipe_agent.llama import engine  # noqa: E402


def install(position: int, marker: Path) -> None:
    original = engine.StageEngine.step

    def step(self: engine.StageEngine, inputs: Any, at: int | None = None) -> Any:
        middle = not self.shape.first and not self.shape.last
        if middle and at == position and not marker.exists():
            marker.touch()
            raise RuntimeError(f"the engine failed at position {position} (injected by the test)")
        return original(self, inputs, at)

    engine.StageEngine.step = step  # type: ignore[method-assign]


if __name__ == "__main__":
    where, _, path = os.environ.get("GGUFPIPE_TEST_ENGINE_FAILS", "").partition(":")
    if where:
        install(int(where), Path(path))
    sys.exit(main())
