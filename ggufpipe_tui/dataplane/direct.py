"""The direct data plane: stage i writes its activations straight to stage i+1,
and the last stage its tokens straight to stage 0 (the token ring).

When the plane opens, the orchestrator sets up one link per pair of
neighbours (``LinkListen`` to the consumer, ``LinkConnect`` to the producer,
over their control channels; ``ggufpipe_agent.process.peer_links``): a Unix socket when
both stages run on one inventory host, mutual TLS over TCP between hosts,
with certificates of a per-session authority made here
(:mod:`~ggufpipe_tui.dataplane.credentials`). The producer's connect and
attach is the probe: where it fails, that pair falls back to the relay
(unless the inventory says ``data: direct``), and a :class:`DataPath` event
says which way each pair goes.

Every stage keeps its data stream to the orchestrator (the relay's): stage 0
takes the prompt on it, the last stage writes token-out on it, and relayed
pairs use it as before. Each run, a stage's edge ends go up as soon as it has
taken its provision, like the relay's; the ends on a link are set up with
``LinkEdge`` once both stages of the pair have taken theirs (the producer
then opens the consumer's end on the link itself, so nothing can overtake
the consumer's provision).

A link that goes down (``LinkDown`` from either end, or a producer's
``StageFault`` with ``link_peer``) first gives its peers a moment: when a
stage died, its loss (the root cause, with the exit status) is the reason,
not the link it took with it. Between two live stages the break is reported
as such (:attr:`DataPlaneEvents.broken`): the session repairs it with a new
plane (docs/recovery.md, "A link that breaks"), whose :meth:`open` is told
which links broke and tries each again for up to :data:`RELINK_SECONDS`
(new credentials, a new token, a new listener) before it falls back to the
relay, or, with ``data: direct``, fails naming the link. A LinkDown names its
link's token: one of an older plane's links, closed by the repair, is not
news. Without ``broken`` (no recovery) a broken link faults the session.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable, Collection, Sequence

from ggufpipe_agent.ids import RunId
from ggufpipe_agent.tasks import TaskOwner
from ggufpipe_agent.wire import link_messages as links
from ggufpipe_agent.wire.protocol import Message, OpenEdge, RequestFailed, StageFault, encode_message
from ggufpipe_tui.core.errors import PipelineError
from ggufpipe_tui.core.events import DataPath
from ggufpipe_tui.core.plan import RunPlan
from ggufpipe_tui.dataplane import DataPlaneEvents, DataStage
from ggufpipe_tui.dataplane.relay import RelayPlane

#: How long a producer may take to reach one endpoint of its consumer and
#: attach: a firewalled host costs this much before its relay fallback.
PROBE_SECONDS = 5.0
#: How long a broken link waits for a dead peer's loss report (the root cause).
LINK_GRACE_SECONDS = 1.5
#: How long a repair tries again to make a link that broke (a network blip
#: between two live stages) before its pair falls back to the relay.
RELINK_SECONDS = 10.0
#: The pause between two such tries.
RELINK_PAUSE = 0.25

#: A test hook (tests/e2e/test_link_repair.py): the producer ``producer`` is
#: handed ``endpoints`` of its consumer; returns the ones it is handed
#: instead (a proxy of the test's in between).
Route = Callable[[int, tuple[str, ...]], Awaitable[tuple[str, ...]]]


def _edge_mode(producer: DataStage, consumer: DataStage) -> str:
    """The inventory's word for a pair: relay wins, then direct, else auto."""
    modes = {producer.host.data or "auto", consumer.host.data or "auto"}
    if "relay" in modes:
        return "relay"
    return "direct" if "direct" in modes else "auto"


def _same_host(producer: DataStage, consumer: DataStage) -> bool:
    """One machine: every local host is this one; an SSH host is itself.
    (Two inventory hosts that are one machine get TLS: nobody can tell.)"""
    a, b = producer.host, consumer.host
    return (a.local and b.local) or a.name == b.name


def _tcp(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


class DirectPlane(RelayPlane):
    def __init__(
        self,
        stages: Sequence[DataStage],
        tasks: TaskOwner,
        events: DataPlaneEvents,
        *,
        route: Route | None = None,
        transport: str = "",
    ) -> None:
        """``route`` and ``transport`` ("tls" between stages of one host) are
        test hooks: a proxy between two local agents' TLS link."""
        super().__init__(stages, tasks, events)
        self.paths: dict[int, DataPath] = {}  # by producer: its link to (producer + 1) % n
        self._authority: object | None = None
        self._acked: dict[int, set[int]] = {}  # by run: stages that have taken its provision
        self._linked: dict[int, set[int]] = {}  # by run: producers whose LinkEdge has been sent
        self._down: set[int] = set()
        self._tokens: dict[str, int] = {}  # this plane's links' tokens: their producer
        self._route = route
        self._transport = transport

    # ---------------------------------------------------------- the links

    async def open(self, timeout: float, again: Collection[int] = ()) -> None:
        """``again``: producers whose link broke (a repair): each is tried
        again for up to RELINK_SECONDS before its pair is relayed."""
        await super().open(timeout)
        n = len(self.stages)
        linking = (self._link(p, (p + 1) % n, timeout, p in again) for p in range(n))
        paths = await asyncio.gather(*linking)
        for path in paths:
            self.paths[path.producer] = path
            self.events.routed(path)

    def _credentials(self, stage: int) -> links.LinkCredentials:
        from ggufpipe_tui.dataplane.credentials import LinkAuthority

        if self._authority is None:
            self._authority = LinkAuthority()
        assert isinstance(self._authority, LinkAuthority)
        issued = self._authority.issue(stage)
        return links.LinkCredentials(issued.certificate, issued.key, self._authority.certificate_pem)

    def _endpoints(self, consumer: DataStage, listening: links.LinkListening) -> tuple[str, ...]:
        if listening.endpoint.startswith("unix:"):
            return (listening.endpoint,)
        port = int(listening.endpoint.removeprefix("tcp:"))
        host = consumer.host
        # Its link address as the inventory gives it, then where its SSH
        # connection arrived (an address, where host.address may be an alias
        # of ~/.ssh/config), then the address the orchestrator dialled.
        candidates = [host.link_address, *listening.addresses, "127.0.0.1" if host.local else host.address]
        seen: list[str] = []
        for address in candidates:
            if address and address not in seen:
                seen.append(address)
        return tuple(_tcp(address, port) for address in seen)

    async def _link(self, producer: int, consumer: int, timeout: float, again: bool = False) -> DataPath:
        if producer == consumer:  # a one-stage ring: the stage feeds itself
            return DataPath(producer, consumer, "direct", "self")
        p, c = self.stages[producer], self.stages[consumer]
        mode = _edge_mode(p, c)
        if mode == "relay":
            return DataPath(producer, consumer, "relay", "relay", reason="data: relay in the inventory")
        until = time.monotonic() + (RELINK_SECONDS if again else 0.0)
        tries = 0
        while True:
            tries += 1
            path, failure = await self._try_link(producer, consumer, timeout)
            if path is not None:
                return path
            if time.monotonic() + RELINK_PAUSE >= until:
                break
            await asyncio.sleep(RELINK_PAUSE)
        if again:
            failure += f" ({tries} tries in {RELINK_SECONDS:g} s)"
        if mode == "direct":
            raise PipelineError(
                f"the direct link from stage {producer} to stage {consumer} cannot be set up: {failure} "
                "(the inventory says data: direct, so there is no relay fallback)"
            )
        return DataPath(producer, consumer, "relay", "relay", reason=failure)

    async def _try_link(self, producer: int, consumer: int, timeout: float) -> tuple[DataPath | None, str]:
        """One try: the link up (its path), or why not."""
        p, c = self.stages[producer], self.stages[consumer]
        transport = self._transport or ("unix" if _same_host(p, c) else "tls")
        token = secrets.token_hex(16)
        self._tokens[token] = producer
        blank = links.LinkCredentials()
        theirs = blank if transport == "unix" else self._credentials(consumer)
        ours = blank if transport == "unix" else self._credentials(producer)
        probe = min(timeout, PROBE_SECONDS)
        failure = ""
        try:
            listening = await c.request(
                lambda rid: links.LinkListen(rid, transport, producer, token, theirs, 4 * probe + timeout),
                timeout,
            )
            if isinstance(listening, links.LinkListening):
                endpoints = self._endpoints(c, listening)
                if self._route is not None:
                    endpoints = await self._route(producer, endpoints)
                connected = await p.request(
                    lambda rid: links.LinkConnect(rid, transport, consumer, endpoints, token, ours, probe),
                    probe * len(endpoints) + timeout,
                )
                if isinstance(connected, links.LinkConnected):
                    path = DataPath(
                        producer, consumer, "direct", transport, connected.endpoint, connected.round_trip_ms
                    )
                    return path, ""
                failure = connected.reason if isinstance(connected, RequestFailed) else repr(connected)
            else:
                failure = listening.reason if isinstance(listening, RequestFailed) else repr(listening)
        except PipelineError as error:
            failure = str(error)
        return None, failure

    def direct(self, producer: int) -> bool:
        path = self.paths.get(producer)
        return path is not None and path.data == "direct"

    # ---------------------------------------------------------- each run

    def _linked_end(self, plan: RunPlan, stage: int, end: OpenEdge) -> bool:
        """Whether ``end`` of ``stage`` is set up on a link instead of the data stream."""
        n = len(plan.stages)
        if end.role == "inbound":
            return stage > 0 and self.direct(stage - 1)
        if end.role == "outbound":
            return stage < n - 1 and self.direct(stage)
        return self.direct(n - 1)  # ring-in, ring-out: the last stage's link to stage 0

    async def open_edges(self, plan: RunPlan, stage: int) -> None:
        if plan.run_id not in self.bound:
            return  # the run ended (faulted while its stages set up): nothing to link
        acked = self._acked.setdefault(plan.run_id, set())
        linked = self._linked.setdefault(plan.run_id, set())
        ends = [end for end in self.edge_ends(plan, stage) if not self._linked_end(plan, stage, end)]
        if ends:
            await self._stream(stage).writer.write(*(encode_message(end) for end in ends))
        acked.add(stage)
        n = len(plan.stages)
        # Each link whose two stages have now both taken their provision.
        for producer in {stage, (stage - 1) % n}:
            consumer = (producer + 1) % n
            both = {producer, consumer} <= acked
            if producer in linked or not both or not self.direct(producer):
                continue
            if producer < n - 1:
                message = links.LinkEdge(plan.run_id, plan.stages[producer].outbound_edge, "outbound")
            elif plan.ring is not None:
                message = links.LinkEdge(plan.run_id, plan.ring.edge_id, "ring-out")
            else:
                continue  # the orchestrator feeds tokens back: the ring's link idles
            # Once: the setups of both stages of a pair run at once, and each
            # may find the pair complete while the other awaits its send.
            linked.add(producer)
            await self.stages[producer].send(message)

    def unbind(self, run_id: RunId) -> None:
        super().unbind(run_id)
        self._acked.pop(run_id, None)
        self._linked.pop(run_id, None)

    # ------------------------------------------------------- a link down

    def on_message(self, stage: int, message: Message) -> bool:
        n = len(self.stages)
        if isinstance(message, links.LinkDown):
            if message.token not in self._tokens:
                return True  # a link of an older plane, which a repair closed
            peer, reason = message.peer, message.reason
        elif isinstance(message, StageFault) and 0 <= message.link_peer < n and self.events.broken:
            # A write on a link failed: the same break as its LinkDown (the
            # repair interrupts the run; without one the run's driver says so).
            peer, reason = message.link_peer, message.reason
        else:
            return False
        producer = stage if (stage + 1) % n == peer else peer
        if producer not in self._down:
            self._down.add(producer)
            self.tasks.spawn(self._link_down(producer, stage, reason), f"link {producer} down")
        return True

    async def _link_down(self, producer: int, reporter: int, reason: str) -> None:
        consumer = (producer + 1) % len(self.stages)
        ends = (self.stages[producer], self.stages[consumer])
        for _ in range(int(LINK_GRACE_SECONDS / 0.05)):
            if not all(end.alive() for end in ends):
                return  # the stage that died is reported lost, with its exit status
            await asyncio.sleep(0.05)
        why = f"{self.stages[reporter].label}: {reason}"
        if self.events.broken is None:
            self.events.fault(why)
        else:
            link = f"the direct link from stage {producer} to stage {consumer}"
            self.events.broken(producer, f"{link} broke ({why})")
