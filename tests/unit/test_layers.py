"""The packages' layers: each imports only its own layer and those below,
and no module imports another that imports it back, even for types only
(read from the source with the standard library's ast)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from tests.support.common import REPO

#: Lowest first. A module may import modules of its own layer and below.
AGENT_LAYERS = (
    ("ggufpipe_agent", "ggufpipe_agent.errors", "ggufpipe_agent.aio", "ggufpipe_agent.tasks"),
    ("ggufpipe_agent.wire",),
    ("ggufpipe_agent.gguf",),
    ("ggufpipe_agent.llama",),
    ("ggufpipe_agent.stagefiles",),
    ("ggufpipe_agent.delivery",),
    ("ggufpipe_agent.stage",),
    ("ggufpipe_agent.process",),
    ("ggufpipe_agent.selfcheck", "ggufpipe_agent.cli", "ggufpipe_agent.__main__"),
)
TUI_LAYERS = (
    ("ggufpipe_tui",),
    ("ggufpipe_tui.core",),
    ("ggufpipe_tui.provision",),
    ("ggufpipe_tui.transports",),
    ("ggufpipe_tui.dataplane",),
    ("ggufpipe_tui.session",),
    ("ggufpipe_tui.views",),
    ("ggufpipe_tui.commands",),
    ("ggufpipe_tui.server",),
    ("ggufpipe_tui.cli",),
)
#: What the orchestrator's pure core may use of the agent: data, no processes.
CORE_MAY_USE = ("ggufpipe_agent", "ggufpipe_agent.errors", "ggufpipe_agent.wire", "ggufpipe_agent.gguf")
MAX_MODULES = 25


def modules() -> dict[str, Path]:
    found = {}
    for package in ("ggufpipe_agent", "ggufpipe_tui"):
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts).removesuffix(".__init__")] = path
    return found


def imports(path: Path, runtime_only: bool) -> set[str]:
    """Every module ``path`` imports (at any depth; ``runtime_only``: not the
    ones under ``if TYPE_CHECKING``, nor those inside functions)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test) and runtime_only:
                continue
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) and runtime_only:
                continue
            if isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                found.add(child.module)
                found.update(f"{child.module}.{alias.name}" for alias in child.names)
            elif isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return found


def graph(runtime_only: bool) -> dict[str, set[str]]:
    known = modules()
    return {name: {m for m in imports(path, runtime_only) if m in known and m != name} for name, path in known.items()}


def layer_of(module: str, layers: tuple[tuple[str, ...], ...]) -> int:
    best, level = -1, -1
    for index, names in enumerate(layers):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, level = len(name), index
    return level


def test_imports_go_only_downward() -> None:
    wrong = []
    for module, targets in graph(runtime_only=False).items():
        for target in targets:
            for layers in (AGENT_LAYERS, TUI_LAYERS):
                same = module.split(".")[0] == target.split(".")[0] == layers[0][0]
                if same and layer_of(target, layers) > layer_of(module, layers):
                    wrong.append(f"{module} -> {target}")
            if module.startswith("ggufpipe_agent") and target.startswith("ggufpipe_tui"):
                wrong.append(f"{module} -> {target} (the agent never imports the orchestrator)")
            core = module.startswith("ggufpipe_tui.core") and target.startswith("ggufpipe_agent")
            if core and layer_of(target, AGENT_LAYERS) > layer_of(CORE_MAY_USE[-1], AGENT_LAYERS):
                wrong.append(f"{module} -> {target} (the core uses only the agent's data layers)")
    assert not wrong, "imports that go up a layer:\n" + "\n".join(sorted(wrong))


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on.add(node)
        for target in edges[node]:
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in edges:
        if node not in index:
            connect(node)
    return found


def test_no_import_cycles_at_run_time_or_for_types() -> None:
    assert cycles(graph(runtime_only=True)) == []
    assert cycles(graph(runtime_only=False)) == [], "a cycle through imports for types or inside functions"


def test_no_package_folder_is_crowded() -> None:
    crowded = {}
    for package in ("ggufpipe_agent", "ggufpipe_tui"):
        for folder in [REPO / package, *(p for p in (REPO / package).iterdir() if p.is_dir())]:
            count = len(list(folder.glob("*.py")))
            if count > MAX_MODULES:
                crowded[str(folder.relative_to(REPO))] = count
    assert not crowded, f"folders of more than {MAX_MODULES} modules: {crowded}"


def test_the_wire_layer_loads_nothing_above_it() -> None:
    """The orchestrator's pure core imports the protocol: that must not load
    stage files, llama.cpp or the agent process."""
    import subprocess

    script = (
        "import sys, ggufpipe_agent.wire.protocol, ggufpipe_agent.wire.framing\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('ggufpipe_agent.'))))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=REPO)
    loaded = done.stdout.split()
    assert all(m.startswith(("ggufpipe_agent.wire", "ggufpipe_agent.errors")) for m in loaded), loaded
    assert "llama_cpp" not in done.stdout
