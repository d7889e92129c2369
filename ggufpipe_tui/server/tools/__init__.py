"""Tool calls per chat-template family: which family a template is
(:func:`family_for`), the grammar that forces a call, the streaming parser
that turns generated text into calls, and the schema checks.

One module per family (hermes, qwen3_coder, llama3, mistral, deepseek, glm,
harmony, kimi, minimax, generic); :mod:`registry` picks one by the markup
the template writes. Pure: no I/O, no model.

How a run uses it::

    family = family_for(template_text)
    if family.native:   # the template renders the tools and the calls
        prompt = render(template, messages=template_messages(msgs, family,
                        object_arguments(template_text)), tools=template_tools(tools))
    else:               # described in a system message instead
        system = family.system_prompt(tools, tool_choice, tool_name, parallel)
    thinking = family.opens_reasoning(prompt)
    grammar = (family.call_grammar(tools, tool_name or None, parallel, thinking)
               if tool_choice in ("required", "function") else family.auto_grammar(tools, parallel))
    parser = family.parser(tools, thinking=thinking, stream=True)
    for text in generated: pieces = parser.feed(text)   # then parser.close()

The generated text must be detokenized with special tokens rendered (the
markers of harmony, Kimi and DeepSeek are special tokens).
"""

from __future__ import annotations

from ggufpipe_tui.server.tools.base import Family, Parser, new_call_id
from ggufpipe_tui.server.tools.registry import NAMES, family_for
from ggufpipe_tui.server.tools.render import object_arguments, template_messages, template_tools
from ggufpipe_tui.server.tools.schema import schema_problem, validate_arguments

__all__ = [
    "NAMES",
    "Family",
    "Parser",
    "family_for",
    "new_call_id",
    "object_arguments",
    "schema_problem",
    "template_messages",
    "template_tools",
    "validate_arguments",
]
