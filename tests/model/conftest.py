"""The synthetic model of an architecture test module.

A module of tests/model that sets ``MODEL`` (a name of
tests/support/arch_harness.py MODELS) gets that model as the ``model``
fixture and its whole-model greedy tokens as ``reference``; both are
computed once per session. A module that defines its own ``model`` or
``reference`` fixture overrides these.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.arch_harness import greedy_reference, model_path


@pytest.fixture(scope="module")
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_path(tmp_path_factory, request.module.MODEL)


@pytest.fixture(scope="module")
def reference(model: Path) -> list[int]:
    return greedy_reference(model)
