"""``ggufpipe-agent receive`` as the process it is on a host: the delivery
wire on its stdin/stdout (what the SSH exec session carries), a stage file
into the cache, a stream cut halfway kept for a resume, a malformed stream
one clear error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ggufpipe_agent.delivery.sender import StageSender
from ggufpipe_agent.stagefiles.cache import verify_entry
from ggufpipe_agent.wire.delivery_messages import (
    ReceiveAnswer,
    ReceiveStage,
    StageData,
    StageDataEnd,
    StageStored,
)
from ggufpipe_agent.wire.protocol import CONTROL_PREFIX_SIZE, decode_payload, encode_message, parse_prefix
from tests.support.common import REPO

CHUNK = 1 << 20
RANGE = (8, 21)


def start(cache: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "ggufpipe_agent", "receive", "--cache-dir", str(cache)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
    )


def answer(process: subprocess.Popen[bytes]) -> object:
    assert process.stdout is not None
    prefix = process.stdout.read(CONTROL_PREFIX_SIZE)
    return decode_payload(process.stdout.read(parse_prefix(prefix)))


def test_a_stage_file_arrives_and_a_cut_stream_is_kept_for_a_resume(model_path, tmp_path):
    cache = tmp_path / "cache"
    with StageSender(model_path, *RANGE, chunk_size=CHUNK, memo_dir=tmp_path / "sent") as sender:
        first = start(cache)
        assert first.stdin is not None
        first.stdin.write(encode_message(ReceiveStage(sender.offer, False)))
        first.stdin.flush()
        opened = answer(first)
        assert isinstance(opened, ReceiveAnswer) and opened.status.state == "empty"
        for chunk in sender.chunks(0):
            if chunk.index == 20:
                first.stdin.write(encode_message(StageData(chunk.index, chunk.digest, len(chunk.data))))
                first.stdin.write(chunk.data[:1000])  # the connection breaks inside a chunk
                break
            first.stdin.write(
                encode_message(StageData(chunk.index, chunk.digest, len(chunk.data))) + chunk.data
            )
        first.stdin.close()
        assert first.wait(60) == 1
        assert b"interrupted at byte 20971520" in first.stderr.read()  # type: ignore[union-attr]

        second = start(cache)
        assert second.stdin is not None
        second.stdin.write(encode_message(ReceiveStage(sender.offer, False)))
        second.stdin.flush()
        resumed = answer(second)
        assert isinstance(resumed, ReceiveAnswer)
        assert (resumed.status.state, resumed.status.verified_chunks) == ("partial", 20)
        for chunk in sender.chunks(20):
            second.stdin.write(
                encode_message(StageData(chunk.index, chunk.digest, len(chunk.data))) + chunk.data
            )
        second.stdin.write(encode_message(StageDataEnd(sender.digest)))
        second.stdin.flush()
        stored = answer(second)
        assert isinstance(stored, StageStored) and stored.digest == sender.digest
        second.stdin.close()
        assert second.wait(60) == 0
        sidecar = verify_entry(cache / stored.name)
        assert sidecar is not None and sidecar.digest == sender.digest


def test_a_malformed_stream_is_one_clear_error(tmp_path):
    process = start(tmp_path / "cache")
    out, err = process.communicate(b"GPXX" + os.urandom(60), timeout=60)
    assert process.returncode == 1 and out
    assert b"cannot receive the stage file: bad control frame magic b'GPXX'" in err
