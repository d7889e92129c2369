"""This orchestrator's agent, as hosts get it: its name and the wheels it is made of.

:func:`this_build` names the agent a host must run for this orchestrator:
ggufpipe's version, and a key over its source and the versions of every
dependency installed here (so a changed checkout, or an upgraded numpy, is a
new agent: versions never mix in one venv). It is cheap (no subprocess), so
every start can ask for it.

:func:`wheelhouse` makes (once per key, kept in ``~/.cache/ggufpipe/wheelhouse``)
the wheels a host is set up from: ggufpipe's own (built from the checkout
this orchestrator runs from, or found where wheels are kept), pip's, and
every dependency at the version pinned here, the llama-cpp-python build
among them taken from where ``scripts/setup`` keeps it (``.wheels/`` of the
checkout, or ``$GGUFPIPE_WHEELS``): pip here builds nothing big, and a host
it is pushed to needs no index.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata as metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ggufpipe_agent
from ggufpipe_agent import __version__
from ggufpipe_agent.errors import GgufpipeError

DISTRIBUTION = "ggufpipe"
PACKAGES = ("ggufpipe_agent", "ggufpipe_tui")
LLAMA = "llama-cpp-python"
CMAKE_ARGS_FILE = "llama_cpp_python.cmake_args"  # next to the wheel: how scripts/setup built it
PIP_TIMEOUT = 1800.0
COMPLETE = "complete"


class WheelError(GgufpipeError):
    """The wheels to push cannot be made here."""


@dataclass(frozen=True)
class AgentBuild:
    """The agent this orchestrator needs on a host."""

    version: str
    key: str  # over the source and the dependency versions
    pins: tuple[str, ...]  # "name==version" of each dependency installed here

    @property
    def name(self) -> str:
        """The agent's directory under a host's agents directory."""
        return f"ggufpipe-{self.version}-{self.key}"

    @property
    def python(self) -> str:
        return f"{sys.version_info[0]}.{sys.version_info[1]}"

    @property
    def platform(self) -> str:
        return sysconfig.get_platform()


def _name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    return match.group(1) if match else ""


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def dependency_pins() -> tuple[str, ...]:
    """Every installed distribution ggufpipe needs, at its installed version
    (requirements of extras are left out; a marker that is false here leaves
    out what is not installed)."""
    pins: dict[str, str] = {}
    todo = [DISTRIBUTION]
    while todo:
        try:
            dist = metadata.distribution(todo.pop())
        except metadata.PackageNotFoundError:
            continue
        for requirement in dist.requires or []:
            if "extra ==" in requirement.replace("extra==", "extra =="):
                continue
            name = _canonical(_name(requirement))
            if not name or name in pins:
                continue
            try:
                pins[name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                continue
            todo.append(name)
    return tuple(sorted(f"{name}=={version}" for name, version in pins.items()))


def source_root() -> Path | None:
    """The checkout this orchestrator runs from (editable install), if it is one."""
    root = Path(ggufpipe_agent.__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() else None


def _source_digest() -> str:
    digest = hashlib.sha256()
    for package in PACKAGES:
        base = Path(ggufpipe_agent.__file__).resolve().parents[1] / package
        for path in sorted(base.rglob("*")):
            if path.suffix in (".py", ".tcss") and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(base.parent)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def this_build() -> AgentBuild:
    pins = dependency_pins()
    key = hashlib.sha256(f"{__version__}\n{_source_digest()}\n{chr(10).join(pins)}".encode()).hexdigest()
    return AgentBuild(__version__, key[:12], pins)


def cache_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ggufpipe"


def wheel_dirs() -> list[Path]:
    """Where wheels built here are kept: $GGUFPIPE_WHEELS, the checkout's .wheels/."""
    found = [Path(part) for part in os.environ.get("GGUFPIPE_WHEELS", "").split(os.pathsep) if part]
    root = source_root()
    if root is not None:
        found.append(root / ".wheels")
    return [path for path in found if path.is_dir()]


@dataclass(frozen=True)
class LlamaWheel:
    path: Path
    cmake_args: str  # "" when unknown

    @property
    def cuda(self) -> bool:
        return "CUDA=on" in self.cmake_args.replace("CUDA=ON", "CUDA=on")


def llama_wheel(build: AgentBuild | None = None) -> LlamaWheel | None:
    """The kept llama-cpp-python wheel of the version installed here, if any."""
    build = build or this_build()
    versions = [pin.split("==", 1)[1] for pin in build.pins if pin.startswith(LLAMA + "==")]
    if not versions:
        return None
    for directory in wheel_dirs():
        for path in sorted(directory.glob(f"llama_cpp_python-{versions[0]}-*.whl")):
            args = directory / CMAKE_ARGS_FILE
            return LlamaWheel(path, args.read_text().strip() if args.is_file() else "")
    return None


@dataclass(frozen=True)
class Wheelhouse:
    """What a host is set up from: ``own`` (ggufpipe's wheel), ``pip``,
    ``constraints`` (the pins), ``deps`` (every dependency's wheel)."""

    own: Path
    pip: Path
    constraints: Path
    deps: tuple[Path, ...]

    def files(self, push: bool) -> list[Path]:
        """What is sent: everything (push), or what a build there needs."""
        return [self.own, self.pip, self.constraints, *(self.deps if push else ())]


def _pip(*args: str, cwd: Path | None = None) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=PIP_TIMEOUT,
    )
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        raise WheelError(f"pip {args[0]} here failed: {' '.join(lines[-3:]) or done.returncode}")


def _kept(target: Path, pattern: str, make: Callable[[Path], None], house: Path) -> Path:
    """``target``/``pattern``, made once by ``make(partial)`` in a temporary
    folder renamed into place (so a folder that exists is complete)."""
    found = sorted(target.glob(pattern)) if (target / COMPLETE).exists() else []
    if found:
        return found[0]
    partial = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=house))
    try:
        make(partial)
        (partial / COMPLETE).touch()
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return sorted(target.glob(pattern))[0]


def _make_own(build: AgentBuild, partial: Path) -> None:
    """ggufpipe's wheel for this build: made from the checkout, or found kept;
    and the version pins beside it."""
    root = source_root()
    if root is not None:
        # setuptools builds in the checkout's build/, and a build/lib left
        # from before a module moved would put the old module in the wheel.
        shutil.rmtree(root / "build", ignore_errors=True)
        _pip("wheel", "--no-deps", "-w", str(partial), str(root), cwd=root)
    else:
        kept = [p for d in wheel_dirs() for p in d.glob(f"ggufpipe-{build.version}-*.whl")]
        if not kept:
            raise WheelError(
                f"no wheel of ggufpipe {build.version} here to send (this ggufpipe is not a checkout): "
                "put the wheel it was installed from in $GGUFPIPE_WHEELS"
            )
        shutil.copy2(kept[0], partial / kept[0].name)
    (partial / "constraints.txt").write_text("\n".join(build.pins) + "\n")


def wheelhouse(progress: Callable[[str], None] = lambda line: None, push: bool = True) -> Wheelhouse:
    """The wheels hosts are set up from (made here once per build, kept in
    the wheelhouse). ``push``: also every dependency's wheel (for a host
    that installs with no index)."""
    build = this_build()
    house = cache_home() / "wheelhouse"
    house.mkdir(parents=True, exist_ok=True)
    pip_version = metadata.version("pip")
    pip = _kept(
        house / f"pip-{pip_version}",
        "pip-*.whl",
        lambda partial: _pip(
            "download", "--no-deps", "--only-binary=:all:", "-d", str(partial), f"pip=={pip_version}"
        ),
        house,
    )
    own = _kept(house / build.name, "ggufpipe-*.whl", functools.partial(_make_own, build), house)
    constraints = own.parent / "constraints.txt"
    if not push:
        return Wheelhouse(own, pip, constraints, ())
    llama = llama_wheel(build)
    if llama is None:
        raise WheelError(
            f"no {LLAMA} wheel kept here to send (scripts/setup keeps the one it builds in .wheels/; "
            "or name a folder with it in $GGUFPIPE_WHEELS)"
        )
    deps_key = hashlib.sha256("\n".join([*build.pins, llama.path.name, build.platform]).encode()).hexdigest()
    target = house / f"deps-{deps_key[:12]}"
    if not (target / COMPLETE).exists():
        progress("making the dependency wheels to send (once for this set of versions)")

    def make_deps(partial: Path) -> None:
        links = ["--find-links", str(llama.path.parent)]
        _pip("wheel", "-w", str(partial), *links, "-c", str(constraints), str(own))
        for extra in partial.glob("ggufpipe-*.whl"):
            extra.unlink()

    _kept(target, "*.whl", make_deps, house)
    return Wheelhouse(own, pip, constraints, tuple(sorted(target.glob("*.whl"))))
