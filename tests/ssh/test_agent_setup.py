"""Hosts with nothing installed: ggufpipe sets up its own agent over SSH.

A brand-new account (only SSH and the system's python3; as root, one made
for this module, with a pip whose index cannot be reached) named in
inventories with no ``agent:``; real sshd, real pip, real agents and
llama.cpp. Each test sets up into an agents folder of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from ggufpipe_tui.provision import wheels
from tests.support.common import REPO, whole_model_greedy
from tests.support.hostaccount import HostAccount, account_entry, create_account, remove_account, run_setup
from tests.support.sshd import Sshd, sshd_missing

pytestmark = [pytest.mark.ssh, pytest.mark.model, pytest.mark.slow]

BARE = "ggufpipe-bare"
PROMPT = "The history of the Roman empire is long and complicated."
STEPS = 16
AS_ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    missing = sshd_missing()
    if missing:
        raise RuntimeError(f"the SSH tests need OpenSSH: {missing}")
    sshd = Sshd(tmp_path_factory.mktemp("sshd-setup"), extra_users=(BARE,) if AS_ROOT else ()).start()
    yield sshd
    sshd.stop()


@pytest.fixture(scope="module")
def bare(server: Sshd):
    """An account with nothing but SSH, whose pip cannot reach any index."""
    account = create_account(BARE, server.client_key.with_suffix(".pub").read_text().strip())
    if AS_ROOT:
        write_as(
            account, ".config/pip/pip.conf", "[global]\nindex-url = http://127.0.0.1:9/simple\ntimeout = 3\n"
        )
    yield account
    remove_account(account)


def write_as(account: HostAccount, relative: str, text: str, mode: int = 0o644) -> Path:
    path = account.home / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    if AS_ROOT:
        subprocess.run(["chown", "-R", f"{account.name}:{account.name}", str(account.home)], check=True)
    return path


@pytest.fixture
def agents(bare: HostAccount, tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    """An agents folder of the test's own on the host (nothing set up there yet)."""
    name = f"agents-{request.node.name[:40]}"
    return (bare.home / name) if AS_ROOT else (tmp_path / name)


def ready_file(agents: Path) -> Path:
    return agents / wheels.this_build().name / "ggufpipe-ready"


def setup_report(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.stdout.strip(), done.stderr
    return dict(json.loads(done.stdout)["hosts"][0])


@pytest.fixture(scope="module")
def private_model(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Path:
    directory = tmp_path_factory.mktemp("private-model")
    directory.chmod(0o700)
    target = directory / model_path.name
    target.symlink_to(model_path)
    return target


def run_inventory(path: Path, server: Sshd, bare: HostAccount, model: Path, agents: Path) -> Path:
    entry = account_entry(server, bare, agents_dir=str(agents))
    document = {
        "model": {"path": str(model), "send": True},
        "hosts": {
            "gpu-a": {**entry, "cache_dir": "~/stages/a"},
            "gpu-b": {**entry, "cache_dir": "~/stages/b"},
        },
        "stages": [{"host": "gpu-a"}, {"host": "gpu-b"}],
        "run": {"context": 512, "ubatch": 32, "chat": False, "max_tokens": STEPS, "ignore_eos": True},
        "timeouts": {"connect": 30, "ready": 120, "step": 30, "teardown": 10},
    }
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def headless(path: Path) -> tuple[dict[str, Any], str, float]:
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "ggufpipe_tui.cli", str(path), "--prompt", PROMPT, "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout)), done.stderr, time.monotonic() - began


def test_a_bare_host_is_set_up_by_its_first_run_and_the_second_installs_nothing(
    tmp_path: Path, server: Sshd, bare: HostAccount, agents: Path, private_model: Path, model_path: Path
) -> None:
    path = run_inventory(tmp_path / "inv.yaml", server, bare, private_model, agents)
    first, stderr, _ = headless(path)
    assert first["outcome"] == "completed", first["failure"]
    reference = whole_model_greedy(model_path, first["prompt_tokens"], STEPS, n_ctx=512, n_ubatch=32)
    assert first["tokens"] == reference, "the set-up agents run the whole model, token for token"
    # Two stages on the host, one set-up: the second stage found it done.
    assert sorted(row["how"] for row in first["setup"]) == ["pushed", "ready"], first["setup"]
    assert "setting up its agent (pushing wheels: its Python and platform are this machine's)" in stderr
    assert "installing the wheels sent (no index)" in stderr
    stamp = ready_file(agents)
    assert stamp.is_file()
    made = stamp.stat().st_mtime_ns
    processes = {row["pid"] for row in first["processes"]}
    assert processes  # the agents ran from the set-up venv (checked below through the second run)

    second, stderr, seconds = headless(path)
    assert second["outcome"] == "completed" and second["tokens"] == first["tokens"]
    assert second["setup"] == [], "nothing is set up the second time"
    assert "setting up" not in stderr
    assert stamp.stat().st_mtime_ns == made
    # The venv's agent: what ran is under the agents folder.
    name = wheels.this_build().name
    assert sorted(os.listdir(agents)) == [name, name + ".lock"]
    print(f"second run, nothing to set up: {seconds:.1f} s in all")

    # A set-up agent that cannot run (a package gone from its venv) is set up again.
    site = next((agents / wheels.this_build().name / "lib").glob("python3*/site-packages"))
    subprocess.run(["rm", "-rf", str(site / "gguf")], check=True)
    third, stderr, _ = headless(path)
    assert third["outcome"] == "completed" and third["tokens"] == first["tokens"]
    assert "pushed" in [row["how"] for row in third["setup"]], third["setup"]
    assert (site / "gguf").is_dir()


def test_setup_ahead_of_time_then_check(
    tmp_path: Path, server: Sshd, bare: HostAccount, agents: Path
) -> None:
    check = run_setup(server, bare, tmp_path / "check", "--check", agents_dir=str(agents))
    assert check.returncode == 0, check.stderr
    before = setup_report(check)
    assert before["agent"] == "" and before["managed"] is True
    assert before["verdict"].startswith(
        "no agent set up for this orchestrator yet; a set-up would be wheels pushed"
    )
    assert not ready_file(agents).exists(), "--check sets nothing up"

    done = run_setup(server, bare, tmp_path / "setup", agents_dir=str(agents))
    assert done.returncode == 0, done.stderr
    report = setup_report(done)
    assert report["how"] == "pushed" and report["verdict"].startswith("ready: agent pushed in ")
    assert ready_file(agents).is_file()
    again = run_setup(server, bare, tmp_path / "again", agents_dir=str(agents))
    assert again.returncode == 0 and setup_report(again)["how"] == "ready"
    text = run_setup(server, bare, tmp_path / "text", agents_dir=str(agents))
    assert text.returncode == 0


@pytest.mark.skipif(not AS_ROOT, reason="configures the host account's own pip")
def test_built_there_from_the_hosts_own_index(
    tmp_path: Path, server: Sshd, bare: HostAccount, agents: Path
) -> None:
    """install: build: ggufpipe's wheel and the pins are sent, pip there takes
    the rest from the host's own index (here a folder of wheels its pip.conf
    names: llama-cpp-python is found built, so nothing compiles in the test)."""
    index = bare.home / "own-index"
    index.mkdir(exist_ok=True)
    for wheel in wheels.wheelhouse().deps:
        (index / wheel.name).write_bytes(wheel.read_bytes())
    conf = bare.home / ".config/pip/pip.conf"
    saved = conf.read_text()
    try:
        write_as(bare, ".config/pip/pip.conf", f"[global]\nno-index = true\nfind-links = {index}\n")
        done = run_setup(server, bare, tmp_path / "build", agents_dir=str(agents), install="build")
        assert done.returncode == 0, done.stderr
        report = setup_report(done)
        assert report["how"] == "built there", report
        assert "installing from this host's index; llama-cpp-python is built here (CPU)" in done.stderr
    finally:
        write_as(bare, ".config/pip/pip.conf", saved)
    assert ready_file(agents).is_file()
    assert not any(path.name.startswith("ggufpipe-") and path.suffix == ".whl" for path in index.iterdir())


def test_hosts_that_cannot_be_set_up_each_say_why(
    tmp_path: Path, server: Sshd, bare: HostAccount, agents: Path
) -> None:
    missing = run_setup(server, bare, tmp_path / "missing", agents_dir=str(agents), python="python3-nowhere")
    assert missing.returncode == 2
    assert "no python3-nowhere on the login PATH: ggufpipe needs Python 3.10 or newer there" in missing.stderr
    assert "Traceback" not in missing.stderr

    # A Python 3.8 (the system's, saying it is 3.8: a host's Python is not ours).
    old = write_as(
        bare,
        "old-python3",
        '#!/bin/sh\nshift\ntext=$1\nshift\nexec /usr/bin/python3 -c "import sys, platform; '
        "platform.python_version = lambda: '3.8.10'; sys.version_info = (3, 8, 10, 'final', 0); "
        'exec(sys.argv.pop(1))" "$text" "$@"\n',
        0o755,
    )
    for extra in ((), ("--check",)):
        done = run_setup(server, bare, tmp_path / "old", *extra, agents_dir=str(agents), python=str(old))
        assert done.returncode == 1, done.stderr
        report = setup_report(done)
        assert report["python"] == "3.8.10"
        assert report["verdict"].startswith(
            f"its {old} is Python 3.8.10, too old: ggufpipe needs 3.10 or newer"
        )
    assert not ready_file(agents).exists()


@pytest.mark.skipif(not AS_ROOT, reason="mounts a small filesystem")
def test_a_host_without_disk_for_the_venv(tmp_path: Path, server: Sshd, bare: HostAccount) -> None:
    small = bare.home / "small"
    small.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(small)], check=True)
    try:
        subprocess.run(["chown", f"{bare.name}:{bare.name}", str(small)], check=True)
        done = run_setup(server, bare, tmp_path / "small", agents_dir=str(small / "agents"))
        assert done.returncode == 2
        assert (
            "not enough free disk for its agent at " in done.stderr
            and "the set-up needs about" in done.stderr
        )
        assert "agents_dir:" in done.stderr
        assert not (small / "agents").exists() or not any((small / "agents").iterdir())
    finally:
        subprocess.run(["umount", str(small)], check=True)


def _host_setup_pids(agents: Path) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if str(agents).encode() in command and b"ggufpipe_tui" not in command:
                found.append(int(entry.name))
    return found


def test_an_interrupted_setup_is_redone_and_never_used_half_made(
    tmp_path: Path, server: Sshd, bare: HostAccount, agents: Path
) -> None:
    """The host's side of a set-up killed mid-install (a host that reboots, a
    connection that drops): no agent is marked ready, and the next set-up
    starts again from nothing and finishes."""
    results: list[subprocess.CompletedProcess[str]] = []
    first = threading.Thread(
        target=lambda: results.append(run_setup(server, bare, tmp_path / "one", agents_dir=str(agents)))
    )
    first.start()
    venv = agents / wheels.this_build().name
    deadline = time.monotonic() + 120
    while not (venv / "bin" / "python").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (venv / "bin" / "python").exists(), "the set-up never began"
    for pid in _host_setup_pids(agents):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    first.join(timeout=300)
    assert results and results[0].returncode == 2, results and results[0].stderr
    assert "setting up its agent failed" in results[0].stderr and "docs/ssh.md" in results[0].stderr
    assert not ready_file(agents).exists(), "a half-made agent is not marked ready"
    again = run_setup(server, bare, tmp_path / "two", agents_dir=str(agents))
    assert again.returncode == 0, again.stderr
    assert setup_report(again)["how"] == "pushed"
    assert ready_file(agents).is_file() and not (agents / (venv.name + ".wheels")).exists()


def test_two_orchestrators_setting_up_one_host_at_once(
    tmp_path: Path, server: Sshd, bare: HostAccount, agents: Path
) -> None:
    results: dict[int, subprocess.CompletedProcess[str]] = {}

    def one(index: int) -> None:
        results[index] = run_setup(server, bare, tmp_path / str(index), agents_dir=str(agents))

    threads = [threading.Thread(target=one, args=(index,)) for index in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert all(done.returncode == 0 for done in results.values()), [d.stderr for d in results.values()]
    hows = sorted(setup_report(done)["how"] for done in results.values())
    assert hows in (["pushed", "set up by another"], ["pushed", "ready"]), hows
    assert ready_file(agents).is_file()
