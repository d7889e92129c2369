"""Delivery benchmark: a stage file sent over SSH by ggufpipe against OpenSSH.

    .venv/bin/python benchmarks/bench_delivery.py [--size-gib 4] [--repeats 5] [--no-write]

In one run, on a loopback sshd (tests/sshd.py: forwarding off, as the tests
use it), a synthetic llama model of ``--size-gib`` GiB is written (random
weights: nothing compresses), the stage file of its first half is the payload,
and each repeat times, interleaved:

* ``ssh host 'cat > file'`` of the stage file's bytes (the baseline: OpenSSH's
  client and server, no checks), and the same followed by ``sync file``;
* asyncssh alone: an exec session running ``cat > file`` fed 8 MiB writes
  (what the orchestrator's SSH library can carry);
* ggufpipe: ``deliver_stage`` to an agent started over SSH, as ``Pipeline``
  does for ``model: {send: true}``: read from the model, hashed, framed,
  sent on its own data connection through ``ggufpipe-agent bridge``, checked
  chunk by chunk and whole, fsynced, a cache entry. The orchestrator runs in
  a child process so its peak RSS during the delivery is its own; the agent's
  is read from /proc (VmHWM, reset before the transfer).

Then a second delivery of the same file (the host has it: nothing is sent).
Medians of ``--repeats``; the ratio is ggufpipe's rate over OpenSSH's. The
model and every copy are deleted at the end. Results go to
docs/bench-delivery.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BLOCKS = 16
HIDDEN = 4096


def write_big_model(path: Path, total_bytes: int) -> Path:
    """A llama GGUF of about ``total_bytes``: the synthetic vocabulary of the
    tests, F16 blocks of random bytes, written tensor by tensor (bounded memory)."""
    import gguf
    import numpy as np

    from tests.synthetic import MERGES, vocabulary

    per_block = total_bytes // (BLOCKS + 1)
    rows = max(1, per_block // (HIDDEN * 2))
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_name("bench delivery")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_uint32("llama.context_length", 4096)
    writer.add_uint32("llama.embedding_length", HIDDEN)
    writer.add_uint32("llama.block_count", BLOCKS)
    writer.add_uint32("llama.feed_forward_length", rows)
    writer.add_uint32("llama.attention.head_count", 32)
    writer.add_uint32("llama.attention.head_count_kv", 8)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    tokens, types = vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(MERGES))
    tensors: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (len(tokens), HIDDEN))]
    tensors += [("output_norm.weight", (HIDDEN,))]
    for block in range(BLOCKS):
        tensors += [(f"blk.{block}.attn_norm.weight", (HIDDEN,)), (f"blk.{block}.ffn_up.weight", (rows, HIDDEN))]
    for name, shape in tensors:
        count = int(np.prod(shape))
        writer.add_tensor_info(name, shape, np.dtype(np.float16), count * 2, gguf.GGMLQuantizationType.F16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for _name, shape in tensors:
        count = int(np.prod(shape))
        writer.write_tensor_data(rng.integers(0, 1 << 16, count, dtype=np.uint16).view(np.float16).reshape(shape))
    writer.close()
    return path


# ------------------------------------------------------------- measurements


def rss_kib(pid: int | str, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def reset_peak(pid: int | str) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux 4.0+)


def ssh_command(server: Any, cipher: str = "") -> list[str]:
    return [
        "ssh", "-p", str(server.port), "-i", str(server.client_key),
        "-o", f"UserKnownHostsFile={server.known_hosts}", "-o", "BatchMode=yes",
        *(["-c", cipher] if cipher else []),
        f"{server.user}@127.0.0.1",
    ]


def openssh_cat(server: Any, source: Path, target: Path, sync: bool, cipher: str = "") -> float:
    remote = f"cat > {target}" + (f" && sync {target}" if sync else "")
    started = time.perf_counter()
    with source.open("rb") as stream:
        subprocess.run([*ssh_command(server, cipher), remote], stdin=stream, check=True)
    seconds = time.perf_counter() - started
    target.unlink()
    return seconds


async def asyncssh_cat(server: Any, source: Path, target: Path) -> tuple[float, str]:
    """asyncssh with the orchestrator's own cipher preference (sshconn.cipher_preference)."""
    import asyncssh

    from ggufpipe_tui.transports.sshconn import cipher_preference

    options: dict[str, Any] = {
        "port": server.port, "username": server.user, "client_keys": [str(server.client_key)],
        "known_hosts": str(server.known_hosts),
    }
    if cipher_preference():
        options["encryption_algs"] = cipher_preference()
    async with asyncssh.connect("127.0.0.1", **options) as connection:
        process = await connection.create_process(f"cat > {target}", encoding=None)
        fd = os.open(source, os.O_RDONLY)
        started = time.perf_counter()
        try:
            offset, size = 0, os.fstat(fd).st_size
            while offset < size:
                data = os.pread(fd, 8 << 20, offset)
                offset += len(data)
                process.stdin.write(data)
                await process.stdin.drain()
        finally:
            os.close(fd)
        process.stdin.write_eof()
        await process.wait_closed()
        seconds = time.perf_counter() - started
        cipher = str(connection.get_extra_info("send_cipher"))
    target.unlink()
    return seconds, cipher


async def deliver_once(args: argparse.Namespace) -> dict[str, Any]:
    """The child: one delivery as Pipeline does it; times and peak RSS."""
    from ggufpipe_agent.modelfiles import read_model_files
    from ggufpipe_tui.core.inventory import HostSpec, Timeouts
    from ggufpipe_tui.session.delivery import deliver_stage
    from ggufpipe_tui.session.stages import StageHandle
    from ggufpipe_tui.transports.ssh import SshAgent

    host = HostSpec(
        name="bench", line=0, address="127.0.0.1", port=args.port, user=args.user,
        identity=(args.key,), known_hosts=(args.known_hosts,), agent=f"{sys.executable} -m ggufpipe_agent",
        cache_dir=args.cache_dir,
    )
    link = SshAgent(host, 0, lambda line: None)
    stage = StageHandle(0, link, lambda *_: None, lambda *_: None)
    files = read_model_files(args.model)
    try:
        hello = await stage.start(30)
        read = asyncio.ensure_future(stage.read_control())
        reset_peak("self")
        reset_peak(hello.pid)
        before = rss_kib("self", "VmRSS")
        agent_before = rss_kib(hello.pid, "VmRSS")
        started = time.perf_counter()
        delivered = await deliver_stage(stage, files, (0, args.end), lambda event: None, Timeouts())
        seconds = time.perf_counter() - started
        result = {
            "seconds": seconds, "outcome": delivered.outcome, "sent": delivered.sent, "size": delivered.ref.size,
            "rss_kib": before, "peak_kib": rss_kib("self", "VmHWM"),
            "agent_rss_kib": agent_before, "agent_peak_kib": rss_kib(hello.pid, "VmHWM"),
        }
        read.cancel()
        return result
    finally:
        await link.close(3)


def run_child(server: Any, model: Path, end: int, cache: Path) -> dict[str, Any]:
    command = [
        sys.executable, __file__, "--deliver", "--model", str(model), "--end", str(end),
        "--port", str(server.port), "--user", server.user, "--key", str(server.client_key),
        "--known-hosts", str(server.known_hosts), "--cache-dir", str(cache),
    ]
    done = subprocess.run(command, check=True, capture_output=True, text=True, cwd=REPO)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def clear(directory: Path) -> None:
    for entry in directory.iterdir():
        entry.unlink()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=4.0, help="synthetic model size (default 4)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-write", action="store_true", help="do not write docs/bench-delivery.md")
    parser.add_argument("--work", type=Path, help="where the model and copies go (default: a temp dir)")
    parser.add_argument("--deliver", action="store_true", help=argparse.SUPPRESS)
    for name in ("--model", "--user", "--key", "--known-hosts", "--cache-dir"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--end", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.deliver:
        print(json.dumps(asyncio.run(deliver_once(args))))
        return 0

    from ggufpipe_agent.stagestream import open_stage_stream
    from tests.sshd import Sshd

    work = Path(tempfile.mkdtemp(prefix="bench-delivery-", dir=args.work))
    server = None
    try:
        model = write_big_model(work / "bench-delivery.gguf", int(args.size_gib * 2**30))
        end = BLOCKS // 2
        payload = work / "stage.gguf"  # the same bytes, as a file, for cat
        from ggufpipe_agent.modelfiles import read_model_files

        with open_stage_stream(read_model_files(model), 0, end) as stream, payload.open("wb") as out:
            for chunk in stream.chunks():
                out.write(chunk)
        size = payload.stat().st_size
        model.read_bytes() if model.stat().st_size < 2**31 else None  # warm the page cache when it fits
        host_dir = work / "host"
        host_dir.mkdir(mode=0o700)
        cache = work / "host-cache"
        server = Sshd(work / "sshd").start()
        openssh, synced, gcm, plain, ours, rows = [], [], [], [], [], []
        cipher = ""
        for _ in range(args.repeats):
            openssh.append(openssh_cat(server, payload, host_dir / "cat.out", sync=False))
            gcm.append(openssh_cat(server, payload, host_dir / "cat.out", False, "aes128-gcm@openssh.com"))
            seconds, cipher = asyncio.run(asyncssh_cat(server, payload, host_dir / "asyncssh.out"))
            plain.append(seconds)
            if cache.exists():
                clear(cache)
            row = run_child(server, model, end, cache)
            assert row["outcome"] == "sent" and row["sent"] == size, row
            ours.append(row["seconds"])
            rows.append(row)
            synced.append(openssh_cat(server, payload, host_dir / "cat.out", sync=True))
        again = run_child(server, model, end, cache)
        assert again["outcome"] == "cached" and again["sent"] == 0, again
        load = os.getloadavg()[0]
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)

    def rate(seconds: list[float]) -> float:
        return size / statistics.median(seconds) / 1e6

    peak = max(row["peak_kib"] - row["rss_kib"] for row in rows) / 1024
    agent_peak = max(row["agent_peak_kib"] - row["agent_rss_kib"] for row in rows) / 1024
    lines = [
        "# Delivery benchmark",
        "",
        "`benchmarks/bench_delivery.py` (`.venv/bin/python benchmarks/bench_delivery.py "
        f"--size-gib {args.size_gib:g} --repeats {args.repeats}`): one stage file of a synthetic "
        f"{args.size_gib:g} GiB llama model (blocks [0, {end}) of {BLOCKS}: {size / 2**30:.2f} GiB, random "
        "weights) over SSH on loopback (the tests' sshd, forwarding off), interleaved, medians of "
        f"{args.repeats}. {platform.node()}: {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"load average {load:.1f} at the end (a shared machine: absolute rates move with it, the ratios "
        f"are what a run compares). The orchestrator's cipher (asyncssh): {cipher}; OpenSSH's: its default "
        "(chacha20-poly1305@openssh.com) unless `-c` says otherwise.",
        "",
        "| what | median s | MB/s | vs `ssh 'cat > file'` |",
        "|---|---:|---:|---:|",
    ]
    base = rate(openssh)
    for name, seconds in (
        ("`ssh host 'cat > file'` (OpenSSH)", openssh),
        ("`ssh host 'cat > file && sync file'`", synced),
        ("`ssh -c aes128-gcm@openssh.com host 'cat > file'`", gcm),
        ("asyncssh exec `cat > file`, 8 MiB writes", plain),
        ("**ggufpipe delivery** (send: true)", ours),
    ):
        lines.append(
            f"| {name} | {statistics.median(seconds):.2f} | {rate(seconds):.0f} | {rate(seconds) / base:.2f} |"
        )
    lines += [
        "",
        f"A second delivery of the same file (the host has it, same digest): {again['seconds']:.2f} s, "
        f"{again['sent']} bytes sent.",
        "",
        "Memory during the delivery (peak RSS above the process's RSS when it began, largest of the "
        f"repeats): the orchestrator +{peak:.0f} MiB (of {rows[-1]['rss_kib'] / 1024:.0f} MiB), the agent "
        f"+{agent_peak:.0f} MiB (of {rows[-1]['agent_rss_kib'] / 1024:.0f} MiB), for a "
        f"{size / 2**30:.2f} GiB file: two 8 MiB chunks in flight on each side, whatever the size.",
        "",
        "Per repeat (s): OpenSSH " + ", ".join(f"{s:.2f}" for s in openssh)
        + "; ggufpipe " + ", ".join(f"{s:.2f}" for s in ours) + ".",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        (REPO / "docs" / "bench-delivery.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
