"""Tool calls per chat-template family: which family a template is
(:func:`family_for`), the grammar that forces a call, the streaming parser
that turns generated text into calls, and the schema checks.

One module per family (hermes, qwen3_coder, llama3, mistral, deepseek, glm,
harmony, kimi, minimax, generic); :mod:`registry` picks one by the markup
the template writes. Pure: no I/O, no model.
"""

from __future__ import annotations

from ggufpipe_tui.server.tools.base import Family, Parser, new_call_id
from ggufpipe_tui.server.tools.registry import NAMES, family_for
from ggufpipe_tui.server.tools.schema import schema_problem, validate_arguments

__all__ = [
    "NAMES",
    "Family",
    "Parser",
    "family_for",
    "new_call_id",
    "schema_problem",
    "validate_arguments",
]
