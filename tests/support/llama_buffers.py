"""What llama.cpp says it allocated for a stage, read from its own log lines.

llama.cpp logs every buffer it allocates while a model loads and a context is
made (``load_tensors: CPU_Mapped model buffer size = 92.10 MiB``, ``KV buffer
size``, ``output buffer size``, ``compute buffer size``); the engine routes
them to the ``ggufpipe.llama`` logger. The memory estimate is tested and
calibrated against these figures.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from ggufpipe_agent.gguf.facts import read_model_facts
from ggufpipe_agent.llama.engine import StageEngine, StageShape
from ggufpipe_agent.stagefiles.build import ensure_stage_file
from ggufpipe_agent.wire.protocol import EngineOptions

_BUFFER = re.compile(r"(\S+)\s+(model|KV|output|compute) buffer size =\s+([\d.]+) MiB")


@dataclass(frozen=True, slots=True)
class Reported:
    """Bytes llama.cpp reported per kind of buffer (all devices together)."""

    model: int
    kv: int
    output: int
    compute: int

    @property
    def total(self) -> int:
        return self.model + self.kv + self.output + self.compute


class LogLines(logging.Handler):
    """A logging handler that keeps the messages."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def parse(lines: list[str]) -> Reported:
    sizes = {"model": 0.0, "KV": 0.0, "output": 0.0, "compute": 0.0}
    for line in lines:
        match = _BUFFER.search(line)
        if match:
            sizes[match.group(2)] += float(match.group(3))
    mib = 1 << 20
    return Reported(*(round(sizes[key] * mib) for key in ("model", "KV", "output", "compute")))


def load_and_report(
    source: Path, start: int, end: int, options: EngineOptions, cache_dir: Path
) -> tuple[Reported, StageEngine]:
    """Load blocks [start, end) of ``source`` as a stage and return what
    llama.cpp reported, with the engine (the caller closes it)."""
    facts = read_model_facts(source)
    path = ensure_stage_file(source, start, end, cache_dir)
    shape = StageShape(start == 0, end == facts.block_count, end - start, facts.hidden_dim)
    logger = logging.getLogger("ggufpipe.llama")
    handler = LogLines()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)  # the buffer lines are llama.cpp INFO
    try:
        engine = StageEngine(str(path), shape, options)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return parse(handler.lines), engine


def resident_anonymous() -> int:
    """This process's anonymous resident memory (heap, malloc'd buffers)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0
