"""An agent of another ggufpipe version is refused at its Hello, with both
versions named, even where it speaks the same protocol (one
version everywhere)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import yaml

from ggufpipe_agent import __version__
from tests.support.local import run_cli

#: The real agent, claiming another release (its Hello says 0.0.9).
OLDER = f"{shlex.quote(sys.executable)} -c " + shlex.quote(
    "import sys, ggufpipe_agent; ggufpipe_agent.__version__ = '0.0.9'; "
    "from ggufpipe_agent.cli import main; sys.exit(main(sys.argv[1:]))"
)


def test_an_agent_of_another_version_is_refused_naming_both(tmp_path: Path, no_agent_left) -> None:
    document = {
        "model": {"path": str(tmp_path / "never-read.gguf")},
        "hosts": {"old": {"local": True, "agent": OLDER}},
        "stages": [{"host": "old"}],
        "timeouts": {"connect": 20},
    }
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump(document))
    done = run_cli(str(path), "--prompt", "hi")
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "the agent on old is ggufpipe 0.0.9, this orchestrator is ggufpipe " + __version__ in last, last
    assert f"install ggufpipe=={__version__} there (or leave agent: out of its entry" in last, last
    assert "Traceback" not in done.stderr
