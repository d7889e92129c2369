"""A direct link that breaks while both of its agents live is re-made
(docs/recovery.md, "A link that breaks"): three local agents whose links are
TLS (the data plane's test hooks: ``transport="tls"`` between stages of one
host, ``route`` through a TCP proxy of ours on the link from stage 0 to stage
1). Mid-reply the proxy drops its connections and refuses new ones for 2 s,
then passes again: the run is interrupted, the data plane rebuilt with no
agent restarted (new credentials, the link tried again until it is up) and
the run replayed; the reply equals the unbroken one token for token. A link
that cannot be re-made falls back to the relay, or with ``data: direct``
fails naming the link. No agent is left behind."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from ggufpipe_tui.core.events import AgentConnected, DataPath, RunFinished, StageRecovery
from ggufpipe_tui.core.inventory import load_inventory
from ggufpipe_tui.dataplane import direct
from ggufpipe_tui.dataplane.direct import DirectPlane
from ggufpipe_tui.session.pipeline import Pipeline
from tests.support.common import LONG_PROMPT, whole_model_greedy
from tests.support.link_proxy import LinkProxies, assert_replayed, of
from tests.support.local import UNEVEN, write_inventory
from tests.support.sabotage import Saboteur, assert_carried_on, on_token

pytestmark = pytest.mark.model

MAX_TOKENS = 40
LINK = "the direct link from stage 0 to stage 1"


def inventory_file(tmp_path: Path, model_path: Path, data: str) -> Path:
    return write_inventory(
        tmp_path,
        model_path,
        UNEVEN,
        f"max_tokens: {MAX_TOKENS}, ignore_eos: true, chat: false, feedback: ring",
        f"data: {data}\n",
        timeouts="connect: 30, ready: 60, step: 30, teardown: 5",
        extra="recovery: {attempts: 2, deadline: 120}\n",
    )


async def run_cut(tmp_path: Path, model_path: Path, seconds: float, data: str = "direct") -> tuple[Any, ...]:
    """One reply with the link from stage 0 to stage 1 cut at token 8 for
    ``seconds``: (result, events, proxies)."""
    proxies = LinkProxies((0,))
    saboteur = Saboteur(on_token(8), lambda pipeline: proxies.blackout_soon(seconds))
    plane = functools.partial(DirectPlane, route=proxies.route, transport="tls")
    pipeline = Pipeline(
        load_inventory(inventory_file(tmp_path, model_path, data)), saboteur, data_plane=plane
    )
    saboteur.pipeline = pipeline
    try:
        await pipeline.start()
        result = await pipeline.generate(LONG_PROMPT)
    finally:
        await pipeline.close()
        await proxies.close()
    assert saboteur.fired
    return result, saboteur.events, proxies


async def test_a_link_cut_for_two_seconds_is_made_again(tmp_path, model_path, no_agent_left):
    result, events, proxies = await run_cut(tmp_path, model_path, 2.0)
    recovered = assert_replayed(result, events, model_path, LINK)
    # Both ends kept their caches: the run was carried on with no stage rebuilt.
    assert_carried_on(events, "no stage rebuilt")
    assert recovered.at_token >= 9
    paths = [e for e in of(events, DataPath) if e.producer == 0]
    assert [(p.data, p.transport) for p in paths] == [("direct", "tls")] * 2, paths
    assert proxies.routed >= 3, "the link was tried while the proxy refused, then made through it"
    assert recovered.restart_s >= 0.2, "the repair waited for the link"


async def test_a_link_that_cannot_be_made_again_is_relayed(tmp_path, model_path, no_agent_left, monkeypatch):
    monkeypatch.setattr(direct, "RELINK_SECONDS", 1.0)
    result, events, _ = await run_cut(tmp_path, model_path, float("inf"), data="auto")
    assert_replayed(result, events, model_path, LINK)
    first, again = [e for e in of(events, DataPath) if e.producer == 0]
    assert (first.data, first.transport) == ("direct", "tls")
    assert again.data == "relay" and "tries in 1 s" in again.reason, again


async def test_a_direct_only_link_that_cannot_be_made_again_names_it(
    tmp_path, model_path, no_agent_left, monkeypatch
):
    monkeypatch.setattr(direct, "RELINK_SECONDS", 1.0)
    result, events, _ = await run_cut(tmp_path, model_path, float("inf"))
    assert result.outcome == "faulted"
    assert result.failure.startswith(f"{LINK} broke (stage "), result.failure
    assert "recovery gave up: 2 of recovery.attempts 2 used" in result.failure
    assert "the direct link from stage 0 to stage 1 cannot be set up" in result.failure
    assert "data: direct" in result.failure
    assert len(of(events, RunFinished)) == 1


async def test_a_link_cut_between_runs_is_made_again(tmp_path, model_path, no_agent_left):
    """No run in flight: the link is made again at once, the next prompt
    waits for it and its reply is the unbroken one."""
    proxies = LinkProxies((0,))
    events: list[Any] = []
    plane = functools.partial(DirectPlane, route=proxies.route, transport="tls")
    inventory = load_inventory(inventory_file(tmp_path, model_path, "direct"))
    pipeline = Pipeline(inventory, events.append, data_plane=plane, prefix_reuse=False)
    try:
        await pipeline.start()
        first = await pipeline.generate(LONG_PROMPT)
        await proxies.blackout(2.0)
        second = await pipeline.generate(LONG_PROMPT)
    finally:
        await pipeline.close()
        await proxies.close()
    assert first.outcome == second.outcome == "completed", second.failure
    expected = whole_model_greedy(model_path, list(first.prompt_tokens), MAX_TOKENS, n_ctx=512, n_ubatch=32)
    assert list(first.tokens) == list(second.tokens) == expected
    paths = [e for e in of(events, DataPath) if e.producer == 0]
    assert [(p.data, p.transport) for p in paths] == [("direct", "tls")] * 2, paths
    assert len(of(events, AgentConnected)) == 3 and not of(events, StageRecovery)
