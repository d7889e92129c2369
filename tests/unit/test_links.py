"""Direct stage links, the agent's side (ggufpipe_agent/process/peer_links.py), with real
sockets and real TLS in one process: who is let in and who is not."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from ggufpipe_agent.process.peer_links import Links
from ggufpipe_agent.tasks import TaskOwner
from ggufpipe_agent.wire.link_messages import (
    LinkConnect,
    LinkConnected,
    LinkCredentials,
    LinkDown,
    LinkListen,
    LinkListening,
)
from ggufpipe_agent.wire.protocol import Message, RequestFailed
from ggufpipe_tui.dataplane.credentials import LinkAuthority


class Agent:
    """One agent's links, with what it posts and serves recorded."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(mode=0o700)
        self.posted: list[Message] = []
        self.served: list[int] = []
        self.tasks = TaskOwner(lambda name, error: None, "test")
        self.links = Links(directory, self.posted.append, self.serve, self.tasks.spawn)

    async def serve(self, reader: Any, writer: Any, peer: int) -> str:
        self.served.append(peer)
        await reader.read()  # until the producer closes
        return "it was closed"

    async def close(self) -> None:
        self.links.close()
        await self.tasks.close()


def credentials(authority: LinkAuthority, stage: int) -> LinkCredentials:
    issued = authority.issue(stage)
    return LinkCredentials(issued.certificate, issued.key, authority.certificate_pem)


@pytest.fixture
async def pair(tmp_path):
    consumer, producer = Agent(tmp_path / "consumer"), Agent(tmp_path / "producer")
    yield consumer, producer
    await consumer.close()
    await producer.close()


async def link(
    consumer: Agent,
    producer: Agent,
    transport: str,
    theirs: LinkCredentials,
    ours: LinkCredentials,
    token: str = "secret",
    presented: str | None = None,
    peer: int = 0,
) -> Message:
    listening = await consumer.links.listen(LinkListen(1, transport, peer, token, theirs, 5.0))
    assert isinstance(listening, LinkListening), listening
    endpoint = listening.endpoint
    if endpoint.startswith("tcp:"):
        endpoint = f"127.0.0.1:{endpoint[4:]}"
    request = LinkConnect(2, transport, 1, (endpoint,), presented or token, ours, 3.0)
    return await producer.links.connect(request)


async def test_mutual_tls_between_the_stages_of_one_session(pair):
    consumer, producer = pair
    authority = LinkAuthority()
    answer = await link(consumer, producer, "tls", credentials(authority, 1), credentials(authority, 0))
    assert isinstance(answer, LinkConnected) and answer.round_trip_ms > 0
    await asyncio.sleep(0.05)
    assert consumer.served == [0]


async def test_a_certificate_of_another_session_is_refused(pair):
    consumer, producer = pair
    ours, stranger = LinkAuthority(), LinkAuthority()
    answer = await link(consumer, producer, "tls", credentials(ours, 1), credentials(stranger, 0))
    assert isinstance(answer, RequestFailed), answer
    assert consumer.served == []


async def test_a_certificate_for_another_stage_is_refused_both_ways(pair):
    consumer, producer = pair
    authority = LinkAuthority()
    # The consumer expects stage 0; the producer presents stage 2's certificate.
    answer = await link(consumer, producer, "tls", credentials(authority, 1), credentials(authority, 2))
    assert isinstance(answer, RequestFailed) and consumer.served == []
    # The producer expects stage 1 to answer; the consumer presents stage 3's.
    answer = await link(consumer, producer, "tls", credentials(authority, 3), credentials(authority, 0))
    assert isinstance(answer, RequestFailed) and "stage-1.ggufpipe.invalid" in answer.reason
    assert consumer.served == []


async def test_the_link_token_is_required(pair):
    consumer, producer = pair
    answer = await link(consumer, producer, "unix", LinkCredentials(), LinkCredentials(), presented="guess")
    assert isinstance(answer, RequestFailed) and consumer.served == []


async def test_a_unix_link_lives_in_the_private_directory_and_takes_one_producer(pair, tmp_path):
    consumer, producer = pair
    listening = await consumer.links.listen(LinkListen(1, "unix", 0, "secret", LinkCredentials(), 5.0))
    assert isinstance(listening, LinkListening)
    path = Path(listening.endpoint.removeprefix("unix:"))
    assert path.parent == tmp_path / "consumer" and stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    request = LinkConnect(2, "unix", 1, (listening.endpoint,), "secret", LinkCredentials(), 3.0)
    assert isinstance(await producer.links.connect(request), LinkConnected)
    again = await producer.links.connect(request)
    assert isinstance(again, RequestFailed), "the listener closed after its one producer"


async def test_a_link_that_ends_is_reported(pair):
    consumer, producer = pair
    answer = await link(consumer, producer, "unix", LinkCredentials(), LinkCredentials())
    assert isinstance(answer, LinkConnected)
    await asyncio.sleep(0.05)
    assert producer.links.outbound is not None
    producer.links.outbound.writer.close()  # the producer's side goes away
    for _ in range(100):
        if consumer.posted:
            break
        await asyncio.sleep(0.02)
    assert consumer.posted and isinstance(consumer.posted[0], LinkDown)
    assert consumer.posted[0].peer == 0 and "ended" in consumer.posted[0].reason


async def test_each_pair_gets_its_link_edge_once_when_the_stages_set_up_at_once():
    """The stages of a run take their provisions at about the same moment and
    their edge setups run side by side; each may find its pair complete while
    the other waits for a send, and a second LinkEdge would make the producer
    open the consumer's end twice (refused: the run faults)."""
    from types import SimpleNamespace

    from ggufpipe_agent.wire.link_messages import LinkEdge
    from ggufpipe_tui.core.events import DataPath
    from ggufpipe_tui.dataplane import DataPlaneEvents
    from ggufpipe_tui.dataplane.direct import DirectPlane
    from tests.support.fakes import inventory, plan_for

    sent: list[tuple[int, LinkEdge]] = []

    class Stage:
        def __init__(self, index: int) -> None:
            self.index = index
            self.data = SimpleNamespace(writer=SimpleNamespace(write=self.write))

        async def write(self, *frames: bytes) -> None:
            await asyncio.sleep(0)

        async def send(self, message: LinkEdge) -> None:
            await asyncio.sleep(0)  # a bounded send yields (asyncio.wait_for)
            sent.append((self.index, message))

    def ignore(*args: object) -> None:
        pass

    plan = plan_for(inventory(stages=3, feedback="ring"))
    owner = TaskOwner(lambda name, error: None, "test")
    plane = DirectPlane([Stage(i) for i in range(3)], owner, DataPlaneEvents(ignore, ignore, ignore))  # type: ignore[list-item]
    for producer in range(3):
        plane.paths[producer] = DataPath(producer, (producer + 1) % 3, "direct", "unix")
    plane.bind(plan, lambda sequence, token: None)  # as the pipeline binds each run first
    await asyncio.gather(*(plane.open_edges(plan, stage) for stage in range(3)))
    assert sorted((stage, message.role) for stage, message in sent) == [
        (0, "outbound"),
        (1, "outbound"),
        (2, "ring-out"),
    ]
    await owner.close()
