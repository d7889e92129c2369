"""Which family a chat template belongs to, by the markup it writes (the
substrings llama.cpp's common/chat.cpp looks for), most particular first."""

from __future__ import annotations

from collections.abc import Callable

import ggufpipe_tui.server.tools.deepseek as deepseek
import ggufpipe_tui.server.tools.generic as generic
import ggufpipe_tui.server.tools.glm as glm
import ggufpipe_tui.server.tools.harmony as harmony
import ggufpipe_tui.server.tools.hermes as hermes
import ggufpipe_tui.server.tools.kimi as kimi
import ggufpipe_tui.server.tools.llama3 as llama3
import ggufpipe_tui.server.tools.minimax as minimax
import ggufpipe_tui.server.tools.mistral as mistral
import ggufpipe_tui.server.tools.qwen3_coder as qwen3_coder
from ggufpipe_tui.server.tools.base import Family


def _all(*words: str) -> Callable[[str], bool]:
    return lambda t: all(w in t for w in words)


def _llama3(template: str) -> bool:
    return "<|start_header_id|>" in template and ("<|python_tag|>" in template or "ipython" in template)


#: (the test on the template's text, the family it picks), in order.
DETECTION: tuple[tuple[Callable[[str], bool], Callable[[str], Family]], ...] = (
    (_all("<|channel|>"), lambda t: harmony.FAMILY),
    (_all(kimi.SECTION), lambda t: kimi.FAMILY),
    (_all(minimax.OPEN), lambda t: minimax.FAMILY),
    (_all(deepseek.CALLS), deepseek.family),
    (_all(mistral.MARK), mistral.family),
    (_all(glm.OPEN, glm.KEY), lambda t: glm.FAMILY),
    (_all(qwen3_coder.OPEN, qwen3_coder.FUNCTION, qwen3_coder.PARAM), lambda t: qwen3_coder.FAMILY),
    (_all(hermes.OPEN), lambda t: hermes.FAMILY),
    (_llama3, lambda t: llama3.FAMILY),
)

#: Every family's name.
NAMES = (
    "harmony",
    "kimi-k2",
    "minimax",
    "deepseek",
    "mistral",
    "glm",
    "qwen3-coder",
    "hermes",
    "llama3",
    "generic",
)


def family_for(template: str) -> Family:
    """The family of the model's chat template (Jinja text); ``generic``
    when it writes calls in none of the forms known here (a template with
    no tool support, or one we cannot parse: its tools are then described
    in a system message, not passed to it)."""
    for test, make in DETECTION:
        if test(template):
            return make(template)
    return generic.FAMILY
