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
#: The agent's layers every orchestrator layer may use: its base, the wire
#: protocol and the model's facts (data, no processes).
AGENT_DATA = ("ggufpipe_agent", "ggufpipe_agent.wire", "ggufpipe_agent.gguf")
#: What each orchestrator layer may import of the agent: an entry that names a
#: layer of AGENT_LAYERS allows that layer, any other names one module. The
#: orchestrator drives two pieces of the agent's own code: it tokenizes with the
#: model's vocabulary where the model is local, and sends stage files with the
#: agent's sender.
ORCHESTRATOR_MAY_USE: dict[str, tuple[str, ...]] = {
    "ggufpipe_tui": AGENT_DATA,
    "ggufpipe_tui.core": AGENT_DATA,
    "ggufpipe_tui.provision": AGENT_DATA,
    "ggufpipe_tui.transports": ("ggufpipe_agent", "ggufpipe_agent.wire"),
    "ggufpipe_tui.dataplane": ("ggufpipe_agent", "ggufpipe_agent.wire"),
    "ggufpipe_tui.session": (
        *AGENT_DATA,
        "ggufpipe_agent.llama.vocabulary",
        "ggufpipe_agent.delivery.sender",
    ),
    "ggufpipe_tui.views": AGENT_DATA,
    "ggufpipe_tui.commands": AGENT_DATA,
    # A request's grammar is checked by the parser the last stage runs.
    "ggufpipe_tui.server": (*AGENT_DATA, "ggufpipe_agent.llama.sampler"),
    "ggufpipe_tui.cli": AGENT_DATA,
}
MAX_MODULES = 25


def modules() -> dict[str, Path]:
    found = {}
    for package in ("ggufpipe_agent", "ggufpipe_tui"):
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts).removesuffix(".__init__")] = path
    return found


def absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The module a ``from`` import names, relative ones (``from . import x``,
    ``from .mod import y``) resolved against ``module``."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports(path: Path, runtime_only: bool) -> set[str]:
    """Every module ``path`` imports (at any depth; ``runtime_only``: not the
    ones under ``if TYPE_CHECKING``, nor those inside functions)."""
    found: set[str] = set()
    parts = path.relative_to(REPO).with_suffix("").parts
    module = ".".join(parts).removesuffix(".__init__")
    is_package = path.name == "__init__.py"

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test) and runtime_only:
                continue
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) and runtime_only:
                continue
            if isinstance(child, ast.ImportFrom):
                source = absolute(module, is_package, child)
                found.add(source)
                found.update(f"{source}.{alias.name}" for alias in child.names)
            elif isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return found


def graph(runtime_only: bool) -> dict[str, set[str]]:
    known = modules()
    return {
        name: {m for m in imports(path, runtime_only) if m in known and m != name}
        for name, path in known.items()
    }


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
            orchestrator = module.startswith("ggufpipe_tui") and target.startswith("ggufpipe_agent")
            if orchestrator and not orchestrator_may_use(module, target):
                wrong.append(f"{module} -> {target} (not in ORCHESTRATOR_MAY_USE)")
    assert not wrong, "imports that go up a layer:\n" + "\n".join(sorted(wrong))


#: The front ends: each stands on the session alone, none imports another
#: (what two of them share lives below them, in core/ or session/).
FRONT_ENDS = ("ggufpipe_tui.views", "ggufpipe_tui.commands", "ggufpipe_tui.server")


def front_end(module: str) -> str:
    return next((name for name in FRONT_ENDS if module == name or module.startswith(name + ".")), "")


def test_no_front_end_imports_another() -> None:
    wrong = [
        f"{module} -> {target}"
        for module, targets in graph(runtime_only=False).items()
        for target in targets
        if front_end(module) and front_end(target) and front_end(module) != front_end(target)
    ]
    assert not wrong, "front ends that import another:\n" + "\n".join(sorted(wrong))


def orchestrator_may_use(module: str, target: str) -> bool:
    layer = TUI_LAYERS[layer_of(module, TUI_LAYERS)][0]
    layers = {name for names in AGENT_LAYERS for name in names}
    for allowed in ORCHESTRATOR_MAY_USE[layer]:
        if allowed in layers and layer_of(target, AGENT_LAYERS) == layer_of(allowed, AGENT_LAYERS):
            return True
        if allowed not in layers and (target == allowed or target.startswith(allowed + ".")):
            return True
    return False


def test_the_table_names_every_orchestrator_layer() -> None:
    assert set(ORCHESTRATOR_MAY_USE) == {names[0] for names in TUI_LAYERS}
    known = modules()
    assert all(name in known for names in ORCHESTRATOR_MAY_USE.values() for name in names)


def test_relative_imports_are_resolved() -> None:
    """``from . import x`` and ``from .mod import y`` count like absolute ones."""
    source = ast.parse("from . import a\nfrom .b import c\nfrom .. import d\n")
    froms = [node for node in source.body if isinstance(node, ast.ImportFrom)]
    assert [absolute("pkg.sub.mod", False, node) for node in froms] == ["pkg.sub", "pkg.sub.b", "pkg"]
    assert [absolute("pkg.sub", True, node) for node in froms] == ["pkg.sub", "pkg.sub.b", "pkg"]


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
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=REPO
    )
    loaded = done.stdout.split()
    assert all(
        m.startswith(("ggufpipe_agent.wire", "ggufpipe_agent.errors", "ggufpipe_agent.ids")) for m in loaded
    ), loaded
    assert "llama_cpp" not in done.stdout
