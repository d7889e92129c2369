"""Running ``--serve``: bind the port before any agent starts, start the
pipeline, print progress until every stage is loaded, then serve until
SIGTERM or SIGINT (exit 0) or a fault of the pipeline (exit 1); drain and
tear down on the way out. The handlers are :mod:`ggufpipe_tui.server.http`."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence
from typing import IO

from aiohttp import web

from ggufpipe_agent.aio import freeze_heap
from ggufpipe_agent.errors import GgufpipeError
from ggufpipe_tui.core.events import (
    AgentConnected,
    Event,
    Notice,
    PlanMade,
    RunRecovered,
    StageRecovery,
    StageStateChanged,
)
from ggufpipe_tui.core.inventory import Inventory
from ggufpipe_tui.core.printer import EXIT_FAULTED, EXIT_OK, EXIT_SETUP, Printer
from ggufpipe_tui.server.http import IDLE_SECONDS, Server
from ggufpipe_tui.session.pipeline import Pipeline


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[V6]:PORT``, ``:PORT`` or ``PORT`` (127.0.0.1); port 0 picks a free one."""
    host, _, port = text.rpartition(":")
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise GgufpipeError(f"--serve {text!r}: HOST:PORT is required, e.g. 127.0.0.1:8080")
    return host.strip("[]") or "127.0.0.1", int(port)


class ServerPrinter(Printer):
    """Start-up progress on stderr as headless mode prints it, until every
    stage of the first run is loaded (:attr:`loaded`); after that, only what
    goes wrong (each request has its own line)."""

    def __init__(self, inventory: Inventory, err: IO[str], verbose: bool, quiet: bool) -> None:
        super().__init__(inventory, sys.stdout, err, True, verbose, quiet)
        self.loaded = asyncio.Event()
        self._run = 0
        self._ready: set[int] = set()

    def __call__(self, event: Event) -> None:
        started = self.loaded.is_set()
        faulted = isinstance(event, StageStateChanged) and event.state == "Faulted"
        said = Notice | AgentConnected | StageRecovery | RunRecovered
        if self.verbose or not started or faulted or isinstance(event, said):
            super().__call__(event)
        if started:
            return
        if isinstance(event, PlanMade):
            self._run, self._ready = event.plan.run_id, set()
        elif isinstance(event, StageStateChanged) and event.run_id == self._run and event.state == "Ready":
            self._ready.add(event.stage)
            if len(self._ready) == len(self.inventory.stages):
                self.loaded.set()


def curl_example(host: str, port: int, api_key: str) -> str:
    shown = f"[{host}]" if ":" in host else host
    auth = ' -H "Authorization: Bearer $GGUFPIPE_API_KEY"' if api_key else ""
    body = '{"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}'
    return (
        f"curl -s http://{shown}:{port}/v1/chat/completions{auth} "
        f"-H 'Content-Type: application/json' -d '{body}'"
    )


async def run_server(
    inventory: Inventory,
    listen: str,
    *,
    api_key: str = "",
    queue: int = 16,
    verbose: bool = False,
    quiet: bool = False,
    log_dir: str | None = None,
    err: IO[str] = sys.stderr,
    cors_origins: Sequence[str] = (),
    chat_template: str = "",
) -> int:
    """Serve until SIGTERM or SIGINT (exit 0) or a fault of the pipeline (exit 1)."""
    printer = ServerPrinter(inventory, err, verbose, quiet)
    pipeline = Pipeline(inventory, printer, log_dir=log_dir, prepare_ahead=True)
    server = Server(
        pipeline,
        inventory,
        api_key=api_key,
        queue=queue,
        err=err,
        cors_origins=cors_origins,
        chat_template=chat_template,
    )
    runner = web.AppRunner(
        server.app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=5.0,
        keepalive_timeout=IDLE_SECONDS,
    )
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for number in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(number, stop.set)
    try:
        host, port = parse_listen(listen)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()  # bound before any agent starts: a busy port fails at once
        except OSError as error:
            raise GgufpipeError(f"--serve {listen}: cannot listen: {error.strerror or error}") from None
        port = runner.addresses[0][1] if runner.addresses else port  # the one picked for port 0
        shown = f"[{host}]" if ":" in host else host
        server.log(f"listening on http://{shown}:{port}/v1 (OpenAI-compatible); starting the stages")
        if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
            server.log(f"warning: {host} without --api-key: whoever reaches this port can use the pipeline")
        if "*" in cors_origins and not api_key:
            server.log(
                "warning: --cors-origin '*' without --api-key: "
                "any web page a browser here opens can use the pipeline"
            )
        starting = asyncio.ensure_future(pipeline.start())
        signalled = asyncio.ensure_future(stop.wait())
        await asyncio.wait([starting, signalled], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # a signal while the agents start: give up starting
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError, GgufpipeError):
                await starting
            server.log("shutting down: signal received while starting")
            await runner.cleanup()
            await pipeline.close()
            return EXIT_OK
        starting.result()
    except GgufpipeError as error:
        server.log(f"error: {error}")
        await runner.cleanup()
        await pipeline.close()
        return EXIT_SETUP
    stopped = asyncio.ensure_future(pipeline.wait_stopped())
    loaded = asyncio.ensure_future(printer.loaded.wait())
    await asyncio.wait([stopped, signalled, loaded], return_when=asyncio.FIRST_COMPLETED)
    loaded.cancel()
    if printer.loaded.is_set():
        server.ready = True
        freeze_heap()  # the session's set-up lives as long as the server
        server.log(f"ready: {server.model} on {len(inventory.stages)} stages; try")
        print(f"  {curl_example(host, port, api_key)}", file=err, flush=True)
        await asyncio.wait([stopped, signalled], return_when=asyncio.FIRST_COMPLETED)
    fault = "" if signalled.done() else stopped.result()
    stopped.cancel()
    signalled.cancel()
    server.log("shutting down: " + (f"the pipeline stopped: {fault}" if fault else "signal received"))
    await server.drain()
    await runner.cleanup()
    await pipeline.close()
    for number in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(number)
    server.log("every stage is torn down")
    return EXIT_FAULTED if fault else EXIT_OK
