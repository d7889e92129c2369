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
  sent on an exec session running ``ggufpipe-agent receive`` (which writes
  the agent's cache itself), checked chunk by chunk and whole, fsynced, a
  cache entry. The orchestrator runs in
  a child process so its peak RSS during the delivery is its own; the agent's
  is read from /proc (VmHWM, reset before the transfer).

Then a second delivery of the same file (the host has it: nothing is sent),
and one killed halfway (the orchestrator's process SIGKILLed once the host's
progress record vouches for half the bytes) followed by one that resumes.
Medians of ``--repeats``; the ratio is ggufpipe's rate over OpenSSH's. The
model and every copy are deleted at the end. Results go to
docs/bench-delivery.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BLOCKS = 16
HIDDEN = 4096
ROWS = {
    "openssh": "`ssh host 'cat > file'` (OpenSSH)",
    "synced": "`ssh host 'cat > file && sync file'`",
    "gcm": "`ssh -c aes128-gcm@openssh.com host 'cat > file'`",
    "asyncssh": "asyncssh exec `cat > file`, 8 MiB writes",
    "ggufpipe": "**ggufpipe delivery** (send: true)",
}


def write_big_model(path: Path, total_bytes: int) -> Path:
    """A llama GGUF of about ``total_bytes``: the synthetic vocabulary of the
    tests, F16 blocks of random bytes, written tensor by tensor (bounded memory)."""
    import gguf
    import numpy as np

    from tests.support.synthetic import add_keys, add_vocabulary

    per_block = total_bytes // (BLOCKS + 1)
    rows = max(1, per_block // (HIDDEN * 2))
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_name("bench delivery")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    keys = {
        "context_length": 4096,
        "embedding_length": HIDDEN,
        "block_count": BLOCKS,
        "feed_forward_length": rows,
        "attention.head_count": 32,
        "attention.head_count_kv": 8,
        "attention.layer_norm_rms_epsilon": 1e-5,
    }
    add_keys(writer, "llama", keys)
    tokens = add_vocabulary(writer, "default")
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


TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | str) -> float:
    fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


class HostCpu:
    """CPU seconds of what runs on the "host" side of the loopback sshd while
    a transfer goes: sshd's processes of this server (decryption), and what
    its sessions run (agent, bridge, cat), polled from /proc every 50 ms."""

    def __init__(self, sshd_pid: int, port: int) -> None:
        self.sshd_pid, self.port = sshd_pid, str(port).encode()
        self.first: dict[int, tuple[str, float]] = {}
        self.last: dict[int, float] = {}
        self.peak_kib = 0  # the largest peak RSS of a receiving process seen
        self._stop = threading.Event()
        self._poll(baseline=True)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _kind(self, pid: int) -> str:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
        if command.startswith(b"sshd:"):
            ancestor = pid
            while ancestor > 1:
                ancestor = int(Path(f"/proc/{ancestor}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])
                if ancestor == self.sshd_pid:
                    return "sshd"
            return ""
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        if not any(v.startswith(b"SSH_CONNECTION=") and v.split()[-1] == self.port for v in environ.split(b"\0")):
            return ""
        words = command.replace(b"\0", b" ") + b" "
        if b" bridge " in words:
            return "bridge"
        if b" receive " in words:
            return "receive"
        return "agent" if b"ggufpipe_agent" in command else command.split(b"\0")[0].rsplit(b"/", 1)[-1].decode()

    def _poll(self, baseline: bool = False) -> None:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            try:
                if pid not in self.first:
                    kind = self._kind(pid)
                    if not kind:
                        continue
                    self.first[pid] = (kind, cpu_seconds(pid) if baseline else 0.0)
                self.last[pid] = cpu_seconds(pid)
                if self.first[pid][0] == "receive":
                    self.peak_kib = max(self.peak_kib, rss_kib(pid, "VmHWM"))
            except (OSError, IndexError, ValueError):
                continue

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self._poll()

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        self._poll()
        used: dict[str, float] = {}
        for pid, (kind, start) in self.first.items():
            used[kind] = used.get(kind, 0.0) + self.last.get(pid, start) - start
        return used


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def ssh_command(server: Any, cipher: str = "") -> list[str]:
    return [
        "ssh", "-p", str(server.port), "-i", str(server.client_key),
        "-o", f"UserKnownHostsFile={server.known_hosts}", "-o", "BatchMode=yes",
        *(["-c", cipher] if cipher else []),
        f"{server.user}@127.0.0.1",
    ]


def openssh_cat(server: Any, source: Path, target: Path, sync: bool, cipher: str = "") -> tuple[float, dict[str, float]]:
    """Seconds, and CPU seconds by process (the ssh client, sshd, cat)."""
    remote = f"cat > {target}" + (f" && sync {target}" if sync else "")
    host = HostCpu(server.process.pid, server.port)
    client = children_cpu()
    started = time.perf_counter()
    with source.open("rb") as stream:
        subprocess.run([*ssh_command(server, cipher), remote], stdin=stream, check=True)
    seconds = time.perf_counter() - started
    cpu = host.stop() | {"orchestrator": children_cpu() - client}
    target.unlink()
    return seconds, cpu


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
    from ggufpipe_agent.gguf.files import read_model_files
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
        host = HostCpu(args.sshd_pid, args.port)
        mine = own_cpu()
        started = time.perf_counter()
        delivered = await deliver_stage(stage, files, (0, args.end), lambda event: None, Timeouts())
        seconds = time.perf_counter() - started
        cpu = host.stop() | {"orchestrator": own_cpu() - mine}
        result = {
            "cpu": cpu,
            "seconds": seconds, "outcome": delivered.outcome, "sent": delivered.sent, "size": delivered.ref.size,
            "rss_kib": before, "peak_kib": rss_kib("self", "VmHWM"),
            "agent_rss_kib": agent_before, "agent_peak_kib": rss_kib(hello.pid, "VmHWM"),
            "receive_peak_kib": host.peak_kib,
        }
        read.cancel()
        return result
    finally:
        await link.close(3)


def child_command(server: Any, model: Path, end: int, cache: Path) -> list[str]:
    return [
        sys.executable, __file__, "--deliver", "--model", str(model), "--end", str(end),
        "--port", str(server.port), "--user", server.user, "--key", str(server.client_key),
        "--known-hosts", str(server.known_hosts), "--cache-dir", str(cache),
        "--sshd-pid", str(server.process.pid),
    ]


def run_child(server: Any, model: Path, end: int, cache: Path) -> dict[str, Any]:
    done = subprocess.run(child_command(server, model, end, cache), check=True, capture_output=True, text=True, cwd=REPO)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def interrupt_halfway(server: Any, model: Path, end: int, cache: Path, size: int) -> tuple[int, int]:
    """A delivery whose orchestrator is SIGKILLed once the host's progress
    record vouches for half the stage file (its SSH connection dies with it,
    as a lost link would). Returns (verified bytes recorded when killed,
    verified bytes the host kept for a resume: its record once the agent let
    go of the file; the partial file is fallocated whole, so its size says
    nothing)."""
    if cache.exists():
        clear(cache)
    child = subprocess.Popen(
        child_command(server, model, end, cache), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO
    )
    deadline = time.monotonic() + 600
    written = 0
    try:
        while True:
            partials = list(cache.glob("*.partial")) if cache.exists() else []
            with contextlib.suppress(OSError, ValueError, KeyError, IndexError):  # absent, or being replaced
                written = int(json.loads(Path(f"{partials[0]}.json").read_text())["verified"])
            if written >= size // 2:
                break
            if child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the delivery ended before it could be interrupted halfway")
            time.sleep(0.02)
    finally:
        child.kill()
        child.wait()
    # The receiving agent sees its connection end, writes its last record and
    # closes the partial file, which releases its flock.
    with partials[0].open("rb") as stream:
        while time.monotonic() < deadline:
            try:
                fcntl.flock(stream, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(0.05)
        fcntl.flock(stream, fcntl.LOCK_UN)
    record = json.loads(Path(f"{partials[0]}.json").read_text())
    return written, int(record["verified"])


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
    parser.add_argument("--sshd-pid", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    from ggufpipe_agent import aio  # uvloop, as ggufpipe-tui runs

    if args.deliver:
        print(json.dumps(aio.run(deliver_once(args))))
        return 0

    from ggufpipe_agent.stagefiles.stream import open_stage_stream
    from tests.support.sshd import Sshd

    work = Path(tempfile.mkdtemp(prefix="bench-delivery-", dir=args.work))
    server = None
    try:
        model = write_big_model(work / "bench-delivery.gguf", int(args.size_gib * 2**30))
        end = BLOCKS // 2
        payload = work / "stage.gguf"  # the same bytes, as a file, for cat
        from ggufpipe_agent.gguf.files import read_model_files

        with open_stage_stream(read_model_files(model), 0, end) as stream, payload.open("wb") as out:
            for chunk in stream.chunks():
                out.write(chunk)
        size = payload.stat().st_size
        model.read_bytes() if model.stat().st_size < 2**31 else None  # warm the page cache when it fits
        host_dir = work / "host"
        host_dir.mkdir(mode=0o700)
        cache = work / "host-cache"
        server = Sshd(work / "sshd").start()
        times: dict[str, list[float]] = {name: [] for name in ROWS}
        cpus: dict[str, list[dict[str, float]]] = {name: [] for name in ROWS}
        rows = []
        cipher = ""
        for _ in range(args.repeats):
            for name, sync, forced in (("openssh", False, ""), ("gcm", False, "aes128-gcm@openssh.com")):
                seconds, cpu = openssh_cat(server, payload, host_dir / "cat.out", sync, forced)
                times[name].append(seconds)
                cpus[name].append(cpu)
            seconds, cipher = aio.run(asyncssh_cat(server, payload, host_dir / "asyncssh.out"))
            times["asyncssh"].append(seconds)
            if cache.exists():
                clear(cache)
            row = run_child(server, model, end, cache)
            assert row["outcome"] == "sent" and row["sent"] == size, row
            times["ggufpipe"].append(row["seconds"])
            cpus["ggufpipe"].append(row["cpu"])
            rows.append(row)
            seconds, cpu = openssh_cat(server, payload, host_dir / "cat.out", True)
            times["synced"].append(seconds)
            cpus["synced"].append(cpu)
        again = run_child(server, model, end, cache)
        assert again["outcome"] == "cached" and again["sent"] == 0, again
        written, kept = interrupt_halfway(server, model, end, cache, size)
        resumed = run_child(server, model, end, cache)
        assert resumed["outcome"] == "resumed" and resumed["sent"] == size - kept, (resumed, kept, size)
        load = os.getloadavg()[0]
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)

    def rate(seconds: list[float]) -> float:
        return size / statistics.median(seconds) / 1e6

    def cpu_cell(name: str, *kinds: str) -> str:
        samples = cpus[name]
        if not samples:
            return "-"
        return f"{statistics.median(sum(sample.get(kind, 0.0) for kind in kinds) for sample in samples):.2f}"

    peak = max(row["peak_kib"] - row["rss_kib"] for row in rows) / 1024
    agent_peak = max(row["agent_peak_kib"] - row["agent_rss_kib"] for row in rows) / 1024
    receive_peak = max(row["receive_peak_kib"] for row in rows) / 1024
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
        "| what | median s | MB/s | vs `ssh 'cat > file'` | CPU s, sending side | CPU s, host side |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    base = rate(times["openssh"])
    for name, label in ROWS.items():
        seconds = times[name]
        host_kinds = ("sshd", "cat", "bridge", "agent", "receive", "sync")
        lines.append(
            f"| {label} | {statistics.median(seconds):.2f} | {rate(seconds):.0f} | {rate(seconds) / base:.2f} "
            f"| {cpu_cell(name, 'orchestrator')} | {cpu_cell(name, *host_kinds)} |"
        )
    breakdown = ", ".join(
        f"{kind} {statistics.median(sample.get(kind, 0.0) for sample in cpus['ggufpipe']):.2f}"
        for kind in ("orchestrator", "sshd", "receive", "agent")
    )
    lines += [
        "",
        f"CPU seconds of ggufpipe's delivery by process (medians): {breakdown}; of OpenSSH's: "
        + ", ".join(
            f"{kind} {statistics.median(sample.get(kind, 0.0) for sample in cpus['openssh']):.2f}"
            for kind in ("orchestrator", "sshd", "cat")
        )
        + " (its ssh client in the first column).",
        "",
        f"A second delivery of the same file (the host has it, same digest): {again['seconds']:.2f} s, "
        f"{again['sent']} bytes sent.",
        "",
        f"Interrupted halfway (the orchestrator SIGKILLed, its SSH connection gone, once the host's "
        f"progress record vouched for {written / 2**20:.0f} MiB): the host kept {kept / 2**20:.0f} MiB verified; "
        f"the next delivery resumed there and sent {resumed['sent'] / 2**20:.0f} MiB of "
        f"{size / 2**20:.0f} in {resumed['seconds']:.2f} s (the kept prefix re-hashed on the host first).",
        "",
        "Memory during the delivery (peak RSS above the process's RSS when it began, largest of the "
        f"repeats): the orchestrator +{peak:.0f} MiB (of {rows[-1]['rss_kib'] / 1024:.0f} MiB), the agent "
        f"+{agent_peak:.0f} MiB (of {rows[-1]['agent_rss_kib'] / 1024:.0f} MiB; it only waits meanwhile), "
        f"the receiving process (`ggufpipe-agent receive`) {receive_peak:.0f} MiB in all, for a "
        f"{size / 2**30:.2f} GiB stage file of a {args.size_gib:g} GiB model.",
        "",
        "Per repeat (s): OpenSSH " + ", ".join(f"{s:.2f}" for s in times["openssh"])
        + "; ggufpipe " + ", ".join(f"{s:.2f}" for s in times["ggufpipe"]) + ".",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        (REPO / "docs" / "bench-delivery.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
