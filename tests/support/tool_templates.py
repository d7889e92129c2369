"""Small chat templates of our own, one per tool-call family (none is a
model's own text): each writes the markup its family is recognised by, the
tools, an assistant's calls in the family's call syntax and the tool results.

Rendered as llama-cpp-python's Jinja2ChatFormatter renders a model's
template (``messages``, ``tools``, ``add_generation_prompt``, ``bos_token``,
``eos_token``); a call's ``arguments`` reach the template as an object.
"""

from __future__ import annotations

from typing import Any

#: The chatml-like frame most of ours share: {tools} and {call} are filled in.
_CHATML = """\
{%- if tools %}<|im_start|>system
You may call these tools:
{% for t in tools %}{{ t | tojson }}
{% endfor %}TOOLS_HOW<|im_end|>
{% endif %}
{% for m in messages %}
{% if m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content or '' }}{% for c in m.tool_calls or [] %}CALL{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def _chatml(how: str, call: str) -> str:
    return _CHATML.replace("TOOLS_HOW", how).replace("CALL", call)


_VALUE = "{{ v if v is string else v | tojson }}"

HERMES = _chatml(
    "Answer a call as <tool_call>{a JSON object of name and arguments}</tool_call>.",
    '<tool_call>\n{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments | tojson }}}\n</tool_call>",
)

QWEN3_CODER = _chatml(
    "Call one as <tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>.",
    "<tool_call>\n<function={{ c.function.name }}>\n"
    "{% for k, v in c.function.arguments.items() %}<parameter={{ k }}>\n" + _VALUE + "\n</parameter>\n"
    "{% endfor %}</function>\n</tool_call>",
)

GLM = (
    """\
[gMASK]<sop>{% if tools %}<|system|>
Tools: {% for t in tools %}{{ t | tojson }} {% endfor %}
Call one as <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value></tool_call>{% endif %}
{% for m in messages %}
{% if m.role == 'tool' %}<|observation|><tool_response>{{ m.content }}</tool_response>
{% elif m.role == 'assistant' %}<|assistant|>
{{ m.content or '' }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}
{% for k, v in c.function.arguments.items() %}<arg_key>{{ k }}</arg_key>
<arg_value>"""
    + _VALUE
    + """</arg_value>
{% endfor %}</tool_call>{% endfor %}
{% else %}<|{{ m.role }}|>
{{ m.content }}
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|assistant|>
{% endif %}"""
)

MINIMAX = (
    """\
{% if tools %}<|sys|>Tools: {% for t in tools %}{{ t | tojson }} {% endfor %}
Call as <minimax:tool_call><invoke name="NAME"><parameter name="KEY">VALUE</parameter></invoke></minimax:tool_call>
{% endif %}
{% for m in messages %}
{% if m.role == 'tool' %}<|tool|><response>{{ m.content }}</response>
{% elif m.role == 'assistant' %}<|ai|>{{ m.content or '' }}{% if m.tool_calls %}<minimax:tool_call>
{% for c in m.tool_calls %}<invoke name="{{ c.function.name }}">
{% for k, v in c.function.arguments.items() %}<parameter name="{{ k }}">"""
    + _VALUE
    + """</parameter>
{% endfor %}</invoke>
{% endfor %}</minimax:tool_call>{% endif %}{{ eos_token }}
{% else %}<|{{ m.role }}|>{{ m.content }}
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|ai|>{% endif %}"""
)

KIMI = """\
{% if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{% endif %}
{% for m in messages %}
{% if m.role == 'tool' %}<|im_system|>tool<|im_middle|>## Result of {{ m.tool_call_id }}
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_assistant|>assistant<|im_middle|>{{ m.content or '' }}\
{% if m.tool_calls %}<|tool_calls_section_begin|>{% for c in m.tool_calls %}<|tool_call_begin|>{{ c.id }}\
<|tool_call_argument_begin|>{{ c.function.arguments | tojson }}<|tool_call_end|>{% endfor %}\
<|tool_calls_section_end|>{% endif %}<|im_end|>
{% else %}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"""

_DEEPSEEK = """\
{{ bos_token }}{% if tools %}Tools: {% for t in tools %}{{ t | tojson }} {% endfor %}
{% endif %}
{% for m in messages %}
{% if m.role == 'tool' %}<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>
{% elif m.role == 'assistant' %}<｜Assistant｜>{{ m.content or '' }}{% if m.tool_calls %}<｜tool▁calls▁begin｜>\
{% for c in m.tool_calls %}CALL{% endfor %}<｜tool▁calls▁end｜>{% endif %}<｜end▁of▁sentence｜>
{% else %}<｜{{ m.role }}｜>{{ m.content }}
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"""

DEEPSEEK_V31 = _DEEPSEEK.replace(
    "CALL",
    "<｜tool▁call▁begin｜>{{ c.function.name }}<｜tool▁sep｜>{{ c.function.arguments | tojson }}"
    "<｜tool▁call▁end｜>",
)

DEEPSEEK_R1 = _DEEPSEEK.replace(
    "CALL",
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ c.function.name }}\n```json\n"
    "{{ c.function.arguments | tojson }}\n```<｜tool▁call▁end｜>",
)

_MISTRAL = """\
{{ bos_token }}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{% for m in messages %}
{% if m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]
{% elif m.role == 'assistant' %}{{ m.content or '' }}{% if m.tool_calls %}CALLS{% endif %}{{ eos_token }}
{% else %}[INST]{{ m.content }}[/INST]
{% endif %}
{% endfor %}"""

MISTRAL_LIST = _MISTRAL.replace(
    "CALLS",
    '[TOOL_CALLS][{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", "arguments": '
    '{{ c.function.arguments | tojson }}, "id": "{{ c.id }}"}{{ ", " if not loop.last }}{% endfor %}]',
)

MISTRAL_ARGS = _MISTRAL.replace(
    "CALLS",
    "{% for c in m.tool_calls %}[TOOL_CALLS]{{ c.function.name }}[ARGS]"
    "{{ c.function.arguments | tojson }}{% endfor %}",
)

MISTRAL_CALL_ID = _MISTRAL.replace(
    "CALLS",
    "{% for c in m.tool_calls %}[TOOL_CALLS]{{ c.function.name }}[CALL_ID]{{ c.id }}[ARGS]"
    "{{ c.function.arguments | tojson }}{% endfor %}",
)

LLAMA3 = """\
{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>

Call a function by answering {"name": NAME, "parameters": {ARGUMENTS}} alone:
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|eot_id|>{% endif %}
{% for m in messages %}
{% if m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ m.content }}<|eot_id|>
{% elif m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", "parameters": \
{{ c.function.arguments | tojson }}}{% endfor %}<|eom_id|>
{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

HARMONY = """\
<|start|>system<|message|>Channels: analysis, commentary, final.<|end|>
{% if tools %}<|start|>developer<|message|>namespace functions {
{% for t in tools %}// {{ t.function.description }}
type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;
{% endfor %}}<|end|>{% endif %}
{% for m in messages %}
{% if m.role == 'tool' %}<|start|>functions.{{ m.name }} to=assistant<|channel|>commentary<|message|>\
{{ m.content }}<|end|>
{% elif m.role == 'assistant' and m.tool_calls %}{% for c in m.tool_calls %}<|start|>assistant\
<|channel|>commentary to=functions.{{ c.function.name }} <|constrain|>json<|message|>\
{{ c.function.arguments | tojson }}<|call|>{% endfor %}
{% elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>
{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|start|>assistant{% endif %}"""

PLAIN = """\
{% for m in messages %}<|{{ m.role }}|>
{{ m.content }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}<|assistant|>
{% endif %}"""

#: (template, the family it is, the family's variant if any) by our name.
TEMPLATES: dict[str, tuple[str, str]] = {
    "hermes": (HERMES, "hermes"),
    "qwen3-coder": (QWEN3_CODER, "qwen3-coder"),
    "glm": (GLM, "glm"),
    "minimax": (MINIMAX, "minimax"),
    "kimi": (KIMI, "kimi-k2"),
    "deepseek-v31": (DEEPSEEK_V31, "deepseek"),
    "deepseek-r1": (DEEPSEEK_R1, "deepseek"),
    "mistral-list": (MISTRAL_LIST, "mistral"),
    "mistral-args": (MISTRAL_ARGS, "mistral"),
    "mistral-call-id": (MISTRAL_CALL_ID, "mistral"),
    "llama3": (LLAMA3, "llama3"),
    "harmony": (HARMONY, "harmony"),
    "plain": (PLAIN, "generic"),
}


def render(
    template: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """``template`` rendered as llama-cpp-python renders a model's own."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    formatter = Jinja2ChatFormatter(
        template, eos_token="</s>", bos_token="<s>", add_generation_prompt=add_generation_prompt
    )
    return formatter(messages=messages, tools=tools).prompt
