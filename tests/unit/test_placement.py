"""The placement: a pure function of the inventory, the model's facts and the
agents' Hellos. Tables of hosts and caps; no processes."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from ggufpipe_agent.gguf.memory import GIB, MIB, estimate_stage
from ggufpipe_agent.wire.protocol import EngineOptions, Hello, MemoryFacts, ModelFacts
from ggufpipe_tui.core.inventory import InventoryError, parse_inventory
from ggufpipe_tui.core.placement import MARGIN, RAM, Placement, PlacementError, evaluate
from ggufpipe_tui.core.plan import build_plan
from ggufpipe_tui.core.refusal import place_stages
from tests.support.placement_facts import BLOCKS, FACTS, MEMORY, hello


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
    from benchmarks.plan_70b import BEGIN, END, example
    from benchmarks.planning_doc import DOC

    assert DOC.read_text().split(BEGIN)[1].split(END)[0] == example(), "run benchmarks/plan_70b.py --docs"


# ------------------------------------- where an architecture lets stages start


def facts_of(architecture: str, blocks: int) -> ModelFacts:
    """FACTS for a model of ``architecture`` with ``blocks`` blocks like FACTS's."""
    from dataclasses import replace

    memory = replace(
        MEMORY,
        block_bytes=(100 * MIB,) * blocks,
        kv_widths=(2048,) * blocks,
        swa_blocks=(False,) * blocks,
    )
    return replace(
        FACTS, architecture=architecture, block_count=blocks, block_bytes=memory.block_bytes, memory=memory
    )


@pytest.mark.parametrize(
    ("caps", "stage_hosts"),
    [
        (("2GiB", "4GiB"), "ab"),
        (("4GiB", "2GiB"), "ab"),
        (("1600MiB", "6GiB"), "ab"),
        (("2GiB", "5GiB"), "abb"),
        (("5GiB", "2GiB"), "aab"),
        (("3GiB", "3GiB"), "abab"),
    ],
)
def test_automatic_ranges_start_where_the_architecture_lets_stages_start(caps, stage_hosts):
    """llama4 stages start at multiples of 4 blocks (cut_multiple) and the
    last one has 4 or more; the ranges still follow the room."""
    hosts = "".join(
        f"  {name}: {{local: true, memory: {cap}}}\n" for name, cap in zip("ab", caps, strict=True)
    )
    stages = "".join(f"  - {{host: {host}}}\n" for host in stage_hosts)
    for blocks in (20, 22):
        placement = place_stages(
            inventory(hosts, stages), facts_of("llama4", blocks), [hello()] * len(stage_hosts)
        )
        ranges = placement.ranges
        assert placement.automatic and placement.fits
        assert ranges[0][0] == 0 and ranges[-1][1] == blocks
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
        assert all(start % 4 == 0 and end - start >= 4 for start, end in ranges), ranges


def test_automatic_ranges_of_a_model_split_anywhere_are_unchanged():
    hosts = "  a: {local: true}\n  b: {local: true}\n"
    stages = "  - {host: a}\n  - {host: b}\n" * 2 + "  - {host: a}\n"
    assert evaluate(inventory(hosts, stages), facts_of("llama", 22), [None] * 5).ranges == (
        (0, 4),
        (4, 9),
        (9, 13),
        (13, 18),
        (18, 22),
    )
    # the same stages of a llama4 model: the nearest multiples of 4, the last
    # stage from 16 (from 20 it would have only 2 blocks)
    assert evaluate(inventory(hosts, stages), facts_of("llama4", 22), [None] * 5).ranges == (
        (0, 4),
        (4, 8),
        (8, 12),
        (12, 16),
        (16, 22),
    )


def test_more_stages_than_the_architecture_allows_is_an_inventory_error():
    hosts = "  a: {local: true}\n"
    with pytest.raises(InventoryError, match="6 stages for a llama4 model of 22 blocks.*at most 5 stages"):
        evaluate(inventory(hosts, "  - {host: a}\n" * 6), facts_of("llama4", 22), [hello()] * 6)
    evaluate(inventory(hosts, "  - {host: a}\n" * 6), facts_of("llama", 22), [hello()] * 6)


def test_repair_moves_a_cut_by_the_architecture_multiple():
    """A first stage that overflows gives whole multiples of 4 blocks to its
    neighbour, never a block or two."""
    from ggufpipe_agent.gguf.memory import memory_facts_of
    from ggufpipe_tui.core import placement as module
    from ggufpipe_tui.core.plan import engine_options

    facts = facts_of("llama4", 20)
    for cap, repaired in (("2GiB", [(0, 8), (8, 20)]), ("1600MiB", [(0, 4), (4, 20)])):
        inv = inventory(
            f"  a: {{local: true, memory: {cap}}}\n  b: {{local: true, memory: 6GiB}}\n",
            "  - {host: a}\n  - {host: b}\n",
        )
        hosts = module.host_pools(inv, [hello()] * 2)
        sizing = module.Sizing(inv, memory_facts_of(facts), engine_options(inv.run, facts), hosts)
        assert not module.evaluate_ranges(sizing, [(0, 12), (12, 20)], True).fits
        assert module._repair(sizing, [(0, 12), (12, 20)], 4) == repaired


# ------------------------------------------------------ mixtures of experts

#: A mixture of experts: each block 100 MiB, of which 80 MiB routed experts
#: (three tensors, the largest 30 MiB).
MOE_MEMORY = replace(MEMORY, expert_bytes=(80 * MIB,) * BLOCKS, expert_tensor_bytes=(30 * MIB,) * BLOCKS)
MOE_FACTS = replace(FACTS, memory=MOE_MEMORY)
ONE_GPU = "  g: {address: 10.0.0.1%s}\n"


def gpu_host(free_gib: float, ram: int = 64 * GIB) -> Hello:
    return hello(ram, ((24 * GIB, int(free_gib * GIB)),))


def moe_plan(free_gib: float, extra: str = "", ram: int = 64 * GIB) -> Placement:
    return evaluate(inventory(ONE_GPU % extra, "  - {host: g}\n"), MOE_FACTS, [gpu_host(free_gib, ram)])


def test_experts_in_ram_move_only_the_routed_experts_and_add_their_copy_to_the_gpu_compute():
    devices = [("CUDA0", 24 * GIB)]
    on_gpu = estimate_stage(MOE_MEMORY, 0, 5, OPTIONS, devices)
    in_ram = estimate_stage(MOE_MEMORY, 0, 5, replace(OPTIONS, experts_in_ram=True), devices)
    assert in_ram.devices[0].weights == on_gpu.devices[0].weights - 5 * 80 * MIB
    assert in_ram.host.weights == on_gpu.host.weights + 5 * 80 * MIB
    assert in_ram.devices[0].kv == on_gpu.devices[0].kv and in_ram.devices[0].blocks == 5
    # A prompt ubatch of >= 32 tokens runs the experts on the GPU on a copy of
    # one expert tensor at a time (ggml's op offload): that copy is GPU compute.
    ub = OPTIONS.n_ubatch
    feed_forward = ub * (3 * MEMORY.n_ff + 4 * MEMORY.n_embd) * 4 + 4096 * ub * 2
    assert in_ram.devices[0].compute == max(on_gpu.devices[0].compute, feed_forward + 30 * MIB)
    assert in_ram.host.compute == on_gpu.host.compute
    # Below 32 the CPU runs them: the host's compute buffer holds the feed-forward.
    small = replace(OPTIONS, n_ubatch=16, experts_in_ram=True)
    cpu = estimate_stage(MOE_MEMORY, 0, 5, small, devices)
    assert cpu.host.compute == 16 * (3 * MEMORY.n_ff + 4 * MEMORY.n_embd) * 4 + 4096 * 16 * 2
    assert (
        cpu.devices[0].compute
        == estimate_stage(MOE_MEMORY, 0, 5, replace(small, experts_in_ram=False), devices).devices[0].compute
    )
    # Without a GPU (or for a model without experts) the flag changes nothing.
    assert estimate_stage(MOE_MEMORY, 0, 5, replace(OPTIONS, experts_in_ram=True)) == estimate_stage(
        MOE_MEMORY, 0, 5, OPTIONS
    )
    assert estimate_stage(MEMORY, 0, 5, replace(OPTIONS, experts_in_ram=True), devices) == estimate_stage(
        MEMORY, 0, 5, OPTIONS, devices
    )


def test_the_experts_stay_on_a_gpu_that_holds_them():
    placement = moe_plan(23.5)
    assert placement.fits and placement.stages[0].experts == "gpu"
    assert placement.stages[0].places == ("CUDA0",)


def test_the_experts_go_to_ram_when_the_gpu_is_short_and_the_ram_is_not():
    on_gpu = moe_plan(2.0, ", experts: gpu")
    assert not on_gpu.pool("g", "CUDA0").fits and on_gpu.pool("g", RAM).fits  # the GPU alone is short
    placement = moe_plan(2.0)
    stage = placement.stages[0]
    assert placement.fits and stage.experts == "ram" and stage.experts_in_ram
    assert stage.places == (RAM, "CUDA0") and stage.needed == stage.memory.total
    assert stage.memory.host.weights == MEMORY.token_embd_bytes + BLOCKS * 80 * MIB
    assert (
        stage.memory.devices[0].weights
        == BLOCKS * 20 * MIB + MEMORY.output_norm_bytes + MEMORY.token_embd_bytes
    )
    # The run plan carries the choice to the agent: its engine options.
    inv = inventory(ONE_GPU % "", "  - {host: g}\n")
    plan = build_plan(inv, MOE_FACTS, list(placement.ranges), run_id=7, edge_base=100, placement=placement)
    assert plan.stages[0].engine.experts_in_ram
    from ggufpipe_agent.wire.protocol import decode_message, encode_message
    from ggufpipe_tui.core.format import stage_plan_line
    from ggufpipe_tui.core.plan import provision_message

    provision = decode_message(encode_message(provision_message(plan, 0)))
    assert provision.engine.experts_in_ram  # type: ignore[attr-defined]
    assert stage_plan_line(plan.stages[0]).endswith(", experts in RAM")


def test_the_experts_stay_on_the_gpu_when_neither_holds_them_and_the_plan_is_refused():
    with pytest.raises(PlacementError) as refused:
        place_stages(inventory(ONE_GPU % ", memory: 1GiB", "  - {host: g}\n"), MOE_FACTS, [gpu_host(2.0)])
    assert refused.value.placement.stages[0].experts == "gpu"
    assert re.search(r"memory: \d+[MG]iB or more on g for its stages' routed experts", str(refused.value))
    assert "needs 2." in str(refused.value) and "of GPU CUDA0" in str(refused.value)


def test_experts_pinned_to_the_gpu_are_refused_with_the_advice_to_move_them():
    with pytest.raises(PlacementError, match=r"experts: ram on g \(its stages' routed experts in RAM"):
        place_stages(inventory(ONE_GPU % ", experts: gpu", "  - {host: g}\n"), MOE_FACTS, [gpu_host(2.0)])


def test_experts_pinned_to_ram_stay_there_and_a_dense_model_has_none():
    assert moe_plan(23.5, ", experts: ram").stages[0].experts == "ram"
    dense = evaluate(inventory(ONE_GPU % ", experts: ram", "  - {host: g}\n"), FACTS, [gpu_host(23.5)])
    assert dense.stages[0].experts == "" and not dense.stages[0].experts_in_ram
    cpu_only = evaluate(inventory("  c: {local: true}\n", "  - {host: c}\n"), MOE_FACTS, [hello()])
    assert cpu_only.stages[0].experts == ""


def test_the_auto_choice_is_per_stage_until_the_hosts_gpu_fits():
    # Two stages on one host: moving the first stage's experts is enough.
    inv = inventory(ONE_GPU % "", "  - {host: g, layers: [0, 10]}\n  - {host: g, layers: [10, 20]}\n")
    placement = evaluate(inv, MOE_FACTS, [gpu_host(3.0)] * 2)
    assert placement.fits
    assert [stage.experts for stage in placement.stages] == ["ram", "gpu"]


def test_an_output_kept_in_every_stage_is_counted_in_every_stage():
    kept = replace(MEMORY, output_bytes=300 * MIB, output_kept=True)
    alone = replace(kept, output_kept=False)
    middle, middle_alone = (estimate_stage(m, 0, 10, OPTIONS) for m in (kept, alone))
    assert middle.host.weights == middle_alone.host.weights + 300 * MIB
    devices = [("CUDA0", 24 * GIB)]
    # On a GPU the kept output.weight replaces the copy of token_embd.
    gpu, gpu_alone = (estimate_stage(m, 0, 10, OPTIONS, devices) for m in (kept, alone))
    assert gpu.devices[0].weights == gpu_alone.devices[0].weights - MEMORY.token_embd_bytes + 300 * MIB
    assert estimate_stage(kept, 10, 20, OPTIONS) == estimate_stage(alone, 10, 20, OPTIONS)  # the last


def test_the_moe_worked_examples_in_the_docs_are_what_their_script_prints():
    from benchmarks.plan_moe import BEGIN, END, example
    from benchmarks.planning_doc import DOC

    assert DOC.read_text().split(BEGIN)[1].split(END)[0] == example(), "run benchmarks/plan_moe.py --docs"


def test_records_without_the_expert_fields_decode_with_their_defaults():
    """A record written before the fields existed (the version check keeps
    mixed releases apart, but a record may be older, e.g. a run log)."""
    from ggufpipe_agent.wire.codec import build, to_plain

    options = to_plain(EngineOptions(256, 256, 16))
    del options["experts_in_ram"]
    assert build(EngineOptions, options, "test") == EngineOptions(256, 256, 16)
    memory = to_plain(MEMORY)
    for name in ("expert_bytes", "expert_tensor_bytes", "output_kept"):
        del memory[name]
    decoded = build(MemoryFacts, memory, "test")
    assert decoded == MEMORY and decoded.expert_bytes == () and not decoded.output_kept


def test_too_many_slots_are_refused_with_as_many_as_fit():
    """Each run in flight (docs/architecture.md, "Runs in flight") holds a KV cache of the whole context:
    a plan of too many slots says how many fit, and that many do."""
    hosts = "  a: {local: true, memory: 3GiB}\n  b: {local: true, memory: 4GiB}\n"
    stages = "  - {host: a, layers: [0, 10]}\n  - {host: b, layers: [10, 20]}\n"
    with pytest.raises(PlacementError) as refused:
        place_stages(inventory(hosts, stages, "parallel: 32"), FACTS, [hello()] * 2)
    found = re.search(
        r"fewer runs in flight \(--parallel (\d+); now 32, a KV cache each\)", str(refused.value)
    )
    assert found, str(refused.value)
    most = int(found.group(1))
    assert place_stages(inventory(hosts, stages, f"parallel: {most}"), FACTS, [hello()] * 2).fits
    with pytest.raises(PlacementError):
        place_stages(inventory(hosts, stages, f"parallel: {most + 1}"), FACTS, [hello()] * 2)
