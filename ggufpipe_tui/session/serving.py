"""Prompts become runs, one at a time (session/parallel.py keeps several in
flight, each on its own slot).

:class:`SerialRunner` takes the prompts of a :class:`~.runs.RunQueue` in
submission order and runs each to its end before the next; with
``prepare_ahead`` (the interactive views) it keeps the next run provisioned
and loaded so a prompt starts the moment it is given. A run that faults
stops the queue: the pipeline cannot carry another run, and every prompt
still waiting is failed with the reason.

The sampling is part of each stage's provision, so a run prepared ahead
with other sampling than a prompt asks is torn down and one is prepared
with the prompt's (the next run is prepared ahead as the last prompt
sampled); max_tokens is the orchestrator's alone and is given with the
prompt. Each prompt's tokens are its whole context (a conversation's every
turn so far), and runs go in submission order, so whatever a run leaves in
the stages is what the next one starts from.

What a runner needs of the pipeline is :class:`Serving`: to prepare a run,
tokenize, and run a prompt on a prepared run to its end. Recovery of a
lost stage is the pipeline's business behind those.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

from ggufpipe_agent.errors import GgufpipeError
from ggufpipe_agent.ids import FIRST_SLOT, SlotId
from ggufpipe_agent.wire.protocol import ChatMessage
from ggufpipe_tui.core.events import RunResult
from ggufpipe_tui.core.inventory import Inventory, RunOptions
from ggufpipe_tui.core.plan import GgufModelPlan
from ggufpipe_tui.session.driver import RunDriver
from ggufpipe_tui.session.runs import (
    Prompt,
    RunHandle,
    RunQueue,
    Turn,
    prompt_tokens,
    run_options,
    serves,
    with_history,
)
from ggufpipe_tui.session.stages import PipelineError

log = logging.getLogger(__name__)


class Serving(Protocol):
    """What the runners need of the pipeline they serve (session/pipeline.py's
    Pipeline; tests/support/fakes.py's FakePipeline)."""

    @property
    def inventory(self) -> Inventory: ...

    @property
    def broken(self) -> str: ...

    async def prepare_run(
        self, options: RunOptions | None = None, *, slot: SlotId = FIRST_SLOT, reuse: bool = True
    ) -> RunDriver: ...

    async def tokenize(
        self, text: str, chat: bool, messages: Sequence[ChatMessage] = (), tools: str = "", template: str = ""
    ) -> tuple[list[int], str]: ...

    def model_plan(self) -> GgufModelPlan:
        """The model as every run's plan has it (vocabulary, context)."""
        ...

    async def run(self, driver: RunDriver, turn: Turn) -> RunResult:
        """``turn``'s prompt run on ``driver`` to its end, and its handle
        finished (or failed, when the run was refused at the last moment)."""
        ...

    async def repaired(self, driver: RunDriver) -> bool:
        """``driver`` ended before its prompt: True when a lost stage ended it
        and the pipeline is repaired now."""
        ...


def pipeline_error(error: GgufpipeError) -> PipelineError:
    return error if isinstance(error, PipelineError) else PipelineError(str(error))


def queue_failure(error: Exception) -> str:
    """Why the queue stops after ``error`` ended its loop: a fault says why;
    a bug is logged, and every prompt fails instead of waiting forever."""
    if isinstance(error, GgufpipeError):
        return str(error)
    log.exception("the run queue failed")
    return f"internal error in the run queue: {type(error).__name__}: {error}"


class Runner:
    """What both runners share: the queue, the pipeline, the options of the
    last prompt (a run prepared ahead samples as it asked)."""

    def __init__(self, pipeline: Serving, queue: RunQueue, prepare_ahead: bool) -> None:
        self.pipeline = pipeline
        self.queue = queue
        self.prepare_ahead = prepare_ahead
        self.last_options: RunOptions | None = None  # the last run's (None: the inventory's)

    def _options(self, handle: RunHandle) -> RunOptions:
        return run_options(self.pipeline.inventory.run, handle.prompt.options)

    async def _tokens(
        self, prompt: Prompt, options: RunOptions, model: GgufModelPlan
    ) -> tuple[list[int], int]:
        """The prompt's tokens and the most its reply may take; raises when it cannot run."""
        chat = self.pipeline.inventory.run.chat
        return await prompt_tokens(prompt, options, model, chat, self.pipeline.tokenize)


class SerialRunner(Runner):
    def __init__(self, pipeline: Serving, queue: RunQueue, prepare_ahead: bool) -> None:
        super().__init__(pipeline, queue, prepare_ahead)
        self.taking: RunHandle | None = None  # taken from the queue, not finished yet

    async def serve(self) -> None:
        """Prompts to runs until the pipeline breaks or closes."""
        pipeline, queue = self.pipeline, self.queue
        reason = ""
        prepared: RunDriver | None = None
        try:
            while not queue.stopped:
                if self.prepare_ahead and prepared is None:
                    # Sampled as the last prompt asked: a client that keeps its
                    # settings finds its next run ready.
                    prepared = await pipeline.prepare_run(self.last_options)
                handle = self.taking = await queue.take(None if prepared is None else prepared.done)
                if handle is None:
                    if prepared is not None and prepared.done.is_set():
                        if await pipeline.repaired(prepared):
                            # A stage lost while the run waited for its prompt:
                            # repaired, and the next run is prepared afresh.
                            prepared = None
                            continue
                        # The run ended before its prompt: it faulted while preparing or waiting.
                        reason = prepared.result.failure if prepared.result else ""
                        break
                    continue
                try:
                    options = self._options(handle)
                except PipelineError as error:
                    handle.fail(error)
                    continue
                keep = handle.prompt.cache_prompt
                if prepared is not None and (
                    not serves(prepared.plan, options) or (not keep and prepared.plan.reuse.run_id)
                ):
                    # Prepared with other sampling, or offering what the prompt
                    # keeps nothing of: the stages must be provisioned again.
                    prepared.stop("the next prompt asks for other options")
                    await prepared.done.wait()
                    prepared = None
                    if pipeline.broken:
                        break
                driver, prepared = prepared or await pipeline.prepare_run(options, reuse=keep), None
                try:
                    tokens, limit = await self._tokens(handle.prompt, options, driver.plan.model)
                except GgufpipeError as error:
                    # Not run (tokenizing failed, too long for the context): the
                    # prompt fails alone and the prepared run waits for the next.
                    handle.fail(pipeline_error(error))
                    prepared = driver
                    continue
                if handle.done:  # withdrawn while it was tokenized
                    prepared = driver
                    continue
                # The penalties look back over the prompt: its tokens go to the last stage.
                wanted = with_history(options, tokens)
                if (driver.plan.ring is not None and limit != driver.plan.max_tokens) or not serves(
                    driver.plan, wanted
                ):
                    # On the token ring the last stage stops at the max_tokens
                    # of its provision (no step runs past the stop), so a reply
                    # limit other than the prepared run's needs a run
                    # provisioned with it, as other sampling does.
                    driver.stop("the next prompt has another reply limit or sampling")
                    await driver.done.wait()
                    if pipeline.broken:
                        break
                    driver = await pipeline.prepare_run(replace(wanted, max_tokens=limit), reuse=keep)
                self.last_options = options
                turn = Turn(handle, tokens, limit, replace(wanted, max_tokens=limit))
                result = await pipeline.run(driver, turn)
                if pipeline.broken or result.outcome == "faulted":
                    reason = result.failure or pipeline.broken
                    break
        except Exception as error:
            reason = queue_failure(error)
        finally:
            # Cancelled (the pipeline closing) or stopped: the prompt taken
            # from the queue must not be left waiting for its result.
            taken, self.taking = self.taking, None
            if taken is not None and not taken.done:
                running = taken.driver
                if running is not None and running.result is not None:
                    taken.finish(running.result)
                else:
                    taken.fail(PipelineError(f"not run: {queue.stopped or reason or 'the pipeline closed'}"))
        if prepared is not None and not prepared.done.is_set():
            prepared.stop("the session is stopping")
        queue.stop(reason or pipeline.broken or "the pipeline closed")
