"""The worked examples' sections of docs/planning.md: each planning script
(plan_70b.py, plan_moe.py) prints its example and, given ``--docs``, writes it
between its own markers there; tests/unit/test_placement.py checks the
document still says what the script prints."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "planning.md"


def markers(script: str) -> tuple[str, str]:
    """The lines that open and close ``script``'s section of the document."""
    return f"<!-- benchmarks/{script}: begin -->\n", f"<!-- benchmarks/{script}: end -->"


def write_section(begin: str, end: str, text: str) -> None:
    """Replace what stands between ``begin`` and ``end`` in the document with ``text``."""
    whole = DOC.read_text()
    head, rest = whole.split(begin, 1)
    _, tail = rest.split(end, 1)
    DOC.write_text(head + begin + text + end + tail)


def main(script: str, example: Callable[[], str]) -> None:
    """Print the example; with ``--docs`` also write it into the document."""
    text = example()
    print(text, end="")
    if "--docs" in sys.argv[1:]:
        write_section(*markers(script), text)
