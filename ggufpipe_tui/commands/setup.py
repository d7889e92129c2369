"""``ggufpipe-tui setup INVENTORY --check``: what each host has for an agent.

For every host of the inventory (or those given with ``--host``) it reports,
over the host's own SSH connection and without starting any agent: its
``python3`` (version, platform), its NVIDIA GPUs (``nvidia-smi``), the free
disk where the stage cache goes, and the agent its ``agent:`` command runs
(``--version``); then whether wheels from this machine would fit it (the
same Python minor version and platform) or an agent would have to be built
there. Setting a host up from this report is the next step (docs/ssh.md
says what to do by hand until then).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import subprocess
import sys
import sysconfig
from dataclasses import asdict, dataclass, field
from typing import IO, Any

from ggufpipe_agent import PROTOCOL_VERSION, __version__
from ggufpipe_agent.errors import GgufpipeError
from ggufpipe_tui.core.format import format_bytes
from ggufpipe_tui.core.inventory import HostSpec, Inventory

EXIT_OK = 0
EXIT_UNFIT = 1
EXIT_SETUP = 2
#: The oldest Python an agent runs on (pyproject.toml's requires-python).
MIN_PYTHON = (3, 10)

#: Run by the host's python3: one JSON line. Standard library only.
PROBE = r"""
import json, os, platform, shutil, subprocess, sys, sysconfig
cache = os.environ.get("GGUFPIPE_CACHE_DIR") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "ggufpipe")
if len(sys.argv) > 1 and sys.argv[1]:
    cache = os.path.expanduser(sys.argv[1])
there = cache
while not os.path.isdir(there) and os.path.dirname(there) != there:
    there = os.path.dirname(there)
try:
    free = shutil.disk_usage(there).free
except OSError:
    free = -1
gpus = []
smi = shutil.which("nvidia-smi")
if smi:
    try:
        out = subprocess.run([smi, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
        gpus = [line.strip() for line in out.splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError):
        gpus = ["nvidia-smi failed"]
print(json.dumps({"python": platform.python_version(), "executable": sys.executable,
                  "platform": sysconfig.get_platform(), "cache": cache, "free": free, "gpus": gpus}))
"""


@dataclass
class HostReport:
    host: str
    where: str
    python: str = ""
    platform: str = ""
    gpus: list[str] = field(default_factory=list)
    cache: str = ""
    free_bytes: int = -1
    agent: str = ""  # what `agent --version` said ("" when it did not run)
    verdict: str = ""
    error: str = ""


def _verdict(report: HostReport) -> str:
    if report.error:
        return ""
    version = tuple(int(part) for part in report.python.split(".")[:2] if part.isdigit())
    if version < MIN_PYTHON:
        return f"Python {report.python} is too old: ggufpipe needs {'.'.join(map(str, MIN_PYTHON))} or newer"
    expected = f"ggufpipe-agent {__version__} (protocol {PROTOCOL_VERSION})"
    if report.agent == expected:
        return "ready: its agent is this orchestrator's version"
    ours = f"{sys.version_info[0]}.{sys.version_info[1]}"
    same = report.python.startswith(ours + ".") and report.platform == sysconfig.get_platform()
    how = (
        "wheels from this machine fit it (same Python and platform)"
        if same
        else f"an agent must be built there (Python {report.python} on {report.platform}; "
        f"this machine: {ours} on {sysconfig.get_platform()})"
    )
    have = f"its agent is {report.agent}" if report.agent else "no agent runs there"
    return f"{have}; {how}"


def _fill(report: HostReport, probed: dict[str, Any], agent: str) -> None:
    report.python = str(probed.get("python", ""))
    report.platform = str(probed.get("platform", ""))
    report.gpus = [str(gpu) for gpu in probed.get("gpus", [])]
    report.cache = str(probed.get("cache", ""))
    report.free_bytes = int(probed.get("free", -1))
    report.agent = agent
    report.verdict = _verdict(report)


def _first_json(text: str) -> dict[str, Any]:
    for line in text.splitlines():
        if line.startswith("{"):
            value = json.loads(line)
            if isinstance(value, dict):
                return value
    raise ValueError("no report")


async def check_local(host: HostSpec) -> HostReport:
    """A local host: this machine, its agent this ggufpipe."""
    report = HostReport(host.name, host.where)
    command = [sys.executable, "-c", PROBE, host.cache_dir]
    done = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=60)
    _fill(report, _first_json(done.stdout), f"ggufpipe-agent {__version__} (protocol {PROTOCOL_VERSION})")
    return report


async def check_ssh(host: HostSpec, timeout: float) -> HostReport:
    """An SSH host, over its connection: the probe, then its agent's version."""
    import asyncssh

    from ggufpipe_tui.transports.ssh import output_text
    from ggufpipe_tui.transports.sshconn import connection_pool

    report = HostReport(host.name, host.where)
    pool = connection_pool()
    try:
        entry, connection = await pool.acquire(host, timeout)
    except (GgufpipeError, asyncssh.Error, OSError, asyncio.TimeoutError) as error:
        report.error = f"{host.name} ({host.where}): cannot connect: {error or type(error).__name__}"
        return report
    try:
        probe = f"python3 -c {shlex.quote(PROBE)} {shlex.quote(host.cache_dir)}"
        done = await asyncio.wait_for(connection.run(probe, check=False), timeout)
        if done.exit_status == 127:
            report.error = (
                f"{host.name} ({host.where}): no python3 on the login PATH (ggufpipe needs Python 3.10+)"
            )
            return report
        try:
            probed = _first_json(output_text(done.stdout))
        except ValueError:
            lines = output_text(done.stderr).strip().splitlines()
            report.error = f"{host.name} ({host.where}): python3 could not run the probe" + (
                f": {lines[-1]}" if lines else ""
            )
            return report
        version = await asyncio.wait_for(connection.run(f"{host.agent} --version", check=False), timeout)
        said = output_text(version.stdout).strip()
        _fill(report, probed, said if version.exit_status == 0 and said.startswith("ggufpipe-agent") else "")
        return report
    except (asyncssh.Error, OSError, asyncio.TimeoutError) as error:
        report.error = f"{host.name} ({host.where}): the check broke off: {error or type(error).__name__}"
        return report
    finally:
        await pool.release(host, entry)


def printoutput_text(reports: list[HostReport], out: IO[str], err: IO[str]) -> None:
    for report in reports:
        if report.error:
            print(f"ggufpipe: error: {report.error}", file=err, flush=True)
            continue
        gpus = ", ".join(report.gpus) if report.gpus else "no NVIDIA GPU"
        free = format_bytes(report.free_bytes) if report.free_bytes >= 0 else "?"
        where = f"{report.host} ({report.where})"
        print(f"{where}: Python {report.python} on {report.platform}; {gpus}", file=out)
        print(f"  agent: {report.agent or 'none'}; {free} free at {report.cache}", file=out)
        print(f"  {report.verdict}", file=out, flush=True)


async def check_hosts(inventory: Inventory, names: list[str] | None) -> list[HostReport]:
    timeout = inventory.timeouts.connect
    hosts = [host for name, host in inventory.hosts.items() if not names or name in names]
    return list(
        await asyncio.gather(*(check_local(h) if h.local else check_ssh(h, timeout) for h in hosts))
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ggufpipe-tui setup",
        description="Report what each host of INVENTORY has for a ggufpipe agent: Python, platform, "
        "NVIDIA GPUs, the agent its agent: command runs, free disk where the stage cache goes, and "
        "whether wheels from this machine would fit it. Starts no agent. Setting the hosts up from it "
        "is not done by this command yet: --check is required (docs/ssh.md, 'Preparing a GPU host').",
    )
    parser.add_argument("inventory", metavar="INVENTORY", help="inventory YAML file")
    parser.add_argument("--check", action="store_true", help="report each host (required)")
    parser.add_argument(
        "--host", action="append", metavar="HOST", help="only this host of the inventory (repeatable)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object: each host's report")
    parser.epilog = (
        "exit status: 0 every host can run this orchestrator's agent or be given one; 1 a host cannot "
        "(its Python is too old); 2 an inventory or a host that cannot be reached or checked"
    )
    return parser


def setup_main(argv: list[str], out: IO[str] = sys.stdout, err: IO[str] = sys.stderr) -> int:
    from ggufpipe_agent import aio
    from ggufpipe_tui.core.inventory import load_inventory

    parser = build_parser()
    options = parser.parse_args(argv)
    if not options.check:
        parser.error("only --check is here so far: it reports what each host has")
    try:
        inventory = load_inventory(options.inventory)
    except GgufpipeError as error:
        print(f"ggufpipe: error: {error}", file=err)
        return EXIT_SETUP
    unknown = [name for name in options.host or [] if name not in inventory.hosts]
    if unknown:
        print(f"ggufpipe: error: --host {unknown[0]}: not a host of {options.inventory}", file=err)
        return EXIT_SETUP
    reports = aio.run(check_hosts(inventory, options.host))
    if options.json:
        print(json.dumps({"hosts": [asdict(report) for report in reports]}, indent=2), file=out)
    else:
        printoutput_text(reports, out, err)
    if any(report.error for report in reports):
        return EXIT_SETUP
    return EXIT_UNFIT if any("too old" in report.verdict for report in reports) else EXIT_OK
