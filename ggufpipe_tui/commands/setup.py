"""``ggufpipe-tui setup INVENTORY [--check]``: every host's agent, ahead of the first prompt.

Each SSH host whose entry names no ``agent:`` is given this orchestrator's
agent (provision/hosts.py: wheels pushed over its SSH connection, or built
there), all hosts at once, so that the first run does not wait for it.
``--check`` sets nothing up: for every host (or those given with ``--host``)
it reports its ``python3`` (version, platform), its NVIDIA GPUs, the free
disk where agents go, and its agent: the one set up for this orchestrator,
or what the ``agent:`` it names says of its version; then what a set-up
would do there (push or build, and why).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import IO

from ggufpipe_agent import PROTOCOL_VERSION, __version__
from ggufpipe_agent.errors import GgufpipeError
from ggufpipe_tui.core.format import format_bytes, format_seconds
from ggufpipe_tui.core.inventory import HostSpec, Inventory

EXIT_OK = 0
EXIT_UNFIT = 1
EXIT_SETUP = 2
OUR_AGENT = f"ggufpipe-agent {__version__} (protocol {PROTOCOL_VERSION})"


@dataclass
class HostReport:
    host: str
    where: str
    python: str = ""
    platform: str = ""
    gpus: list[str] = field(default_factory=list)
    agents_dir: str = ""
    free_bytes: int = -1
    agent: str = ""  # the agent's version line ("" when there is none)
    managed: bool = False  # its agent is the one ggufpipe sets up (no agent: in its entry)
    verdict: str = ""
    unfit: bool = False  # it cannot run an agent as it is (its Python)
    how: str = ""  # after a set-up: "pushed", "built there", "set up by another", "ready"
    seconds: float = 0.0
    error: str = ""


async def _report_local(host: HostSpec) -> HostReport:
    import platform
    import sysconfig

    return HostReport(
        host.name,
        host.where,
        python=platform.python_version(),
        platform=sysconfig.get_platform(),
        agent=OUR_AGENT,
        verdict="ready: its agent is this ggufpipe",
    )


async def _report_ssh(host: HostSpec, timeout: float, set_up: bool, log: IO[str]) -> HostReport:
    import asyncssh

    from ggufpipe_tui.provision import hosts as provision
    from ggufpipe_tui.provision.shell import output_text
    from ggufpipe_tui.transports.sshconn import connection_pool

    report = HostReport(host.name, host.where, managed=not host.agent)
    pool = connection_pool()
    try:
        entry, connection = await pool.acquire(host, timeout)
    except (GgufpipeError, asyncssh.Error, OSError, asyncio.TimeoutError) as error:
        report.error = f"{host.name} ({host.where}): cannot connect: {error or type(error).__name__}"
        return report
    began = time.monotonic()
    try:
        probed = await provision.probe(host, connection)
        report.python, report.platform, report.gpus = probed.python, probed.platform, probed.gpus
        report.agents_dir, report.free_bytes = probed.agents, probed.free
        problem = provision.python_problem(host, probed)
        if host.agent:
            done = await asyncio.wait_for(connection.run(f"{host.agent} --version", check=False), timeout)
            said = output_text(done.stdout).strip()
            report.agent = said if done.exit_status == 0 and said.startswith("ggufpipe-agent") else ""
            if report.agent == OUR_AGENT:
                report.verdict = "ready: its agent: is this orchestrator's version"
            else:
                have = (
                    f"its agent: is {report.agent}"
                    if report.agent
                    else f"its agent: '{host.agent}' did not run"
                )
                report.verdict = f"{have}; install ggufpipe=={__version__} there, or leave agent: out"
                report.unfit = True
            return report
        if problem:
            report.verdict, report.unfit = problem, True
            return report
        report.agent = OUR_AGENT if probed.ready else ""
        if probed.ready:
            report.verdict = "ready: the agent ggufpipe set up for this orchestrator is there"
            report.how = "ready"
        elif not set_up:
            mode, why = provision.choose(host, probed)
            way = "wheels pushed from here" if mode == "push" else "built there from its own index"
            report.verdict = f"no agent set up for this orchestrator yet; a set-up would be {way} ({why})"
        if set_up and not probed.ready:

            def progress(line: str) -> None:
                print(f"ggufpipe: {host.name}: {line}", file=log, flush=True)

            result = await provision.set_up_once(host, connection, progress, lambda line: None, probed=probed)
            report.how, report.seconds = result.how, time.monotonic() - began
            report.agent = OUR_AGENT
            report.verdict = f"ready: agent {result.how} in {format_seconds(report.seconds)}"
        return report
    except (GgufpipeError, asyncssh.Error, OSError, asyncio.TimeoutError) as error:
        report.error = str(error) or f"{host.name} ({host.where}): {type(error).__name__}"
        return report
    finally:
        await pool.release(host, entry)


def print_reports(reports: list[HostReport], out: IO[str], err: IO[str]) -> None:
    for report in reports:
        if report.error:
            print(f"ggufpipe: error: {report.error}", file=err, flush=True)
            continue
        gpus = ", ".join(report.gpus) if report.gpus else "no NVIDIA GPU"
        where = f"{report.host} ({report.where})"
        print(f"{where}: Python {report.python} on {report.platform}; {gpus}", file=out)
        if report.agents_dir:
            free = format_bytes(report.free_bytes) if report.free_bytes >= 0 else "?"
            print(f"  agent: {report.agent or 'none'}; {free} free at {report.agents_dir}", file=out)
        print(f"  {report.verdict}", file=out, flush=True)


async def report_hosts(
    inventory: Inventory, names: list[str] | None, set_up: bool, log: IO[str]
) -> list[HostReport]:
    timeout = inventory.timeouts.connect
    hosts = [host for name, host in inventory.hosts.items() if not names or name in names]
    reports = (_report_local(h) if h.local else _report_ssh(h, timeout, set_up, log) for h in hosts)
    return list(await asyncio.gather(*reports))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ggufpipe-tui setup",
        description="Give every SSH host of INVENTORY whose entry names no agent: this orchestrator's "
        "agent (a venv of its own under ~/.cache/ggufpipe/agents there: the wheels pushed over SSH where "
        "the host's Python and platform are this machine's, else installed from the host's own index with "
        "llama-cpp-python built there), all at once, so that the first run does not wait for it. With "
        "--check, set nothing up: report each host's Python, platform, NVIDIA GPUs, agent and free disk.",
    )
    parser.add_argument("inventory", metavar="INVENTORY", help="inventory YAML file")
    parser.add_argument("--check", action="store_true", help="report each host; set nothing up")
    parser.add_argument(
        "--host", action="append", metavar="HOST", help="only this host of the inventory (repeatable)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object: each host's report")
    parser.epilog = (
        "exit status: 0 every host has (or, with --check, can be given) this orchestrator's agent; 1 a host "
        "cannot (its Python is too old, or the agent: it names is another version); 2 an inventory or a "
        "host that cannot be reached, checked or set up"
    )
    return parser


def setup_main(argv: list[str], out: IO[str] = sys.stdout, err: IO[str] = sys.stderr) -> int:
    from ggufpipe_agent import aio
    from ggufpipe_tui.core.inventory import load_inventory

    parser = build_parser()
    options = parser.parse_args(argv)
    try:
        inventory = load_inventory(options.inventory)
    except GgufpipeError as error:
        print(f"ggufpipe: error: {error}", file=err)
        return EXIT_SETUP
    unknown = [name for name in options.host or [] if name not in inventory.hosts]
    if unknown:
        print(f"ggufpipe: error: --host {unknown[0]}: not a host of {options.inventory}", file=err)
        return EXIT_SETUP
    reports = aio.run(report_hosts(inventory, options.host, not options.check, err))
    if options.json:
        print(json.dumps({"hosts": [asdict(report) for report in reports]}, indent=2), file=out)
        for report in reports:
            if report.error:
                print(f"ggufpipe: error: {report.error}", file=err, flush=True)
    else:
        print_reports(reports, out, err)
    if any(report.error for report in reports):
        return EXIT_SETUP
    return EXIT_UNFIT if any(report.unfit for report in reports) else EXIT_OK
