"""Soak: many consecutive prompts through one warm pipeline, memory and file
descriptors of every process sampled.

    .venv/bin/python benchmarks/soak.py [--local 1000] [--ssh 200] [--every 10]

One pipeline of 3 local stages (SmolLM2-135M split [0, 10), [10, 20), [20, 30))
serves --local prompts one after the other; then one pipeline of 3 stages
over SSH (a real OpenSSH server on loopback, started here; two hosts, one
connection each) serves --ssh prompts. Prompts are short ("Prompt N:", raw,
4 tokens each), so the soak exercises what every run does (plan, provision,
edge setup, prefill, decode, teardown, run log) rather than llama.cpp. Every
--every prompts the orchestrator's (this process) and each agent's resident
memory (VmRSS) and open descriptors (/proc/PID/fd) are sampled. The first
--warmup prompts are the warm-up: growth is measured from the first sample
after them to the last one.

Target (docs/performance.md, "Soak: a long session of prompts"): no failed run, RSS within 5 %, descriptors flat. Writes
docs/soak.md and docs/soak.png.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import contextlib
import ctypes
import dataclasses
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ggufpipe_tui.core.inventory import parse_inventory  # noqa: E402
from ggufpipe_tui.session.pipeline import Pipeline  # noqa: E402
from tests.support.common import smollm_path  # noqa: E402

RANGES = ((0, 10), (10, 20), (20, 30))
MAX_TOKENS = 4


@dataclasses.dataclass
class Series:
    """One process's samples: prompt number, RSS in bytes, open descriptors."""

    name: str
    pid: int
    # Arrays, not lists: the soak's own bookkeeping must not show up in the
    # orchestrator's count of Python objects (a list of ints would, by one
    # object per sample).
    prompts: array.array[int] = dataclasses.field(default_factory=lambda: array.array("q"))
    rss: array.array[int] = dataclasses.field(default_factory=lambda: array.array("q"))
    fds: array.array[int] = dataclasses.field(default_factory=lambda: array.array("q"))
    blocks: array.array[int] = dataclasses.field(default_factory=lambda: array.array("q"))  # this process: Python's heap
    trimmed: int = 0  # this process only: RSS at the end once glibc has returned its free pages

    def sample(self, prompt: int) -> None:
        self.prompts.append(prompt)
        self.rss.append(rss_bytes(self.pid))
        self.fds.append(len(os.listdir(f"/proc/{self.pid}/fd")))
        if self.pid == os.getpid():
            gc.collect()
            self.blocks.append(sys.getallocatedblocks())


@dataclasses.dataclass
class Phase:
    name: str
    prompts: int
    series: list[Series]
    failed: list[str]
    seconds: float
    run_ms: array.array[float]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def inventory_text(model: Path, hosts: str, host_names: tuple[str, ...], log: Path) -> str:
    stages = "".join(
        f"  - {{host: {host}, layers: [{start}, {end}]}}\n"
        for host, (start, end) in zip(host_names, RANGES, strict=True)
    )
    return (
        f"model: {{path: {model}}}\nhosts:\n{hosts}stages:\n{stages}"
        f"run: {{context: 128, ubatch: 64, max_tokens: {MAX_TOKENS}, ignore_eos: true, chat: false}}\n"
        "timeouts: {connect: 30, ready: 300, step: 60, teardown: 10}\n"
    )


async def soak(name: str, text: str, prompts: int, every: int, log_dir: Path) -> Phase:
    inventory = parse_inventory(text, log_dir / f"{name}.yaml")
    pipeline = Pipeline(inventory, lambda event: None, log_dir=log_dir / name)
    failed: list[str] = []
    run_ms = array.array("d")
    started = time.monotonic()
    await pipeline.start()
    try:
        series = [Series("orchestrator", os.getpid())]
        for index, link in enumerate(pipeline.links):
            assert link.hello is not None
            series.append(Series(f"agent {index}", link.hello.pid))
        for number in range(1, prompts + 1):
            begun = time.perf_counter()
            result = await pipeline.generate(f"Prompt {number}:")
            run_ms.append((time.perf_counter() - begun) * 1000)
            if result.outcome != "completed" or len(result.tokens) != MAX_TOKENS:
                failed.append(f"prompt {number}: {result.outcome} {result.failure}")
            if number == 1 or number % every == 0:
                for one in series:
                    one.sample(number)
            if number % 100 == 0:
                print(f"  {name}: {number}/{prompts} prompts, {len(failed)} failed", flush=True)
        # What of the orchestrator's growth is memory glibc keeps after it was
        # freed (not a leak: Python's allocated blocks are flat) shows here.
        gc.collect()
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        series[0].trimmed = rss_bytes(os.getpid())
    finally:
        await pipeline.close()
    return Phase(name, prompts, series, failed, time.monotonic() - started, run_ms)


def growth(series: Series, warmup: int) -> tuple[int, int, float, int, int]:
    """RSS and descriptors at the first sample after the warm-up and at the end."""
    first = next(i for i, prompt in enumerate(series.prompts) if prompt >= warmup)
    start, end = series.rss[first], series.rss[-1]
    return start, end, (end - start) / start * 100, series.fds[first], series.fds[-1]


def table(phases: list[Phase], warmup: int) -> str:
    mib = 1 << 20
    lines = [
        "| transport | process | RSS after warm-up | RSS at the end | change | RSS max | descriptors (after warm-up -> end, max) |",
        "|---|---|---|---|---|---|---|",
    ]
    for phase in phases:
        for one in phase.series:
            start, end, change, fds_start, fds_end = growth(one, warmup)
            lines.append(
                f"| {phase.name} | {one.name} | {start / mib:.1f} MiB | {end / mib:.1f} MiB | "
                f"{change:+.1f} % | {max(one.rss) / mib:.1f} MiB | {fds_start} -> {fds_end}, {max(one.fds)} |"
            )
    lines += [
        "",
        "| transport | orchestrator's Python heap (allocated blocks, after warm-up -> end) | its RSS at the end after malloc_trim |",
        "|---|---|---|",
    ]
    for phase in phases:
        own = phase.series[0]
        first = next(i for i, prompt in enumerate(own.prompts) if prompt >= warmup)
        lines.append(
            f"| {phase.name} | {own.blocks[first]:,} -> {own.blocks[-1]:,} "
            f"({(own.blocks[-1] - own.blocks[first]) / own.blocks[first] * 100:+.2f} %) | {own.trimmed / mib:.1f} MiB |"
        )
    lines += ["", "| transport | prompts | failed runs | wall time | run time, median (p95) |", "|---|---|---|---|---|"]
    for phase in phases:
        ordered = sorted(phase.run_ms)
        p95 = ordered[int(len(ordered) * 0.95) - 1]
        lines.append(
            f"| {phase.name} | {phase.prompts} | {len(phase.failed)} | {phase.seconds:.0f} s | "
            f"{statistics.median(phase.run_ms):.0f} ms ({p95:.0f} ms) |"
        )
    return "\n".join(lines)


def plot(phases: list[Phase], warmup: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(phases), figsize=(6 * len(phases), 6.5), squeeze=False)
    for column, phase in enumerate(phases):
        memory, descriptors = axes[0][column], axes[1][column]
        for one in phase.series:
            memory.plot(one.prompts, [value / (1 << 20) for value in one.rss], label=one.name, linewidth=1.2)
            descriptors.plot(one.prompts, one.fds, label=one.name, linewidth=1.2)
        for axis in (memory, descriptors):
            axis.axvline(warmup, color="grey", linestyle=":", linewidth=1)
            axis.grid(alpha=0.3)
        memory.set_title(f"{phase.name}: {phase.prompts} prompts, {len(phase.failed)} failed")
        memory.set_ylabel("RSS (MiB)")
        memory.set_ylim(bottom=0)
        descriptors.set_ylabel("open descriptors")
        descriptors.set_xlabel("prompt")
        descriptors.set_ylim(bottom=0)
        memory.legend(fontsize=8, loc="lower right")
    fig.suptitle("ggufpipe soak: one warm pipeline, consecutive prompts (dotted: end of warm-up)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main_async(args: argparse.Namespace) -> int:
    model = smollm_path()
    work = Path(tempfile.mkdtemp(prefix="ggufpipe-soak-"))
    os.environ.setdefault("GGUFPIPE_CACHE_DIR", str(work / "stages"))
    phases: list[Phase] = []
    if args.local:
        hosts = "  here: {local: true, threads: 1}\n"
        print(f"local: {args.local} prompts through 3 local stages", flush=True)
        text = inventory_text(model, hosts, ("here", "here", "here"), work)
        phases.append(await soak("local", text, args.local, args.every, work))
    if args.ssh:
        from tests.support.sshd import Sshd, sshd_missing

        missing = sshd_missing()
        if missing:
            raise SystemExit(f"the SSH phase needs OpenSSH: {missing}")
        sshd = Sshd(work / "sshd").start()
        try:
            agent = f"{sys.executable} -m ggufpipe_agent"
            entry = (
                f"{{address: 127.0.0.1, port: {sshd.port}, user: {sshd.user}, identity: {sshd.client_key}, "
                f"known_hosts: {sshd.known_hosts}, agent: '{agent}', cache_dir: {os.environ['GGUFPIPE_CACHE_DIR']}, "
                "threads: 1}"
            )
            hosts = f"  gpu-a: {entry}\n  gpu-b: {entry}\n"
            print(f"ssh: {args.ssh} prompts through 3 stages over SSH", flush=True)
            text = inventory_text(model, hosts, ("gpu-a", "gpu-b", "gpu-a"), work)
            phases.append(await soak("ssh", text, args.ssh, args.every, work))
        finally:
            sshd.stop()
    report = table(phases, args.warmup)
    print()
    print(report)
    for phase in phases:
        for failure in phase.failed[:10]:
            print(f"{phase.name} failed: {failure}")
    if args.no_write:
        return 0
    docs = REPO / "docs"
    command = "python benchmarks/soak.py" + "".join(
        f" --{key} {value}"
        for key, value in (("local", args.local), ("ssh", args.ssh), ("every", args.every), ("warmup", args.warmup))
        if value != DEFAULTS[key]
    )
    (docs / "soak.md").write_text(
        "# Soak: a long session of prompts\n\n"
        f"Measured {time.strftime('%Y-%m-%d')} on {os.cpu_count()} CPU cores with `{command}` "
        "([plot](soak.png)). One warm pipeline per transport (3 stages of SmolLM2-135M, one "
        f"thread each), short prompts of {MAX_TOKENS} generated tokens each, one after the other; "
        f"every {args.every} prompts the resident memory (VmRSS) and open descriptors of the "
        "orchestrator (the script's own process) and of each agent are sampled. Growth is from "
        f"the first sample after a warm-up of {args.warmup} prompts to the last. Target: no failed "
        "run, RSS within 5 %, descriptors flat.\n\n" + report + "\n\n" + READING + "\n"
    )
    plot(phases, args.warmup, docs / "soak.png")
    print(f"written to {docs / 'soak.md'} and {docs / 'soak.png'}")
    return 1 if any(phase.failed for phase in phases) else 0


DEFAULTS = {"local": 1000, "ssh": 200, "every": 10, "warmup": 50}
READING = """\
Reading the figures: the agents' RSS includes their stage of the model
(llama.cpp's weights and KV cache) and stays where the warm-up left it, within
1 %. The orchestrator's own objects are counted by Python's allocated blocks,
which stay flat; its RSS also counts heap pages glibc keeps after they were
freed, which `malloc_trim` hands back (its RSS after that is the last column
of the second table). Descriptors do not move: a run's log file and streams
are closed with the run or kept for the session, never one more per prompt.
The run time is what every run costs on a warm pipeline on this shared 2-core
machine (tokenize, plan, provision, edge setup, prefill, 4 decode steps,
teardown, run log); it is not a speed figure (see bench-pipeline.md)."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local", type=int, default=DEFAULTS["local"], help="prompts through local stages")
    parser.add_argument("--ssh", type=int, default=DEFAULTS["ssh"], help="prompts through SSH stages")
    parser.add_argument("--every", type=int, default=DEFAULTS["every"], help="sample every N prompts")
    parser.add_argument("--warmup", type=int, default=DEFAULTS["warmup"], help="prompts before growth counts")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
