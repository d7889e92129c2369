"""The inventory and the run plan: every malformed inventory names the key and
the line; every guarantee (docs/design.md, "Correctness guarantees") is checked before anything starts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from ggufpipe_tui.core.inventory import (
    InventoryError,
    parse_inventory,
    with_data_mode,
    with_run_options,
)
from ggufpipe_tui.core.inventory_policy import assign_layers
from ggufpipe_tui.core.plan import EdgeEndpoint, PlanError, build_plan, provision_message, validate_plan
from tests.support.model_facts import model_facts

FACTS = model_facts(
    path="/m.gguf",
    name="tiny",
    file_size=1,
    eog_token_ids=(2,),
    block_bytes=(1000,) * 30,
    embedding_bytes=500,
    output_bytes=10,
)

GOOD = """\
model: {path: models/m.gguf}
hosts:
  here: {local: true}
  gpu-a: {address: 10.0.0.11, user: ubuntu, port: 2222, identity: [~/.ssh/a, ~/.ssh/b], model_path: /data/m.gguf}
stages:
  - {host: here, layers: [0, 12]}
  - {host: gpu-a, layers: [12, 30]}
run: {max_tokens: 64, temperature: 0.5, activation_dtype: float16}
timeouts: {connect: 5}
"""


def parse(text: str):
    return parse_inventory(text, Path("/inv/inventory.yaml"))


def test_a_good_inventory():
    inventory = parse(GOOD)
    assert [s.layers for s in inventory.stages] == [(0, 12), (12, 30)]
    gpu = inventory.hosts["gpu-a"]
    assert gpu.port == 2222 and gpu.identity[0].endswith("/.ssh/a") and not gpu.identity[0].startswith("~")
    assert inventory.run.max_tokens == 64 and inventory.run.activation_dtype == "float16"
    assert inventory.timeouts.connect == 5 and inventory.timeouts.ready > 0
    # A relative model path is relative to the inventory on a local host,
    # and a host may give its own path.
    assert inventory.model_path_for(inventory.hosts["here"]) == "/inv/models/m.gguf"
    assert inventory.model_path_for(gpu) == "/data/m.gguf"
    assert assign_layers(inventory, 30) == [(0, 12), (12, 30)]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "model: {path: m.gguf}\nhosts: {h: {local: true}}\nstages: [{host: h}]\nbogus: 1\n",
            ":4: bogus: unknown key",
        ),
        (
            "model: {path: m.gguf}\nhosts: {h: {local: true}}\nstages:\n  - {host: h}\n  - {host: x}\n",
            ":5: stages[1].host: 'x' is not defined under hosts",
        ),
        (
            "model: {path: m.gguf}\nhosts:\n  h: {local: true, port: many}\nstages: [{host: h}]\n",
            ":3: hosts.h.port: expected an integer, got 'many'",
        ),
        (
            "model: {path: m.gguf}\nhosts:\n  h: {user: me}\nstages: [{host: h}]\n",
            ":3: hosts.h: needs an address",
        ),
        (
            "model: {path: m.gguf}\nhosts: {h: {local: true}}\nstages:\n  - {host: h, layers: [5, 2]}\n",
            ":4: stages[0].layers: [5, 2) is empty or reversed",
        ),
        (
            "model: {path: m.gguf}\nhosts: {h: {local: true}}\nstages:\n  - {host: h, layers: [0, 2]}\n  - {host: h}\n",
            ":5: stages[1].layers: give layers on every stage",
        ),
        ("model: {}\nhosts: {h: {local: true}}\nstages: [{host: h}]\n", ":1: model.path: missing"),
        ("hosts: {h: {local: true}}\nstages: [{host: h}]\n", "model: missing"),
        (
            "model: {path: m.gguf}\nhosts: {h: {local: true}}\nstages: [{host: h}]\nrun:\n  max_tokens: 0\n",
            ":5: run.max_tokens: must be at least 1",
        ),
        (
            "model: {path: m.gguf}\nhosts: {h: {local: true}}\nstages: [{host: h}]\nrun: {activation_dtype: int8}\n",
            "run.activation_dtype: must be one of float32, float16",
        ),
        (
            "model: {path: m.gguf}\nhosts: {h: {local: true}}\nstages: [{host: h}]\nrun: {temperature: hot}\n",
            ":4: run.temperature: expected a number",
        ),
        (
            "model: {path: m.gguf}\nhosts: {h: {local: true}}\nstages: [{host: h}]\nrun: {feedback: pigeon}\n",
            "run.feedback: must be one of ring, orchestrator",
        ),
        (
            "model: {path: m.gguf}\nhosts: {h: {local: true}}\nstages: [{host: h}]\ndata: fast\n",
            ":4: data: must be one of auto, direct, relay",
        ),
        (
            "model: {path: m.gguf}\nhosts:\n  h: {local: true, data: tls}\nstages: [{host: h}]\n",
            ":3: hosts.h.data: must be one of auto, direct, relay",
        ),
        ("model: [\n", "not valid YAML"),
        ("", ":1: the inventory is empty"),
    ],
)
def test_malformed_inventories_name_the_line_and_key(text, expected):
    with pytest.raises(InventoryError) as error:
        parse(text)
    assert expected in str(error.value)
    assert str(error.value).startswith("/inv/inventory.yaml")


@pytest.mark.parametrize(
    ("layers", "expected"),
    [
        ([[0, 12], [10, 30]], ":5: stages[1].layers: [10, 30) overlaps the previous stage"),
        ([[0, 12], [14, 30]], ":5: stages[1].layers: [14, 30) leaves blocks [12, 14) unassigned"),
        ([[0, 12], [12, 28]], ":5: stages[1].layers: the stages end at block 28, the model has 30"),
        ([[0, 12], [12, 31]], ":5: stages[1].layers: [12, 31) goes past the model's 30 blocks"),
    ],
)
def test_layer_ranges_are_checked_against_the_model(layers, expected):
    text = (
        "model: {path: m.gguf}\nhosts: {h: {local: true}}\nstages:\n"
        f"  - {{host: h, layers: {layers[0]}}}\n  - {{host: h, layers: {layers[1]}}}\n"
    )
    with pytest.raises(InventoryError, match=expected.replace("[", r"\[").replace(")", r"\)")):
        assign_layers(parse(text), 30)


def test_automatic_split_is_even():
    text = "model: {path: m.gguf}\nhosts: {h: {local: true}}\nstages: [{host: h}, {host: h}, {host: h}, {host: h}]\n"
    assert assign_layers(parse(text), 30) == [(0, 8), (8, 16), (16, 23), (23, 30)]


def test_data_modes_globally_and_per_host():
    text = GOOD + "data: relay\n"
    text = text.replace(
        "model_path: /data/m.gguf}", "model_path: /data/m.gguf, data: direct, link_address: 10.1.0.11}"
    )
    inventory = parse(text)
    assert inventory.hosts["here"].data == "relay", "the top level applies where a host says nothing"
    assert inventory.hosts["gpu-a"].data == "direct" and inventory.hosts["gpu-a"].link_address == "10.1.0.11"
    assert parse(GOOD).hosts["here"].data == "auto" and parse(GOOD).run.feedback == "ring"
    forced = with_data_mode(inventory, "auto")
    assert {host.data for host in forced.hosts.values()} == {"auto"}
    with pytest.raises(InventoryError, match="--data"):
        with_data_mode(inventory, "sideways")


def test_command_line_overrides_are_checked():
    inventory = with_run_options(parse(GOOD), max_tokens=3, temperature=None)
    assert inventory.run.max_tokens == 3 and inventory.run.temperature == 0.5
    with pytest.raises(InventoryError, match="--top-p"):
        with_run_options(inventory, top_p=2.0)


# ------------------------------------------------------------------- plan


def three_stage_plan():
    text = GOOD.replace(
        "  - {host: gpu-a, layers: [12, 30]}",
        "  - {host: gpu-a, layers: [12, 20]}\n  - {host: here, layers: [20, 30]}",
    )
    inventory = parse(text)
    return build_plan(inventory, FACTS, assign_layers(inventory, 30), run_id=77, edge_base=1000)


def test_plan_shape():
    plan = three_stage_plan()
    validate_plan(plan)
    assert [e.kind for e in plan.edges] == ["TokenIn", "Activation", "Activation", "TokenOut"]
    assert [e.edge_id for e in plan.edges] == [1000, 1001, 1002, 1003]
    assert plan.edges[0].producer.is_orchestrator and plan.edges[-1].consumer.is_orchestrator
    assert plan.model.max_seq_len == 2048 and plan.model.dtype_width_bytes == 2
    assert plan.edges[1].object_spec.max_extent == 2048 * 576 * 2
    assert plan.stages[1].gguf_source == "/data/m.gguf"
    kv_per_block = 3 * (64 + 64) * 2 * 2048  # heads_kv * (k + v) * f16 * context
    first, last = (plan.stages[i].memory for i in (0, 2))
    assert first is not None and last is not None
    # Every stage carries token_embd and the output norm (the hand-made facts
    # count output_norm as output_bytes); without a placement: the CPU estimate.
    assert (first.host.weights, first.host.kv) == (12 * 1000 + 500 + 10, 12 * kv_per_block)
    assert (last.host.weights, last.host.kv) == (10 * 1000 + 500 + 10, 10 * kv_per_block)
    assert plan.stages[0].estimated_bytes == first.total and plan.stages[0].available_bytes == 0
    message = provision_message(plan, 1)
    assert (message.inbound.edge_id, message.outbound.edge_id) == (1001, 1002)
    assert message.outbound.consumer_node_id == "here" and message.model.max_seq_len == 2048


def test_the_token_ring_is_an_edge_of_its_own_between_the_ends():
    plan = three_stage_plan()
    ring = plan.ring
    assert ring is not None and ring.kind == "TokenRing" and ring.edge_id == 1004
    assert ring.producer == EdgeEndpoint("here", 2) and ring.consumer == EdgeEndpoint("here", 0)
    first, middle, last = (provision_message(plan, i).ring for i in range(3))
    assert middle is None
    assert first is not None and first.consume and not first.produce
    assert last is not None and last.produce and last.max_tokens == 64 and last.eog_token_ids == (2,)
    fed = parse(GOOD.replace("run: {", "run: {feedback: orchestrator, "))
    plan = build_plan(fed, FACTS, assign_layers(fed, 30), run_id=77, edge_base=1000)
    assert plan.ring is None and provision_message(plan, 1).ring is None
    with pytest.raises(PlanError, match="token ring"):
        validate_plan(replace(three_stage_plan(), ring=replace(ring, edge_id=1001)))
    with pytest.raises(PlanError, match="produced by the last stage"):
        validate_plan(replace(three_stage_plan(), ring=replace(ring, producer=EdgeEndpoint("gpu-a", 1))))


def broken(plan, index, **changes):
    stages = list(plan.stages)
    stages[index] = replace(stages[index], **changes)
    return replace(plan, stages=tuple(stages))


def broken_edge(plan, index, **changes):
    edges = list(plan.edges)
    edges[index] = replace(edges[index], **changes)
    return replace(plan, edges=tuple(edges))


@pytest.mark.parametrize(
    ("mutate", "words"),
    [
        (lambda p: broken(p, 1, layer_start=10), "overlaps"),
        (lambda p: broken(p, 1, layer_start=14), "unassigned"),
        (lambda p: broken(p, 2, layer_end_exclusive=29), "cover layers"),
        (lambda p: broken(p, 1, layer_start=20, layer_end_exclusive=20), "empty range"),
        (lambda p: broken(p, 1, run_id=5), "belongs to run"),
        (lambda p: broken_edge(p, 2, edge_id=1001), "not unique"),
        (lambda p: broken_edge(p, 0, producer=EdgeEndpoint("here", 0)), "token-in must be produced"),
        (lambda p: broken_edge(p, 3, consumer=EdgeEndpoint("here", 2)), "token-out must be consumed"),
        (lambda p: broken_edge(p, 2, producer=EdgeEndpoint("here", 2)), "not produced by stage 1"),
        (lambda p: broken_edge(p, 1, consumer=EdgeEndpoint("gpu-a", 2)), "not consumed by stage 1"),
        (lambda p: broken(p, 1, outbound_edge=1001), "not produced by stage 1"),
        (lambda p: broken_edge(p, 1, kind="TokenIn"), "wired"),
        (lambda p: replace(p, edges=p.edges[:-1]), "need 4 edges"),
        (lambda p: broken(p, 2, stage_index=1), "numbered"),
        (lambda p: replace(p, max_tokens=0), "max_tokens"),
        (lambda p: broken_edge(p, 1, object_spec=replace(p.edges[1].object_spec, width=7)), "disagrees"),
        (lambda p: broken_edge(p, 1, run_id=3), "belongs to run"),
    ],
)
def test_every_guarantee_of_section_11_is_checked(mutate, words):
    with pytest.raises(PlanError, match=words):
        validate_plan(mutate(three_stage_plan()))
