"""What a run does in Preparing: find or write its stage file (received from
the orchestrator, or cut here from the host's own copy of the model) and load
it into an engine of the process's engine slot, keeping what it may of the
run before it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

from ggufpipe_agent.delivery.service import received_stage_file
from ggufpipe_agent.errors import ProtocolError
from ggufpipe_agent.gguf.architectures import check_architecture
from ggufpipe_agent.gguf.facts import read_model_facts
from ggufpipe_agent.llama.engine import StageEngine, StageShape
from ggufpipe_agent.llama.loaded import LoadedEngine
from ggufpipe_agent.stagefiles.build import check_range, ensure_stage_file
from ggufpipe_agent.wire.protocol import PrefixHeld, ProvisionStage

Progress = Callable[[float], None]


async def stage_file(
    p: ProvisionStage, worker: Executor, cache_dir: Path | None, progress: Callable[[str], Progress]
) -> Path:
    """The run's stage file on this host; ``progress(what)`` reports a long
    step's fraction done."""
    loop = asyncio.get_running_loop()
    if p.stage_file is not None:  # sent here by the orchestrator (model send: true)
        return await loop.run_in_executor(worker, received_stage_file, cache_dir, p)
    return await _stage_file_from_source(p, worker, cache_dir, progress)


async def _stage_file_from_source(
    p: ProvisionStage, worker: Executor, cache_dir: Path | None, progress: Callable[[str], Progress]
) -> Path:
    """The stage file written here from the host's own copy of the model."""
    loop = asyncio.get_running_loop()
    facts = await loop.run_in_executor(worker, read_model_facts, p.gguf_source)
    check_architecture(facts.architecture, facts.path)
    check_range(p.layer_start, p.layer_end_exclusive, facts.block_count, facts.path)
    if facts.hidden_dim != p.model.hidden_dim or facts.block_count != p.model.block_count:
        raise ProtocolError(
            f"{facts.path} has {facts.block_count} blocks of width {facts.hidden_dim}; "
            f"the plan says {p.model.block_count} of width {p.model.hidden_dim} "
            "(a different model file on this host?)"
        )
    return await loop.run_in_executor(
        worker,
        lambda: ensure_stage_file(
            facts.path,
            p.layer_start,
            p.layer_end_exclusive,
            cache_dir,
            progress("writing stage file"),
        ),
    )


def load_engine(
    slots: LoadedEngine, stage_path: Path, p: ProvisionStage, progress: Progress
) -> tuple[StageEngine, PrefixHeld]:
    """The run's engine, on its slot and reset for it, and what it holds of
    the run offered for reuse (on the worker thread: engine calls run there)."""
    shape = StageShape(
        first=p.stage_index == 0,
        last=p.stage_index == p.stage_count - 1,
        block_count=p.layer_end_exclusive - p.layer_start,
        hidden=p.model.hidden_dim,
    )
    engine, loaded = slots.get(stage_path, shape, p.engine, progress, p.run_id)
    held = slots.held(engine, p.reuse, loaded, p.slot)
    engine.use(p.slot)
    engine.reset(p.sampling, keep=held.positions > 0)
    if not held.positions:
        slots.forget(f"its cache was emptied for run {p.run_id:016x}", p.slot)
    return engine, held
