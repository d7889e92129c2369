"""Which spare host a lost stage moves to (core/spares.py, docs/recovery.md):
the first spare no stage uses, in the inventory's order, that can hold the
stages with their layer ranges by the memory plan's own figures. Pure."""

from __future__ import annotations

from pathlib import Path

import pytest

from ggufpipe_agent.gguf.memory import GIB
from ggufpipe_tui.core.inventory import InventoryError, parse_inventory
from ggufpipe_tui.core.spares import moved_inventory, spare_candidates, spare_placement, spare_problem
from tests.support.placement_facts import FACTS, hello

RANGES = [(0, 6), (6, 14), (14, 20)]


def inventory(spares: str):
    text = (
        "model: {path: m.gguf}\n"
        "hosts:\n"
        "  a: {address: a.example}\n"
        "  b: {address: b.example}\n"
        f"{spares}"
        "stages:\n  - {host: a}\n  - {host: b}\n  - {host: a}\n"
        "run: {context: 4096}\n"
    )
    return parse_inventory(text, Path("inv.yaml"))


def test_the_spares_no_stage_uses_in_the_inventorys_order():
    inv = inventory(
        "  s2: {address: s2.example, spare: true}\n"
        "  s1: {address: s1.example, spare: true}\n"
        "  c: {address: c.example}\n"  # not a spare: never a candidate
    )
    assert spare_candidates(inv, {"a", "b"}) == ["s2", "s1"]
    assert spare_candidates(inv, {"a", "s2"}) == ["s1"]  # s2 took a stage already
    assert spare_candidates(inventory(""), {"a", "b"}) == []


def test_the_spare_that_holds_the_stage_fits_and_one_too_small_says_why():
    inv = inventory(
        "  big: {address: big.example, spare: true}\n  small: {address: s.example, spare: true}\n"
    )
    hellos = [hello(16 * GIB)] * 3
    fits = spare_placement(inv, FACTS, hellos, RANGES, [1], "big", hello(16 * GIB))
    assert spare_problem(fits, "big") == ""
    assert fits.ranges == tuple(RANGES), "the stage keeps its layers"
    assert [stage.host for stage in fits.stages] == ["a", "big", "a"]
    small = spare_placement(inv, FACTS, hellos, RANGES, [1], "small", hello(1 * GIB))
    problem = spare_problem(small, "small")
    assert problem.startswith("stage 1 needs ") and "of RAM with the 5% margin, small has 512 MiB" in problem


def test_the_stages_of_one_host_move_together_and_share_the_spares_memory():
    inv = inventory("  s: {address: s.example, spare: true, memory: 2GiB}\n")
    hellos = [hello(16 * GIB)] * 3
    one = spare_placement(inv, FACTS, hellos, RANGES, [2], "s", hello(16 * GIB))
    assert spare_problem(one, "s") == ""  # 6 blocks fit in 2 GiB
    both = spare_placement(inv, FACTS, hellos, RANGES, [0, 2], "s", hello(16 * GIB))
    assert spare_problem(both, "s").startswith("stages 0, 2 need ")  # 12 blocks and the embeddings do not


def test_the_moved_inventory_names_the_spare():
    inv = moved_inventory(inventory("  s: {address: s.example, spare: true}\n"), {1: "s"})
    assert [stage.host for stage in inv.stages] == ["a", "s", "a"]


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (
            "hosts:\n  a: {address: a.example, spare: true}\nstages:\n  - {host: a}\n",
            "inv.yaml:5: stages[0].host: a is a spare (spare: true at line 3)",
        ),
        (
            "hosts:\n  a: {address: a.example, spare: maybe}\nstages:\n  - {host: a}\n",
            "inv.yaml:3: hosts.a.spare: expected true or false",
        ),
    ],
)
def test_a_spare_named_by_a_stage_or_not_a_boolean_is_refused(text, said):
    with pytest.raises(InventoryError) as error:
        parse_inventory("model: {path: m.gguf}\n" + text, Path("inv.yaml"))
    assert str(error.value).startswith(said), error.value
