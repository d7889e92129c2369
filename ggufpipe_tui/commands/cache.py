"""``ggufpipe-tui cache INVENTORY ...``: the stage files cached on the hosts.

Stage files (written on a host from its own copy of the model, or sent there
with ``model: {send: true}``) stay in each host's cache for the next start.
This command asks each host's agent, the way a session reaches it (local
process, SSH, a hand-started agent), to list its entries, remove some, or
verify them (re-hash every complete entry; a damaged one is removed and will
be written or sent again). Nothing else is started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import IO

from ggufpipe_agent.errors import GgufpipeError
from ggufpipe_agent.wire.delivery_messages import CacheEntry, CacheReport, CacheRequest
from ggufpipe_agent.wire.protocol import RequestFailed, Shutdown
from ggufpipe_tui.commands.parsing import inventory_parser
from ggufpipe_tui.core.format import format_bytes
from ggufpipe_tui.core.inventory import HostSpec, Inventory

EXIT_OK = 0
EXIT_NOT_FOUND = 1
EXIT_SETUP = 2
REQUEST_SECONDS = 600.0  # a verify re-hashes every entry at disk speed

DESCRIPTION = """\
List, remove or verify the stage files cached on the hosts of INVENTORY
(every host under hosts:, or those given with --host), through their agents.

  ggufpipe-tui cache INVENTORY                 list (the default)
  ggufpipe-tui cache INVENTORY remove NAME...  remove the named entries
  ggufpipe-tui cache INVENTORY remove --all    remove every entry
  ggufpipe-tui cache INVENTORY verify          re-hash every complete entry and
                                               remove the damaged ones

An entry is a complete stage file, a partial one (a transfer to resume) or an
unverified file the cache cannot vouch for. Names are file names as listed."""

EPILOG = """\
exit status: 0 done; 1 a named entry is on none of the hosts, or verify found
damaged entries (removed: they are written or sent again at the next start);
2 an inventory or a host that cannot be used (the others are still done)."""


def build_parser() -> argparse.ArgumentParser:
    parser = inventory_parser("ggufpipe-tui cache", DESCRIPTION, EPILOG)
    parser.add_argument("action", nargs="?", default="list", choices=("list", "remove", "verify"))
    parser.add_argument("names", nargs="*", metavar="NAME", help="entries to remove")
    parser.add_argument("--all", action="store_true", dest="every", help="with remove: every entry")
    parser.add_argument(
        "--host", action="append", metavar="HOST", help="only this host of the inventory (repeatable)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object: each host's cache")
    parser.add_argument("-v", "--verbose", action="store_true", help="the agents' logs on stderr")
    return parser


@dataclass(frozen=True, slots=True)
class HostCache:
    host: HostSpec
    report: CacheReport | None
    error: str = ""


async def ask_host(host: HostSpec, request: CacheRequest, timeout: float, log: IO[str] | None) -> HostCache:
    """Start the host's agent, send ``request``, return its answer, end it."""
    from ggufpipe_tui.session.pipeline import default_connection_factory

    def on_log(line: str) -> None:
        if log is not None:
            print(f"[{host.name}] {line}", file=log, flush=True)

    link = default_connection_factory(host, -1, on_log)
    try:
        await asyncio.wait_for(link.start(timeout), timeout + 5)
        await link.send(request)
        deadline = time.monotonic() + REQUEST_SECONDS
        while True:
            left = deadline - time.monotonic()
            message = await asyncio.wait_for(link.receive(), max(left, 0.1))
            if message is None:
                return HostCache(host, None, f"{link.label}: the agent ended before answering")
            if isinstance(message, CacheReport) and message.request_id == request.request_id:
                return HostCache(host, message)
            if isinstance(message, RequestFailed) and message.request_id == request.request_id:
                return HostCache(host, None, f"{link.label}: {message.reason}")
    except asyncio.TimeoutError:
        return HostCache(host, None, f"{link.label}: no answer within {timeout:g}s")
    except GgufpipeError as error:
        return HostCache(host, None, str(error))
    except (ConnectionError, OSError) as error:
        return HostCache(host, None, f"{link.label}: the control stream broke ({error})")
    finally:
        if link.control is not None and link.alive():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(link.send(Shutdown("cache command done")), 2)
        await link.close(3.0)


def _entry_line(entry: CacheEntry) -> str:
    layers = f"layers [{entry.start}, {entry.end}) of {entry.block_count}" if entry.block_count else "?"
    if entry.state == "partial":
        size = f"{format_bytes(entry.size)} of {format_bytes(entry.expected_size)} verified"
    else:
        size = format_bytes(entry.size)
    used = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.last_used))
    model = entry.model_name or "?"
    return f"  {entry.state:<10} {entry.name}\n             {model} · {layers} · {size} · last used {used}"


def print_text(results: list[HostCache], action: str, out: IO[str], err: IO[str]) -> None:
    for result in results:
        host = result.host
        if result.report is None:
            print(f"ggufpipe: error: {result.error}", file=err, flush=True)
            continue
        report = result.report
        total = sum(entry.size for entry in report.entries)
        count = len(report.entries)
        print(
            f"{host.name} ({host.where}): {report.cache_dir}: {count} entr{'y' if count == 1 else 'ies'}, "
            f"{format_bytes(total)}, {format_bytes(report.free_bytes)} free",
            file=out,
        )
        for name in report.removed:
            print(f"  removed    {name}", file=out)
        for name in report.damaged:
            print(f"  DAMAGED    {name} (removed: it is written or sent again at the next start)", file=out)
        if action in ("list", "verify"):
            for entry in report.entries:
                print(_entry_line(entry), file=out)
        if action == "verify":
            checked = sum(entry.state == "complete" for entry in report.entries) + len(report.damaged)
            print(f"  {checked} complete entries verified, {len(report.damaged)} damaged", file=out)
    out.flush()


def as_json(results: list[HostCache]) -> dict[str, object]:
    hosts = []
    for result in results:
        report = result.report
        hosts.append(
            {
                "host": result.host.name,
                "where": result.host.where,
                "error": result.error,
                "cache_dir": report.cache_dir if report else "",
                "free_bytes": report.free_bytes if report else 0,
                "entries": [asdict(entry) for entry in report.entries] if report else [],
                "removed": list(report.removed) if report else [],
                "damaged": list(report.damaged) if report else [],
            }
        )
    return {"hosts": hosts}


async def run_cache(
    inventory: Inventory,
    action: str,
    names: tuple[str, ...] = (),
    every: bool = False,
    only: tuple[str, ...] = (),
    *,
    json_out: bool = False,
    verbose: bool = False,
    out: IO[str] = sys.stdout,
    err: IO[str] = sys.stderr,
) -> int:
    hosts = [inventory.hosts[name] for name in (only or tuple(inventory.hosts))]
    request = CacheRequest(1, action, names, every)
    timeout = inventory.timeouts.connect
    log = err if verbose else None
    results = list(await asyncio.gather(*(ask_host(host, request, timeout, log) for host in hosts)))
    if json_out:
        print(json.dumps(as_json(results), ensure_ascii=False), file=out, flush=True)
        for result in results:
            if result.error:
                print(f"ggufpipe: error: {result.error}", file=err, flush=True)
    else:
        print_text(results, action, out, err)
    if any(result.error for result in results):
        return EXIT_SETUP
    reports = [result.report for result in results if result.report is not None]
    status = EXIT_OK
    if action == "remove" and not every:
        removed = {name for report in reports for name in report.removed}
        for name in names:
            if name not in removed:
                print(f"ggufpipe: {name}: not in the cache of any of these hosts", file=err, flush=True)
                status = EXIT_NOT_FOUND
    if action == "verify" and any(report.damaged for report in reports):
        status = EXIT_NOT_FOUND
    return status


def cache_main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.action == "remove" and not (args.names or args.every):
        parser.error("remove needs entry names or --all")
    if args.action == "remove" and args.names and args.every:
        parser.error("remove takes entry names or --all, not both")
    if args.action != "remove" and (args.names or args.every):
        parser.error(f"{args.action} takes no entry names")
    from ggufpipe_agent import aio
    from ggufpipe_tui.core.inventory import load_inventory

    try:
        inventory = load_inventory(args.inventory)
    except GgufpipeError as error:
        print(f"ggufpipe: error: {error}", file=sys.stderr)
        return EXIT_SETUP
    only = tuple(args.host or ())
    unknown = [name for name in only if name not in inventory.hosts]
    if unknown:
        defined = ", ".join(inventory.hosts)
        print(
            f"ggufpipe: error: --host {unknown[0]}: not a host of {args.inventory} ({defined})",
            file=sys.stderr,
        )
        return EXIT_SETUP
    names = tuple(args.names)
    run = run_cache(inventory, args.action, names, args.every, only, json_out=args.json, verbose=args.verbose)
    return aio.run(run)
