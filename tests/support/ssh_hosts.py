"""Host entries and inventories for the loopback sshd, and the agents its sessions started."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import yaml

from ggufpipe_tui.core.inventory import HostSpec
from tests.support.common import DATA_MODES
from tests.support.sshd import Sshd

AGENT = f"{sys.executable} -m ggufpipe_agent"  # sshd passes none of our environment
#: The three-stage pipeline of the SSH fault and recovery tests: two hosts, stages 0 and 2 on gpu-a.
RANGES = [[0, 7], [7, 23], [23, 30]]
HOSTS = ("gpu-a", "gpu-b", "gpu-a")


def host_entry(sshd: Sshd, cache: Path, **overrides: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {
        **sshd.login(sshd.user),
        "agent": AGENT,
        "cache_dir": str(cache),
        "threads": 1,  # one thread per stage keeps these tests light on a shared 2-core machine
    }
    entry.update(overrides)
    return {key: value for key, value in entry.items() if value is not None}


def sshd_host(sshd: Sshd, name: str, **fields: Any) -> HostSpec:
    """A host of the inventory, as parsed, for the loopback sshd with the client key."""
    return HostSpec(
        name=name,
        line=1,
        address="127.0.0.1",
        port=sshd.port,
        identity=(str(sshd.client_key),),
        agent=AGENT,
        **fields,
    )


def write_inventory(
    path: Path,
    model_path: Path,
    hosts: dict[str, dict[str, Any]],
    stages: list[tuple[str, list[int]]],
    connect: float = 20,
    mode: str = "",
    recovery: dict[str, Any] | None = None,
    **run: Any,
) -> Path:
    """``mode``: one of tests.conftest.DATA_MODES ("" leaves both to the defaults)."""
    document: dict[str, Any] = {
        "model": {"path": str(model_path)},
        "hosts": hosts,
        "stages": [{"host": host, "layers": layers} for host, layers in stages],
        "run": {"context": 512, "ubatch": 32, "chat": False, **run},
        "timeouts": {"connect": connect, "ready": 120, "step": 30, "teardown": 10},
    }
    if recovery is not None:
        document["recovery"] = recovery
    if mode:
        document["data"] = DATA_MODES[mode]["data"]
        document["run"]["feedback"] = DATA_MODES[mode]["feedback"]
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def three_stages(
    tmp_path: Path,
    model_path: Path,
    hosts: dict[str, dict[str, Any]],
    mode: str = "direct",
    recovery: dict[str, Any] | None = None,
) -> Path:
    """tmp_path/inventory.yaml: HOSTS with RANGES, 40 tokens past any end of generation."""
    return write_inventory(
        tmp_path / "inventory.yaml",
        model_path,
        hosts,
        list(zip(HOSTS, RANGES, strict=True)),
        mode=mode,
        recovery=recovery,
        max_tokens=40,
        ignore_eos=True,
    )


def where(sshd: Sshd) -> str:
    """How a host entry of the loopback sshd is named in a failure."""
    return f"{sshd.user}@127.0.0.1:{sshd.port}"


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])


def sshd_session_of(pid: int) -> int:
    """The sshd process serving the connection that started ``pid``."""
    while pid > 1:
        pid = parent(pid)
        if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"sshd:"):
            return pid
    raise AssertionError("not started through sshd")


def wait_no_session_agents(sshd: Sshd, timeout: float) -> dict[int, str]:
    deadline = time.monotonic() + timeout
    while True:
        left = sshd.session_agents()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def wait_session_agents(sshd: Sshd, agents: int, bridges: int, timeout: float = 15) -> tuple[int, int]:
    """How many agents and data bridges run under sshd, once there are as many
    as expected (a bridge may still be in the login shell's startup files
    when the pipeline already runs)."""
    deadline = time.monotonic() + timeout
    while True:
        running = [line for line in sshd.session_agents().values() if not line.startswith(("bash", "sh "))]
        found = (sum(" bridge " not in line for line in running), sum(" bridge " in line for line in running))
        if found == (agents, bridges) or time.monotonic() > deadline:
            return found
        time.sleep(0.1)
