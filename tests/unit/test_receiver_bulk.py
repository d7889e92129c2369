"""Stage-file delivery with bounded memory, whatever the file size, and the
whole-file digest, however the bytes arrive.

Neither needs the real model (the receiver's other tests, which needed it
for no more than a big enough stage file, are tests/unit/test_receiver_units.py);
these two are the slow ones: a ~400 MB synthetic GGUF, and a
digest fed a byte at a time."""

from __future__ import annotations

import contextlib
import hashlib
import subprocess
import sys

import numpy as np
import pytest

from tests.support.bulky_gguf import big_model
from tests.support.common import REPO

# ------------------------------------------------------------ memory


MEASURE = """
import json, sys
from pathlib import Path
from ggufpipe_agent.delivery.receiver import StageFileReceiver
from ggufpipe_agent.delivery.sender import StageSender
from ggufpipe_agent.stagefiles.build import ensure_stage_file

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

source, work = Path(sys.argv[1]), Path(sys.argv[2])
with StageSender(source, 1, 8, memo_dir=work / "sent") as sender:  # headers read, imports done
    before = status("VmHWM")
    local = ensure_stage_file(source, 1, 8, work / "local")
    offer = sender.offer
    with StageFileReceiver(work / "received", offer.key, offer.size, offer.chunk_size) as receiver:
        receiver.open()
        for chunk in sender.chunks(0):
            receiver.accept(chunk.index, chunk.data, chunk.digest)
        received = receiver.finish(sender.digest)
print(json.dumps({"before": before, "peak": status("VmHWM"), "size": offer.size,
                  "same": local.read_bytes() == received.read_bytes() if offer.size < 2**30 else None}))
"""


@pytest.mark.slow
def test_memory_stays_bounded_whatever_the_file_size(tmp_path):
    import json

    source = big_model(tmp_path / "big.gguf")
    assert source.stat().st_size > 380 << 20
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(source), str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    growth = result["peak"] - result["before"]
    print(
        f"\nstage file {result['size'] / 2**20:.0f} MiB written locally and received: peak RSS grew {growth / 2**20:.1f} MiB"
    )
    assert result["size"] > 320 << 20 and result["same"]
    assert growth < 48 << 20, (
        f"peak RSS grew by {growth / 2**20:.0f} MiB for a {result['size'] / 2**20:.0f} MiB file"
    )
    with contextlib.suppress(OSError):
        source.unlink()


# ------------------------------------------------------------ the digest


@pytest.mark.slow
def test_the_file_digest_is_the_same_however_the_bytes_arrive():
    from ggufpipe_agent.stagefiles.digest import LEAF, FileDigest, chunk_digest, leaf_digests

    data = np.random.default_rng(3).bytes(5 * LEAF + 12345)
    whole = FileDigest()
    whole.update(data)
    expected = hashlib.sha256(
        b"".join(hashlib.sha256(data[i : i + LEAF]).digest() for i in range(0, len(data), LEAF))
    )
    assert whole.hexdigest() == expected.hexdigest()
    for piece in (1, 999, LEAF - 1, LEAF, 3 * LEAF + 7):
        pieces = FileDigest()
        for offset in range(0, len(data), piece):
            pieces.update(data[offset : offset + piece])
        assert pieces.hexdigest() == whole.hexdigest(), piece
    chunks = FileDigest()
    for offset in range(0, len(data), 2 * LEAF):  # as a receiver adds verified chunks
        leaves = leaf_digests(data[offset : offset + 2 * LEAF])
        assert chunk_digest(leaves) == hashlib.sha256(leaves).hexdigest()
        chunks.add_leaves(leaves)
    assert chunks.hexdigest() == whole.hexdigest()
