"""What a conversation sends and what each way a turn ends leaves in it."""

from __future__ import annotations

import pytest

from ggufpipe_agent.errors import ModelError
from ggufpipe_agent.wire.protocol import ChatMessage
from ggufpipe_tui.core.conversation import Conversation
from ggufpipe_tui.core.events import RunResult, Timings


def ended(
    outcome: str, stop_reason: str, text: str = "Paris.", tokens: tuple[int, ...] = (5, 6)
) -> RunResult:
    return RunResult(
        run_id=1,
        outcome=outcome,
        stop_reason=stop_reason,
        failure="stage 1: gone" if outcome == "faulted" else "",
        prompt_tokens=(1, 2, 3),
        tokens=tokens,
        text=text,
        timings=Timings(),
    )


def test_each_prompt_sends_every_kept_turn_then_itself():
    conversation = Conversation()
    assert conversation.messages("Capital of France?") == (ChatMessage("user", "Capital of France?"),)
    assert conversation.record("Capital of France?", ended("completed", "eos", " Paris. ")) == ""
    assert conversation.messages("And of Italy?") == (
        ChatMessage("user", "Capital of France?"),
        ChatMessage("assistant", " Paris. "),  # as the model produced it, spaces and all
        ChatMessage("user", "And of Italy?"),
    )
    assert conversation.tokens == 5 and conversation.exchanges == 1


def test_a_reply_cut_at_max_tokens_or_stopped_with_text_is_kept_as_far_as_it_got():
    conversation = Conversation()
    assert conversation.record("a", ended("completed", "max_tokens", "long")) == ""
    said = conversation.record("b", ended("completed", "stopped", "half"))
    assert said == "stopped: the reply so far stays in the conversation"
    assert [turn.content for turn in conversation.turns] == ["a", "long", "b", "half"]


def test_a_turn_without_a_reply_leaves_nothing():
    conversation = Conversation()
    conversation.record("kept", ended("completed", "eos"))
    before = list(conversation.turns)
    assert "stopped before a reply" in conversation.record("x", ended("completed", "stopped", "", ()))
    assert "faulted: this turn is left out" in conversation.record("y", ended("faulted", "", "par"))
    assert "not run" in conversation.record("z", ended("torn down", "", "", ()))
    assert conversation.turns == before and conversation.tokens == 5


@pytest.mark.model
def test_the_chat_template_renders_every_turn(model_path):
    """The agent's side: SmolLM2's template, a two-turn conversation, ready for the next reply."""
    from ggufpipe_agent.gguf.facts import read_model_facts
    from ggufpipe_agent.llama.vocabulary import vocabulary

    facts = read_model_facts(str(model_path))
    vocab = vocabulary(facts.path)
    turns = (ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello!"), ChatMessage("user", "Bye"))
    tokens, rendered = vocab.prompt_tokens(facts.chat_template, "ignored", True, turns)
    assert rendered.endswith(
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )
    one, _ = vocab.prompt_tokens(facts.chat_template, "Hi", True)
    assert tokens[: len(one)] == one, "the first turn renders as it did alone: a prefix of the next"
    with pytest.raises(ModelError, match="needs the chat template"):
        vocab.prompt_tokens(facts.chat_template, "", False, turns)
    with pytest.raises(ModelError, match="no chat template"):
        vocab.prompt_tokens("", "", True, turns)
