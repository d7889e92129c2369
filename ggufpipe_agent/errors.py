"""One small family of errors, rooted in :class:`GgufpipeError`.

Errors are caught at a boundary (the agent loop, an orchestrator effect) and
turned into one fault with one clear reason; ``str(error)`` is that reason.
"""

from __future__ import annotations


class GgufpipeError(Exception):
    """Root of every error this project raises on purpose."""


class ProtocolError(GgufpipeError):
    """A frame or message that does not follow the wire protocol."""


class TruncatedFrame(ProtocolError):
    """The stream ended inside a frame: the peer went away mid-write (a lost
    stream), as opposed to a frame that is malformed (a protocol fault)."""


class ModelError(GgufpipeError):
    """A GGUF file that is missing, unreadable, unsupported or inconsistent."""


class RangeError(ModelError):
    """A layer range that is empty, reversed, out of bounds or not covered."""


class UnsupportedArchitecture(ModelError):
    """An architecture that has not been verified split-exact."""


class EngineError(GgufpipeError):
    """llama.cpp failed to load a stage or to run a step."""


class ContextOverflow(EngineError):
    """A step would write past the end of the KV cache (the context size)."""


class StepNotStarted(EngineError):
    """A step of a slot that StopRun aborted, refused before it computed
    anything: the slot's cache is as the steps before it left it."""


class TransitionError(GgufpipeError):
    """An event that the state machine does not accept in its current state."""


class CacheError(GgufpipeError):
    """The stage-file cache cannot be trusted or written: its directory, an
    entry, a full disk."""


class DiskFull(CacheError):
    """Not enough space for a stage file: ``path``, bytes ``needed`` and
    ``available`` say where and how much."""

    def __init__(self, message: str, path: str, needed: int, available: int) -> None:
        super().__init__(message)
        self.path = path
        self.needed = needed
        self.available = available


class TransferError(GgufpipeError):
    """A stage-file transfer that does not verify: a chunk out of order or
    with a wrong digest, a file whose digest or size is not the one announced."""
