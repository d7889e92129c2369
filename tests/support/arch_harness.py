"""What every architecture test shares: the synthetic models by name, the
engine options, the prompt, a split chain's greedy tokens and the headless
command line.

A model of :data:`MODELS` is written once per session (:func:`model_path`);
its whole-model greedy tokens are computed once per session
(``whole_model_greedy`` caches them) and must not collapse onto a few tokens
(:func:`greedy_reference`), or the token-identical comparisons would prove little.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from ggufpipe_agent.errors import UnsupportedArchitecture
from ggufpipe_agent.gguf.architectures import check_split
from ggufpipe_agent.wire.protocol import EngineOptions
from tests.support import synthetic, synthetic_families
from tests.support.common import REPO, whole_model_greedy
from tests.support.stage_chain import Chain

STEPS = 64
UBATCH = 16
CONTEXT = 256
# One thread per engine: on a small shared machine, ggml's spinning worker
# threads of several engines slow each other down by an order of magnitude.
OPTIONS = EngineOptions(n_ctx=CONTEXT, n_batch=CONTEXT, n_ubatch=UBATCH, threads=1)
PROMPT = synthetic.prompt_tokens(3 * UBATCH - 5)  # three ubatches, the last one partial

Writer = Callable[[Path], Path]

#: Every synthetic model the architecture tests run, by name: the dense
#: families of :data:`tests.support.synthetic.SPECS` and the rows of
#: :data:`tests.support.synthetic_families.FAMILIES`.
MODELS: dict[str, Writer] = {
    **{name: partial(synthetic.write_model, name=name) for name in synthetic.SPECS},
    **{name: partial(synthetic_families.write_model, name=name) for name in synthetic_families.FAMILIES},
}

#: The ``general.architecture`` of each model of MODELS.
ARCHITECTURES: dict[str, str] = {
    **{name: spec.arch for name, spec in synthetic.SPECS.items()},
    **{name: family.arch for name, family in synthetic_families.FAMILIES.items()},
}

_paths: dict[str, Path] = {}


def model_path(factory: pytest.TempPathFactory, name: str) -> Path:
    """The synthetic model ``name`` of MODELS, written once per session."""
    if name not in _paths:
        file = "synthetic-" + "".join(c if c.isalnum() or c in "-_" else "-" for c in name) + ".gguf"
        _paths[name] = MODELS[name](factory.mktemp("synthetic") / file)
    return _paths[name]


def greedy_reference(path: Path, distinct: int = 16) -> list[int]:
    """The whole model's greedy tokens for PROMPT; at least ``distinct`` different ones."""
    tokens = whole_model_greedy(path, PROMPT, STEPS, n_ctx=CONTEXT, n_ubatch=UBATCH)
    assert len(set(tokens)) >= distinct, f"the random {path.name} collapsed: {tokens}"
    return tokens


def run_chain(
    path: Path, splits: list[tuple[int, int]], cache_dir: Path | None = None, dtype: str = "float32"
) -> list[int]:
    """The greedy tokens of a chain of stage engines over ``splits`` for PROMPT."""
    chain = Chain(path, splits, OPTIONS, cache_dir=cache_dir, dtype=dtype)
    try:
        return chain.generate(PROMPT, STEPS)
    finally:
        chain.close()


def per_layer_cases(
    blocks: int,
    *,
    head: tuple[int, int],
    kv: tuple[int, int],
    used: tuple[int, int],
    expert_ff: tuple[int, int],
    ff: tuple[int, int],
) -> list[tuple[str, list[int]]]:
    """The per-layer counts a mixture-of-experts family refuses when they differ
    between blocks, as ``(key, values)`` over ``blocks`` blocks: the head count
    changes half way, the KV head count and the experts' width in the last
    block, the experts used from block 40, the dense width after block 0. Each
    pair is (the value before, the value after)."""
    half = (blocks + 1) // 2
    return [
        ("attention.head_count", [head[0]] * half + [head[1]] * (blocks - half)),
        ("attention.head_count_kv", [kv[0]] * (blocks - 1) + [kv[1]]),
        ("expert_used_count", [used[0]] * 40 + [used[1]] * (blocks - 40)),
        ("expert_feed_forward_length", [expert_ff[0]] * (blocks - 1) + [expert_ff[1]]),
        ("feed_forward_length", [ff[0]] + [ff[1]] * (blocks - 1)),
    ]


def assert_per_layer_refused(
    arch: str,
    metadata: dict[str, Any],
    key: str,
    values: list[int],
    part: tuple[int, int],
    whole: bool = True,
    rest: tuple[int, int] | None = None,
    uniform: bool = False,
) -> None:
    """A model whose per-layer ``{arch}.{key}`` is ``values`` (not the same
    for every block) over ``metadata``: the whole model runs as the source
    file itself (if ``whole``), the stage ``part`` is refused by the key's
    name, the stage ``rest`` (if given) because the model runs only as one
    stage, and ``part`` of a uniform array of the first value runs (if
    ``uniform``)."""
    name = f"{arch}.{key}"
    get = {**metadata, name: values}.get
    if whole:
        check_split(arch, get, 0, len(values), "odd")
    with pytest.raises(UnsupportedArchitecture, match=re.escape(name) + " differs between blocks"):
        check_split(arch, get, *part, "odd")
    if rest:
        with pytest.raises(UnsupportedArchitecture, match="runs only as one stage"):
            check_split(arch, get, *rest, "odd")
    if uniform:
        check_split(arch, {**metadata, name: [values[0]] * len(values)}.get, *part, "uniform")


# ------------------------------------------------------- command line


def write_inventory(tmp_path: Path, model: Path, splits: list[tuple[int, int]], run: str) -> Path:
    stages = "".join(f"- {{host: here, layers: [{start}, {end}]}}\n" for start, end in splits)
    path = tmp_path / "inventory.yaml"
    path.write_text(
        f"model: {{path: {model}}}\n"
        "hosts:\n  here: {local: true, threads: 1}\n"
        f"stages:\n{textwrap.indent(stages, '  ')}"
        f"run: {{context: {CONTEXT}, ubatch: {UBATCH}, {run}}}\n"
        "timeouts: {connect: 60, ready: 300, step: 60, teardown: 10}\n"
    )
    return path


def ggufpipe_tui(inventory: Path, prompt: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """The headless command line (what ``ggufpipe-tui`` runs), as a user runs it."""
    command = [sys.executable, "-m", "ggufpipe_tui.cli", str(inventory), "--prompt", prompt, "--json", "-q"]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=os.environ.copy(), cwd=REPO
    )


#: The run section of a headless run whose tokens are compared.
HEADLESS_RUN = "max_tokens: 32, ignore_eos: true, chat: false"


def run_headless(inventory: Path, prompt: str, timeout: float = 300) -> dict[str, Any]:
    """Run the headless command line; its JSON result, which must have completed."""
    done = ggufpipe_tui(inventory, prompt, timeout)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    assert result["outcome"] == "completed", result
    return result


def headless_greedy(path: Path, result: dict[str, Any]) -> list[int]:
    """The whole model's 32 greedy tokens for the prompt a headless run tokenised."""
    return whole_model_greedy(path, result["prompt_tokens"], 32, n_ctx=CONTEXT, n_ubatch=UBATCH)
