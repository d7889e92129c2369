"""docs/design.md, "Security model": a corrupt control stream, sent to a real agent process: refused,
and the process ends by itself with status 0 (never a crash).

Every other rejection a stage owes is tested in the unit lane against the
agent's own runtime and control session with llama.cpp replaced by a fake
(tests/unit/test_stage_refusals.py): none of them depends on what a
real stage computes. This one stays with a process because what it checks is
the process's exit; it loads no model."""

from __future__ import annotations

import asyncio
import struct

from ggufpipe_agent.wire.protocol import CONTROL_MAGIC, Refused
from tests.support.agent_client import AgentClient


async def test_corrupt_control_frame_ends_the_session_cleanly(no_agent_left):
    client = AgentClient()
    await client.start()
    await client.send_raw(struct.pack("<4sI", CONTROL_MAGIC, 5) + b"\xc1\xc1\xc1\xc1\xc1")
    refused = await client.expect(Refused)
    assert refused.what == "control frame" and "undecodable" in refused.reason
    assert await asyncio.wait_for(client.process.wait(), 15) == 0
    await client.close()
