"""Model delivery over SSH: the real loopback sshd (forwarding off), real
agents under a non-root account that holds no model, real llama.cpp.

``model: {path: P, send: true}``: P is read here, each stage host is sent its
stage file on its SSH connection and loads it from its cache. Also: the
default mode's check that every host's copy is stage 0's model, and split
sets that are incomplete.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

import ggufpipe_tui.session.delivery as delivery
from ggufpipe_tui.core.events import StageDelivery
from ggufpipe_tui.core.inventory import load_inventory
from ggufpipe_tui.provision import wheels
from ggufpipe_tui.session.pipeline import Pipeline
from ggufpipe_tui.session.stages import PipelineError
from tests.support.common import REPO, whole_model_greedy
from tests.support.hostaccount import (
    ACCOUNT,
    HostAccount,
    install_agent,
    make_account,
    remove_account,
)
from tests.support.splitset import write_split_set
from tests.support.ssh_hosts import sshd_session_of
from tests.support.sshd import Sshd, sshd_missing

pytestmark = [pytest.mark.ssh, pytest.mark.model]

PROMPT = "The history of the Roman empire is long and complicated."
STEPS = 24


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """A loopback sshd that also lets the test account in."""
    missing = sshd_missing()
    if missing:
        raise RuntimeError(f"the SSH tests need OpenSSH: {missing}")
    extra = (ACCOUNT,) if os.geteuid() == 0 else ()
    sshd = Sshd(tmp_path_factory.mktemp("sshd-delivery"), extra_users=extra).start()
    yield sshd
    sshd.stop()


@pytest.fixture(scope="module")
def account(server: Sshd, tmp_path_factory: pytest.TempPathFactory):
    made = make_account(server, tmp_path_factory.mktemp("account-setup"))
    yield made
    remove_account(made)


@pytest.fixture
def none_left(server: Sshd):
    yield
    deadline = time.monotonic() + 15
    while server.session_agents() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not server.session_agents(), f"agent or bridge processes left: {server.session_agents()}"


def host(server: Sshd, account: HostAccount | None, cache: str, **extra: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "address": "127.0.0.1",
        "port": server.port,
        "user": account.name if account else server.user,
        "identity": str(server.client_key),
        "known_hosts": str(server.known_hosts),
        "agent": account.agent if account else f"{sys.executable} -m ggufpipe_agent",
        "threads": 1,
    }
    if cache:
        entry["cache_dir"] = cache
    entry.update(extra)
    return entry


def inventory(
    path: Path, model: Path | str, hosts: dict[str, Any], stages: list[dict[str, Any]], send: bool
) -> Path:
    document = {
        "model": {"path": str(model), **({"send": True} if send else {})},
        "hosts": hosts,
        "stages": stages,
        "run": {"context": 512, "ubatch": 32, "chat": False, "max_tokens": STEPS, "ignore_eos": True},
        "timeouts": {"connect": 30, "ready": 120, "step": 30, "teardown": 10},
    }
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def headless(path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ggufpipe_tui.cli", str(path), "--prompt", PROMPT, *extra],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )


def report(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout))


def cache_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


@pytest.fixture(scope="module")
def private_model(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Path:
    """The model where only this (root) process can read it: the hosts get
    their slices from the orchestrator, never from a path of their own."""
    directory = tmp_path_factory.mktemp("private-model")
    directory.chmod(0o700)
    target = directory / "SmolLM2-135M-Instruct.Q4_1.gguf"
    target.symlink_to(model_path)
    return target


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory, server, account, private_model) -> tuple[Path, dict[str, Any]]:
    """send: true to two stages on the account: the first run, and its report."""
    hosts = {"gpu-a": host(server, account, "~/send/a"), "gpu-b": host(server, account, "~/send/b")}
    stages = [{"host": "gpu-a"}, {"host": "gpu-b"}]
    path = inventory(tmp_path_factory.mktemp("send") / "inv.yaml", private_model, hosts, stages, send=True)
    done = headless(path, "--json")
    return path, report(done) | {"stderr": done.stderr}


# ------------------------------------------------------------------ send: true


def test_two_stages_on_an_account_that_holds_no_model(
    two_stages, account, private_model, model_path, none_left
):
    path, first = two_stages
    if os.geteuid() == 0:
        assert account.name != "root" and not account.can_read(private_model), (
            "the host cannot read the model"
        )
        found = account.run(
            "find", str(account.home), "-name", "*.gguf", "-not", "-path", "*/send/*", check=False
        )
        assert not found.stdout.strip(), f"the account holds a model of its own: {found.stdout}"
    assert first["outcome"] == "completed", first["failure"]
    reference = whole_model_greedy(model_path, first["prompt_tokens"], STEPS, n_ctx=512, n_ubatch=32)
    assert first["tokens"] == reference, "the sent stages are the whole model, token for token"
    sent = {row["stage"]: row for row in first["delivery"]}
    assert [sent[i]["outcome"] for i in (0, 1)] == ["sent", "sent"]
    assert all(row["bytes_sent"] == row["size"] > 0 for row in sent.values())
    assert sum(row["size"] for row in sent.values()) < 1.5 * model_path.stat().st_size, "slices, not copies"
    assert "stage 0 on gpu-a: sent " in first["stderr"] and "stage 1 on gpu-b: sent " in first["stderr"]
    for stage, name in ((0, "a"), (1, "b")):
        held = cache_files(account.home / "send" / name)
        assert held == [sent[stage]["file"], sent[stage]["file"] + ".json"], held
        owner = (account.home / "send" / name / sent[stage]["file"]).stat()
        assert oct(owner.st_mode & 0o777) == "0o600"


def test_stages_that_share_a_process_each_receive_their_file(
    tmp_path, server, account, private_model, model_path, none_left
):
    """share_process: true with send: true: the attached stage's file comes
    on its own receiving session of the host's connection, into the same
    cache, and the shared process runs both."""
    hosts = {"gpu": host(server, account, "~/send/shared", share_process=True)}
    path = inventory(
        tmp_path / "inv.yaml", private_model, hosts, [{"host": "gpu"}, {"host": "gpu"}], send=True
    )
    done = headless(path, "--json")
    result = report(done)
    assert result["outcome"] == "completed", result["failure"]
    assert result["tokens"] == whole_model_greedy(
        model_path, result["prompt_tokens"], STEPS, n_ctx=512, n_ubatch=32
    )
    assert [row["outcome"] for row in sorted(result["delivery"], key=lambda row: row["stage"])] == [
        "sent",
        "sent",
    ]
    assert [entry["stages"] for entry in result["processes"]] == [[0, 1]]
    held = cache_files(account.home / "send" / "shared")
    assert len(held) == 4 and not [name for name in held if ".partial" in name], held


def test_a_second_run_sends_nothing(two_stages, model_path, none_left):
    path, first = two_stages
    again = report(headless(path, "--json", "-q"))
    assert [row["outcome"] for row in again["delivery"]] == ["cached", "cached"]
    assert [row["bytes_sent"] for row in again["delivery"]] == [0, 0]
    assert again["tokens"] == first["tokens"]


def test_a_corrupted_slice_is_sent_again(two_stages, account, none_left):
    path, first = two_stages
    stage1 = first["delivery"][1]
    entry = account.home / "send" / "b" / stage1["file"]
    with entry.open("r+b") as handle:  # a plain write: the sidecar's stat no longer vouches for it
        handle.seek(stage1["size"] // 2)
        byte = handle.read(1)
        handle.seek(stage1["size"] // 2)
        handle.write(bytes([byte[0] ^ 0xFF]))
    done = headless(path, "--json")
    again = report(done)
    rows = {row["stage"]: row for row in again["delivery"]}
    assert rows[0]["outcome"] == "cached"
    assert rows[1]["outcome"] == "sent" and rows[1]["bytes_sent"] == stage1["size"]
    assert again["tokens"] == first["tokens"]


def test_the_cache_command_lists_verifies_and_removes(two_stages, account, none_left):
    path, first = two_stages
    cli = [sys.executable, "-m", "ggufpipe_tui.cli", "cache", str(path)]
    listed = subprocess.run([*cli, "--json"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert listed.returncode == 0, listed.stderr
    hosts = {row["host"]: row for row in json.loads(listed.stdout)["hosts"]}
    assert [entry["name"] for entry in hosts["gpu-a"]["entries"]] == [first["delivery"][0]["file"]]
    assert hosts["gpu-b"]["entries"][0]["state"] == "complete"
    assert hosts["gpu-b"]["cache_dir"] == str(account.home / "send" / "b")
    # Damage that keeps size, mtime and inode passes the cheap check; verify re-hashes.
    entry = account.home / "send" / "a" / first["delivery"][0]["file"]
    info = entry.stat()
    with entry.open("r+b") as handle:
        handle.seek(1000)
        handle.write(b"\0")
    os.utime(entry, ns=(info.st_atime_ns, info.st_mtime_ns))
    verified = subprocess.run([*cli, "verify"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert verified.returncode == 1, verified.stderr
    assert f"DAMAGED    {entry.name}" in verified.stdout
    assert entry.name not in cache_files(entry.parent)
    removed = subprocess.run(
        [*cli, "remove", "--all", "--host", "gpu-b"], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert removed.returncode == 0, removed.stderr
    assert f"removed    {first['delivery'][1]['file']}" in removed.stdout
    assert cache_files(account.home / "send" / "b") == []
    missing = subprocess.run(
        [*cli, "remove", "nothing-like-it.gguf"], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert missing.returncode == 1 and "nothing-like-it.gguf: not in the cache of any" in missing.stderr


async def test_an_interrupted_transfer_resumes(
    tmp_path, server, account, private_model, model_path, monkeypatch, none_left
):
    """The SSH connection to stage 1's host dies (its sshd process killed)
    halfway through sending its file: one reason, a clean teardown; the next
    start sends only what the host had not verified."""
    hosts = {"gpu-a": host(server, account, "~/resume/a"), "gpu-b": host(server, account, "~/resume/b")}
    path = inventory(
        tmp_path / "inv.yaml", private_model, hosts, [{"host": "gpu-a"}, {"host": "gpu-b"}], send=True
    )
    original = delivery._next_frame

    def slowly(chunks: Any) -> Any:  # a slow link, so that the kill lands halfway
        time.sleep(0.3)
        return original(chunks)

    monkeypatch.setattr(delivery, "_next_frame", slowly)
    record_dir = account.home / "resume" / "b"
    killed: list[int] = []
    events: list[Any] = []
    pipeline: Pipeline | None = None

    def on_event(event: Any) -> None:
        events.append(event)
        if killed or pipeline is None or not isinstance(event, StageDelivery) or event.stage != 1:
            return
        record = record_dir / f"{event.name}.partial.json"
        if event.state == "sending" and record.exists() and json.loads(record.read_text())["verified"] > 0:
            hello = pipeline.links[1].hello
            assert hello is not None
            killed.append(sshd_session_of(hello.pid))
            os.kill(killed[0], signal.SIGKILL)

    pipeline = Pipeline(load_inventory(path), on_event)
    with pytest.raises(PipelineError) as failed:
        await pipeline.start()
    assert killed, "the transfer ended before the kill"
    reason = str(failed.value)
    assert reason.startswith(f"stage 1 on gpu-b ({account.name}@127.0.0.1:{server.port}): "), reason
    assert "the SSH connection was lost" in reason and reason.endswith("start again to resume the transfer")
    record = next(record_dir.glob("*.partial.json"))
    kept = json.loads(record.read_text())["verified"]
    size = json.loads(record.read_text())["size"]
    assert 0 < kept < size

    monkeypatch.setattr(delivery, "_next_frame", original)
    second = Pipeline(load_inventory(path), lambda event: None)
    try:
        await second.start()
        result = await second.generate(PROMPT)
    finally:
        await second.close()
    resumed = {done.stage: done for done in second.delivered}[1]
    assert resumed.outcome == "resumed" and resumed.sent == size - kept, (resumed, kept, size)
    assert result.outcome == "completed", result.failure
    assert list(result.tokens) == whole_model_greedy(
        model_path, list(result.prompt_tokens), STEPS, n_ctx=512, n_ubatch=32
    )
    assert not list(record_dir.glob("*.partial*")), "the partial file became the entry"


def test_a_full_disk_on_the_host_is_one_clear_error(tmp_path, server, account, private_model, none_left):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    small = account.home / "small-cache"
    small.mkdir(exist_ok=True)
    owner = account.home.stat()
    subprocess.run(
        [
            "mount",
            "-t",
            "tmpfs",
            "-o",
            f"size=16m,mode=0700,uid={owner.st_uid},gid={owner.st_gid}",
            "tmpfs",
            str(small),
        ],
        check=True,
    )
    try:
        hosts = {"gpu-a": host(server, account, "~/small-cache"), "gpu-b": host(server, account, "~/roomy")}
        stages = [{"host": "gpu-a", "layers": [0, 15]}, {"host": "gpu-b", "layers": [15, 30]}]
        path = inventory(tmp_path / "inv.yaml", private_model, hosts, stages, send=True)
        done = headless(path)
        assert done.returncode == 2, done.stderr
        last = done.stderr.strip().splitlines()[-1]
        where = f"{account.name}@127.0.0.1:{server.port}"
        assert last.startswith(f"ggufpipe: error: stage 0 on gpu-a ({where}): no space left for {small}/"), (
            last
        )
        assert "the stage file needs 65107648 bytes (62.1 MiB)" in last and "are free there" in last, last
        assert cache_files(small) == [], "no partial file is left"
        assert "Traceback" not in done.stderr and "never retrieved" not in done.stderr, done.stderr
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_a_host_lacking_a_package_is_named_before_any_stage_loads(
    tmp_path, server, account, private_model, none_left
):
    """A venv with ggufpipe and every dependency but gguf (which the agent
    imports only when it reads a stage file): the run fails at once, naming
    the host and the module, and no stage file is sent."""
    venv = account.home / "venv-without-gguf"
    install_agent(account, venv, wheels.wheelhouse(), skip="gguf")
    lacking = f"{venv}/bin/python -m ggufpipe_agent"
    hosts = {
        "gpu-a": host(server, account, "~/lacking/a", agent=lacking),
        "gpu-b": host(server, account, "~/lacking/b"),
    }
    path = inventory(
        tmp_path / "inv.yaml", private_model, hosts, [{"host": "gpu-a"}, {"host": "gpu-b"}], send=True
    )
    done = headless(path)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    where = f"{account.name}@127.0.0.1:{server.port}"
    assert last.startswith(
        f"ggufpipe: error: stage 0 on gpu-a ({where}): the agent '{lacking}' on gpu-a cannot run"
    ), last
    assert "module 'gguf' (imported by ggufpipe_agent.gguf.facts) is not installed" in last, last
    assert f"{lacking} --check" in last, last
    assert (
        cache_files(account.home / "lacking" / "a") == []
        and cache_files(account.home / "lacking" / "b") == []
    )
    assert "Traceback" not in done.stderr, done.stderr
    check = account.run(f"{venv}/bin/python", "-m", "ggufpipe_agent", "--check", check=False)
    assert check.returncode == 1 and "module 'gguf'" in check.stderr, check


# ------------------------------------------------------ the hosts' own copies


def renamed_copy(source: Path, target: Path, old: bytes, new: bytes) -> Path:
    """A copy of ``source`` whose general.name has one character changed (same length)."""
    data = bytearray(source.read_bytes())
    at = data.index(old)
    data[at : at + len(new)] = new
    target.write_bytes(bytes(data))
    return target


def test_a_copy_of_another_model_on_one_host_is_refused(tmp_path, server, model_path, none_left):
    other = renamed_copy(model_path, tmp_path / "other.gguf", b"Smollm2 135M 8k", b"Smollm3 135M 8k")
    hosts = {
        "gpu-a": host(server, None, str(tmp_path / "cache")),
        "gpu-b": host(server, None, str(tmp_path / "cache"), model_path=str(other)),
    }
    path = inventory(
        tmp_path / "inv.yaml", model_path, hosts, [{"host": "gpu-a"}, {"host": "gpu-b"}], send=False
    )
    done = headless(path)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        f"ggufpipe: error: stage 1 on gpu-b: its model {other} is not the model stage 0 has on gpu-a "
        f"({model_path}): metadata general.name differs ('Smollm2 135M 8k Lc100K Mix1 Ep2' vs "
        "'Smollm3 135M 8k Lc100K Mix1 Ep2'). Give every host the same model file, or let ggufpipe send "
        "each host its stage (model: {send: true})"
    ), last
    assert not (tmp_path / "cache").exists(), "refused before anything was written or loaded"


def test_an_incomplete_split_set_is_refused(tmp_path, server, account, model_path, none_left):
    parts = write_split_set(model_path, tmp_path, "smol", max_tensors=120)
    assert len(parts) == 3
    parts[1].unlink()
    hosts = {"gpu-a": host(server, account, "~/incomplete")}
    path = inventory(tmp_path / "inv.yaml", parts[0], hosts, [{"host": "gpu-a"}], send=True)
    done = headless(path)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ggufpipe: error: model on this machine: {parts[1]}: missing part 2 of 3"), last
    assert not (account.home / "incomplete").exists(), "nothing was sent"
    # The same set as the hosts' own copy: refused by the host that has it, by name.
    own = inventory(
        tmp_path / "own.yaml",
        parts[2],
        {"gpu-a": host(server, None, str(tmp_path / "cache"))},
        [{"host": "gpu-a"}],
        send=False,
    )
    done = headless(own)
    assert done.returncode == 2, done.stderr
    assert f"model on gpu-a: {parts[1]}: missing part 2 of 3" in done.stderr.strip().splitlines()[-1]
