"""llama-server's sampling and grammar fields as the server takes them, and
what a request's prompts carry to the pipeline (pure: no server, no model)."""

from __future__ import annotations

import json
import math

import pytest

from ggufpipe_agent.wire.objects import read_logprobs, token_out_width
from ggufpipe_agent.wire.records import SamplingParams, sampler_problem
from ggufpipe_tui.core.inventory import RunOptions
from ggufpipe_tui.core.plan import sampling_params
from ggufpipe_tui.server.fields import ApiError
from ggufpipe_tui.server.openai_api import parse_chat
from ggufpipe_tui.server.replies import prompts_for
from ggufpipe_tui.server.sampling import REFUSED, sampler_fields
from ggufpipe_tui.session.runs import run_options, with_history
from tests.support.tool_templates import HERMES, PLAIN

HELLO = [{"role": "user", "content": "Hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_every_llama_server_field_reaches_the_stage_sampler():
    body = {
        "min_p": 0.1,
        "typical_p": 0.9,
        "top_n_sigma": 1.5,
        "xtc_probability": 0.2,
        "xtc_threshold": 0.3,
        "dynatemp_range": 0.5,
        "dynatemp_exponent": 2,
        "repeat_penalty": 1.2,
        "repeat_last_n": 32,
        "frequency_penalty": 0.5,
        "presence_penalty": -0.5,
        "dry_multiplier": 0.8,
        "dry_base": 0.5,  # below 1: llama-server's default
        "dry_allowed_length": 3,
        "dry_penalty_last_n": -1,
        "dry_sequence_breakers": ["\n", "."],
        "mirostat": 2,
        "mirostat_tau": 4,
        "mirostat_eta": 0.2,
        "min_keep": 2,
        "samplers": "kpt",
        "logit_bias": [[5, False], [6, 1.5]],
    }
    extra = dict(sampler_fields(body))
    sampling = sampling_params(RunOptions(extra=tuple(extra.items())))
    assert sampling.dry_base == 1.75 and sampling.samplers == ("top_k", "top_p", "temperature")
    assert sampling.logit_bias == ((5, -math.inf), (6, 1.5)) and sampling.mirostat == 2
    assert sampler_problem(sampling, vocab_size=100) == ("", "")
    assert sampling.uses_history


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"min_p": -0.1}, "min_p"),
        ({"repeat_penalty": 0}, "repeat_penalty"),
        ({"mirostat": 1.5}, "mirostat"),
        ({"samplers": ["top_k", "beam"]}, "samplers"),
        ({"dry_sequence_breakers": [""]}, "dry_sequence_breakers"),
        ({"logit_bias": {"1": "a lot"}}, "logit_bias"),
        *(({name: "x"}, name) for name in REFUSED),
    ],
)
def test_a_field_out_of_range_or_not_done_is_refused_by_name(body, field):
    with pytest.raises(ApiError) as refused:
        sampler_fields(body)
    assert refused.value.param == field


def test_the_prompt_goes_to_the_penalties_only_when_they_look_back():
    plain = run_options(RunOptions(), parse_chat({"messages": HELLO}).options)
    assert with_history(plain, [1, 2, 3]) == plain
    penalised = run_options(
        RunOptions(), parse_chat({"messages": HELLO, "repeat_penalty": 1.1, "repeat_last_n": 2}).options
    )
    assert dict(with_history(penalised, [1, 2, 3]).extra)["history"] == (2, 3)


def test_a_logprob_record_carries_the_token_its_logprob_and_the_alternatives():
    import numpy as np

    from ggufpipe_agent.llama.sampler import logprob_payload

    logits = np.array([0.0, 2.0, 1.0, -1.0], dtype=np.float32)
    words = logprob_payload(logits, 2, 2)
    assert len(words) == token_out_width(2)
    token, logprob, top = read_logprobs(list(words))
    expected = logits - np.log(np.exp(logits).sum())
    assert token == 2 and logprob == pytest.approx(expected[2], abs=1e-6)
    assert [t for t, _ in top] == [1, 2] and top[0][1] == pytest.approx(expected[1], abs=1e-6)


def test_a_required_call_is_forced_by_a_grammar_and_the_tools_reach_the_template():
    c = parse_chat({"messages": HELLO, "tools": [WEATHER], "tool_choice": "required", "n": 2, "seed": 7})
    prompts, family = prompts_for(c, HERMES, base_seed=0)
    assert family is not None and family.name == "hermes"
    extra = dict(prompts[0].options.extra)
    assert "root ::=" in extra["grammar"]
    assert json.loads(prompts[0].tools)[0]["function"]["name"] == "weather"
    assert [p.options.seed for p in prompts] == [7, 8], "each choice its own draw"


def test_a_template_without_tools_gets_them_in_a_system_message_and_a_json_form():
    c = parse_chat({"messages": HELLO, "tools": [WEATHER]})
    prompts, family = prompts_for(c, PLAIN, base_seed=0)
    assert family is not None and not family.native and prompts[0].tools == ""
    assert prompts[0].messages[0].role == "system" and "weather" in prompts[0].messages[0].content
    assert "root ::=" in dict(prompts[0].options.extra)["grammar"]


def test_tool_calls_in_the_history_reach_the_template_as_its_fields():
    c = parse_chat(
        {
            "messages": [
                *HELLO,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "weather", "arguments": '{"city":"Oslo"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "rain"},
            ],
            "tools": [WEATHER],
        }
    )
    prompts, _ = prompts_for(c, HERMES, base_seed=0)
    assistant, tool = prompts[0].messages[1:]
    call = json.loads(assistant.fields)["tool_calls"][0]
    assert call["function"] == {"name": "weather", "arguments": {"city": "Oslo"}}
    assert json.loads(tool.fields) == {"tool_call_id": "c1", "name": "weather"}


def test_sampling_params_default_to_llama_servers():
    s = SamplingParams()
    assert (s.min_p, s.top_k, s.top_p, s.repeat_last_n, s.dry_base) == (0.05, 40, 0.95, 64, 1.75)
