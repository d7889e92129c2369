"""The orchestrator's own error."""

from __future__ import annotations

from ggufpipe_agent.errors import GgufpipeError


class PipelineError(GgufpipeError):
    """The pipeline could not be set up (agents, model, plan) or run a prompt."""


class InventoryError(GgufpipeError):
    """A malformed inventory; the message names the file, line and key."""
