"""The answers of OpenAI's Responses API (:mod:`ggufpipe_tui.server.responses_api`):
the run's pieces into the response object, whole or as the typed
server-sent events the ``openai`` SDK (and the Agents SDK, Codex) read.
Pure."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from ggufpipe_tui.server import api_common as common
from ggufpipe_tui.server.request import CallArguments, CallStart, Completion, Piece, Text, Usage

# ---------------------------------------------------------------- answers


def new_id() -> str:
    return common.new_id("resp_")


def usage(counts: Usage) -> dict[str, Any]:
    return {
        "input_tokens": counts.prompt_tokens,
        "input_tokens_details": {"cached_tokens": counts.cached_tokens},
        "output_tokens": counts.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": counts.prompt_tokens + counts.completion_tokens,
    }


def message_item(ident: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": ident, "status": status, "role": "assistant", "content": [part]}


def call_item(ident: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": ident,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(pieces: Sequence[Piece]) -> list[dict[str, Any]]:
    """The ``output`` of a reply not streamed: its text as a message, then its calls."""
    reply = common.collect(pieces)
    status = "incomplete" if reply.finish is not None and reply.finish.reason == "length" else "completed"
    items = [message_item(common.new_id("msg_"), reply.text, status)] if reply.text or not reply.calls else []
    for call in reply.calls:
        items.append(call_item(common.new_id("fc_"), call.id, call.name, call.arguments, "completed"))
    return items


def response_object(
    completion: Completion,
    ident: str,
    model: str,
    pieces: Sequence[Piece],
    status: str | None = None,
    *,
    created: int | None = None,
    output: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The response: ``status`` "completed", or "incomplete" where the reply
    was cut by ``max_output_tokens``, derived from the pieces unless given
    ("in_progress" for the stream's first events); ``output`` the items a
    stream already sent, else made from the pieces."""
    reply = common.collect(pieces)
    if status is None:
        cut = reply.finish is not None and reply.finish.reason == "length"
        status = "incomplete" if cut else "completed" if reply.finish is not None else "in_progress"
    echoed = completion.metadata
    choice: object = completion.tool_choice
    if choice == "function":
        choice = {"type": "function", "name": completion.tool_name}
    return {
        "id": ident,
        "object": "response",
        "created_at": int(time.time()) if created is None else created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": echoed.get("instructions"),
        "max_output_tokens": echoed.get("max_output_tokens"),
        "model": model,
        "output": output_items(pieces) if output is None else output,
        "parallel_tool_calls": completion.parallel_tool_calls,
        "previous_response_id": echoed.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None},
        "store": echoed.get("store", True),
        "temperature": completion.options.temperature,
        "text": echoed.get("text", {"format": {"type": "text"}}),
        "tool_choice": choice,
        "tools": [
            {
                "type": "function",
                "name": tool.name,
                "description": tool.description or None,
                "parameters": dict(tool.parameters),
                "strict": tool.strict,
            }
            for tool in completion.tools
        ],
        "top_p": completion.options.top_p,
        "truncation": "disabled",
        "usage": usage(reply.usage) if reply.finish is not None else None,
        "user": echoed.get("user"),
        "metadata": dict(echoed.get("metadata") or {}),
    }


Event = tuple[str, dict[str, Any]]


class ResponseStream:
    """The typed server-sent events of a streamed response, as the ``openai``
    SDK reads them: :meth:`start` gives ``response.created`` and
    ``response.in_progress``; each :meth:`feed` the events its piece makes
    (an output item is added when it begins and done when the next begins);
    the :class:`Finish` piece closes the open item and gives
    ``response.completed``, or ``response.incomplete`` (as OpenAI) where the
    reply was cut by ``max_output_tokens``. Each event carries its
    ``sequence_number``; write it as ``event: NAME`` and ``data: JSON``.
    :attr:`pieces` are the pieces fed, for :meth:`ResponseStore.save`;
    :attr:`response` the final response once finished."""

    def __init__(self, completion: Completion, ident: str, model: str) -> None:
        self.completion, self.ident, self.model = completion, ident, model
        self.created = int(time.time())
        self.sequence = 0
        self.pieces: list[Piece] = []
        self.output: list[dict[str, Any]] = []  # the items, as each was done (or is now)
        self.open: dict[str, Any] | None = None  # the item open now
        self.calls: dict[int, dict[str, Any]] = {}  # a call's index -> its item
        self.response: dict[str, Any] | None = None

    def start(self, prompt_tokens: int = 0, cached_tokens: int = 0) -> list[Event]:
        """The first events (the counts, as :class:`MessageStream` takes
        them, go unused: the Responses API gives usage only at the end)."""
        shell = response_object(
            self.completion, self.ident, self.model, [], "in_progress", created=self.created, output=[]
        )
        return [
            self._event("response.created", response=shell),
            self._event("response.in_progress", response=shell),
        ]

    def feed(self, piece: Piece) -> list[Event]:
        if self.response is not None:
            return []
        self.pieces.append(piece)
        if isinstance(piece, Text):
            return self._text(piece.text) if piece.text else []
        if isinstance(piece, CallStart):
            events = self._close("completed")
            added = call_item(common.new_id("fc_"), piece.id, piece.name, "", "in_progress")
            self.calls[piece.index] = added
            return [*events, *self._add(added)]
        if isinstance(piece, CallArguments):
            item = self.calls.get(piece.index)
            if item is None or item is not self.open or not piece.arguments:
                return []  # a call's arguments come before the next item begins
            item["arguments"] += piece.arguments
            return [
                self._event("response.function_call_arguments.delta", delta=piece.arguments, **self._at(item))
            ]
        cut = piece.reason == "length"
        events = self._close("incomplete" if cut else "completed")
        self.response = response_object(
            self.completion, self.ident, self.model, self.pieces, created=self.created, output=self.output
        )
        name = "response.incomplete" if cut else "response.completed"
        return [*events, self._event(name, response=self.response)]

    def fail(self, message: str, code: str = "server_error") -> list[Event]:
        """The last event of a stream whose run failed: ``response.failed``
        with the error, the items begun so far left incomplete."""
        if self.response is not None:
            return []
        events = self._close("incomplete")
        self.response = response_object(
            self.completion,
            self.ident,
            self.model,
            self.pieces,
            "failed",
            created=self.created,
            output=self.output,
        )
        self.response["error"] = {"code": code, "message": message}
        return [*events, self._event("response.failed", response=self.response)]

    def _text(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self.open is None or self.open["type"] != "message":
            events = self._close("completed")
            added = message_item(common.new_id("msg_"), "", "in_progress")
            part = dict(added["content"].pop())
            events += self._add(added)
            added["content"].append(part)
            events.append(
                self._event("response.content_part.added", content_index=0, part=part, **self._at(added))
            )
        item = self.open
        assert item is not None
        item["content"][0]["text"] += text
        events.append(
            self._event(
                "response.output_text.delta", content_index=0, delta=text, logprobs=[], **self._at(item)
            )
        )
        return events

    def _add(self, item: dict[str, Any]) -> list[Event]:
        self.open = item
        self.output.append(item)
        return [
            self._event("response.output_item.added", output_index=len(self.output) - 1, item=_copy(item))
        ]

    def _close(self, status: str) -> list[Event]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        at = self._at(item)
        if item["type"] == "message":
            part = item["content"][0]
            events = [
                self._event(
                    "response.output_text.done", content_index=0, text=part["text"], logprobs=[], **at
                ),
                self._event("response.content_part.done", content_index=0, part=dict(part), **at),
            ]
        else:
            done = {"name": item["name"], "arguments": item["arguments"]}
            events = [self._event("response.function_call_arguments.done", **done, **at)]
        done_at = {"output_index": at["output_index"]}
        return [*events, self._event("response.output_item.done", item=_copy(item), **done_at)]

    def _at(self, item: dict[str, Any]) -> dict[str, Any]:
        return {
            "item_id": item["id"],
            "output_index": next(i for i, it in enumerate(self.output) if it is item),
        }

    def _event(self, name: str, /, **data: Any) -> Event:
        event = {"type": name, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return name, event


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """An item as it is now (the open one changes as the reply streams)."""
    return json.loads(json.dumps(item))  # type: ignore[no-any-return]
