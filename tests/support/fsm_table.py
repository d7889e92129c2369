"""The table tests of the state machines (the stage's, the run's): every
(state, event) pair either makes the listed transition or is refused."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from enum import Enum
from typing import Any

import pytest

from ggufpipe_agent.errors import TransitionError


def every_pair(
    names: tuple[str, str], states: dict[Any, Any], events: dict[str, Any]
) -> pytest.MarkDecorator:
    """Parametrizes ``names`` over every (state, event) pair of the two tables, by name."""

    def label(state: Any) -> str:
        return state.value if isinstance(state, Enum) else str(state)

    pairs = list(itertools.product(states, events))
    return pytest.mark.parametrize(names, pairs, ids=[f"{label(s)}-{e}" for s, e in pairs])


def check_pair(
    transition: Callable[[Any, Any], tuple[Any, list[Any]]],
    machine: Any,
    event: Any,
    expected: tuple[Any, list[type]] | None,
    state_of: Callable[[Any], Any],
) -> None:
    """``expected``: None, the event is refused; else the state after
    (``state_of`` the machine after) and the types of the effects, in order."""
    if expected is None:
        with pytest.raises(TransitionError):
            transition(machine, event)
        return
    after, effects = transition(machine, event)
    assert state_of(after) is expected[0]
    assert [type(effect) for effect in effects] == expected[1]
