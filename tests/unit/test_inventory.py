"""The inventory's checks of hand-started agents (listen:) and of recovery:."""

from __future__ import annotations

import pytest

from ggufpipe_tui.core.inventory import InventoryError, parse_inventory
from ggufpipe_tui.core.inventory_policy import default_parallel


def test_listen_key_needs_listen(tmp_path):
    text = "model: {path: m.gguf}\nhosts:\n  a: {local: true, listen_key: /k}\nstages:\n  - {host: a}\n"
    with pytest.raises(InventoryError, match=r"hosts.a.listen_key: goes with listen:"):
        parse_inventory(text, tmp_path / "inv.yaml")


def test_a_hand_started_agent_serves_one_stage(tmp_path):
    text = (
        "model: {path: m.gguf}\nhosts:\n  manual: {local: true, listen: '127.0.0.1:7000'}\n  b: {local: true}\n"
        "stages:\n  - {host: manual}\n  - {host: b}\n  - {host: manual}\n"
    )
    with pytest.raises(InventoryError) as refused:
        parse_inventory(text, tmp_path / "inv.yaml")
    assert str(refused.value).startswith(
        f"{tmp_path / 'inv.yaml'}:8: stages[2]: stage 0 runs on manual already"
    )
    assert "one agent per stage" in str(refused.value)


def _host(tmp_path, entry: str):
    text = f"model: {{path: m.gguf}}\nhosts:\n  h: {entry}\nstages:\n  - {{host: h}}\n"
    return parse_inventory(text, tmp_path / "inv.yaml").hosts["h"]


def test_an_ssh_host_without_agent_gets_the_one_ggufpipe_sets_up(tmp_path):
    host = _host(tmp_path, "{address: a}")
    assert (host.agent, host.agents_dir, host.install, host.python) == ("", "", "auto", "python3")
    chosen = _host(tmp_path, "{address: a, agents_dir: /scratch/agents, install: build, python: python3.11}")
    assert (chosen.agents_dir, chosen.install, chosen.python) == ("/scratch/agents", "build", "python3.11")
    # A hand-started agent's bridge runs the one on the login PATH unless named.
    assert _host(tmp_path, "{address: a, listen: '127.0.0.1:7000'}").agent == "ggufpipe-agent"


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("{address: a, install: pip}", "hosts.h.install: must be one of auto, push, build"),
        ("{address: a, agent: x, install: push}", "hosts.h.install: is for the agent ggufpipe sets up"),
        ("{address: a, agent: x, agents_dir: /d}", "hosts.h.agents_dir: is for the agent ggufpipe sets up"),
        ("{address: a, python: ' '}", "hosts.h.python: names no command"),
    ],
)
def test_the_setup_keys_are_checked(tmp_path, entry, message):
    with pytest.raises(InventoryError, match=message):
        _host(tmp_path, entry)


def _recovery(tmp_path, entry: str):
    text = f"model: {{path: m.gguf}}\nhosts:\n  h: {{local: true}}\nstages:\n  - {{host: h}}\n{entry}"
    return parse_inventory(text, tmp_path / "inv.yaml").recovery


def test_recovery_keys(tmp_path):
    default = _recovery(tmp_path, "")
    assert (default.attempts, default.deadline) == (2, 120.0)
    chosen = _recovery(tmp_path, "recovery: {attempts: 0, deadline: 30}\n")
    assert (chosen.attempts, chosen.deadline) == (0, 30.0)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("recovery: {attempts: -1}\n", r"inv.yaml:6: recovery.attempts: must be 0 \(off\) or more"),
        ("recovery: {deadline: 0}\n", "inv.yaml:6: recovery.deadline: must be a positive number of seconds"),
        ("recovery: {attempts: two}\n", "inv.yaml:6: recovery.attempts: "),
        ("recovery: {tries: 2}\n", "inv.yaml:6: recovery.tries"),
        ("recovery: 2\n", "inv.yaml:6: recovery: expected a mapping"),
    ],
)
def test_recovery_keys_are_checked(tmp_path, entry, message):
    with pytest.raises(InventoryError, match=message):
        _recovery(tmp_path, entry)


PARALLEL_CASES = {
    # hosts, the stages' hosts, cores -> runs in flight by default
    "two SSH machines": ("a: {address: h1}\n  b: {address: h2}", ["a", "b"], 2, 2),
    "two stages on one SSH machine": ("a: {address: h1}", ["a", "a"], 2, 1),
    "one machine named twice": ("a: {address: h1}\n  b: {address: h1}", ["a", "b"], 2, 1),
    "local stages on every core": ("a: {local: true}\n  b: {local: true}", ["a", "b"], 2, 1),
    "local stages a core each": (
        "a: {local: true, threads: 1}\n  b: {local: true, threads: 1}",
        ["a", "b"],
        2,
        2,
    ),
    "more threads than cores": (
        "a: {local: true, threads: 2}\n  b: {local: true, threads: 1}",
        ["a", "b"],
        2,
        1,
    ),
    "one shared process": ("a: {local: true, threads: 1, share_process: true}", ["a", "a"], 4, 1),
    "local and SSH": ("a: {local: true}\n  b: {address: h2}\n  c: {address: h3}", ["a", "b", "c"], 2, 3),
}


@pytest.mark.parametrize(
    ("hosts", "stages", "cores", "expected"), PARALLEL_CASES.values(), ids=PARALLEL_CASES
)
def test_the_servers_default_runs_in_flight_count_machines(tmp_path, hosts, stages, cores, expected):
    """One run in flight per machine; on this machine one per stage where
    each stage has threads of its own that fit its cores (docs/architecture.md, "Runs in flight")."""
    layers = [(30 * i // len(stages), 30 * (i + 1) // len(stages)) for i in range(len(stages))]
    pairs = zip(stages, layers, strict=True)
    listed = "".join(f"  - {{host: {host}, layers: [{a}, {b}]}}\n" for host, (a, b) in pairs)
    text = f"model: {{path: m.gguf}}\nhosts:\n  {hosts}\nstages:\n{listed}"
    assert default_parallel(parse_inventory(text, tmp_path / "inv.yaml"), cores) == expected
