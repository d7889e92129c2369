"""An operator's view of the server, as llama-server gives it: ``POST
/tokenize``, ``POST /detokenize``, ``GET /props``, ``GET /slots`` and ``GET
/metrics`` (Prometheus' text format), with llama-server's field and metric
names, so its tools and dashboards read them as they are.

The orchestrator loads no model: tokenizing goes to where the pipeline's
prompts are tokenized (stage 0's agent, or this machine with ``send: true``:
session/modelsource.py), and token ids become text with the token pieces the
pipeline read with the model (the bytes each token prints as output, control
tokens empty), as a run's reply does.

``/metrics`` is written by hand: about twenty series in the text exposition
format (https://prometheus.io/docs/instrumenting/exposition_formats/) are a
few lines each, and prometheus_client would be a dependency with a registry
of its own for what :class:`~ggufpipe_tui.server.metrics.Metrics` already
keeps. llama-server's own names (``llamacpp:*``) are given where one means
the same; ours are ``ggufpipe_*``.

Every one of these needs the API key when the server has one (as
llama-server: only ``/health`` is public): the template, the slots' runs and
the traffic are the operator's business.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from ggufpipe_tui.server.fields import ApiError
from ggufpipe_tui.server.prometheus import CONTENT_TYPE, Exposition
from ggufpipe_tui.session.stages import PipelineError

if TYPE_CHECKING:
    from ggufpipe_tui.core.inventory import Inventory
    from ggufpipe_tui.server.metrics import Metrics
    from ggufpipe_tui.session.driver import RunDriver
    from ggufpipe_tui.session.pipeline import Pipeline
    from ggufpipe_tui.session.runs import RunHandle


class Server(Protocol):
    """What these handlers read of the server (server/http.py's Server)."""

    pipeline: Pipeline
    inventory: Inventory
    api_key: str
    model: str
    queue: int
    admitted: int  # requests submitted and not answered, the running ones included
    handles: set[RunHandle]
    ready: bool
    closing: bool
    metrics: Metrics


#: llama-server's sampling fields in /props' default_generation_settings.params,
#: each from the run options' field of that name where ggufpipe has one.
PROPS_FIELDS = (
    "seed",
    "temperature",
    "dynatemp_range",
    "dynatemp_exponent",
    "top_k",
    "top_p",
    "min_p",
    "top_n_sigma",
    "xtc_probability",
    "xtc_threshold",
    "typical_p",
    "repeat_last_n",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "ignore_eos",
    "min_keep",
)
#: The most token ids one /detokenize may give (a whole context is far fewer).
MAX_TOKENS = 1 << 20

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def add_routes(app: web.Application, server: Server) -> None:
    """The operator's endpoints on ``app``, answered from ``server``."""

    def bound(handler: Callable[[Server, web.Request], Awaitable[web.StreamResponse]]) -> Handler:
        async def handle(request: web.Request) -> web.StreamResponse:
            check_key(server, request)
            return await handler(server, request)

        return handle

    app.router.add_post("/tokenize", bound(tokenize))
    app.router.add_post("/detokenize", bound(detokenize))
    app.router.add_get("/props", bound(props))
    app.router.add_get("/slots", bound(slots))
    app.router.add_get("/metrics", bound(metrics))


def check_key(server: Server, request: web.Request) -> None:
    """The server's API key, as ``Authorization: Bearer KEY`` (or Anthropic's ``x-api-key``)."""
    if not server.api_key:
        return
    given = request.headers.get("Authorization", "")
    token = given[len("Bearer ") :] if given.startswith("Bearer ") else request.headers.get("x-api-key", "")
    # A header of bytes that are not UTF-8 arrives with surrogates in it.
    if not hmac.compare_digest(token.encode("utf-8", "replace"), server.api_key.encode()):
        problem = "a missing" if not (given or request.headers.get("x-api-key")) else "an invalid"
        raise ApiError(401, f"{problem} API key (Authorization: Bearer KEY)", code="invalid_api_key")


async def json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json(loads=_loads)
    except ValueError as error:
        raise ApiError(400, f"the request body is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise ApiError(400, f"{name}: must be true or false", param=name)
    return value


def pieces_of(server: Server) -> tuple[bytes, ...]:
    pieces = server.pipeline.pieces
    if not pieces or server.pipeline.facts is None:
        raise ApiError(
            503, "the pipeline is loading: the model's vocabulary is not read yet", "unavailable_error"
        )
    return pieces


# ---------------------------------------------------------------- tokens


async def tokenize(server: Server, request: web.Request) -> web.Response:
    """``{content, add_special, with_pieces}`` -> ``{tokens}``: ids, or with
    pieces ``[{id, piece}]``, a piece as text or, where its bytes are not
    UTF-8 by themselves, as a list of byte values (as llama-server).
    ``content``: a string, or a list of strings and token ids (llama-server's
    mixed prompt). Special tokens written as text are parsed
    (``parse_special`` true); ``add_special`` (false) adds the model's BOS."""
    body = await json_body(request)
    add_special = flag(body, "add_special", False)
    with_pieces = flag(body, "with_pieces", False)
    if body.get("parse_special", True) is not True:
        raise ApiError(400, "parse_special: only true (the agents tokenize special tokens written as text)")
    content = body.get("content")
    if content is None:
        return web.json_response({"tokens": []})  # as llama-server: no content, no tokens
    parts = [content] if isinstance(content, str) else content
    if not isinstance(parts, list) or not all(isinstance(part, str | int) for part in parts):
        raise ApiError(400, "content: a string, or a list of strings and token ids", param="content")
    pieces = pieces_of(server)
    facts = server.pipeline.facts
    assert facts is not None
    tokens: list[int] = []
    for index, part in enumerate(parts):
        if isinstance(part, bool) or (isinstance(part, int) and not 0 <= part < len(pieces)):
            raise ApiError(
                400, f"content[{index}]: {part!r} is not a token id of this model", param="content"
            )
        if isinstance(part, int):
            tokens.append(part)
            continue
        tokens.extend(await _tokens(server, part, add_special and index == 0))
    if add_special and parts and not isinstance(parts[0], str) and facts.add_bos and facts.bos_token_id >= 0:
        tokens.insert(0, facts.bos_token_id)
    if not with_pieces:
        return web.json_response({"tokens": tokens})
    return web.json_response(
        {"tokens": [{"id": token, "piece": piece_json(pieces[token])} for token in tokens]}
    )


async def _tokens(server: Server, text: str, add_special: bool) -> list[int]:
    """``text``'s tokens by the pipeline's tokenizer, which adds the model's
    BOS: taken off again unless ``add_special``."""
    try:
        tokens, _ = await server.pipeline.tokenize(text, False)
    except PipelineError as error:
        if not server.ready or server.closing:
            raise ApiError(503, str(error), "unavailable_error") from None
        raise ApiError(400, str(error)) from None
    facts = server.pipeline.facts
    assert facts is not None
    bos = facts.bos_token_id
    if not add_special and facts.add_bos and tokens and bos >= 0 and tokens[0] == bos:
        return tokens[1:]
    return tokens


def piece_json(piece: bytes) -> str | list[int]:
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)


async def detokenize(server: Server, request: web.Request) -> web.Response:
    """``{tokens}`` -> ``{content}``: the tokens' pieces as one text (bytes
    that are not UTF-8 become U+FFFD)."""
    body = await json_body(request)
    tokens = body.get("tokens", [])
    if not isinstance(tokens, list) or len(tokens) > MAX_TOKENS:
        raise ApiError(400, f"tokens: a list of at most {MAX_TOKENS} token ids", param="tokens")
    pieces = pieces_of(server)
    for index, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < len(pieces):
            raise ApiError(400, f"tokens[{index}]: {token!r} is not a token id of this model", param="tokens")
    content = b"".join(pieces[token] for token in tokens).decode("utf-8", errors="replace")
    return web.json_response({"content": content})


# ----------------------------------------------------------- props, slots


def n_ctx(server: Server) -> int:
    """Each slot's context, in tokens (the model's limit if smaller than the run's)."""
    if server.pipeline.facts is not None:
        return server.pipeline.model_plan().max_seq_len
    return server.inventory.run.context


def piece_text(server: Server, token: int) -> str:
    pieces = server.pipeline.pieces
    return pieces[token].decode("utf-8", "replace") if 0 <= token < len(pieces) else ""


def build_info() -> str:
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "unknown"

    return f"ggufpipe {of('ggufpipe')} (llama-cpp-python {of('llama_cpp_python')})"


async def props(server: Server, request: web.Request) -> web.Response:
    """llama-server's ``/props``: the defaults a request starts from, the
    slots, the model and its chat template."""
    options = server.inventory.run
    params: dict[str, Any] = {name: getattr(options, name) for name in PROPS_FIELDS if hasattr(options, name)}
    params |= {"max_tokens": options.max_tokens, "n_predict": options.max_tokens, "stream": False}
    facts = server.pipeline.facts
    body: dict[str, Any] = {
        "default_generation_settings": {"params": params, "n_ctx": n_ctx(server)},
        "total_slots": server.pipeline.parallel,
        "model_alias": server.model,
        "model_path": server.inventory.model_path,
        "modalities": {"vision": False, "video": False, "audio": False},
        "endpoint_slots": True,
        "endpoint_props": False,
        "endpoint_metrics": True,
        "chat_template": facts.chat_template if facts is not None else "",
        "bos_token": piece_text(server, facts.bos_token_id) if facts is not None else "",
        "eos_token": piece_text(server, facts.eos_token_id) if facts is not None else "",
        "build_info": build_info(),
        "is_sleeping": False,
        "stages": len(server.inventory.stages),
    }
    return web.json_response(body)


def running(handles: Iterable[RunHandle]) -> dict[int, RunHandle]:
    """The requests whose runs are in flight, by slot."""
    return {
        handle.driver.plan.slot: handle
        for handle in handles
        if handle.driver is not None and not handle.done and not handle.driver.done.is_set()
    }


def slot_entry(slot: int, context: int, driver: RunDriver | None, processing: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"id": slot, "n_ctx": context, "speculative": False, "is_processing": processing}
    if driver is None:
        return entry
    plan = driver.plan
    limit = getattr(driver.run, "max_tokens", plan.max_tokens) or plan.max_tokens
    sampling = plan.sampling
    entry |= {
        "id_task": plan.run_id,
        "run": f"{plan.run_id:016x}",
        "n_prompt_tokens": len(driver.prompt),
        "n_prompt_tokens_cache": driver.kept,
        "params": {
            "seed": sampling.seed,
            "temperature": sampling.temperature,
            "top_k": sampling.top_k,
            "top_p": sampling.top_p,
            "max_tokens": limit,
            "n_predict": limit,
            "ignore_eos": plan.ignore_eos,
        },
        "next_token": [
            {
                "has_next_token": processing,
                "n_remain": max(0, limit - len(driver.tokens)) if processing else 0,
                "n_decoded": len(driver.tokens),
            }
        ],
    }
    return entry


async def slots(server: Server, request: web.Request) -> web.Response:
    """llama-server's ``/slots``: each slot, whether a request runs on it,
    and the run it holds (the one running, else the last); ``run`` is the
    run id as the run logs and ``X-Ggufpipe-Run`` name it.
    ``?fail_on_no_slot=1``: a 503 when every slot is busy."""
    pipeline = server.pipeline
    busy = running(server.handles)
    context = n_ctx(server)
    entries = []
    for slot in range(pipeline.parallel):
        handle = busy.get(slot)
        driver = handle.driver if handle is not None else pipeline.on_slot[slot]
        if driver is not None and handle is None and not driver.prompt:
            driver = None  # a run prepared ahead: nothing ran on it yet
        entries.append(slot_entry(slot, context, driver, handle is not None))
    if request.query.get("fail_on_no_slot") and len(busy) >= pipeline.parallel:
        raise ApiError(503, "no slot available", "unavailable_error")
    return web.json_response(entries)


# ---------------------------------------------------------------- metrics


async def metrics(server: Server, request: web.Request) -> web.Response:
    """Prometheus' text format (llama-server's Content-Type and start-time header)."""
    headers = {"Content-Type": CONTENT_TYPE, "Process-Start-Time-Unix": str(int(server.metrics.started))}
    return web.Response(body=metrics_text(server).encode(), headers=headers)


def metrics_text(server: Server) -> str:
    counts, pipeline = server.metrics, server.pipeline
    busy = len(running(server.handles))
    waiting = max(0, server.admitted - busy)
    out = Exposition()
    # llama-server's names, with its meanings.
    out.counter(
        "llamacpp:prompt_tokens_total",
        "Number of prompt tokens processed, excluding cached tokens",
        counts.prompt_tokens,
    )
    out.counter(
        "llamacpp:prompt_tokens_cached_total",
        "Number of prompt tokens reused from the cache",
        counts.prompt_tokens_cached,
    )
    out.counter("llamacpp:prompt_seconds_total", "Total time spent processing prompts", counts.prompt_seconds)
    out.counter(
        "llamacpp:tokens_predicted_total", "Number of generation tokens processed", counts.completion_tokens
    )
    out.counter(
        "llamacpp:tokens_predicted_seconds_total", "Total time spent generating tokens", counts.decode_seconds
    )
    out.counter(
        "llamacpp:n_tokens_max",
        "Largest observed sequence length (prompt + generation)",
        counts.largest_sequence,
    )
    prompt_rate = counts.prompt_tokens / counts.prompt_seconds if counts.prompt_seconds > 0 else 0.0
    decode_rate = counts.completion_tokens / counts.decode_seconds if counts.decode_seconds > 0 else 0.0
    out.gauge("llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s", prompt_rate)
    out.gauge("llamacpp:predicted_tokens_seconds", "Average generation throughput in tokens/s", decode_rate)
    out.gauge("llamacpp:requests_processing", "Number of requests processing", busy)
    out.gauge("llamacpp:requests_deferred", "Number of requests deferred", waiting)
    # Ours.
    out.header("ggufpipe_requests_total", "counter", "HTTP requests answered, by method, endpoint and status")
    for method, endpoint, status, count in counts.requests_by():
        out.sample("ggufpipe_requests_total", count, method=method, endpoint=endpoint, status=str(status))
    out.counter(
        "ggufpipe_completions_total",
        "Completion requests ended (answered, refused or stopped)",
        counts.completions,
    )
    out.counter(
        "ggufpipe_prompt_tokens_total",
        "Prompt tokens of the completions, kept from a cache or not",
        counts.prompt_tokens + counts.prompt_tokens_cached,
    )
    out.counter("ggufpipe_completion_tokens_total", "Tokens generated", counts.completion_tokens)
    out.gauge(
        "ggufpipe_tokens_per_second", "Decode tokens/s of the last completion", counts.last_tokens_per_s
    )
    out.gauge(
        "ggufpipe_tokens_per_second_moving",
        "Decode tokens/s, a moving average over the completions",
        counts.moving_tokens_per_s,
    )
    out.gauge("ggufpipe_requests_waiting", "Requests admitted and waiting for a slot", waiting)
    out.gauge("ggufpipe_queue_limit", "Requests that may wait before the next is a 503", server.queue)
    out.gauge("ggufpipe_slots_busy", "Slots running a request", busy)
    out.gauge("ggufpipe_slots_total", "Slots: requests in flight at once on every stage", pipeline.parallel)
    out.gauge("ggufpipe_stages", "Stages of the pipeline", len(server.inventory.stages))
    out.gauge(
        "ggufpipe_ready",
        "1 when the pipeline serves requests, 0 loading, recovering or closing",
        _ready(server),
    )
    stages = sorted(counts.stages.items())
    out.header(
        "ggufpipe_stage_step_seconds", "summary", "Decode steps of each stage and their time, every run"
    )
    for stage, steps in stages:
        out.sample("ggufpipe_stage_step_seconds_sum", steps.seconds, stage=str(stage))
        out.sample("ggufpipe_stage_step_seconds_count", steps.steps, stage=str(stage))
    out.header(
        "ggufpipe_stage_step_ms", "gauge", "Mean ms per decode step of each stage, as it last reported"
    )
    for stage, steps in stages:
        out.sample("ggufpipe_stage_step_ms", steps.last_mean_ms, stage=str(stage))
    out.header("ggufpipe_stage_prefill_seconds_total", "counter", "Time each stage spent on prompts")
    for stage, steps in stages:
        out.sample("ggufpipe_stage_prefill_seconds_total", steps.prefill_seconds, stage=str(stage))
    lost = pipeline.recovery.counts  # as GET /health counts them
    out.counter(
        "ggufpipe_stage_losses_total",
        "Stages lost (a process or a host gone, a stream broken)",
        lost.stages_lost,
    )
    out.counter("ggufpipe_repairs_total", "Repairs of lost stages that worked", lost.repairs)
    out.counter(
        "ggufpipe_runs_replayed_total", "Runs replayed after a lost stage was repaired", lost.runs_replayed
    )
    out.counter(
        "ggufpipe_recoveries_total",
        "Runs replayed after a lost stage was repaired (the old name of ggufpipe_runs_replayed_total)",
        lost.runs_replayed,
    )
    out.gauge("ggufpipe_recovering", "1 while a lost stage is being repaired", int(pipeline.recovering))
    out.counter("ggufpipe_runs_faulted_total", "Runs that faulted", counts.runs_faulted)
    return out.text()


def _ready(server: Server) -> int:
    pipeline = server.pipeline
    return int(server.ready and not server.closing and not pipeline.queue.stopped and not pipeline.recovering)


def served(app: web.Application) -> str:
    """What ``app`` serves, for a 404: "GET /health, POST /v1/chat/completions, ..."."""
    seen: dict[str, None] = {}
    for route in app.router.routes():
        if route.method in ("HEAD", "OPTIONS", "*") or route.resource is None:
            continue
        seen.setdefault(f"{route.method} {route.resource.canonical}")
    return ", ".join(seen)
