"""The data plane: how token and activation objects move between the stages.

A :class:`DataPlane` owns the run's edges. The session opens it once (after
the agents started), binds each run to it, asks it to set up a stage's edge
ends when the stage has taken its provision, and writes the token-in edge
through it. Whatever it consumes of the token-out edge goes to the
:class:`TokenSink` of the bound run it belongs to; a stream that breaks or carries garbage is reported
through :class:`DataPlaneEvents`, never raised into the run.

Implementations: :class:`~ggufpipe_tui.dataplane.relay.RelayPlane` (every
object crosses the orchestrator, which forwards it by header only) and
:class:`~ggufpipe_tui.dataplane.direct.DirectPlane` (stages write to each
other over direct links, the relay where a link cannot be set up).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Protocol

from ggufpipe_agent.ids import RunId
from ggufpipe_agent.wire.framing import FrameReader, FrameWriter
from ggufpipe_agent.wire.protocol import Message
from ggufpipe_tui.core.events import DataPath
from ggufpipe_tui.core.inventory import HostSpec
from ggufpipe_tui.core.plan import RunPlan

#: The bound run's consumer of token-out objects: (sequence, words): the token
#: first, then its logprobs when the run asked for them (objects.token_out_width).
TokenSink = Callable[[int, list[int]], None]


@dataclass(slots=True)
class DataStream:
    """A stage's data stream as the orchestrator holds it: one reader, one writer."""

    reader: FrameReader
    writer: FrameWriter


class DataStage(Protocol):
    """What a data plane needs of a stage (the session's StageHandle)."""

    @property
    def label(self) -> str: ...

    @property
    def host(self) -> HostSpec: ...

    data: DataStream | None

    async def open_data(self, timeout: float) -> DataStream: ...

    def close_data(self) -> None: ...

    def alive(self) -> bool: ...

    async def send(self, message: Message) -> None: ...

    async def request(self, make: Callable[[int], Message], timeout: float) -> Message: ...


def _ignore(path: DataPath) -> None:
    pass


@dataclass(frozen=True, slots=True)
class DataPlaneEvents:
    """What a data plane reports to the session."""

    lost: Callable[[int, str], None]  # stage index, symptom: a stream broke or ended
    fault: Callable[[str], None]  # a bad object: the run cannot go on
    log: Callable[[int, str], None]  # stage index, a line for that stage's log
    routed: Callable[[DataPath], None] = _ignore  # how one link's objects travel (once per session)
    # A direct link between two live stages broke: its producer, why. The
    # session repairs it (docs/recovery.md); None: the break is a fault.
    broken: Callable[[int, str], None] | None = None


class DataPlane(Protocol):
    async def open(self, timeout: float, again: Collection[int] = ()) -> None:
        """Open the data streams of every stage and start moving objects.
        ``again``: the producers whose direct link broke (a repair)."""

    def bind(self, plan: RunPlan, sink: TokenSink) -> None:
        """A run whose objects are checked and routed, beside the others bound
        (runs in flight at once); objects of no bound run are dropped."""

    def unbind(self, run_id: RunId) -> None:
        """The run has ended: its late objects are dropped."""

    async def open_edges(self, plan: RunPlan, stage: int) -> None:
        """Set up stage ``stage``'s edge ends for ``plan`` (it has taken its
        provision). Raises ConnectionError when its stream is broken."""

    async def write_tokens(
        self, plan: RunPlan, sequence: int, tokens: list[int], position: int, rebuild: bool = False
    ) -> None:
        """Write a token object on the token-in edge, its first token at
        sequence position ``position`` (``rebuild``: a part of the prompt
        stage 0 computes into its cache and sends no further, flagged MORE
        and REBUILD). Raises ConnectionError."""

    def on_message(self, stage: int, message: Message) -> bool:
        """A control message from stage ``stage`` that may be the data plane's
        (a direct link went down); True when it was."""

    def close(self) -> None:
        """Close every stream (the session then ends the agents)."""
