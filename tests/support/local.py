"""Local inventories (every stage on this machine) and the ggufpipe-tui command run as a user runs it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import llama_cpp

from tests.support.common import LONG_PROMPT, REPO

TIMEOUTS = "connect: 30, ready: 120, step: 30, teardown: 10"


def write_inventory(
    tmp_path: Path,
    model_path: Path,
    stages: str,
    run: str = "",
    data: str = "",
    *,
    here: str = "{local: true}",
    hosts: str = "",
    timeouts: str = TIMEOUTS,
    extra: str = "",
    context: int = 512,
    ubatch: int = 32,
) -> Path:
    """tmp_path/inventory.yaml: the host "here" (``here``: its entry) and
    ``hosts`` (further entry lines), ``stages`` (a YAML list), ``context``
    and ``ubatch`` with ``run``'s fields; ``extra``: more lines, before
    ``data``."""
    path = tmp_path / "inventory.yaml"
    path.write_text(
        f"model: {{path: {model_path}}}\n"
        f"hosts:\n  here: {here}\n{hosts}"
        f"stages:\n{textwrap.indent(stages, '  ')}"
        f"run: {{context: {context}, ubatch: {ubatch}, {run}}}\n"
        f"timeouts: {{{timeouts}}}\n" + extra + data
    )
    return path


UNEVEN = "- {host: here, layers: [0, 7]}\n- {host: here, layers: [7, 23]}\n- {host: here, layers: [23, 30]}\n"


def run_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ggufpipe_tui.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def send_inventory(tmp_path: Path, model: Path, caches: list[Path]) -> Path:
    hosts = "".join(
        f"  h{i}: {{local: true, cache_dir: {cache}, threads: 1}}\n" for i, cache in enumerate(caches)
    )
    stages = "".join(f"  - {{host: h{i}}}\n" for i in range(len(caches)))
    path = tmp_path / "inventory.yaml"
    path.write_text(
        f"model: {{path: {model}, send: true}}\nhosts:\n{hosts}stages:\n{stages}"
        f"run: {{context: 512, ubatch: 32, chat: false, max_tokens: {STEPS}, ignore_eos: true}}\n"
        "timeouts: {connect: 30, ready: 120, step: 30, teardown: 10}\n"
    )
    return path


def tokenize(model: Path, text: str, bos: bool) -> list[int]:
    llm = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)
    try:
        return llm.tokenize(text.encode(), add_bos=bos)
    finally:
        llm.close()


def long_prompt(model: Path, length: int) -> list[int]:
    """LONG_PROMPT's tokens (with BOS), repeated to ``length`` tokens."""
    tokens = tokenize(model, LONG_PROMPT, bos=True)
    return (tokens * (length // len(tokens) + 1))[:length]


STEPS = 16
