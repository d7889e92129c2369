"""Runs in flight at once over SSH (docs/architecture.md, "Runs in flight"): three stages on two SSH
hosts (a real OpenSSH server on loopback), eight slots; 2, 4 and 8 requests at once,
prefixes shared and not, each equal to the same request alone; and
conversations interleaved on the slots, each keeping its own cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from ggufpipe_tui.core.inventory import load_inventory
from ggufpipe_tui.session.pipeline import Pipeline
from tests.support.parallel_checks import concurrent_equal_alone, conversations_keep_their_caches
from tests.support.ssh_hosts import host_entry, wait_no_session_agents, write_inventory
from tests.support.sshd import Sshd

pytestmark = [pytest.mark.ssh, pytest.mark.model, pytest.mark.slow]

CONTEXT, UBATCH, STEPS = 512, 32, 12


async def test_requests_and_conversations_in_flight_over_ssh(
    tmp_path: Path, sshd: Sshd, cache_dir: Path, model_path: Path
) -> None:
    hosts = {"gpu-a": host_entry(sshd, cache_dir), "gpu-b": host_entry(sshd, cache_dir)}
    stages = [("gpu-a", [0, 9]), ("gpu-a", [9, 20]), ("gpu-b", [20, 30])]
    path = write_inventory(tmp_path / "inv.yaml", model_path, hosts, stages, parallel=8)
    pipeline = Pipeline(load_inventory(path), lambda event: None)
    try:
        await pipeline.start()
        for count in (2, 4, 8):
            await concurrent_equal_alone(pipeline, model_path, count, STEPS, CONTEXT, UBATCH)
        await conversations_keep_their_caches(pipeline, model_path, 2, 3, STEPS, CONTEXT, UBATCH)
    finally:
        await pipeline.close()
    assert not wait_no_session_agents(sshd, 10), "agents left on the host"
