"""Pipeline benchmark: ggufpipe against its two ceilings, in one run.

    .venv/bin/python benchmarks/bench_pipeline.py [--repeats 5] [--no-ssh] [--only WORD ...]

References, measured in every round beside the pipelines:
  * llama.cpp itself: the whole model in one context in this process, every
    core (threads = cores);
  * the raw ring (benchmarks/raw_ring.py): the same three stage engines in
    three processes joined in a ring by raw Unix sockets, no protocol and no
    orchestrator: the ceiling of three processes on this machine.

Configurations, 3 stages of SmolLM2-135M with float32 activations: direct
links with the token ring (the default), the relay with the ring, direct links
with the orchestrator feeding tokens back, and the relay with the
orchestrator feeding tokens back; the three stages in one agent process (share_process: true)
with direct links and the ring; locally, over SSH on loopback (one host: Unix links; three
hosts: mutual TLS links; the relay's data channels through exec bridges or,
on a second sshd that allows it, stream-local forwarding). The terminal UI
against headless is benchmarks/bench_tui.py.

For each: prefill of a 512-token prompt, time to first token (a warm
pipeline), decode tokens/s over 128 tokens (EOS ignored), the ratio to one
process and to the raw ring, the per-token overhead against the raw ring and
per link (three links per token: 0->1, 1->2 and the token back to stage 0),
and the stages' own mean step times. Every pipeline is started (and warmed
up) once, with prefix reuse off (every run prefills its whole prompt, as the
references do); then each round samples every configuration in turn, so the
machine's noise hits them alike; medians of --repeats rounds, and the spread
(slowest to fastest decode of a configuration) says how noisy the run was.

Writes docs/bench-pipeline.md and docs/bench-pipeline.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import llama_cpp  # noqa: E402

from benchmarks.raw_ring import RawRing  # noqa: E402
from ggufpipe_agent import aio  # noqa: E402
from ggufpipe_agent.llama.engine import StageEngine, StageShape  # noqa: E402
from ggufpipe_agent.wire.protocol import EngineOptions, SamplingParams  # noqa: E402
from ggufpipe_tui.core.inventory import Inventory, parse_inventory, with_run_options  # noqa: E402
from ggufpipe_tui.session.pipeline import Pipeline  # noqa: E402
from tests.support.common import smollm_path  # noqa: E402
from tests.support.local import long_prompt  # noqa: E402
from tests.support.stage_chain import even_splits  # noqa: E402

CONTEXT = 1024
UBATCH = 512
DECODE = 128
PROMPTS = (128, 512)
STAGES = 3
LINKS = 3  # per token: 0 -> 1, 1 -> 2, and the token back to stage 0


@dataclasses.dataclass
class Sample:
    prefill_ms: float  # the 512-token prompt
    decode_tps: float
    ttft_ms: float
    step_ms: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    # "local", "ssh" (one host), "ssh-hosts" (three), "ssh-forwarding"; "-shared":
    # the host's three stages in one agent process (share_process: true)
    transport: str
    data: str
    feedback: str
    # Environment of the agents this row starts (local rows only: sshd passes none).
    env: tuple[tuple[str, str], ...] = ()


CONFIGS = [
    Config("local, direct, ring", "local", "direct", "ring"),
    Config("local, one process, direct, ring", "local-shared", "direct", "ring"),
    # The same without the chain (ggufpipe_agent/stage/handover.py): what the worker's
    # hand-off through the event loop costs.
    Config("local, one process, no chain (links through sockets)", "local-shared", "direct", "ring", (("GGUFPIPE_NO_CHAIN", "1"),)),
    Config("local, relay, ring", "local", "relay", "ring"),
    Config("local, direct, orchestrator-fed", "local", "direct", "orchestrator"),
    Config("local, relay, orchestrator-fed (the first design's loop)", "local", "relay", "orchestrator"),
    Config("ssh 1 host, direct (unix), ring", "ssh", "direct", "ring"),
    Config("ssh 1 host, one process, ring", "ssh-shared", "direct", "ring"),
    Config("ssh 3 hosts, direct (TLS), ring", "ssh-hosts", "direct", "ring"),
    Config("ssh, relay via exec bridges, ring", "ssh", "relay", "ring"),
    Config("ssh, relay via exec bridges, orchestrator-fed", "ssh", "relay", "orchestrator"),
    Config("ssh, relay via stream-local, orchestrator-fed", "ssh-forwarding", "relay", "orchestrator"),
]


# --------------------------------------------------------------- references


class Single:
    """The whole model in one llama.cpp context, every core."""

    def __init__(self, path: Path) -> None:
        options = EngineOptions(n_ctx=CONTEXT, n_batch=CONTEXT, n_ubatch=UBATCH)
        self.engine = StageEngine(str(path), StageShape(True, True, 30, 576), options)

    def sample(self, prompts: dict[int, list[int]]) -> Sample:
        engine = self.engine
        engine.reset(SamplingParams())
        started = time.perf_counter()
        engine.step(prompts[512])
        prefill = (time.perf_counter() - started) * 1000
        engine.reset(SamplingParams())
        started = time.perf_counter()
        token = engine.step(prompts[128])
        ttft = (time.perf_counter() - started) * 1000
        started = time.perf_counter()
        for _ in range(DECODE):
            token = engine.step([token])  # type: ignore[list-item]
        return Sample(prefill, DECODE / (time.perf_counter() - started), ttft)

    def close(self) -> None:
        self.engine.close()


def ring_sample(ring: RawRing, prompts: dict[int, list[int]]) -> Sample:
    started = time.perf_counter()
    ring.generate(prompts[512], 0)
    prefill = (time.perf_counter() - started) * 1000
    started = time.perf_counter()
    _, rate = ring.generate(prompts[128], DECODE)
    return Sample(prefill, rate, 0.0)


# ---------------------------------------------------------------- pipelines


class Hosts:
    """Inventory host entries for each transport (the sshd servers started here)."""

    def __init__(self, ssh: bool) -> None:
        self.servers: list[Any] = []
        self.entries: dict[str, str] = {
            "local": "  here: {local: true}\n",
            "local-shared": "  here: {local: true, share_process: true}\n",
        }
        self.stage_hosts: dict[str, list[str]] = {"local": ["here"] * STAGES, "local-shared": ["here"] * STAGES}
        if not ssh:
            return
        from tests.support.sshd import Sshd, sshd_missing

        missing = sshd_missing()
        if missing:
            print(f"SSH rows skipped: {missing}")
            return
        agent = f"{sys.executable} -m ggufpipe_agent"
        cache = os.environ["GGUFPIPE_CACHE_DIR"]

        def entry(name: str, server: Any, extra: str = "") -> str:
            return (
                f"  {name}: {{address: 127.0.0.1, port: {server.port}, user: {server.user}, "
                f"identity: {server.client_key}, known_hosts: {server.known_hosts}, agent: '{agent}', "
                f"cache_dir: {cache}{extra}}}\n"
            )

        # Every pipeline is started up front, in one event loop, and the SSH
        # transport shares one connection per host within a loop: sessions of
        # several pipelines add up past sshd's default MaxSessions of 10.
        plain = Sshd(Path(tempfile.mkdtemp(prefix="ggufpipe-bench-sshd-")), max_sessions=64).start()
        forwarding = Sshd(
            Path(tempfile.mkdtemp(prefix="ggufpipe-bench-sshd-")), forwarding=True, max_sessions=64
        ).start()
        self.servers = [plain, forwarding]
        self.entries["ssh"] = entry("gpu", plain)
        self.stage_hosts["ssh"] = ["gpu"] * STAGES
        self.entries["ssh-shared"] = entry("gpu", plain, ", share_process: true")
        self.stage_hosts["ssh-shared"] = ["gpu"] * STAGES
        self.entries["ssh-hosts"] = "".join(entry(f"gpu-{c}", plain) for c in "abc")
        self.stage_hosts["ssh-hosts"] = [f"gpu-{c}" for c in "abc"]
        self.entries["ssh-forwarding"] = entry("gpu", forwarding)
        self.stage_hosts["ssh-forwarding"] = ["gpu"] * STAGES

    def inventory(self, config: Config) -> Inventory:
        text = (
            f"model: {{path: {smollm_path()}}}\n"
            f"hosts:\n{self.entries[config.transport]}"
            "stages:\n" + "".join(f"  - {{host: {h}}}\n" for h in self.stage_hosts[config.transport]) + "run: {"
            f"context: {CONTEXT}, ubatch: {UBATCH}, chat: false, ignore_eos: true, feedback: {config.feedback}"
            "}\n"
            f"data: {config.data}\n"
            # The references run in this process's event loop and hold it for
            # tens of seconds on a busy machine: the idle pipelines' agents must
            # not take that for a frozen orchestrator (heartbeat) and leave.
            "timeouts: {connect: 30, ready: 300, step: 120, teardown: 15, heartbeat: 900}\n"
        )
        return parse_inventory(text, REPO / "benchmarks" / "bench.yaml")

    def close(self) -> None:
        for server in self.servers:
            server.stop()


async def start_pipeline(inventory: Inventory, prompts: dict[int, list[int]], log_dir: str) -> Pipeline:
    # Cold runs: every round prefills its prompts whole, as the references do
    # (prefix reuse would keep the shared start of the 128- and 512-token prompts).
    pipeline = Pipeline(inventory, lambda event: None, log_dir=log_dir, prefix_reuse=False)
    try:
        await pipeline.start()
        pipeline.inventory = with_run_options(inventory, max_tokens=4)
        await pipeline.generate_tokens(prompts[128][:32])  # warm-up: loads every stage
    except BaseException:
        await pipeline.close()
        raise
    return pipeline


async def pipeline_sample(pipeline: Pipeline, inventory: Inventory, prompts: dict[int, list[int]]) -> Sample:
    pipeline.inventory = with_run_options(inventory, max_tokens=1)
    result = await pipeline.generate_tokens(prompts[512])
    assert result.ok, result.failure
    prefill = result.timings.prefill_ms
    pipeline.inventory = with_run_options(inventory, max_tokens=DECODE + 1)
    result = await pipeline.generate_tokens(prompts[128])
    assert result.ok and len(result.tokens) == DECODE + 1, result.failure
    t = result.timings
    return Sample(prefill, t.decode_tokens_per_s, t.ttft_ms, t.stage_mean_step_ms)


# ------------------------------------------------------------------- output


def med(samples: list[Sample], field: str) -> float:
    return statistics.median(getattr(s, field) for s in samples)


def spread(samples: list[Sample]) -> str:
    rates = [s.decode_tps for s in samples]
    return f"{min(rates):.1f}-{max(rates):.1f}"


def table(results: dict[str, list[Sample]], single: list[Sample], ring: list[Sample], repeats: int) -> str:
    base_tps, ring_tps = med(single, "decode_tps"), med(ring, "decode_tps")
    base_prefill = med(single, "prefill_ms")
    lines = [
        "| configuration | prefill 512 ms | ratio | TTFT ms | decode tok/s (spread) | vs 1 process | vs raw ring "
        "| overhead vs ring ms/token | per link µs | stage steps ms (mean, per token) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        f"| llama.cpp, one process, {os.cpu_count()} threads | {base_prefill:.1f} | 1.000 "
        f"| {med(single, 'ttft_ms'):.1f} | {base_tps:.1f} ({spread(single)}) | 1.000 "
        f"| {base_tps / ring_tps:.3f} | | | {1000 / base_tps:.2f} (whole model) |",
        f"| raw ring: 3 processes, Unix sockets, no protocol | {med(ring, 'prefill_ms'):.1f} "
        f"| {med(ring, 'prefill_ms') / base_prefill:.3f} | | {ring_tps:.1f} ({spread(ring)}) "
        f"| {ring_tps / base_tps:.3f} | 1.000 | 0.00 | 0 | {1000 / ring_tps:.2f} per token |",
    ]
    for name, samples in results.items():
        tps = med(samples, "decode_tps")
        prefill = med(samples, "prefill_ms")
        steps = [statistics.median(s.step_ms[i] for s in samples) for i in range(len(samples[0].step_ms))]
        overhead = 1000 / tps - 1000 / ring_tps
        prefill_cells = f"{prefill:.1f} | {prefill / base_prefill:.3f}" if prefill else " | "
        lines.append(
            f"| {name} | {prefill_cells} | {med(samples, 'ttft_ms'):.1f} | {tps:.1f} ({spread(samples)}) "
            f"| {tps / base_tps:.3f} | {tps / ring_tps:.3f} | {overhead:.2f} | {overhead / LINKS * 1000:.0f} "
            f"| {' + '.join(f'{ms:.2f}' for ms in steps)} = {sum(steps):.2f} of {1000 / tps:.2f} |"
        )
    load = os.getloadavg()
    header = (
        f"SmolLM2-135M-Instruct Q4_1 (30 blocks, hidden 576), {STAGES} stages split evenly, float32 "
        f"activations, context {CONTEXT}, ubatch {UBATCH}, {DECODE} decode tokens with EOS ignored, median "
        f"of {repeats} rounds that interleave every row (every pipeline started and warmed up once, prefix "
        "reuse off), "
        f"{os.cpu_count()} cores ({platform.machine()}), llama-cpp-python "
        f"{llama_cpp.__version__}, agents on every core each. Load average at the end "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1/5/15 min): others use this machine too; the "
        "spread column (slowest to fastest round) says how much that moved a row. Overhead vs ring = "
        "pipeline ms/token - raw ring ms/token; per link = that over the 3 links a token crosses."
    )
    return header + "\n\n" + "\n".join(lines) + "\n"


def plot(results: dict[str, list[Sample]], single: list[Sample], ring: list[Sample], path: Path) -> bool:
    """The plot, where matplotlib is installed (``pip install -e .[bench]``); False where not."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    ring_tps = med(ring, "decode_tps")
    base_tps = med(single, "decode_tps")
    ratios = [med(results[n], "decode_tps") / ring_tps for n in names]
    fig, axis = plt.subplots(figsize=(11, 6.5))
    axis.barh(names, ratios, color=["#4c78a8" if "relay" not in n else "#f58518" for n in names])
    axis.axvline(1.0, color="black", linewidth=1, label="raw ring (3 processes, Unix sockets)")
    axis.axvline(base_tps / ring_tps, color="#54a24b", linewidth=1, label="one llama.cpp process")
    axis.axvline(0.95, color="#e45756", linestyle="--", linewidth=1, label="target 0.95 (local)")
    axis.axvline(0.90, color="#e45756", linestyle=":", linewidth=1, label="target 0.90 (SSH)")
    axis.set_xlabel("decode tokens/s, ratio to the raw ring")
    axis.legend(loc="lower right", fontsize=8)
    axis.invert_yaxis()
    fig.suptitle(f"ggufpipe, 3 stages of SmolLM2-135M on {os.cpu_count()} CPU cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


async def main_async(args: argparse.Namespace) -> int:
    model = smollm_path()
    prompts = {n: long_prompt(model, n) for n in PROMPTS}
    log_dir = tempfile.mkdtemp(prefix="ggufpipe-bench-")
    os.environ.setdefault("GGUFPIPE_CACHE_DIR", os.path.join(log_dir, "stages"))
    hosts = Hosts(ssh=not args.no_ssh)
    configs = [
        c for c in CONFIGS if c.transport in hosts.entries and (not args.only or any(w in c.name for w in args.only))
    ]
    single = Single(model)
    ring = RawRing(model, even_splits(30, STAGES))
    results: dict[str, list[Sample]] = {c.name: [] for c in configs}
    singles: list[Sample] = []
    rings: list[Sample] = []
    pipelines: dict[str, Pipeline] = {}
    try:
        for config in configs:
            print(f"starting {config.name} ...", flush=True)
            saved = {name: os.environ.get(name) for name, _ in config.env}
            os.environ.update(dict(config.env))
            try:
                pipelines[config.name] = await start_pipeline(hosts.inventory(config), prompts, log_dir)
            finally:
                for name, value in saved.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
        for round_ in range(args.repeats):
            print(f"round {round_ + 1} of {args.repeats}", flush=True)
            singles.append(single.sample(prompts))
            rings.append(ring_sample(ring, prompts))
            print(f"  one process: {singles[-1].decode_tps:.1f} tok/s, raw ring: {rings[-1].decode_tps:.1f}")
            for config in configs:
                sample = await pipeline_sample(pipelines[config.name], hosts.inventory(config), prompts)
                results[config.name].append(sample)
                print(f"  {config.name}: {sample.decode_tps:.1f} tok/s", flush=True)
    finally:
        for pipeline in pipelines.values():
            await pipeline.close()
        single.close()
        ring.close()
        hosts.close()
    report = table(results, singles, rings, args.repeats)
    print()
    print(report)
    if args.no_write:
        return 0
    docs = REPO / "docs"
    command = "python benchmarks/bench_pipeline.py" + (f" --repeats {args.repeats}" if args.repeats != 5 else "")
    command += " --no-ssh" * args.no_ssh + (" --only " + " ".join(args.only) if args.only else "")
    drawn = plot(results, singles, rings, docs / "bench-pipeline.png")
    where = (
        "[plot](bench-pipeline.png)"
        if drawn
        else "the plot needs `pip install -e .[bench]`; this run had no matplotlib, so none was drawn"
    )
    (docs / "bench-pipeline.md").write_text(
        "# Pipeline benchmark\n\n" f"Measured {time.strftime('%Y-%m-%d')} with `{command}` ({where}).\n\n" + report
    )
    print(f"written to {docs / 'bench-pipeline.md'}" + (f" and {docs / 'bench-pipeline.png'}" if drawn else ""))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-ssh", action="store_true", help="skip the SSH rows")
    parser.add_argument("--only", nargs="*", help="only the rows whose name has one of these words")
    parser.add_argument("--no-write", action="store_true", help="print the table, leave docs/ alone")
    return aio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
