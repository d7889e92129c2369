"""Hand-started agents (ggufpipe-agent --listen) for the tests."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ggufpipe_tui.core.inventory import HostSpec


@dataclass
class HandStarted:
    process: subprocess.Popen[str]
    endpoint: str
    key_file: Path
    stderr: list[str] = field(default_factory=list)

    def host(self, **changes: object) -> HostSpec:
        values: dict[str, object] = {"listen": self.endpoint, "listen_key": str(self.key_file)}
        values.update(changes)
        return HostSpec(name="manual", line=1, local=True, **values)  # type: ignore[arg-type]


def start_listening(endpoint: str, key_file: Path, *extra: str) -> HandStarted:
    process = subprocess.Popen(
        [sys.executable, "-m", "ggufpipe_agent", "--listen", endpoint, "--key-file", str(key_file), *extra],
        stderr=subprocess.PIPE,
        text=True,
    )
    agent = HandStarted(process, endpoint, key_file)
    assert process.stderr is not None
    deadline = time.monotonic() + 30
    while True:
        line = process.stderr.readline()
        agent.stderr.append(line)
        if "listening on" in line:
            break
        assert line and time.monotonic() < deadline, "".join(agent.stderr)
    threading.Thread(target=lambda: agent.stderr.extend(process.stderr), daemon=True).start()  # type: ignore[arg-type]
    return agent


def stop(agent: HandStarted) -> None:
    if agent.process.poll() is None:
        agent.process.send_signal(signal.SIGTERM)
        try:
            agent.process.wait(10)
        except subprocess.TimeoutExpired:
            agent.process.kill()
            agent.process.wait()
