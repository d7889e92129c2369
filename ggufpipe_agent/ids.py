"""The ids that cross the system, each its own type (``typing.NewType``: an
int at run time, a distinct type to mypy), so that a run id is never passed
where a slot or an edge is meant. docs/architecture.md's glossary says what
each names."""

from __future__ import annotations

from typing import NewType

#: One run: a prompt and its reply (the orchestrator numbers them).
RunId = NewType("RunId", int)
#: One KV sequence of a stage's engine (llama.cpp's seq_id): 0 .. parallel - 1.
SlotId = NewType("SlotId", int)
#: One hop of the chain: the edge from stage k to stage k + 1 (or the ring's).
EdgeId = NewType("EdgeId", int)

#: No run (a field that names none yet).
NO_RUN = RunId(0)
#: The first slot: the only one of an engine without runs in flight.
FIRST_SLOT = SlotId(0)
#: Every slot (abort, forget).
EVERY_SLOT = SlotId(-1)
