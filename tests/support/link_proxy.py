"""TCP proxies of the test's own between two local agents' direct TLS link
(tests/e2e/test_link_repair.py): the data plane's ``route`` hook hands the
producer a proxy's address instead of its consumer's, a new proxy for each
link set up (each listener is on a new port). :meth:`LinkProxies.blackout`
cuts every connection through them and refuses new ones (nothing listens on
their ports) for a while, then lets them pass again on the same ports.
Runs in the test's event loop."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

from ggufpipe_tui.core.events import (
    AgentConnected,
    RunFinished,
    RunInterrupted,
    RunRecovered,
    StageRecovery,
    TokenStreamed,
)
from ggufpipe_tui.core.recovery import recovery_line
from tests.support.common import whole_model_greedy
from tests.support.tcp_proxy import CuttableProxy


class ReopenableProxy(CuttableProxy):
    """A CuttableProxy that can listen again, on the same port."""

    port = 0

    async def start(self) -> int:
        self.port = await super().start()
        return self.port

    async def reopen(self) -> None:
        self.cut_down = False
        self.server = await asyncio.start_server(self._connection, "127.0.0.1", self.port, reuse_address=True)


class LinkProxies:
    """Proxies for the links of the producers in ``producers``; the others'
    links go straight to their consumer."""

    def __init__(self, producers: tuple[int, ...] = (0,)) -> None:
        self.producers = producers
        self.proxies: list[ReopenableProxy] = []
        self.dark = False  # a blackout: new proxies refuse too
        self.forever = False  # a blackout that does not end
        self.routed = 0  # links handed a proxy
        self._tasks: set[asyncio.Task[None]] = set()

    async def route(self, producer: int, endpoints: tuple[str, ...]) -> tuple[str, ...]:
        if producer not in self.producers:
            return endpoints
        routed = []
        for endpoint in endpoints:
            address, _, port = endpoint.rpartition(":")
            if address != "127.0.0.1":
                continue  # the agents are on this machine: loopback is enough
            proxy = ReopenableProxy(int(port))
            routed.append(f"127.0.0.1:{await proxy.start()}")
            self.proxies.append(proxy)
            if self.dark:
                proxy.cut()  # its port refuses until the blackout ends
        self.routed += 1
        return tuple(routed)

    async def blackout(self, seconds: float) -> None:
        """Every connection through the proxies dropped, and ``seconds`` of
        refusal (inf: for good), then the proxies pass again."""
        self.dark = True
        for proxy in self.proxies:
            proxy.cut()
        if seconds == float("inf"):
            self.forever = True
            return
        await asyncio.sleep(seconds)
        self.dark = False
        for proxy in self.proxies:
            await proxy.reopen()

    def blackout_soon(self, seconds: float) -> None:
        """:meth:`blackout` started from a synchronous event consumer."""
        task = asyncio.get_running_loop().create_task(self.blackout(seconds))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for proxy in self.proxies:
            await proxy.close()


def of(events: list[Any], kind: type) -> list[Any]:
    return [e for e in events if isinstance(e, kind)]


def assert_replayed(
    result: Any, events: list[Any], model_path: Path, link: str, tokens: int = 40
) -> RunRecovered:
    """The reply is the unbroken one (the whole model's greedy ``tokens``, at
    context 512 and ubatch 32), each token streamed once; one recovery, of
    ``link``, no stage lost, no agent started again."""
    assert result.outcome == "completed", result.failure
    expected = whole_model_greedy(model_path, list(result.prompt_tokens), tokens, n_ctx=512, n_ubatch=32)
    assert list(result.tokens) == expected, "the output differs from an unbroken run"
    streamed = [e.token for e in of(events, TokenStreamed) if e.sequence >= 0]
    assert streamed == list(result.tokens), "every token streamed once, in order"
    (recovered,) = of(events, RunRecovered)
    assert recovered.stages == link and recovered.how == "reopened the data plane"
    assert recovery_line(recovered).startswith(f"{link} lost at token {recovered.at_token}; reopened")
    assert len(of(events, RunInterrupted)) == 1 and len(of(events, RunFinished)) == 1
    assert not of(events, StageRecovery), "no stage was lost"
    assert len(of(events, AgentConnected)) == 3, "no agent was started again"
    return recovered
