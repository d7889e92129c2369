"""The UI's thread below the stages' priority (views/priority.py): the
thread that lowers itself runs lower, a thread started afterwards through
``start_thread`` (the pipeline's loop) and a process it spawns (a local
agent) keep the priority the process started with. Linux only."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from ggufpipe_tui.views import priority

pytestmark = pytest.mark.skipif(not priority.supported(), reason="per-thread priorities are Linux's")


def nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_the_ui_thread_runs_lower_and_what_it_starts_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(priority, "_launcher", None)
    base = nice()
    if base + 3 > 19:
        pytest.skip("already at the lowest priority")
    seen: dict[str, int] = {}

    def ui() -> None:  # a thread of its own: the test's thread keeps its priority
        seen["applied"] = priority.lower_ui(3)
        seen["ui"] = nice()
        later = threading.Thread(target=lambda: seen.setdefault("plain", nice()))
        later.start()
        later.join()

        def pipeline() -> None:
            seen["pipeline"] = nice()
            child = [sys.executable, "-c", "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"]
            seen["agent"] = int(subprocess.run(child, capture_output=True, text=True, check=True).stdout)

        priority.start_thread(pipeline, "test-pipeline").join()

    thread = threading.Thread(target=ui)
    thread.start()
    thread.join()
    assert seen == {"applied": 3, "ui": base + 3, "plain": base + 3, "pipeline": base, "agent": base}
    assert nice() == base


def test_zero_leaves_the_priority_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(priority, "_launcher", None)
    monkeypatch.setenv(priority.ENV, "0")
    seen: dict[str, int] = {}

    def ui() -> None:
        before = nice()
        seen["applied"] = priority.lower_ui()
        seen["delta"] = nice() - before

    thread = threading.Thread(target=ui)
    thread.start()
    thread.join()
    assert seen == {"applied": 0, "delta": 0}
    assert priority._launcher is None
