"""``ggufpipe-tui setup INVENTORY --check`` over the loopback sshd: what
each host has for an agent, with no agent started."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from ggufpipe_agent import PROTOCOL_VERSION, __version__
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
        "fresh": host_entry(sshd, cache_dir, agent=None, agents_dir=str(tmp_path / "agents")),
        "here": {"local": True},
    }
    done = run_cli("setup", str(inventory(tmp_path / "inv.yaml", hosts)), "--check", "--json")
    assert done.returncode == 1, done.stderr  # "bare" names an agent: that does not run
    reports = {report["host"]: report for report in json.loads(done.stdout)["hosts"]}
    ready, bare, fresh, here = reports["ready"], reports["bare"], reports["fresh"], reports["here"]
    assert ready["agent"] == AGENT_VERSION and ready["verdict"].startswith("ready")
    assert ready["python"].startswith("3.") and ready["platform"] and ready["free_bytes"] > 0
    assert ready["gpus"] == [] and not ready["error"] and not ready["managed"]
    assert bare["agent"] == "" and bare["unfit"]
    assert bare["verdict"].startswith(
        "its agent: '/nonexistent/ggufpipe-agent' did not run; install ggufpipe=="
    )
    assert fresh["managed"] and fresh["agent"] == "" and fresh["agents_dir"] == str(tmp_path / "agents")
    assert fresh["verdict"].startswith("no agent set up for this orchestrator yet; a set-up would be ")
    assert not (tmp_path / "agents").exists(), "--check sets nothing up"
    assert here["agent"] == AGENT_VERSION and here["where"] == "local"
    text = run_cli("setup", str(tmp_path / "inv.yaml"), "--check", "--host", "fresh")
    assert text.returncode == 0, text.stderr
    assert text.stdout.splitlines()[0].startswith(f"fresh ({sshd.user}@127.0.0.1:{sshd.port}): Python 3.")
    assert "agent: none" in text.stdout


def test_a_host_that_cannot_be_reached_is_one_error(tmp_path: Path, sshd: Sshd, cache_dir: Path) -> None:
    hosts = {"gone": host_entry(sshd, cache_dir, port=free_port())}
    done = run_cli("setup", str(inventory(tmp_path / "inv.yaml", hosts)), "--check")
    assert done.returncode == 2
    assert done.stderr.strip().startswith("ggufpipe: error: gone (") and "cannot connect" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_way_each_host_would_be_set_up() -> None:
    from ggufpipe_tui.core.inventory import HostSpec
    from ggufpipe_tui.provision.hosts import Probed, SetupError, choose, python_problem
    from ggufpipe_tui.provision.wheels import this_build

    build = this_build()
    host = HostSpec("h", 1, address="h")
    old = Probed(python="3.8.10", platform="linux-x86_64")
    assert "is Python 3.8.10, too old: ggufpipe needs 3.10 or newer" in python_problem(host, old)
    other = Probed(python="3.12.1", platform="linux-aarch64")
    mode, why = choose(host, other)
    assert mode == "build" and why.startswith("its Python 3.12.1 on linux-aarch64 is not this machine's")
    same = Probed(python=f"{build.python}.0", platform=build.platform)
    assert choose(host, same) == ("push", "its Python and platform are this machine's")
    gpu = Probed(python=f"{build.python}.0", platform=build.platform, gpus=["NVIDIA H200, 143771"])
    assert choose(host, gpu) == (
        "build",
        "it has an NVIDIA GPU and the llama-cpp-python wheel kept here is not a CUDA build",
    )
    assert choose(HostSpec("h", 1, address="h", install="build"), same) == ("build", "install: build")
    with pytest.raises(SetupError, match="install: push cannot be done: it has an NVIDIA GPU"):
        choose(HostSpec("h", 1, address="h", install="push"), gpu)
