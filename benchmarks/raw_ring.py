"""The ceiling of a split on one machine: the same stage engines ggufpipe's
agents run, one per process, joined in a ring by raw Unix sockets.

    .venv/bin/python benchmarks/raw_ring.py [--stages 3] [--tokens 128] [--repeats 3]

No protocol beyond an 8-byte header (sequence, rows) per message, no
orchestrator, no event loop: stage i blocks on its socket from stage i-1,
steps its engine and writes the result to stage i+1; the last stage writes
each sampled token straight back to stage 0. Whatever ggufpipe adds on top
(framing, checks, the control plane, the token-out edge, the views) is
measured against this in ``bench_pipeline.py``. The processes are set up
as the agents are: every thread of the machine each, and GOMP_SPINCOUNT=10000
(the agents' default, ggufpipe_agent/cli.py).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import struct
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

HEADER = struct.Struct("<II")  # sequence, rows (0 rows: a token follows as one int32)


def _exactly(sock: socket.socket, count: int) -> bytes:
    buffer = bytearray(count)
    view = memoryview(buffer)
    got = 0
    while got < count:
        n = sock.recv_into(view[got:])
        if not n:
            raise EOFError
        got += n
    return bytes(buffer)


def _stage(
    index: int,
    count: int,
    split: tuple[int, int],
    model: str,
    where: str,
    threads: int,
    control: Connection,
) -> None:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # before libgomp loads, as the agent does
    import numpy as np

    from ggufpipe_agent.gguf.facts import read_model_facts
    from ggufpipe_agent.llama.engine import StageEngine, StageShape
    from ggufpipe_agent.stagefiles.build import ensure_stage_file
    from ggufpipe_agent.wire.protocol import EngineOptions, SamplingParams

    facts = read_model_facts(model)
    hidden = facts.hidden_dim
    first, last = index == 0, index == count - 1
    stage_file = ensure_stage_file(Path(model), split[0], split[1], None)
    options = EngineOptions(n_ctx=1024, n_batch=1024, n_ubatch=512, threads=threads)
    engine = StageEngine(str(stage_file), StageShape(first, last, split[1] - split[0], hidden), options)
    server = socket.socket(socket.AF_UNIX)
    server.bind(os.path.join(where, f"ring-{index}.sock"))
    server.listen(1)
    control.send("listening")
    control.recv()  # every stage listens: connect onwards
    onward = socket.socket(socket.AF_UNIX)
    onward.connect(os.path.join(where, f"ring-{(index + 1) % count}.sock"))
    inbound, _ = server.accept()
    control.send("ready")
    total = 0
    sampled: list[int] = []
    stamps: list[float] = []
    while True:
        if first:
            order = control.recv()  # (prompt, tokens), or None: the end
            if order is None:
                break
            prompt, total = order
            engine.reset(SamplingParams())
            sequence, value = 0, prompt
            while True:
                rows = np.ascontiguousarray(engine.step(value), dtype=np.float32)
                onward.sendall(HEADER.pack(sequence, rows.shape[0]) + rows.tobytes())
                if sequence == total:
                    break
                sequence, _ = HEADER.unpack(_exactly(inbound, HEADER.size))  # the token, round the ring
                value = [struct.unpack("<i", _exactly(inbound, 4))[0]]
            continue
        try:
            sequence, count_rows = HEADER.unpack(_exactly(inbound, HEADER.size))
        except EOFError:
            break
        payload = _exactly(inbound, count_rows * hidden * 4)
        activations = np.frombuffer(payload, dtype=np.float32).reshape(count_rows, hidden)
        if sequence == 0:
            engine.reset(SamplingParams())
            if last:
                total, sampled, stamps = control.recv(), [], []
        result = engine.step(activations)
        if not last:
            rows = np.ascontiguousarray(result, dtype=np.float32)
            onward.sendall(HEADER.pack(sequence, rows.shape[0]) + rows.tobytes())
            continue
        token = int(result)  # type: ignore[arg-type]
        sampled.append(token)
        stamps.append(time.perf_counter())
        if sequence < total:
            onward.sendall(HEADER.pack(sequence + 1, 0) + struct.pack("<i", token))
        else:
            control.send((sampled, stamps[0], stamps[-1]))
    engine.close()


class RawRing:
    """N stage processes in a ring; :meth:`generate` runs one greedy generation."""

    def __init__(self, model: Path, splits: list[tuple[int, int]], threads: int = 0) -> None:
        context = multiprocessing.get_context("spawn")
        self.where = tempfile.mkdtemp(prefix="ggufpipe-raw-ring-")
        self.controls: list[Connection] = []
        self.processes: list[Any] = []
        # A spawned child imports the parent's main module before _stage runs;
        # when that module imports llama_cpp (bench_pipeline does), libgomp
        # reads GOMP_SPINCOUNT at that import, so the children must inherit it.
        spin = os.environ.get("GOMP_SPINCOUNT")
        os.environ.setdefault("GOMP_SPINCOUNT", "10000")
        try:
            self._spawn(context, model, splits, threads)
        finally:
            if spin is None:
                del os.environ["GOMP_SPINCOUNT"]
        for control in self.controls:
            assert control.recv() == "listening"
        for control in self.controls:
            control.send("connect")
        for control in self.controls:
            assert control.recv() == "ready"

    def _spawn(self, context: Any, model: Path, splits: list[tuple[int, int]], threads: int) -> None:
        for index, split in enumerate(splits):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=_stage,
                args=(index, len(splits), split, str(model), self.where, threads, theirs),
                daemon=True,
            )
            process.start()
            self.controls.append(ours)
            self.processes.append(process)

    def generate(self, prompt: list[int], tokens: int) -> tuple[list[int], float]:
        """``tokens`` + 1 greedy tokens; returns them and the decode tokens/s."""
        self.controls[-1].send(tokens)
        self.controls[0].send((prompt, tokens))
        sampled, first, last = self.controls[-1].recv()
        return sampled, tokens / (last - first) if last > first else 0.0

    def close(self) -> None:
        self.controls[0].send(None)
        for process in self.processes:
            process.join(10)
            if process.is_alive():
                process.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from tests.support.common import smollm_path
    from tests.support.stage_chain import even_splits

    model = smollm_path()
    ring = RawRing(model, even_splits(30, args.stages))
    try:
        prompt = list(range(1, 129))
        for _ in range(args.repeats):
            tokens, rate = ring.generate(prompt, args.tokens)
            print(f"{args.stages} processes in a ring: {rate:.1f} decode tokens/s ({len(tokens)} tokens)")
    finally:
        ring.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
