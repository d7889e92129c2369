"""``ggufpipe-agent``: the stage agent.

ggufpipe-agent                      speak the protocol on stdin/stdout (how the
                                    orchestrator starts it, locally or over SSH)
ggufpipe-agent --listen ADDR        started by hand: wait for an orchestrator on
                                    HOST:PORT or unix:PATH, with readable logs; it
                                    must prove it holds the listen key first
ggufpipe-agent --share-process      on stdio, and further stages of the same
                                    orchestrator may attach to this process
ggufpipe-agent --check              import everything the agent needs and say
                                    whether this host can run it (exit 0) or
                                    which module fails (exit 1)
ggufpipe-agent bridge ENDPOINT      copy stdin/stdout to a local socket (the
                                    orchestrator's data channel over SSH)
ggufpipe-agent receive [--cache-dir DIR]
                                    receive one stage file into the cache on
                                    stdin/stdout (model: {send: true} over SSH)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from ggufpipe_agent import PROTOCOL_VERSION, __version__, aio

T = TypeVar("T")

DESCRIPTION = """\
ggufpipe stage agent: runs one contiguous layer range of a GGUF model with
llama.cpp for a ggufpipe orchestrator. With no options it speaks the ggufpipe
protocol on stdin/stdout (frames only on stdout, logs on stderr); this is how
ggufpipe-tui starts it, as a local process or over SSH. It exits when its
orchestrator goes, or says nothing for the heartbeat bound it announced."""

EPILOG = """\
subcommands:
  bridge ENDPOINT   copy stdin to the socket ENDPOINT (unix:PATH or HOST:PORT)
                    and the socket to stdout; the orchestrator runs this on an
                    SSH exec channel to reach the agent's data socket, so no port
                    forwarding is needed on the host.
  receive [--cache-dir DIR]
                    receive one stage file into the cache, speaking the delivery
                    protocol on stdin/stdout; the orchestrator runs this on an SSH
                    exec channel for model: {send: true} (docs/model-delivery.md).

environment:
  GGUFPIPE_CACHE_DIR  where stage files are cached (default
                      $XDG_CACHE_HOME/ggufpipe/stages or ~/.cache/ggufpipe/stages)
  GOMP_SPINCOUNT      how long llama.cpp's idle CPU threads spin before they sleep;
                      the agent sets 10000 unless given, so stages sharing a host
                      do not starve each other (docs/performance.md)
  GGUFPIPE_ADAPT_THREADS
                      0: a stage with threads 0 decodes on every core even while
                      other processes hold some (by default it keeps the free
                      ones, sampled twice a second; docs/bench-busy.md)
  GGUFPIPE_NO_CHAIN   1: in a shared process (--share-process), hand each token's
                      activation to the next stage through the event loop and the
                      link's socket instead of running that stage's step right after
                      and handing the record over directly (to measure what they save)
"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["bridge"]:
        from ggufpipe_agent.process.bridge import bridge_main

        return bridge_main(args[1:])
    if args[:1] == ["receive"]:
        from ggufpipe_agent.delivery.receive_command import receive_main

        _die_with_parent()
        return receive_main(args[1:])
    parser = argparse.ArgumentParser(
        prog="ggufpipe-agent",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--listen",
        metavar="ADDR",
        help="wait for an orchestrator on HOST:PORT or unix:PATH instead of using stdio "
        "(for an agent started by hand; bind to 127.0.0.1 and let the orchestrator "
        "reach it over SSH). Only an orchestrator that proves it holds the listen key "
        "(--key-file) is served, one at a time; one that falls silent past its heartbeat "
        "bound is detached",
    )
    parser.add_argument(
        "--key-file",
        type=Path,
        metavar="PATH",
        help="with --listen: where to write the listen key orchestrators must prove they hold "
        "(created 0600 at start, removed at exit; default ~/.local/state/ggufpipe/listen/"
        "tcp-HOST-PORT.key or unix-PATH.key, which is where orchestrators look unless the "
        "inventory gives listen_key:)",
    )
    parser.add_argument(
        "--share-process",
        action="store_true",
        help="on stdio: let further stages of the same orchestrator run in this process, "
        "attached on a socket in its private directory with the secret its Hello names "
        "(inventory share_process: true; they end with this process)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="import every module the agent can reach and every package it needs, print one "
        "line saying whether this host can run it (exit 0) or the first module that fails "
        "(exit 1), and exit. Every agent start makes the cheap part of this check (each "
        "package is installed) before its Hello",
    )
    parser.add_argument("--cache-dir", type=Path, help="stage file cache directory")
    parser.add_argument("-v", "--verbose", action="store_true", help="also log llama.cpp's own messages")
    parser.add_argument(
        "--version",
        action="version",
        version=f"ggufpipe-agent {__version__} (protocol {PROTOCOL_VERSION})",
    )
    options = parser.parse_args(args)
    from ggufpipe_agent import selfcheck

    if options.check:
        return selfcheck.check_main()
    problem = selfcheck.missing()
    if problem is not None:
        # Before any Hello: the orchestrator names the host and this module.
        print(f"{problem.describe()}; install ggufpipe's dependencies for {sys.executable}", file=sys.stderr)
        return 3
    if options.listen:
        from ggufpipe_agent.wire.endpoints import parse_endpoint

        try:
            parse_endpoint(options.listen)
        except ValueError as error:
            parser.error(f"--listen: {error}")
        if options.share_process:
            parser.error("--share-process is for an agent on stdio, not --listen")
    elif options.key_file is not None:
        parser.error("--key-file goes with --listen")
    if options.key_file is not None:
        options.key_file = options.key_file.expanduser()
    if options.cache_dir is not None:
        # No shell expands it when the orchestrator starts a local agent.
        options.cache_dir = options.cache_dir.expanduser()
    # llama.cpp's CPU backend runs its threads in OpenMP regions and
    # synchronises them with OpenMP barriers. libgomp lets an idle thread spin
    # for GOMP_SPINCOUNT iterations (300k by default, endless with
    # OMP_WAIT_POLICY=ACTIVE) before it sleeps: with several agents on one
    # host, the spinning threads of idle stages starve the stage that
    # computes. A short spin still covers the barriers inside a step, and the
    # threads sleep between steps. Measured on 2 cores, 3 local stages:
    # 7.7 tokens/s at the default, 68 with 10k; a single stage is unchanged
    # (86). OMP_WAIT_POLICY=PASSIVE instead makes every barrier sleep (22
    # tokens/s for one stage). Set before libgomp loads.
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not options.verbose:
        logging.getLogger("ggufpipe.llama").setLevel(logging.WARNING)
    log = logging.getLogger("ggufpipe.agent")

    if options.listen:
        from ggufpipe_agent.errors import GgufpipeError

        try:
            with contextlib.suppress(KeyboardInterrupt):
                aio.run(_with_signals(_serve_listen(options.listen, options.cache_dir, options.key_file)))
        except (GgufpipeError, OSError) as error:
            log.error("cannot listen on %s: %s", options.listen, error)
            return 1
        return 0

    from ggufpipe_agent.process.runtime import serve_stdio

    _die_with_parent()

    reason = aio.run(_with_signals(serve_stdio(options.cache_dir, options.share_process)))
    log.info("exiting: %s", reason)
    sys.stderr.flush()
    # A llama.cpp step may still run in the worker thread; it must not keep the
    # process (and the model's memory) alive after its orchestrator is gone.
    os._exit(0)


def _die_with_parent() -> None:
    """On stdio the agent belongs to whoever started it (the orchestrator, or
    sshd's session for it): when that process ends, so does the agent, even
    one that is stopped (SIGSTOP) or stuck and cannot read its stdin's EOF."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


async def _serve_listen(endpoint: str, cache_dir: Path | None, key_file: Path | None) -> None:
    from ggufpipe_agent.process.listener import serve_listen

    await serve_listen(endpoint, cache_dir, key_file)


async def _with_signals(work: Coroutine[Any, Any, T]) -> T | str:
    """Run ``work``; SIGTERM and SIGHUP end it like the orchestrator leaving."""
    task = asyncio.ensure_future(work)
    loop = asyncio.get_running_loop()
    for number in (signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(number, task.cancel)
    try:
        return await task
    except asyncio.CancelledError:
        return "terminated by a signal"


if __name__ == "__main__":
    sys.exit(main())
