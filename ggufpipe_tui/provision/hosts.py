"""Giving a host this orchestrator's agent, over its SSH connection.

A host whose inventory entry names no ``agent:`` runs the agent set up in
``AGENTS/NAME`` (``agents_dir:``, default ``~/.cache/ggufpipe/agents``; NAME
from :func:`~ggufpipe_tui.provision.wheels.this_build`: version and a key, so
versions never mix). Starting it costs nothing extra: :func:`start_command`
runs it when its ``READY`` file is there and otherwise exits with
:data:`NOT_SET_UP`, and only then :func:`set_up` runs (once per host at a
time here, and a lock file there for other orchestrators):

* :func:`probe` (``remote.py probe``): the host's Python and platform, GPUs,
  free disk, whether the agent is already there;
* the way, :func:`choose`: **push** (every wheel sent on the connection,
  pip there has no index) where the host's Python and platform are this
  machine's and the llama-cpp-python wheel kept here suits it (a CUDA build
  for a host with an NVIDIA GPU); else **build** there (ggufpipe's wheel and
  the version pins sent, the rest from the host's own index, llama-cpp-python
  compiled there). ``install: push`` or ``install: build`` chooses;
* ``remote.py install``, its steps and pip's output reported as they come.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import tarfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncssh

from ggufpipe_agent.errors import GgufpipeError
from ggufpipe_tui.core.format import format_bytes
from ggufpipe_tui.core.inventory import HostSpec
from ggufpipe_tui.provision import remote, wheels
from ggufpipe_tui.provision.shell import output_text, shell_path

REMOTE = (Path(__file__).parent / "remote.py").read_text()
DEFAULT_AGENTS_DIR = '"${XDG_CACHE_HOME:-$HOME/.cache}/ggufpipe/agents"'
#: The exit status of :func:`start_command` when the agent is not set up.
NOT_SET_UP = 75
NOT_SET_UP_WORDS = "ggufpipe: no agent set up here yet:"
#: Free disk a set-up needs beyond the wheels (unpacked, pip's own work).
PUSH_FACTOR = 3
BUILD_BYTES = 3 << 30  # a llama.cpp build (CUDA's is the larger)
CHUNK = 1 << 20
BUILD_PROGRESS = re.compile(r"^\s*\[\s*(\d{1,3})%\]")
PROBE_TIMEOUT = 60.0
BY_HAND = "docs/ssh.md, 'Preparing a GPU host by hand'"
READY = remote.READY
MIN_PYTHON = remote.MIN_PYTHON


class SetupError(GgufpipeError):
    """A host could not be given an agent; the message names it, the step and what to do."""


def agents_dir(host: HostSpec) -> str:
    """The host's agents folder, as its shell reads it."""
    return shell_path(host.agents_dir) if host.agents_dir else DEFAULT_AGENTS_DIR


def agent_dir(host: HostSpec) -> str:
    return f"{agents_dir(host)}/{wheels.this_build().name}"


def managed_agent(host: HostSpec) -> str:
    """The command of the agent set up for this orchestrator on ``host``."""
    return f"{agent_dir(host)}/bin/python -m ggufpipe_agent"


def start_command(host: HostSpec, arguments: str) -> str:
    """Run the set-up agent with ``arguments``, or say it is not there (exit :data:`NOT_SET_UP`)."""
    where = agent_dir(host)
    return (
        f"if [ -f {where}/{READY} ]; then exec {managed_agent(host)}{arguments}; fi; "
        f"echo {shlex.quote(NOT_SET_UP_WORDS)} {where} >&2; exit {NOT_SET_UP}"
    )


@dataclass
class Probed:
    python: str = ""
    executable: str = ""
    platform: str = ""
    agents: str = ""
    cache: str = ""
    free: int = -1
    gpus: list[str] = field(default_factory=list)
    ready: bool = False
    others: list[str] = field(default_factory=list)
    too_old: bool = False


def _events(text: str) -> list[dict[str, Any]]:
    found = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                found.append(value)
    return found


def _remote(host: HostSpec, *arguments: str) -> str:
    return f"{host.python} -c {shlex.quote(REMOTE)} " + " ".join(arguments)


def _where(host: HostSpec) -> str:
    return f"{host.name} ({host.where})"


async def probe(
    host: HostSpec, connection: asyncssh.SSHClientConnection, timeout: float = PROBE_TIMEOUT
) -> Probed:
    """What ``host`` has; :class:`SetupError` when its Python cannot even say."""
    cache = shell_path(host.cache_dir) if host.cache_dir else "''"
    command = _remote(host, "probe", agents_dir(host), shlex.quote(wheels.this_build().name), cache)
    try:
        done = await asyncio.wait_for(connection.run(command, check=False, encoding=None), timeout)
    except (asyncssh.Error, OSError, asyncio.TimeoutError) as error:
        raise SetupError(f"{_where(host)}: the check broke off: {error or type(error).__name__}") from None
    said = _events(output_text(done.stdout))
    if done.exit_status == 127 or not said:
        lines = output_text(done.stderr).strip().splitlines()
        if done.exit_status == 127:
            raise SetupError(
                f"{_where(host)}: no {host.python} on the login PATH: ggufpipe needs Python "
                f"{'.'.join(map(str, MIN_PYTHON))} or newer there (install it, or name it with python: in "
                "the host's entry)"
            )
        raise SetupError(
            f"{_where(host)}: {host.python} could not run the check"
            + (f": {lines[-1]}" if lines else f" (exit status {done.exit_status})")
        )
    known = {name for name in Probed.__dataclass_fields__}
    return Probed(**{key: value for key, value in said[0].items() if key in known})


def python_problem(host: HostSpec, probed: Probed) -> str:
    """Why the host's Python cannot run an agent ("" when it can)."""
    version = tuple(int(part) for part in probed.python.split(".")[:2] if part.isdigit())
    if probed.too_old or version < MIN_PYTHON:
        return (
            f"its {host.python} is Python {probed.python}, too old: ggufpipe needs "
            f"{'.'.join(map(str, MIN_PYTHON))} or newer (install one, and name it with python: in the "
            "host's entry)"
        )
    return ""


def choose(host: HostSpec, probed: Probed) -> tuple[str, str]:
    """``("push" | "build", why)`` for this host."""
    build = wheels.this_build()
    same = probed.python.startswith(build.python + ".") and probed.platform == build.platform
    llama = wheels.llama_wheel(build)
    if not same:
        ours = f"{build.python} on {build.platform}"
        why = f"its Python {probed.python} on {probed.platform} is not this machine's ({ours})"
    elif llama is None:
        why = "no llama-cpp-python wheel is kept on this machine (scripts/setup keeps one in .wheels/)"
    elif probed.gpus and not llama.cuda:
        why = "it has an NVIDIA GPU and the llama-cpp-python wheel kept here is not a CUDA build"
    else:
        why = ""
    if host.install == "push":
        if why:
            raise SetupError(f"{_where(host)}: install: push cannot be done: {why}")
        return "push", "install: push"
    if host.install == "build" or why:
        return "build", why or "install: build"
    return "push", "its Python and platform are this machine's"


def _tar_chunks(files: list[Path]) -> Any:
    """A tar stream of ``files`` (flat names), in chunks: nothing held whole."""
    for path in files:
        info = tarfile.TarInfo(path.name)
        info.size = path.stat().st_size
        info.mtime = int(time.time())
        yield info.tobuf(format=tarfile.PAX_FORMAT)
        with path.open("rb") as source:
            while chunk := source.read(CHUNK):
                yield chunk
        padding = -info.size % tarfile.BLOCKSIZE
        if padding:
            yield b"\0" * padding
    yield b"\0" * (tarfile.BLOCKSIZE * 2)


@dataclass
class SetupResult:
    host: str
    how: str  # "ready" (it was there), "pushed", "built there", "set up by another"
    why: str = ""
    seconds: float = 0.0
    bytes_sent: int = 0


Progress = Callable[[str], None]


_LOCKS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, str], asyncio.Lock]] = (
    weakref.WeakKeyDictionary()
)


async def set_up_once(
    host: HostSpec,
    connection: asyncssh.SSHClientConnection,
    progress: Progress,
    log: Progress,
    redo: bool = False,
    probed: Probed | None = None,
) -> SetupResult:
    """:func:`set_up`, one at a time per host and agents folder in this
    process: the stages of one host wait for the first to set it up.
    ``probed``: what a probe just said of the host (else it is probed)."""
    locks = _LOCKS.setdefault(asyncio.get_running_loop(), {})
    lock = locks.setdefault((host.where, agents_dir(host)), asyncio.Lock())
    # A stage that waited for another's set-up of the host does not redo it.
    waited = lock.locked()
    async with lock:
        fresh = None if waited else probed  # another stage's set-up changed what a probe said
        return await set_up(host, connection, progress, log, fresh, redo=redo and not waited)


async def set_up(
    host: HostSpec,
    connection: asyncssh.SSHClientConnection,
    progress: Progress,
    log: Progress,
    probed: Probed | None = None,
    redo: bool = False,
) -> SetupResult:
    """Give ``host`` this orchestrator's agent (nothing when it has it;
    ``redo``: set it up again, it is there but cannot run)."""
    began = time.monotonic()
    probed = probed or await probe(host, connection)
    problem = python_problem(host, probed)
    if problem:
        raise SetupError(f"{_where(host)}: {problem}")
    if probed.ready and not redo:
        return SetupResult(host.name, "ready", seconds=time.monotonic() - began)
    mode, why = choose(host, probed)
    progress(f"setting up its agent ({'pushing wheels' if mode == 'push' else 'building there'}: {why})")
    try:
        house = await asyncio.to_thread(wheels.wheelhouse, progress, mode == "push")
    except wheels.WheelError as error:
        raise SetupError(f"{_where(host)}: cannot make the wheels to send: {error}") from None
    files = house.files(mode == "push")
    size = sum(path.stat().st_size for path in files)
    need = size * PUSH_FACTOR + (100 << 20) if mode == "push" else BUILD_BYTES
    if 0 <= probed.free < need:
        raise SetupError(
            f"{_where(host)}: not enough free disk for its agent at {probed.agents}: "
            f"{format_bytes(probed.free)} free, the set-up needs about {format_bytes(need)} "
            "(free some, or name another folder with agents_dir: in the host's entry)"
        )
    command = _remote(
        host,
        "install",
        agents_dir(host),
        shlex.quote(wheels.this_build().name),
        mode,
        str(need),
        str(int(redo)),
    )
    sent, outcome = await _install(host, connection, command, files, progress, log)
    how = {"push": "pushed", "build": "built there"}[mode]
    if outcome.get("already"):
        how = "set up by another"
    return SetupResult(host.name, how, why, time.monotonic() - began, sent)


async def _install(
    host: HostSpec,
    connection: asyncssh.SSHClientConnection,
    command: str,
    files: list[Path],
    progress: Progress,
    log: Progress,
) -> tuple[int, dict[str, Any]]:
    try:
        process = await connection.create_process(command, encoding=None)
    except (asyncssh.Error, OSError) as error:
        raise SetupError(f"{_where(host)}: cannot start the set-up: {error}") from None
    said: dict[str, Any] = {}
    errors: list[str] = []
    sent = 0

    async def read_errors() -> None:
        while line := await process.stderr.readline():
            text = output_text(line).strip()
            if text:
                errors[:] = [*errors[-5:], text]
                log(text)

    async def read() -> None:
        while line := await process.stdout.readline():
            for event in _events(output_text(line)):
                if "step" in event and "error" not in event:
                    progress(str(event["step"]))
                if "log" in event:
                    log(str(event["log"]))
                    built = BUILD_PROGRESS.search(str(event["log"]))
                    if built and built.group(1) != said.get("built"):  # a build's "[ 42%] Building ..."
                        said["built"] = built.group(1)
                        progress(f"building llama-cpp-python there: {built.group(1)}%")
                said.update(event)

    async def write() -> None:
        nonlocal sent
        try:
            for chunk in _tar_chunks(files):
                process.stdin.write(chunk)
                await process.stdin.drain()
                sent += len(chunk)
            process.stdin.write_eof()
        except (asyncssh.Error, OSError, BrokenPipeError):
            pass  # the set-up ended early: its own words say why

    reader = asyncio.ensure_future(asyncio.gather(read(), read_errors()))
    writer = asyncio.ensure_future(write())
    try:
        await reader
        await process.wait_closed()
    except (asyncssh.Error, OSError) as error:
        raise SetupError(f"{_where(host)}: the set-up's connection broke: {error}") from None
    finally:
        writer.cancel()
        reader.cancel()
        process.close()
    if "error" in said or process.exit_status != 0 or "ready" not in said:
        step = said.get("step", "start")
        if "error" in said:
            reason = f"step {step}: {said['error']}"
        else:
            last = f": {errors[-1]}" if errors else ""
            reason = f"it ended without a result (exit status {process.exit_status}){last}"
        raise SetupError(
            f"{_where(host)}: setting up its agent failed: {reason}. To do it by hand: {BY_HAND}"
        )
    return sent, said
