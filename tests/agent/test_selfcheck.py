"""The agent's self-check (ggufpipe_agent/selfcheck.py): which packages it
needs is read from its own source, and a missing one is named at once."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ggufpipe_agent import selfcheck


def test_the_required_packages_are_what_the_source_imports() -> None:
    # Every agent start checks REQUIRED; a new import outside the standard
    # library (lazy or not) must be added there, or a host could lack it.
    assert selfcheck.requirements() == selfcheck.REQUIRED


def test_an_import_that_may_fail_is_not_required() -> None:
    # aio.py: uvloop inside try/except ImportError, the event loop falls back.
    assert "uvloop" not in selfcheck.requirements()


def test_a_missing_package_is_named_with_the_module_that_needs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gguf", None)  # what a venv without gguf finds
    problem = selfcheck.missing()
    assert problem is not None
    assert (problem.module, problem.needed_by) == ("gguf", "ggufpipe_agent.gguf.facts")
    assert problem.describe().startswith(selfcheck.MARKER)
    assert "'gguf'" in problem.describe()


def test_check_imports_every_agent_module() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ggufpipe_agent", "--check"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "can run here" in done.stdout
    assert f"{len(selfcheck.agent_modules())} modules" in done.stdout


def test_an_agent_lacking_a_package_says_so_before_its_hello() -> None:
    script = "import sys; sys.modules['gguf'] = None; from ggufpipe_agent.cli import main; sys.exit(main([]))"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, timeout=60, stdin=subprocess.DEVNULL
    )
    assert done.returncode == 3
    assert done.stdout == b""  # no Hello, nothing else on the protocol stream
    said = done.stderr.decode()
    assert selfcheck.MARKER in said and "module 'gguf'" in said and "ggufpipe_agent.gguf.facts" in said
