"""Can this host run the agent? Every module the agent can reach, checked at
once, so that a host missing a package says which one before anything loads.

The agent imports several packages inside functions (``gguf`` when a stage
file is read, ``llama_cpp`` when a stage loads): a host without them would
only fail halfway through a run. The modules to check are read from the
agent's own source (every ``import`` statement, at any depth), so a new lazy
import is covered without a list to keep. An import inside ``try: ... except
ImportError`` is optional (``uvloop``) and not required.

Two depths:

* :func:`missing` finds the spec of each package in :data:`REQUIRED` without
  importing it: cheap enough for every agent start (about 1 ms), and it
  catches what a half-made venv lacks. :data:`REQUIRED` is what
  :func:`requirements` reads from the source (a test keeps them equal:
  reading the source at every start would cost about 0.3 s);
* :func:`broken` (``ggufpipe-agent --check``) imports every agent module and
  every package it needs, so a package that is present but does not load (a
  wheel of another Python, a missing shared library) is named too.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

from ggufpipe_agent import UNFIT_MARKER

PACKAGE = "ggufpipe_agent"
MARKER = UNFIT_MARKER  # starts the line the orchestrator looks for
IMPORT_ERRORS = ("ImportError", "ModuleNotFoundError")
#: The packages outside the standard library the agent imports
#: unconditionally, each with the first agent module that does (as
#: :func:`requirements` finds them; tests/test_selfcheck.py keeps them equal).
REQUIRED = {
    "gguf": "ggufpipe_agent.gguf.facts",
    "llama_cpp": "ggufpipe_agent.llama.devices",
    "msgpack": "ggufpipe_agent.wire.protocol",
    "numpy": "ggufpipe_agent.llama.batches",
}


@dataclass(frozen=True)
class Problem:
    module: str  # what cannot be imported
    needed_by: str  # the agent module that imports it
    error: str

    def describe(self) -> str:
        return f"{MARKER} module '{self.module}' (imported by {self.needed_by}) {self.error}"


def _optional(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether an import sits in a ``try`` that catches ImportError."""
    child, parent = node, parents.get(node)
    while parent is not None:
        if isinstance(parent, ast.Try) and child in parent.body:
            for handler in parent.handlers:
                names = handler.type
                caught = names.elts if isinstance(names, ast.Tuple) else [names]
                if any(isinstance(n, ast.Name) and n.id in IMPORT_ERRORS for n in caught):
                    return True
        child, parent = parent, parents.get(parent)
    return False


def requirements() -> dict[str, str]:
    """Each top-level module outside the standard library that the agent
    imports unconditionally, with the first agent module that does."""
    root = Path(__file__).resolve().parent
    needed: dict[str, str] = {}
    for path in sorted(root.rglob("*.py")):
        module = ".".join((PACKAGE, *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in (PACKAGE, "__future__"):
                    continue
                if not _optional(node, parents):
                    needed.setdefault(top, module)
    return needed


def agent_modules() -> list[str]:
    root = Path(__file__).resolve().parent
    names = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__main__":
            continue  # running it is running the agent
        names.append(".".join((PACKAGE, *parts)).removesuffix(".__init__"))
    return names


def missing() -> Problem | None:
    """The first required package that is not installed (no import: cheap)."""
    for top, needed_by in sorted(REQUIRED.items()):
        try:
            found = importlib.util.find_spec(top) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return Problem(top, needed_by, "is not installed")
    return None


def broken() -> Problem | None:
    """The first agent module or required package that does not import."""
    problem = missing()
    if problem is not None:
        return problem
    for top, needed_by in sorted(requirements().items()):
        try:
            importlib.import_module(top)
        except Exception as error:  # noqa: BLE001 - any failure to load is the finding
            return Problem(top, needed_by, f"does not load: {type(error).__name__}: {error}")
    for name in agent_modules():
        try:
            importlib.import_module(name)
        except ImportError as error:
            return Problem(error.name or name, name, f"does not import: {error}")
        except Exception as error:  # noqa: BLE001
            return Problem(name, name, f"does not load: {type(error).__name__}: {error}")
    return None


def check_main() -> int:
    """``ggufpipe-agent --check``: one line, exit 0 when everything loads."""
    from ggufpipe_agent import PROTOCOL_VERSION, __version__

    problem = broken()
    where = f"{sys.executable} (Python {sys.version.split()[0]})"
    if problem is not None:
        print(f"{problem.describe()}; Python: {where}", file=sys.stderr)
        return 1
    versions = []
    for top in sorted(requirements()):
        version = getattr(sys.modules.get(top), "__version__", "")
        versions.append(f"{top} {version}".strip())
    print(
        f"ggufpipe-agent {__version__} (protocol {PROTOCOL_VERSION}) can run here: "
        f"{len(agent_modules())} modules and {', '.join(versions)} load; Python: {where}"
    )
    return 0
