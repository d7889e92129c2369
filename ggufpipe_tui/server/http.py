"""``ggufpipe-tui INVENTORY --serve HOST:PORT``: an HTTP server on the warm
pipeline (aiohttp) that speaks the APIs agents speak.

``POST /v1/chat/completions`` and ``/v1/completions`` (OpenAI's, with tools,
structured output, logprobs and ``n``), ``POST /v1/messages`` and
``/v1/messages/count_tokens`` (Anthropic's), ``POST /v1/responses``
(OpenAI's Responses), ``GET /v1/models``, llama-server's ``/tokenize``,
``/detokenize``, ``/props``, ``/slots`` and ``/metrics``
(ggufpipe_tui/server/operator.py), ``GET /health``. Each API is a
translation: its request becomes one :class:`~ggufpipe_tui.server.request.Completion`
(openai_api.py, anthropic_api.py, responses_api.py), whose prompts
(server/replies.py: the chat template with the tools, the grammar the reply
is held to, one prompt per choice) are submitted to the pipeline's queue,
which runs up to ``--parallel`` of them at once (each in its own slot of
every stage; ggufpipe_tui/session/parallel.py), in the order they came; a
chat request's prompt is its whole conversation, and it goes to the slot
whose cache holds the longest prefix of it. The run's text comes back as
pieces (text, tool calls, the end: server/answering.py), which the API's
renderer writes (server/renderers.py). The session policy does the rest:
per-request sampling gets a run provisioned with it, and a reply that cannot
fit the context is refused before it runs (an explicit ``max_tokens``) or
shortened to the room left (none given).

Bounds: at most ``queue`` requests wait behind the running ones (a 503 past
that, never a hang); a client that goes away stops its run or withdraws its
prompt (aiohttp cancels its handler); a connection that sends no whole
request head for :data:`IDLE_SECONDS` is closed, a body that takes more than
:data:`BODY_SECONDS` is a 408. A bad request is that request's 4xx and
nothing more: every field is checked to exactly what the stages accept (the
sampling ranges of :mod:`ggufpipe_agent.wire.records`, text that UTF-8 can
carry), a prompt too long for any context is refused by the stage that
tokenizes it, and a bug in a handler is a 500 for that request alone; ``stop`` strings are applied here as
the text streams, and the run is stopped at the first one. Each request has
one log line, with the tokens it was sent. SIGTERM or SIGINT: answer what
waits with a 503, give the running requests :data:`SHUTDOWN_GRACE` seconds to
finish, stop them (a reply so cut short ends with its API's error event
naming the shutdown, the text sent so far kept, or is a 503 if it was not
streamed; its log line says 503), stop listening, tear every stage down,
exit 0. A lost stage is recovered (docs/recovery.md): the running requests are
replayed and go on, the requests that arrive meanwhile wait (past the queue
a 503 with Retry-After) and ``/health`` says "recovering"; only a pipeline
that cannot be rebuilt ends the server (exit 1): run it under a supervisor
that starts it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

from aiohttp import web

from ggufpipe_tui.core.format import reuse_line
from ggufpipe_tui.core.inventory import Inventory
from ggufpipe_tui.server import (
    answering,
    anthropic_api,
    cors,
    fields,
    operator,
    replies,
    responses_answer,
    responses_api,
)
from ggufpipe_tui.server import openai_answer as answer
from ggufpipe_tui.server import openai_api as api
from ggufpipe_tui.server.answering import Exchange
from ggufpipe_tui.server.metrics import Metrics
from ggufpipe_tui.server.renderers import AnthropicRenderer, OpenAIRenderer, Renderer, ResponsesRenderer
from ggufpipe_tui.server.request import Completion
from ggufpipe_tui.server.responses_api import ResponseStore
from ggufpipe_tui.session.pipeline import Pipeline
from ggufpipe_tui.session.runs import RunHandle
from ggufpipe_tui.session.stages import PipelineError

#: Seconds the running requests may take to finish once SIGTERM came.
SHUTDOWN_GRACE = 10.0
#: Why a run the shutdown stopped was stopped.
SHUTDOWN = "the server is shutting down"
#: The request's key saying its log line is written (by its exchange).
LOGGED = web.RequestKey("ggufpipe.logged", bool)
#: The largest request body (a long conversation is a few hundred KiB).
MAX_BODY = 8 * 1024 * 1024
#: A connection that has not sent a whole request head within this many
#: seconds (from its start, or from the end of its last answer) is closed, so
#: silent sockets cannot pile up to the process's file limit.
IDLE_SECONDS = 15.0
#: The most seconds a request's body may take to arrive.
BODY_SECONDS = 30.0
#: Seconds a request past the queue is told to wait (Retry-After) while the
#: pipeline recovers a lost stage: about a local restart and replay.
RECOVERY_RETRY_AFTER = 5


class Server:
    def __init__(
        self,
        pipeline: Pipeline,
        inventory: Inventory,
        *,
        api_key: str = "",
        queue: int = 16,
        err: IO[str] = sys.stderr,
        cors_origins: Sequence[str] = (),
        chat_template: str = "",
    ) -> None:
        self.pipeline = pipeline
        self.inventory = inventory
        self.api_key = api_key
        self.queue = queue
        self.err = err
        self.model = Path(inventory.model_path).name
        self.created = int(time.time())
        self.admitted = 0  # requests submitted and not answered (the running ones included)
        self.handles: set[RunHandle] = set()
        self.cut: set[RunHandle] = set()  # runs the shutdown stopped before their end
        self.answered = asyncio.Event()  # set while no request is being answered
        self.answered.set()
        self.chat_template = chat_template  # --chat-template-file: instead of the model's
        self.store = ResponseStore()  # /v1/responses' previous_response_id
        self.closing = False
        self.ready = False
        self.metrics = Metrics()
        pipeline.subscribe(self.metrics.on_event)
        middlewares = [self.metrics.middleware, self._errors]
        self.app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY)
        cors.install(self.app, cors_origins)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_post("/v1/chat/completions", self.chat)
        self.app.router.add_post("/v1/completions", self.completion)
        self.app.router.add_post("/v1/messages", self.messages)
        self.app.router.add_post("/v1/messages/count_tokens", self.count_tokens)
        self.app.router.add_post("/v1/responses", self.responses)
        self.app.router.add_post("/v1/embeddings", self.embeddings)
        operator.add_routes(self.app, self)

    # ------------------------------------------------------------ plumbing

    def log(self, text: str) -> None:
        # Whoever read stderr may be gone: the requests still get their answers.
        with contextlib.suppress(OSError):
            print(f"ggufpipe: {text}", file=self.err, flush=True)

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Every error is an error body of the route's API (OpenAI's, or
        Anthropic's on /v1/messages); the API key is checked first (as
        ``Authorization: Bearer KEY`` or Anthropic's ``x-api-key``)."""
        anthropic = request.path.startswith("/v1/messages")
        try:
            if request.path.startswith("/v1/") and self.api_key:
                given = request.headers.get("Authorization", "")
                expected = f"Bearer {self.api_key}"
                if not given and "x-api-key" in request.headers:
                    given, expected = request.headers["x-api-key"], self.api_key
                # A header of bytes that are not UTF-8 arrives with surrogates in it.
                if not hmac.compare_digest(given.encode("utf-8", "replace"), expected.encode()):
                    problem = "a missing" if not given else "an invalid"
                    message = f"{problem} API key (Authorization: Bearer KEY, or x-api-key: KEY)"
                    raise fields.ApiError(401, message, code="invalid_api_key")
            return await handler(request)
        except fields.ApiError as error:
            if not request.get(LOGGED, False):
                self._log_refusal(request, error.status, error.message)
            body = anthropic_api.error_body(error.status, error.message) if anthropic else error.body()
            return web.json_response(body, status=error.status, headers=error.headers)
        except web.HTTPException as error:  # the router's 404 and 405, a body over the size limit
            if error.status < 400:
                raise
            kind = "not_found_error" if error.status == 404 else "invalid_request_error"
            message = f"{request.method} {request.path}: {error.reason}"
            if error.status == 404:
                message += f"; this server serves {operator.served(self.app)}"
            self._log_refusal(request, error.status, error.reason)
            return web.json_response(fields.error_body(message, kind), status=error.status)
        except Exception as error:  # a bug of ours: this request fails, the server goes on
            if not request.get(LOGGED, False):
                self.log(
                    f"internal error on {request.method} {request.path}: {type(error).__name__}: {error}"
                )
            body = fields.error_body(f"internal error: {type(error).__name__}", "server_error")
            return web.json_response(body, status=500)

    def _log_refusal(self, request: web.Request, status: int, why: str) -> None:
        self.log(f"{request.remote} {request.method} {request.path} {status}: {why}")

    def _log_exchange(self, request: web.Request, exchange: Exchange) -> None:
        """The request's one log line (the error middleware writes no other)."""
        request[LOGGED] = True
        self.metrics.exchange(exchange)
        took = time.perf_counter() - exchange.arrived
        line = (
            f"{exchange.peer} {exchange.method} {exchange.path} {exchange.status} · "
            f"prompt {exchange.prompt_tokens} tokens · completion {exchange.completion_tokens} tokens · "
            f"queued {exchange.queued_s:.2f} s"
        )
        result = exchange.result
        if result is not None and result.prompt_reused:
            line += f" · {reuse_line(result)}"
        if result is not None and result.tokens:
            line += (
                f" · first token {result.timings.ttft_ms:.0f} ms · prefill {result.timings.prefill_ms:.0f} ms"
                f" · {result.timings.decode_tokens_per_s:.1f} tok/s"
            )
        line += f" · {took:.2f} s"
        if exchange.run_id:
            line += f" · run {exchange.run_id:016x}"
        if exchange.detail:
            line += f" · {exchange.detail}"
        self.log(line)

    # ----------------------------------------------------------- endpoints

    async def health(self, request: web.Request) -> web.Response:
        if self.ready and not self.pipeline.queue.stopped and not self.closing:
            # requests: being answered or waiting (a load balancer's measure
            # of how busy this pipeline is); past queue + slots the next is a 503.
            # "recovering": a stage was lost and is being started again; the
            # requests wait (docs/recovery.md).
            # stages_lost, repairs, runs_replayed: counted apart (core/recovery.py
            # Counts); "recoveries" is the old name of runs_replayed, kept.
            status = "recovering" if self.pipeline.recovering else "ok"
            body: dict[str, object] = {"status": status, "requests": self.admitted, "queue": self.queue}
            body |= {"slots": self.pipeline.parallel}
            counts = self.pipeline.recovery.counts
            body |= counts.as_json() | {"recoveries": counts.runs_replayed}
            return web.json_response(body)
        status = "loading" if not self.ready else "unavailable"
        return web.json_response(
            fields.error_body(f"the pipeline is {status}", "unavailable_error"), status=503
        )

    async def embeddings(self, request: web.Request) -> web.Response:
        raise fields.ApiError(
            501,
            "embeddings are not served: the pipeline's last stage samples tokens (run llama-server "
            "--embedding on the whole model for /v1/embeddings)",
            "not_implemented_error",
        )

    async def models(self, request: web.Request) -> web.Response:
        facts = self.pipeline.facts
        meta: dict[str, Any] = {"stages": len(self.inventory.stages)}
        if facts is not None:
            meta |= {"architecture": facts.architecture, "name": facts.stem, "layers": facts.block_count}
        entry = {"id": self.model, "object": "model", "created": self.created, "owned_by": "ggufpipe"}
        entry["meta"] = meta
        return web.json_response({"object": "list", "data": [entry]})

    # ---------------------------------------------------------- completions

    async def chat(self, request: web.Request) -> web.StreamResponse:
        c = api.parse_chat(await self._body(request))
        ident, created = answer.new_id(True), int(time.time())
        return await self._complete(request, c, OpenAIRenderer(c, ident, created, self.model))

    async def completion(self, request: web.Request) -> web.StreamResponse:
        c = api.parse_completion(await self._body(request))
        ident, created = answer.new_id(False), int(time.time())
        prefix = c.prompt if c.echo else ""
        return await self._complete(request, c, OpenAIRenderer(c, ident, created, self.model, prefix))

    async def messages(self, request: web.Request) -> web.StreamResponse:
        c = anthropic_api.parse_messages(await self._body(request))
        renderer = AnthropicRenderer(c, anthropic_api.new_id(), int(time.time()), self.model)
        return await self._complete(request, c, renderer)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        c = responses_api.parse_responses(await self._body(request), self.store)
        ident = responses_answer.new_id()
        return await self._complete(
            request, c, ResponsesRenderer(c, ident, int(time.time()), self.model, self.store)
        )

    async def count_tokens(self, request: web.Request) -> web.Response:
        """Anthropic's ``/v1/messages/count_tokens``: the prompt's tokens."""
        body = await self._body(request)
        if isinstance(body, dict):
            body = {"max_tokens": 1, **body}
        c = anthropic_api.parse_messages(body)
        (prompt,), _ = replies.prompts_for(c, self.template, self.inventory.run.seed)
        try:
            tokens, _ = await self.pipeline.tokenize(
                prompt.text, True, prompt.messages, prompt.tools, prompt.template
            )
        except PipelineError as error:
            raise fields.ApiError(400, str(error)) from None
        return web.json_response({"input_tokens": len(tokens)})

    @property
    def template(self) -> str:
        """The chat template prompts are rendered with."""
        facts = self.pipeline.facts
        return self.chat_template or (facts.chat_template if facts is not None else "")

    async def _body(self, request: web.Request) -> object:
        try:
            raw = await asyncio.wait_for(request.read(), BODY_SECONDS)
        except asyncio.TimeoutError:
            raise fields.ApiError(
                408, f"the request body took more than {BODY_SECONDS:g} s to arrive"
            ) from None
        try:
            return json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as error:  # JSONDecodeError, UnicodeDecodeError, 4300+ digits
            raise fields.ApiError(400, f"the request body is not JSON: {error}") from None

    def _admit(self, count: int) -> None:
        if self.closing or self.pipeline.queue.stopped:
            raise fields.ApiError(503, SHUTDOWN, "unavailable_error")
        if self.admitted + count > self.queue + self.pipeline.parallel:
            if self.pipeline.recovering:
                # The pipeline is rebuilding a lost stage: come back when it may be done.
                retry = str(RECOVERY_RETRY_AFTER)
                raise fields.ApiError(
                    503,
                    f"the pipeline is recovering a lost stage and {self.queue} requests wait: "
                    f"try again in {retry} s",
                    "unavailable_error",
                    headers={"Retry-After": retry},
                )
            raise fields.ApiError(
                503, f"the queue is full ({self.queue} requests wait): try again later", "unavailable_error"
            )

    async def _complete(self, request: web.Request, c: Completion, renderer: Renderer) -> web.StreamResponse:
        self._admit(c.n)
        exchange = Exchange(request.method, request.path, str(request.remote), time.perf_counter())
        exchange.ident, exchange.created = renderer.ident, renderer.created
        try:
            prompts, family = replies.prompts_for(c, self.template, self.inventory.run.seed)
        except ValueError as error:  # a call grammar the tools cannot make
            raise fields.ApiError(400, f"tools: {error}", param="tools") from None
        if self.chat_template:
            prompts = [replace(p, template=self.chat_template) for p in prompts]
        handles = [self.pipeline.submit(prompt, stream=True) for prompt in prompts]
        self.admitted += len(handles)
        self.handles.update(handles)
        self.answered.clear()
        try:
            return await answering.answer(
                self.pipeline,
                self._closed,
                self.cut.__contains__,
                request,
                c,
                handles,
                family,
                exchange,
                renderer,
            )
        except asyncio.CancelledError:  # aiohttp cancels the handler of a client that went away
            exchange.status, exchange.detail = 499, "the client went away: run stopped"
            raise
        except fields.ApiError as error:
            exchange.status, exchange.detail = error.status, exchange.detail or error.message
            raise
        except Exception as error:  # a bug of ours: the middleware answers 500
            exchange.status = 500
            exchange.detail = f"internal error: {type(error).__name__}: {error}"
            raise
        finally:
            for handle in handles:
                if not handle.done:
                    handle.stop("the client went away")
                self.handles.discard(handle)
                self.cut.discard(handle)
            self.admitted -= len(handles)
            if not self.admitted:
                self.answered.set()
            self._log_exchange(request, exchange)

    def _closed(self) -> bool:
        return self.closing or bool(self.pipeline.queue.stopped)

    # ------------------------------------------------------------- shutdown

    async def drain(self) -> None:
        """Answer what waits with a 503; give the running requests their grace,
        then stop them (each reply so cut short says so: server/answering.py)
        and let their answers end."""
        self.closing = True
        for handle in list(self.handles):
            if not handle.started:
                handle.stop(SHUTDOWN)
        running = [handle for handle in self.handles if handle.started and not handle.done]
        if running:
            what = "request" if len(running) == 1 else f"{len(running)} requests"
            self.log(f"finishing the running {what} (at most {SHUTDOWN_GRACE:g} s)")
            waits = [asyncio.ensure_future(handle.result()) for handle in running]
            _, late = await asyncio.wait(waits, timeout=SHUTDOWN_GRACE)
            for handle in running:
                if not handle.done:
                    self.cut.add(handle)
                    handle.stop(SHUTDOWN)
            if late:  # stopped: wait for it to end, then give up on it
                await asyncio.wait(late, timeout=SHUTDOWN_GRACE)
            for wait in waits:
                wait.cancel()
        # The answers' last events written and their lines logged.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.answered.wait(), SHUTDOWN_GRACE)
