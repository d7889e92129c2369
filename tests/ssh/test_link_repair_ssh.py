"""A direct link between two hosts that breaks while both agents live is
made again (docs/recovery.md, "A link that breaks"): real agents through a
real sshd on loopback, gpu-a (stages 0 and 2) and gpu-b (stage 1), so the
links from stage 0 to 1 and from 1 to 2 are mutual TLS between hosts. The
link from stage 1 to stage 2 goes through a TCP proxy of ours (the data
plane's ``route`` hook), which mid-reply drops its connections and refuses
new ones for 2 s; or the kernel aborts the link's connections (ss -K). The
reply equals the unbroken one; no agent or bridge is left on the host."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import pytest

from ggufpipe_tui.core.events import DataPath
from ggufpipe_tui.core.inventory import load_inventory
from ggufpipe_tui.dataplane.direct import DirectPlane
from ggufpipe_tui.session.pipeline import Pipeline
from tests.support.common import LONG_PROMPT
from tests.support.link_proxy import LinkProxies, assert_replayed, of
from tests.support.sabotage import Saboteur, on_token, run_with
from tests.support.ssh_hosts import host_entry, three_stages
from tests.support.sshd import Sshd

pytestmark = [pytest.mark.ssh, pytest.mark.model]

LINK = "the direct link from stage 1 to stage 2"


def inventory_file(tmp_path: Path, sshd: Sshd, cache: Path, model_path: Path) -> Path:
    hosts = {"gpu-a": host_entry(sshd, cache), "gpu-b": host_entry(sshd, cache)}
    return three_stages(tmp_path, model_path, hosts, recovery={"attempts": 2, "deadline": 120})


async def test_a_link_between_hosts_cut_for_two_seconds(tmp_path, sshd, cache_dir, model_path, none_left):
    proxies = LinkProxies((1,))
    saboteur = Saboteur(on_token(6), lambda pipeline: proxies.blackout_soon(2.0))
    plane = functools.partial(DirectPlane, route=proxies.route)
    inventory = load_inventory(inventory_file(tmp_path, sshd, cache_dir, model_path))
    pipeline = Pipeline(inventory, saboteur, data_plane=plane)
    saboteur.pipeline = pipeline
    try:
        await pipeline.start()
        result = await pipeline.generate(LONG_PROMPT)
    finally:
        await pipeline.close()
        await proxies.close()
    assert saboteur.fired
    assert_replayed(result, saboteur.events, model_path, LINK)
    paths = [e for e in of(saboteur.events, DataPath) if e.producer == 1]
    assert [(p.data, p.transport) for p in paths] == [("direct", "tls")] * 2, paths
    assert proxies.routed >= 3, "the link was tried while the proxy refused, then made through it"


def kill_tcp(port: int) -> None:
    """Abort both ends of the TCP connections to ``port`` (the kernel's
    SOCK_DESTROY, as a dropped network path or a stateful firewall would)."""
    for selector in (
        ["dst", "127.0.0.1", "dport", "=", str(port)],
        ["src", "127.0.0.1", "sport", "=", str(port)],
    ):
        subprocess.run(["ss", "-K", *selector], capture_output=True, check=False)


async def test_a_link_between_hosts_reset_by_the_kernel(tmp_path, sshd, cache_dir, model_path, none_left):
    def cut(pipeline: Pipeline) -> None:
        (path,) = [e for e in saboteur.events if isinstance(e, DataPath) and e.producer == 1]
        assert path.transport == "tls", path
        kill_tcp(int(path.endpoint.rsplit(":", 1)[1]))

    saboteur = Saboteur(on_token(5), cut)
    result = await run_with(saboteur, inventory_file(tmp_path, sshd, cache_dir, model_path))
    assert saboteur.fired
    assert_replayed(result, saboteur.events, model_path, LINK)
