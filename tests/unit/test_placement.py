"""The placement: a pure function of the inventory, the model's facts and the
agents' Hellos. Tables of hosts and caps; no processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from ggufpipe_agent.gguf.memory import GIB, MIB, estimate_stage
from ggufpipe_agent.wire.protocol import Device, EngineOptions, Hello, MemoryFacts, ModelFacts
from ggufpipe_tui.core.inventory import InventoryError, parse_inventory
from ggufpipe_tui.core.placement import MARGIN, RAM, Placement, PlacementError, evaluate, place_stages
from ggufpipe_tui.core.plan import build_plan

BLOCKS = 20
MEMORY = MemoryFacts(
    block_bytes=(100 * MIB,) * BLOCKS,
    token_embd_bytes=200 * MIB,
    output_norm_bytes=1 * MIB,
    output_bytes=0,
    global_bytes=0,
    kv_widths=(2048,) * BLOCKS,  # 4 KV heads of 128, K and V
    swa_blocks=(False,) * BLOCKS,
    sliding_window=0,
    n_embd=2048,
    n_vocab=32000,
    n_ff=8192,
    q_width=2048,
)
FACTS = ModelFacts(
    path="/m.gguf",
    name="test",
    architecture="llama",
    file_type="Q4_K",
    file_size=2200 * MIB,
    block_count=BLOCKS,
    hidden_dim=2048,
    context_length=8192,
    vocab_size=32000,
    head_count=16,
    head_count_kv=4,
    key_length=128,
    value_length=128,
    bos_token_id=1,
    eos_token_id=2,
    eog_token_ids=(2,),
    add_bos=False,
    chat_template="",
    block_bytes=MEMORY.block_bytes,
    embedding_bytes=200 * MIB,
    output_bytes=1 * MIB,
    memory=MEMORY,
)


def hello(ram: int = 64 * GIB, gpus: tuple[tuple[int, int], ...] = ()) -> Hello:
    """An agent's Hello: RAM available, GPUs as (total, free)."""
    return Hello(
        protocol=2,
        version="0.1.0",
        hostname="h",
        pid=1,
        python="3.11",
        llama_cpp="0.3.36",
        backend="cuda" if gpus else "cpu",
        gpu_offload=bool(gpus),
        devices=tuple(Device(f"CUDA{i}", f"GPU {i}", total, free) for i, (total, free) in enumerate(gpus)),
        memory_total=ram,
        memory_available=ram,
        data_endpoint="unix:/x",
        data_token="t",
    )


def inventory(hosts: str, stages: str, run: str = "context: 4096"):
    text = f"model: {{path: m.gguf}}\nhosts:\n{hosts}stages:\n{stages}run: {{{run}}}\n"
    return parse_inventory(text, Path("inv.yaml"))


def tiles(placement: Placement) -> bool:
    ranges = placement.ranges
    return (
        ranges[0][0] == 0
        and ranges[-1][1] == BLOCKS
        and all(a[1] == b[0] and a[0] < a[1] for a, b in zip(ranges, ranges[1:], strict=False))
    )


def block_cost(options: EngineOptions) -> int:
    cells = -(-options.n_ctx // 256) * 256
    return 100 * MIB + cells * 2048 * 2


# ------------------------------------------------------ proportional split


@pytest.mark.parametrize(
    ("caps", "stage_hosts"),
    [
        (("2GiB", "4GiB"), "ab"),
        (("4GiB", "2GiB"), "ab"),
        (("3GiB", "3GiB"), "ab"),
        (("1600MiB", "6GiB"), "ab"),
        (("2GiB", "5GiB"), "abb"),  # b's two stages share its cap
        (("5GiB", "2GiB"), "aab"),
    ],
)
def test_ranges_follow_the_room_each_stage_has(caps, stage_hosts):
    hosts = "".join(
        f"  {name}: {{local: true, memory: {cap}}}\n" for name, cap in zip("ab", caps, strict=True)
    )
    stages = "".join(f"  - {{host: {host}}}\n" for host in stage_hosts)
    inv = inventory(hosts, stages)
    placement = place_stages(inv, FACTS, [hello()] * len(stage_hosts))
    assert placement.automatic and placement.fits and tiles(placement)
    # Each stage's room: its host's usable memory (shared by the host's
    # stages), less the stage's fixed parts; its blocks in that proportion.
    cost = block_cost(placement.engine)
    rooms = []
    for stage in placement.stages:
        pool = placement.pool(stage.host, RAM)
        sharing = pool.stages
        fixed = sum(
            placement.stages[i].needed
            - (placement.stages[i].layers[1] - placement.stages[i].layers[0]) * cost
            for i in sharing
        )
        rooms.append((pool.usable / (1 + MARGIN) - fixed) / len(sharing))
    for stage, room in zip(placement.stages, rooms, strict=True):
        expected = BLOCKS * room / sum(rooms)
        blocks = stage.layers[1] - stage.layers[0]
        assert abs(blocks - expected) <= 1.0, (stage.index, blocks, expected, placement.ranges)


def test_a_bigger_cap_gets_more_blocks():
    hosts = "  a: {local: true, memory: 2GiB}\n  b: {local: true, memory: 4GiB}\n"
    small = place_stages(inventory(hosts, "  - {host: a}\n  - {host: b}\n"), FACTS, [hello()] * 2)
    assert small.ranges == ((0, 5), (5, 20))
    assert small.stages[0].available == 2 * GIB and small.stages[1].available == 4 * GIB


def test_without_caps_the_free_memory_less_the_reserve_is_the_room():
    hosts = "  a: {local: true}\n  b: {local: true}\n"
    placement = place_stages(
        inventory(hosts, "  - {host: a}\n  - {host: b}\n"), FACTS, [hello(3 * GIB), hello(6 * GIB)]
    )
    pools = [placement.pool(name, RAM) for name in "ab"]
    assert [pool.usable for pool in pools] == [3 * GIB - 512 * MIB, 6 * GIB - 512 * MIB]
    assert placement.stages[0].layers[1] < BLOCKS // 2


def test_stages_on_one_host_share_its_memory():
    hosts = "  a: {local: true, memory: 6GiB}\n"
    placement = place_stages(inventory(hosts, "  - {host: a}\n  - {host: a}\n"), FACTS, [hello()] * 2)
    pool = placement.pool("a", RAM)
    assert pool.stages == (0, 1)
    assert pool.needed == sum(stage.needed for stage in placement.stages)


def test_unknown_hosts_are_split_by_the_blocks_and_not_checked():
    hosts = "  a: {local: true}\n  b: {local: true}\n"
    placement = place_stages(inventory(hosts, "  - {host: a}\n  - {host: b}\n"), FACTS, [None, None])
    assert placement.ranges == ((0, 10), (10, 20))
    assert all(stage.available == -1 for stage in placement.stages)


def test_more_stages_than_blocks_is_an_inventory_error():
    hosts = "  a: {local: true}\n"
    with pytest.raises(InventoryError, match="21 stages for a model of only 20 blocks"):
        place_stages(inventory(hosts, "  - {host: a}\n" * 21), FACTS, [hello()] * 21)


# ------------------------------------------------------------ given ranges


def test_given_ranges_are_kept_and_checked():
    hosts = "  a: {local: true, memory: 2GiB}\n  b: {local: true, memory: 4GiB}\n"
    stages = "  - {host: a, layers: [0, 8]}\n  - {host: b, layers: [8, 20]}\n"
    placement = place_stages(inventory(hosts, stages), FACTS, [hello()] * 2)
    assert not placement.automatic and placement.ranges == ((0, 8), (8, 20)) and placement.fits


def test_given_ranges_that_do_not_fit_are_refused_with_what_would():
    hosts = "  a: {local: true, memory: 2GiB}\n  b: {local: true, memory: 4GiB}\n"
    stages = "  - {host: a, layers: [0, 15]}\n  - {host: b, layers: [15, 20]}\n"
    with pytest.raises(PlacementError) as refused:
        place_stages(inventory(hosts, stages), FACTS, [hello()] * 2)
    message = str(refused.value)
    assert message.startswith(
        "the plan does not fit in memory: stage 0 on a (local), layers [0, 15), needs 2.43 GiB of RAM "
        "(weights 1.66 GiB, KV cache 240 MiB, compute 70 MiB, outputs 250 MiB, agent 224 MiB); "
        "2.55 GiB with the 5% margin, and a has 2.00 GiB there for the plan (memory: 2.00 GiB in the "
        "inventory). What would fit: "
    )
    assert "memory: 2624MiB or more on a (it has 64.0 GiB free)" in message
    assert "at most 10 layers on stage 0 ([0, 10) instead of [0, 15))" in message
    assert "a context of 256 tokens (--context 256; now 4096)" in message
    assert "stage 1" not in message.split("What would fit")[0]  # b fits
    assert not refused.value.placement.fits and refused.value.facts is FACTS
    # What it proposes fits.
    shorter = inventory(hosts, stages, "context: 256")
    assert place_stages(shorter, FACTS, [hello()] * 2).fits
    fewer = inventory(hosts, "  - {host: a, layers: [0, 10]}\n  - {host: b, layers: [10, 20]}\n")
    assert place_stages(fewer, FACTS, [hello()] * 2).fits


def test_a_model_too_big_for_the_hosts_is_refused():
    hosts = "  a: {local: true, memory: 1GiB}\n  b: {local: true, memory: 1GiB}\n"
    with pytest.raises(
        PlacementError, match=r"more hosts or memory: the plan needs 3\.\d\d GiB, the hosts have 2\.00 GiB"
    ):
        place_stages(inventory(hosts, "  - {host: a}\n  - {host: b}\n"), FACTS, [hello()] * 2)


def test_an_unfit_plan_can_still_be_shown():
    hosts = "  a: {local: true, memory: 1GiB}\n"
    placement = evaluate(inventory(hosts, "  - {host: a}\n"), FACTS, [hello()])
    assert not placement.fits and placement.ranges == ((0, 20),)


# --------------------------------------------------------------------- GPUs

OPTIONS = EngineOptions(n_ctx=4096, n_batch=2048, n_ubatch=512)


@pytest.mark.parametrize(
    ("gpu_layers", "frees", "start", "end", "on_devices", "output_on"),
    [
        # -1: every block and the output layer (llama.cpp: n_layer + 1 slots)
        (-1, (20,), 0, 20, (20,), 0),
        (0, (20,), 0, 20, (0,), None),
        # k: the last k slots, the output layer first among them
        (1, (20,), 0, 20, (0,), 0),
        (5, (20,), 0, 20, (4,), 0),
        (21, (20,), 0, 20, (20,), 0),
        # two GPUs, split by free memory: slot i to the first device whose
        # cumulative share exceeds i / (n + 1)
        (-1, (20, 20), 0, 20, (11, 9), 1),
        (-1, (30, 10), 0, 20, (16, 4), 1),
        (-1, (10, 30), 5, 12, (2, 5), 1),
    ],
)
def test_gpu_layers_are_placed_as_llama_cpp_places_them(gpu_layers, frees, start, end, on_devices, output_on):
    devices = [(f"CUDA{i}", free * GIB) for i, free in enumerate(frees)]
    options = EngineOptions(4096, 2048, 512, gpu_layers=gpu_layers)
    estimate = estimate_stage(MEMORY, start, end, options, devices)
    assert tuple(device.blocks for device in estimate.devices) == on_devices
    assert estimate.host.blocks == (end - start) - sum(on_devices)
    norm_and_copy = MEMORY.output_norm_bytes + MEMORY.token_embd_bytes
    for index, device in enumerate(estimate.devices):
        projection = norm_and_copy if index == output_on else 0
        assert device.weights == device.blocks * 100 * MIB + projection
    # token_embd stays in RAM on every stage (llama.cpp's input layer)
    expected_ram = estimate.host.blocks * 100 * MIB + MEMORY.token_embd_bytes
    assert estimate.host.weights == expected_ram + (MEMORY.output_norm_bytes if output_on is None else 0)


def test_a_gpu_host_holds_the_blocks_on_its_gpu_and_the_embeddings_in_ram():
    hosts = "  gpu: {address: 10.0.0.1}\n  cpu: {local: true, memory: 8GiB}\n"
    inv = inventory(hosts, "  - {host: gpu}\n  - {host: cpu}\n")
    placement = place_stages(inv, FACTS, [hello(32 * GIB, ((24 * GIB, 23 * GIB),)), hello()])
    gpu, cpu = placement.stages
    assert gpu.places == ("CUDA0",) and cpu.places == (RAM,)
    assert gpu.available == 23 * GIB - 512 * MIB
    assert gpu.memory.host.weights == MEMORY.token_embd_bytes and gpu.memory.host.kv == 0
    assert placement.pool("gpu", "CUDA0").needed == gpu.needed
    assert tiles(placement)


def test_build_plan_carries_the_placement_figures():
    hosts = "  a: {local: true, memory: 2GiB}\n  b: {local: true, memory: 4GiB}\n"
    inv = inventory(hosts, "  - {host: a}\n  - {host: b}\n")
    placement = place_stages(inv, FACTS, [hello()] * 2)
    plan = build_plan(inv, FACTS, list(placement.ranges), run_id=7, edge_base=100, placement=placement)
    for stage, placed in zip(plan.stages, placement.stages, strict=True):
        assert (stage.estimated_bytes, stage.available_bytes) == (placed.needed, placed.available)
        assert stage.memory == placed.memory


def test_the_worked_example_in_the_docs_is_what_its_script_prints():
    from benchmarks.plan_70b import BEGIN, DOC, END, example

    assert DOC.read_text().split(BEGIN)[1].split(END)[0] == example(), "run benchmarks/plan_70b.py --docs"
