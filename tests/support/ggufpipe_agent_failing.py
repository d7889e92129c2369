"""``ggufpipe-agent`` whose engine fails once, for the tests of a stage
whose engine fails while its process lives (tests/e2e/test_shared_recovery.py):
the real agent, the real engine, except that ``StageEngine.step`` of the
stage named by GGUFPIPE_TEST_ENGINE_FAILS ("WHICH:POSITION:MARKER"; WHICH is
first, middle or last) raises at POSITION, the first time only (it creates
the file MARKER; a stage started again, which finds it, steps as ever).
Used as a host's ``agent:`` command."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ggufpipe_agent.cli import main  # noqa: E402
from ggufpipe_agent.llama import engine  # noqa: E402


def install(which: str, position: int, marker: Path) -> None:
    original = engine.StageEngine.step

    def step(self: engine.StageEngine, inputs: Any, at: int | None = None, sample: bool = True) -> Any:
        shape = self.shape
        where = "first" if shape.first else "last" if shape.last else "middle"
        if where == which and at == position and not marker.exists():
            marker.touch()
            raise RuntimeError(f"the engine failed at position {position} (injected by the test)")
        return original(self, inputs, at, sample)

    engine.StageEngine.step = step  # type: ignore[method-assign]


if __name__ == "__main__":
    fails = os.environ.get("GGUFPIPE_TEST_ENGINE_FAILS", "")
    if fails:
        which, position, path = fails.split(":", 2)
        install(which, int(position), Path(path))
    sys.exit(main())
