"""The memory estimate against what llama.cpp allocates (real SmolLM2 and
Gemma 3 270M), what a host reports (cgroup limits), and the inventory's
``memory:`` key."""

from __future__ import annotations

from pathlib import Path

import pytest

from ggufpipe_agent.gguf.facts import read_model_facts
from ggufpipe_agent.gguf.memory import estimate_stage, memory_facts_of
from ggufpipe_agent.process.host_memory import system_memory
from ggufpipe_tui.core.inventory import InventoryError, RunOptions, parse_inventory
from ggufpipe_tui.core.plan import engine_options
from ggufpipe_tui.core.yamlnodes import parse_size
from tests.support.llama_buffers import load_and_report, resident_anonymous
from tests.support.stage_chain import even_splits

TOLERANCE = 0.10


def close(estimate: int, reported: int) -> bool:
    return abs(estimate - reported) <= TOLERANCE * reported


def check_against_llama_cpp(
    path: Path, context: int, ubatch: int, split: list[tuple[int, int]], cache: Path | None = None
) -> list[str]:
    """Every stage of the whole model and of a three-stage split: weights, KV
    cache, compute buffer, output buffer and their sum within 10 % of
    llama.cpp's own figures. Returns the failures."""
    facts = read_model_facts(path)
    memory = memory_facts_of(facts)
    options = engine_options(RunOptions(context=context, ubatch=ubatch), facts)
    failures = []
    for splits in ([(0, facts.block_count)], split):
        for start, end in splits:
            reported, engine = load_and_report(path, start, end, options, cache)
            engine.close()
            host = estimate_stage(memory, start, end, options).host
            # The output buffer as llama.cpp makes it holds one row of logits;
            # a non-last stage's grows later (test below).
            made = memory.n_vocab * 4
            pairs = {
                "weights": (host.weights, reported.model),
                "KV cache": (host.kv, reported.kv),
                "compute": (host.compute, reported.compute),
                "output": (made, reported.output),
                "total": (host.weights + host.kv + host.compute + made, reported.total),
            }
            for name, (estimate, logged) in pairs.items():
                if not close(estimate, logged):
                    failures.append(f"[{start}, {end}) {name}: estimate {estimate}, llama.cpp {logged}")
    return failures


@pytest.mark.model
def test_smollm2_estimate_matches_llama_cpp(model_path, tmp_path):
    assert check_against_llama_cpp(model_path, 2048, 512, even_splits(30, 3), tmp_path) == []


@pytest.mark.model
@pytest.mark.slow
def test_gemma3_estimate_matches_llama_cpp(gemma3_path):
    # Sliding-window and global blocks in every stage, a 262k vocabulary. The
    # split of the architecture tests, whose stage files the session's cache
    # keeps (each carries the 170 MiB token_embd: slow to write).
    split = [(0, 5), (5, 11), (11, 18)]
    assert check_against_llama_cpp(gemma3_path, 1024, 512, split) == []


@pytest.mark.model
def test_a_middle_stage_output_buffer_grows_as_estimated(model_path, tmp_path):
    """A non-last stage flags every row as an output, so llama.cpp sizes its
    logits buffer for a whole batch after a long prefill (it logs nothing)."""
    facts = read_model_facts(model_path)
    options = engine_options(RunOptions(context=1024, ubatch=512), facts)
    _, engine = load_and_report(model_path, 0, 10, options, tmp_path)
    try:
        before = resident_anonymous()
        engine.step(list(range(10, 10 + options.n_batch)))
        grown = resident_anonymous() - before
    finally:
        engine.close()
    estimate = estimate_stage(memory_facts_of(facts), 0, 10, options).host.outputs
    assert estimate == options.n_batch * facts.vocab_size * 4
    assert close(estimate, grown), (estimate, grown)


# ------------------------------------------------------------------ hosts


def fake_root(tmp_path: Path, files: dict[str, str]) -> Path:
    meminfo = "MemTotal:       32000000 kB\nMemFree:  1000 kB\nMemAvailable:   30000000 kB\n"
    for name, text in {"proc/meminfo": meminfo, **files}.items():
        target = tmp_path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return tmp_path


def test_host_memory_without_a_cgroup_limit(tmp_path):
    root = fake_root(tmp_path, {"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/memory.max": "max\n"})
    assert system_memory(root) == (32000000 * 1024, 30000000 * 1024)


def test_host_memory_within_a_cgroup_v2_limit(tmp_path):
    limit = 8 << 30
    root = fake_root(
        tmp_path,
        {
            "proc/self/cgroup": "0::/docker/abc\n",
            "sys/fs/cgroup/docker/abc/memory.max": f"{limit}\n",
            "sys/fs/cgroup/docker/abc/memory.current": f"{3 << 30}\n",
            # page cache the kernel reclaims before it kills anyone
            "sys/fs/cgroup/docker/abc/memory.stat": f"anon 1000\ninactive_file {1 << 30}\n",
        },
    )
    assert system_memory(root) == (limit, limit - (2 << 30))


def test_host_memory_within_a_container_cgroup_v1_limit(tmp_path):
    root = fake_root(
        tmp_path,
        {
            "proc/self/cgroup": "4:memory:/kubepods/pod1\n1:cpu:/\n",
            # the container sees its own cgroup at the mount's root
            "sys/fs/cgroup/memory/memory.limit_in_bytes": f"{4 << 30}\n",
            "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{1 << 30}\n",
            "sys/fs/cgroup/memory/memory.stat": "cache 0\ntotal_inactive_file 0\n",
        },
    )
    assert system_memory(root) == (4 << 30, 3 << 30)


def test_a_cgroup_v1_without_a_limit_says_a_huge_number(tmp_path):
    root = fake_root(
        tmp_path,
        {
            "proc/self/cgroup": "4:memory:/\n",
            "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
            "sys/fs/cgroup/memory/memory.usage_in_bytes": "5238521856\n",
        },
    )
    assert system_memory(root) == (32000000 * 1024, 30000000 * 1024)


def test_this_host_reports_some_memory():
    total, available = system_memory()
    assert 0 < available <= total


# -------------------------------------------------------------- inventory


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("12GiB", 12 << 30),
        ("12 GiB", 12 << 30),
        ("12Gi", 12 << 30),
        ("16GB", 16 * 10**9),
        ("512MiB", 512 << 20),
        ("512MB", 512 * 10**6),
        ("1.5GiB", 3 << 29),
        ("1073741824", 1 << 30),
    ],
)
def test_memory_sizes(text, size):
    assert parse_size(text) == size


def inventory_with(memory: str) -> str:
    return f"model: {{path: m.gguf}}\nhosts:\n  here: {{local: true, memory: {memory}}}\nstages:\n  - {{host: here}}\n"


def test_a_host_memory_cap_is_read_from_the_inventory():
    inventory = parse_inventory(inventory_with("12GiB"), Path("inv.yaml"))
    assert inventory.hosts["here"].memory == 12 << 30
    assert parse_inventory(inventory_with("8589934592"), Path("inv.yaml")).hosts["here"].memory == 8 << 30


@pytest.mark.parametrize("bad", ["12XB", "lots", "-1GiB", "0", "[1, 2]"])
def test_a_bad_memory_cap_names_the_key_and_line(bad):
    with pytest.raises(InventoryError, match=r"inv\.yaml:3: hosts\.here\.memory: "):
        parse_inventory(inventory_with(bad), Path("inv.yaml"))
