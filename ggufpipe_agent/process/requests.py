"""The control requests an agent answers off its event loop, in a helper
thread (a vocabulary takes a moment to load): Inspect (the model's facts,
vocabulary and identity), Tokenize (a prompt's tokens, through the chat
template) and CacheRequest (this host's stage cache)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ggufpipe_agent.delivery.service import answer_cache_request
from ggufpipe_agent.wire.codec import MAX_PROMPT_TOKENS
from ggufpipe_agent.wire.delivery_messages import CacheRequest
from ggufpipe_agent.wire.protocol import Inspect, Message, ModelInfo, RequestFailed, Tokenize, Tokenized


def answer_request(request: Inspect | Tokenize | CacheRequest, cache_dir: Path | None) -> Message:
    """Inspect, Tokenize and CacheRequest, in a helper thread (vocabulary
    loads take a moment)."""
    from ggufpipe_agent.gguf.facts import read_model_facts
    from ggufpipe_agent.llama.vocabulary import vocabulary

    if isinstance(request, CacheRequest):
        return answer_cache_request(cache_dir, request)
    facts = read_model_facts(request.path)
    if isinstance(request, Inspect):
        from ggufpipe_agent.gguf.identity import model_identity

        pieces: tuple[bytes, ...] = ()
        special: tuple[tuple[int, bytes], ...] = ()
        if request.vocabulary:
            vocab = vocabulary(facts.path)
            pieces, special = vocab.pieces(), vocab.special_pieces()
            facts = replace(facts, eog_token_ids=vocab.eog_tokens())
        return ModelInfo(request.request_id, facts, pieces, model_identity(facts.path), special)
    vocab = vocabulary(facts.path)
    template = request.template or facts.chat_template
    tokens, rendered = vocab.prompt_tokens(
        template, request.text, request.chat, request.messages, request.tools
    )
    if len(tokens) > MAX_PROMPT_TOKENS:
        # Refused here: a reply this long would break the control stream.
        return RequestFailed(
            request.request_id,
            f"the prompt is {len(tokens)} tokens, more than any context holds (at most {MAX_PROMPT_TOKENS})",
        )
    return Tokenized(request.request_id, tuple(tokens), rendered)
