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
