"""One request's answer: its choices' runs followed to the client, streamed
or whole, through the API's renderer (ggufpipe_tui/server/renderers.py);
and the record of the exchange for its log line.

A reply the server's shutdown stopped (``cut``) is not passed off as whole:
streamed, the text already sent stays and the stream ends with the API's
error event naming the shutdown (no finish); not streamed, it is a 503."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from aiohttp import web

from ggufpipe_agent.ids import NO_RUN, RunId
from ggufpipe_tui.core.events import Event, PromptAssigned, RunResult
from ggufpipe_tui.server import fields, replies
from ggufpipe_tui.server import openai_answer as answers
from ggufpipe_tui.server.renderers import Renderer
from ggufpipe_tui.server.request import Completion, Finish, Piece, Usage
from ggufpipe_tui.server.tools import Family
from ggufpipe_tui.session.pipeline import Pipeline
from ggufpipe_tui.session.runs import ContextOverflow, RunHandle
from ggufpipe_tui.session.stages import PipelineError


@dataclass
class Exchange:
    """One request on its way, for the log line at its end."""

    method: str
    path: str
    peer: str
    arrived: float
    status: int = 200
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queued_s: float = 0.0
    run_id: RunId = NO_RUN
    ident: str = ""  # the answer's id
    created: int = 0
    result: RunResult | None = None
    detail: str = ""


async def answer(
    pipeline: Pipeline,
    closing: Callable[[], bool],
    cut: Callable[[RunHandle], bool],
    request: web.Request,
    c: Completion,
    handles: list[RunHandle],
    family: Family | None,
    exchange: Exchange,
    renderer: Renderer,
) -> web.StreamResponse:
    streams = []
    for handle in handles:
        events = handle.events()
        first = await anext(events, None)  # PromptAssigned, or the end of a prompt that never ran
        if first is None:
            raise await _not_run(handle, c, closing)
        assert isinstance(first, PromptAssigned)
        streams.append((handle, events, first.run_id))
    exchange.queued_s = time.perf_counter() - exchange.arrived
    exchange.run_id = streams[0][2]
    run = {"X-Ggufpipe-Run": ",".join(f"{run_id:016x}" for _, _, run_id in streams)}  # the runs' event logs
    choices = [
        replies.ChoiceRun(c, handle, pipeline, family, index) for index, (handle, _, _) in enumerate(streams)
    ]
    response: web.StreamResponse | None = None
    try:
        if c.stream:
            response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **run}
            )
            await response.prepare(request)
            await _write(response, renderer.start())
        return await _follow(
            c, choices, [events for _, events, _ in streams], exchange, renderer, response, run, cut
        )
    except ConnectionError:  # a write to a client that went away
        for handle in handles:
            handle.stop("the client went away")
        exchange.status, exchange.detail = 499, "the client went away: run stopped"
        return response if response is not None else web.Response(status=499)
    finally:
        # What it was sent, however it ended (a client gone mid-reply
        # included); a reply not streamed sends nothing but a whole one.
        if response is not None or exchange.status < 400:
            exchange.completion_tokens = max(exchange.completion_tokens, sum(ch.counted for ch in choices))
        if not exchange.prompt_tokens:
            driver = handles[0].driver
            exchange.prompt_tokens = len(driver.prompt) if driver is not None else 0


async def _follow(
    c: Completion,
    choices: list[replies.ChoiceRun],
    events: list[AsyncIterator[Event]],
    exchange: Exchange,
    renderer: Renderer,
    response: web.StreamResponse | None,
    run: dict[str, str],
    cut: Callable[[RunHandle], bool],
) -> web.StreamResponse:
    """The runs' pieces to the client (as they stream, or whole at the end);
    a choice the shutdown stopped gets no finish (:func:`_cut_short`)."""
    out: asyncio.Queue[tuple[int, Piece | BaseException | None]] = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async for piece in choices[index].pieces(events[index]):
                await out.put((index, piece))
        except replies.Faulted as fault:
            await out.put((index, fault))
        await out.put((index, None))

    tasks = [asyncio.ensure_future(pump(index)) for index in range(len(choices))]
    collected: list[list[Piece]] = [[] for _ in choices]
    fault: BaseException | None = None
    shut = False  # a choice was cut short by the shutdown
    try:
        running = len(tasks)
        while running:
            index, item = await out.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                fault = fault or item
                for choice in choices:
                    choice.handle.stop("another choice of the request faulted")
            elif isinstance(item, Finish) and _cut_short(choices[index], item, cut):
                shut = True
            else:
                collected[index].append(item)
                if response is not None:
                    await _write(response, renderer.piece(index, item))
    finally:
        for task in tasks:
            task.cancel()
    results = [choice.result for choice in choices]
    counts = [piece.usage for pieces in collected for piece in pieces if isinstance(piece, Finish)]
    prompt_tokens = len(results[0].prompt_tokens) if results[0] is not None else 0
    completion_tokens = sum(choice.counted for choice in choices)
    cached = counts[0].cached_tokens if counts else 0
    usage = Usage(prompt_tokens, completion_tokens, cached)
    exchange.result = results[0]
    exchange.prompt_tokens, exchange.completion_tokens = prompt_tokens, completion_tokens
    first = results[0]
    if first is not None and len(choices) == 1:
        spent = first.timings
        renderer.timings = answers.timings(
            prompt_tokens, spent.prefill_ms, completion_tokens, spent.decode_ms, cached
        )
    if fault is not None:
        exchange.status, exchange.detail = 500, f"faulted: {fault}"
        message = f"the pipeline faulted: {fault}"
        if response is None:
            raise fields.ApiError(500, message, "server_error")
        await _write(response, renderer.failed(500, message))
        await response.write_eof()
        return response
    if shut:
        message = f"the server is shutting down: the reply was stopped after {completion_tokens} tokens"
        exchange.status, exchange.detail = 503, f"cut short by the shutdown after {completion_tokens} tokens"
        if response is None:  # not streamed: the client gets none of them
            exchange.completion_tokens = 0
            exchange.detail = (
                f"cut short by the shutdown after {completion_tokens} tokens, none sent (not streamed)"
            )
            raise fields.ApiError(503, message, "unavailable_error")
        await _write(response, renderer.failed(503, message))
        await response.write_eof()
        return response
    if response is None:
        return web.json_response(renderer.whole(collected, usage), headers=run)
    await _write(response, renderer.end(usage))
    await response.write_eof()
    return response


def _cut_short(choice: replies.ChoiceRun, finish: Finish, cut: Callable[[RunHandle], bool]) -> bool:
    """Whether ``finish`` ends a reply the shutdown stopped (not one that
    came to its end, or to a stop string, meanwhile)."""
    result = choice.result
    return (
        cut(choice.handle)
        and finish.reason == "length"
        and not finish.stop
        and result is not None
        and result.stop_reason == "stopped"
    )


async def _not_run(handle: RunHandle, c: Completion, closing: Callable[[], bool]) -> fields.ApiError:
    """Why a prompt never ran, as the answer says it."""
    try:
        await handle.result()
    except ContextOverflow as overflow:
        asked = overflow.max_tokens if c.options.max_tokens is not None else 0
        what = "messages" if c.chat else "prompt"
        message = (
            f"This model's maximum context length is {overflow.context} tokens. However, you "
            f"requested {overflow.prompt_tokens + asked} tokens ({overflow.prompt_tokens} in the "
            f"{what}, {asked} in the completion). Please reduce the length of the {what} or completion."
        )
        return fields.ApiError(400, message, param=what, code="context_length_exceeded")
    except PipelineError as error:
        if closing():
            return fields.ApiError(503, str(error), "unavailable_error")
        return fields.ApiError(400, str(error))  # e.g. the chat template refused the messages
    return fields.ApiError(500, "the run ended before it started", "server_error")


async def _write(response: web.StreamResponse, chunks: list[bytes]) -> None:
    for chunk in chunks:
        await response.write(chunk)
