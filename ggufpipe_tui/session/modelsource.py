"""Where the orchestrator reads the model: through the hosts' own copies
(the default), or on this machine (``model: {path: P, send: true}``).

* :class:`HostCopies`: every stage host holds its own copy of the model.
  Each host's agent reads its copy's facts and identity (Inspect); stage 0's
  also its vocabulary, and it tokenizes the prompts. Every copy must be the
  same model as stage 0's: a copy whose identity differs (metadata or tensor
  table, :mod:`ggufpipe_agent.gguf.identity`) is refused before anything loads,
  naming both hosts and what differs.
* :class:`LocalModel`: the model lies here. Its facts, vocabulary and chat
  template are read here (the agent package's own functions, in
  a thread), prompts are tokenized here, and each host is then sent only its
  stage file (:mod:`ggufpipe_tui.session.delivery`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ggufpipe_agent.errors import GgufpipeError
from ggufpipe_agent.gguf.files import ModelFiles, read_model_files
from ggufpipe_agent.gguf.identity import describe_difference
from ggufpipe_agent.wire.protocol import (
    ChatMessage,
    Inspect,
    ModelFacts,
    ModelInfo,
    RequestFailed,
    Tokenize,
    Tokenized,
)
from ggufpipe_tui.core.inventory import Inventory
from ggufpipe_tui.session.stages import PipelineError, StageHandle


@dataclass(frozen=True, slots=True)
class ModelRead:
    facts: ModelFacts
    pieces: tuple[bytes, ...]  # token id -> bytes
    where: str  # the model, for messages: "PATH on HOST" or "PATH on this machine"
    special: tuple[tuple[int, bytes], ...] = ()  # control tokens' text (ModelInfo.special)


class HostCopies:
    """Each host's own copy, checked to be stage 0's model."""

    def __init__(self, inventory: Inventory, stages: Sequence[StageHandle]) -> None:
        self.inventory = inventory
        self.stages = stages
        self.reference: tuple[StageHandle, ModelInfo] | None = None  # stage 0's copy, once read

    async def read(self, timeout: float) -> ModelRead:
        inventory = self.inventory
        first: dict[str, StageHandle] = {}  # one Inspect per host, by its first stage
        for stage in self.stages:
            first.setdefault(stage.host.name, stage)
        asking = list(first.values())

        async def inspect(stage: StageHandle) -> ModelInfo | RequestFailed:
            path = inventory.model_path_for(stage.host)
            wanted = stage.index == 0  # the vocabulary only where prompts are tokenized
            reply = await stage.request(lambda rid: Inspect(rid, path, wanted), timeout)
            assert isinstance(reply, ModelInfo | RequestFailed)
            return reply

        replies = await asyncio.gather(*(inspect(stage) for stage in asking))
        for stage, reply in zip(asking, replies, strict=True):
            if isinstance(reply, RequestFailed):
                host = stage.host
                if host.model_path:
                    where = f"hosts.{host.name}.model_path at {inventory.where(host.line)}"
                else:
                    where = f"model.path at {inventory.where(inventory.model_line)}"
                raise PipelineError(f"model on {host.name}: {reply.reason} ({where})")
        infos = [reply for reply in replies if isinstance(reply, ModelInfo)]
        reference, reference_stage = infos[0], asking[0]
        self.reference = (reference_stage, reference)
        for stage, info in zip(asking[1:], infos[1:], strict=True):
            self._check_copy(reference_stage, reference, stage, info)
        facts = reference.facts
        where = f"{facts.path} on {reference_stage.host.name}"
        return ModelRead(facts, reference.pieces, where, reference.special)

    async def check(self, stage: StageHandle, timeout: float) -> None:
        """A stage started again (recovery): its host's copy is still stage 0's model."""
        path = self.inventory.model_path_for(stage.host)
        reply = await stage.request(lambda rid: Inspect(rid, path, False), timeout)
        if isinstance(reply, RequestFailed):
            raise PipelineError(f"model on {stage.host.name}: {reply.reason}")
        assert isinstance(reply, ModelInfo)
        if self.reference is not None:
            first, expected = self.reference
            self._check_copy(first, expected, stage, reply)

    def _check_copy(
        self, first: StageHandle, expected: ModelInfo, stage: StageHandle, info: ModelInfo
    ) -> None:
        """Refuse a host whose copy is not stage 0's model."""
        if expected.identity is None or info.identity is None:
            return
        difference = describe_difference(expected.identity, info.identity)
        if difference:
            raise PipelineError(
                f"stage {stage.index} on {stage.host.name}: its model {info.facts.path} is not the model "
                f"stage 0 has on {first.host.name} ({expected.facts.path}): {difference}. Give every host "
                "the same model file, or let ggufpipe send each host its stage (model: {send: true})"
            )

    async def tokenize(
        self,
        text: str,
        chat: bool,
        messages: tuple[ChatMessage, ...] = (),
        tools: str = "",
        template: str = "",
    ) -> tuple[list[int], str]:
        stage = self.stages[0]
        path = self.inventory.model_path_for(stage.host)
        reply = await stage.request(
            lambda rid: Tokenize(rid, path, text, chat, messages, tools, template), 60.0
        )
        if isinstance(reply, RequestFailed):
            raise TokenizeRefused(f"tokenizing on {stage.host.name}: {reply.reason}")
        assert isinstance(reply, Tokenized)
        return list(reply.tokens), reply.rendered


class TokenizeRefused(PipelineError):
    """The text could not be tokenized (its template failed, say): the
    request's fault, not a lost stage's."""


def _read_local(path: str) -> tuple[ModelRead, ModelFiles]:
    """In a thread: facts and vocabulary of the model here (its identity is
    the stage files' business: :mod:`ggufpipe_agent.stagefiles.build`)."""
    from ggufpipe_agent.gguf.facts import read_model_facts
    from ggufpipe_agent.llama.vocabulary import vocabulary

    files = read_model_files(path)  # the whole split set, checked (a missing part is named)
    facts = read_model_facts(path)
    vocab = vocabulary(facts.path)
    facts = replace(facts, eog_token_ids=vocab.eog_tokens())
    read = ModelRead(facts, vocab.pieces(), f"{facts.path} on this machine", vocab.special_pieces())
    return read, files


def _tokenize_local(
    path: str, template: str, text: str, chat: bool, messages: tuple[ChatMessage, ...], tools: str = ""
) -> tuple[list[int], str]:
    from ggufpipe_agent.llama.vocabulary import vocabulary

    tokens, rendered = vocabulary(path).prompt_tokens(template, text, chat, messages, tools)
    return list(tokens), rendered


class LocalModel:
    """The model on this machine (``send: true``)."""

    def __init__(self, inventory: Inventory) -> None:
        self.inventory = inventory
        self.path = inventory.local_model_path()
        self.files: ModelFiles | None = None
        self.facts: ModelFacts | None = None

    async def read(self, timeout: float) -> ModelRead:
        try:
            read, self.files = await asyncio.to_thread(_read_local, self.path)
        except GgufpipeError as error:
            where = self.inventory.where(self.inventory.model_line)
            raise PipelineError(f"model on this machine: {error} (model.path at {where})") from None
        self.facts = read.facts
        return read

    async def check(self, stage: StageHandle, timeout: float) -> None:
        """Nothing to check: the stage file sent to the host is checked by its digest."""

    async def tokenize(
        self,
        text: str,
        chat: bool,
        messages: tuple[ChatMessage, ...] = (),
        tools: str = "",
        template: str = "",
    ) -> tuple[list[int], str]:
        assert self.facts is not None, "read the model first"
        facts = self.facts
        try:
            return await asyncio.to_thread(
                _tokenize_local, facts.path, template or facts.chat_template, text, chat, messages, tools
            )
        except GgufpipeError as error:  # a template that fails, a conversation without one
            raise TokenizeRefused(f"tokenizing on this machine: {error}") from None


ModelSource = HostCopies | LocalModel


def model_source(inventory: Inventory, stages: Sequence[StageHandle]) -> ModelSource:
    return LocalModel(inventory) if inventory.send else HostCopies(inventory, stages)
