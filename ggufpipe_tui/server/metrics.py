"""The server's counters for ``GET /metrics`` (the text is made in
:mod:`ggufpipe_tui.server.operator`).

One :class:`Metrics` per server, fed three ways: :meth:`Metrics.middleware`
counts every answer by endpoint and status (refusals and router 404s too);
:meth:`Metrics.exchange` takes each completion's log line record (tokens,
timings); :meth:`Metrics.on_event` takes the pipeline's events (the step
statistics each stage reports, faulted runs). What is a state rather than a
count (slots busy, requests waiting) and the recovery counts (stages lost,
repairs, runs replayed: the pipeline's, as ``GET /health`` gives them) are
read from the server and the pipeline when the page is scraped.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web

from ggufpipe_agent.wire.records import StepCounters
from ggufpipe_tui.core.events import Event, RunFinished, RunResult, StageStats

#: The weight of the newest run in the moving tokens/s figure.
SMOOTHING = 0.3
#: A status for a request whose client went away before its answer.
GONE = 499


class Exchanged(Protocol):
    """What a completion's log record says (server/http.py's Exchange)."""

    @property
    def status(self) -> int: ...

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def completion_tokens(self) -> int: ...

    @property
    def result(self) -> RunResult | None: ...


@dataclass
class StageSteps:
    """One stage's decode steps over every run so far, and its last report."""

    steps: int = 0
    seconds: float = 0.0
    last_mean_ms: float = 0.0
    prefill_seconds: float = 0.0


def endpoint_of(request: web.Request) -> str:
    """The route's path as registered; a path the router does not serve is
    "other" (a scanner's random paths must not each become a series)."""
    route = request.match_info.route
    resource = route.resource if route is not None else None
    if resource is None or request.match_info.http_exception is not None:
        return "other"
    return resource.canonical


class Metrics:
    def __init__(self) -> None:
        self.started = time.time()
        self.requests: Counter[tuple[str, str, int]] = Counter()  # (method, endpoint, status)
        self.prompt_tokens = 0  # prompt tokens computed (not those kept from a cache)
        self.prompt_tokens_cached = 0
        self.completion_tokens = 0
        self.prompt_seconds = 0.0
        self.decode_seconds = 0.0
        self.completions = 0
        self.last_tokens_per_s = 0.0
        self.moving_tokens_per_s = 0.0
        self.largest_sequence = 0
        self.stages: dict[int, StageSteps] = {}
        self.runs_faulted = 0
        # The counters each stage last reported for a run in flight: a report
        # holds the run's totals so far, so each adds what it adds to the last.
        self._reported: dict[tuple[int, int], StepCounters] = {}

    # ------------------------------------------------------------ requests

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Counts every answer (put it before the error middleware, so that
        the errors it turns into answers are counted with their status)."""
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as error:
            status = error.status
            raise
        except asyncio.CancelledError:
            status = GONE
            raise
        finally:
            self.requests[(request.method, endpoint_of(request), status)] += 1

    def exchange(self, exchange: Exchanged) -> None:
        """A completion's end, from its log record."""
        self.completions += 1
        self.completion_tokens += exchange.completion_tokens
        result = exchange.result
        if result is None:
            self.prompt_tokens += exchange.prompt_tokens
            return
        reused = min(result.prompt_reused, exchange.prompt_tokens)
        self.prompt_tokens += exchange.prompt_tokens - reused
        self.prompt_tokens_cached += reused
        self.largest_sequence = max(self.largest_sequence, len(result.prompt_tokens) + len(result.tokens))
        timings = result.timings
        self.prompt_seconds += timings.prefill_ms / 1000.0
        self.decode_seconds += timings.decode_ms / 1000.0
        if timings.decode_tokens_per_s > 0:
            self.last_tokens_per_s = timings.decode_tokens_per_s
            moving = self.moving_tokens_per_s
            self.moving_tokens_per_s = (
                timings.decode_tokens_per_s
                if moving == 0
                else SMOOTHING * timings.decode_tokens_per_s + (1 - SMOOTHING) * moving
            )

    # -------------------------------------------------------------- events

    def on_event(self, event: Event) -> None:
        """The pipeline's events (``pipeline.subscribe(metrics.on_event)``)."""
        if isinstance(event, StageStats):
            self._stage_stats(event.run_id, event.stage, event.counters)
        elif isinstance(event, RunFinished):
            for key in [key for key in self._reported if key[0] == event.result.run_id]:
                del self._reported[key]
            if event.result.outcome == "faulted":
                self.runs_faulted += 1

    def _stage_stats(self, run_id: int, stage: int, counters: StepCounters) -> None:
        before = self._reported.get((run_id, stage), StepCounters())
        self._reported[(run_id, stage)] = counters
        steps = self.stages.setdefault(stage, StageSteps())
        if counters.steps >= before.steps:
            steps.steps += counters.steps - before.steps
            steps.seconds += max(0.0, counters.total_ms - before.total_ms) / 1000.0
        steps.prefill_seconds += max(0.0, counters.prefill_ms - before.prefill_ms) / 1000.0
        if counters.steps:
            steps.last_mean_ms = counters.mean_ms

    # ------------------------------------------------------------- reading

    def requests_by(self) -> list[tuple[str, str, int, int]]:
        """(method, endpoint, status, count), in a stable order."""
        return [(*key, count) for key, count in sorted(self.requests.items())]
