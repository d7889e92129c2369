"""``ggufpipe-tui setup INVENTORY --check`` over the loopback sshd: what
each host has for an agent, with no agent started."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from ggufpipe_agent import PROTOCOL_VERSION, __version__
from ggufpipe_tui.commands.setup import HostReport, _verdict
from tests.support.local import run_cli
from tests.support.ssh_hosts import host_entry
from tests.support.sshd import Sshd, free_port

AGENT_VERSION = f"ggufpipe-agent {__version__} (protocol {PROTOCOL_VERSION})"


def inventory(path: Path, hosts: dict[str, dict[str, object]]) -> Path:
    document = {
        "model": {"path": "/models/m.gguf"},
        "hosts": hosts,
        "stages": [{"host": name} for name in hosts],
        "timeouts": {"connect": 10},
    }
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def test_each_host_is_reported_without_starting_an_agent(tmp_path: Path, sshd: Sshd, cache_dir: Path) -> None:
    hosts = {
        "ready": host_entry(sshd, cache_dir),
        "bare": host_entry(sshd, cache_dir, agent="/nonexistent/ggufpipe-agent"),
        "here": {"local": True},
    }
    done = run_cli("setup", str(inventory(tmp_path / "inv.yaml", hosts)), "--check", "--json")
    assert done.returncode == 0, done.stderr
    reports = {report["host"]: report for report in json.loads(done.stdout)["hosts"]}
    ready, bare, here = reports["ready"], reports["bare"], reports["here"]
    assert ready["agent"] == AGENT_VERSION and ready["verdict"].startswith("ready")
    assert ready["python"].startswith("3.") and ready["platform"] and ready["free_bytes"] > 0
    assert ready["gpus"] == [] and not ready["error"]
    assert bare["agent"] == "" and bare["verdict"].startswith("no agent runs there; ")
    assert here["agent"] == AGENT_VERSION and here["where"] == "local"
    text = run_cli("setup", str(tmp_path / "inv.yaml"), "--check", "--host", "bare")
    assert text.returncode == 0, text.stderr
    assert text.stdout.splitlines()[0].startswith(f"bare ({sshd.user}@127.0.0.1:{sshd.port}): Python 3.")
    assert "agent: none" in text.stdout


def test_a_host_that_cannot_be_reached_is_one_error(tmp_path: Path, sshd: Sshd, cache_dir: Path) -> None:
    hosts = {"gone": host_entry(sshd, cache_dir, port=free_port())}
    done = run_cli("setup", str(inventory(tmp_path / "inv.yaml", hosts)), "--check")
    assert done.returncode == 2
    assert done.stderr.strip().startswith("ggufpipe: error: gone (") and "cannot connect" in done.stderr
    assert "Traceback" not in done.stderr


def test_setup_without_check_says_what_there_is() -> None:
    done = run_cli("setup", "inv.yaml")
    assert done.returncode == 2 and "only --check is here so far" in done.stderr


def test_the_verdicts() -> None:
    ours = f"{sys.version_info[0]}.{sys.version_info[1]}.0"
    import sysconfig

    old = HostReport("a", "a", python="3.8.10", platform="linux-x86_64")
    assert _verdict(old).startswith("Python 3.8.10 is too old: ggufpipe needs 3.10")
    other = HostReport("b", "b", python="3.12.1", platform="linux-aarch64")
    assert "an agent must be built there (Python 3.12.1 on linux-aarch64" in _verdict(other)
    same = HostReport("c", "c", python=ours, platform=sysconfig.get_platform(), agent="ggufpipe-agent 0.0.1 (protocol 1)")
    assert _verdict(same) == "its agent is ggufpipe-agent 0.0.1 (protocol 1); wheels from this machine fit it (same Python and platform)"
