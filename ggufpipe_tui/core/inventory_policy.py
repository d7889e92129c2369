"""What the runs do where the inventory leaves it to ggufpipe: each stage's
blocks (split evenly, or the given ranges checked) and the server's runs in
flight by default. Pure: functions of a parsed inventory."""

from __future__ import annotations

from ggufpipe_tui.core.errors import InventoryError
from ggufpipe_tui.core.inventory import HostSpec, Inventory


def default_parallel(inventory: Inventory, cores: int) -> int:
    """The server's runs in flight when neither ``--parallel`` nor
    ``run.parallel`` says: one per machine the stages run on, so every machine
    is busy. Stages that share a machine share its cores: each one's steps
    use them all (``threads: 0``), and runs in flight on the same cores make
    llama.cpp's thread teams wait for each other (3 local stages with 3 runs
    in flight served 0.36x the requests/s of one at a time, docs/bench-server.md).
    So a machine's stages count one each only where they cannot collide:
    this machine (``local``), not one shared process, each stage's
    ``threads`` given and together at most ``cores``. Say ``--parallel``
    for anything else (an SSH host whose stages have cores of their own)."""
    machines: dict[tuple[object, ...], list[HostSpec]] = {}
    for stage in inventory.stages:
        host = inventory.hosts[stage.host]
        key: tuple[object, ...] = ("local",) if host.local else ("ssh", host.address, host.port)
        machines.setdefault(key, []).append(host)
    total = 0
    for key, hosts in machines.items():
        apart = (
            key == ("local",)
            and not any(host.share_process for host in hosts)
            and all(host.threads > 0 for host in hosts)
            and sum(host.threads for host in hosts) <= cores
        )
        total += len(hosts) if apart else 1
    return max(1, total)


def assign_layers(inventory: Inventory, block_count: int) -> list[tuple[int, int]]:
    """Each stage's [start, end): as given (checked: no overlap, no gap, the
    model's end reached) or split evenly by block count when no stage gives
    layers. Runs split by memory instead (core.placement), which checks given
    ranges here."""
    stages = inventory.stages
    if stages[0].layers is None:
        if len(stages) > block_count:
            raise InventoryError(
                f"{inventory.where(stages[0].line)}: stages: {len(stages)} stages for a model of "
                f"only {block_count} blocks"
            )
        base, extra = divmod(block_count, len(stages))
        ranges, start = [], 0
        for index in range(len(stages)):
            end = start + base + (1 if index < extra else 0)
            ranges.append((start, end))
            start = end
        return ranges
    ranges = []
    expected = 0
    for index, stage in enumerate(stages):
        assert stage.layers is not None
        start, end = stage.layers
        where = f"{inventory.where(stage.line)}: stages[{index}].layers"
        if start < expected:
            raise InventoryError(
                f"{where}: [{start}, {end}) overlaps the previous stage (ends at {expected})"
            )
        if start > expected:
            raise InventoryError(f"{where}: [{start}, {end}) leaves blocks [{expected}, {start}) unassigned")
        if end > block_count:
            raise InventoryError(f"{where}: [{start}, {end}) goes past the model's {block_count} blocks")
        ranges.append((start, end))
        expected = end
    if expected != block_count:
        last = stages[-1]
        raise InventoryError(
            f"{inventory.where(last.line)}: stages[{len(stages) - 1}].layers: the stages end at "
            f"block {expected}, the model has {block_count} blocks"
        )
    return ranges
