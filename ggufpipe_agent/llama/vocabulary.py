"""The model's vocabulary, where the model lives: tokenize, token pieces, EOG set.

The orchestrator holds no weights, so it asks a stage host for what needs the
tokenizer. llama.cpp loads a GGUF with ``vocab_only`` in a fraction of a
second and no tensor data. Even so, llama.cpp's loader opens every part of a
split set and must be given the first one (``llama_model_loader`` reads the
parts' headers before it looks at ``vocab_only``), so the whole set is
checked first (:func:`ggufpipe_agent.gguf.files.read_model_files`) and its
first part is what llama.cpp gets.
"""

from __future__ import annotations

import ctypes
import functools
import json
import threading
from collections.abc import Sequence
from typing import Any

from ggufpipe_agent.errors import ModelError
from ggufpipe_agent.gguf.files import read_model_files
from ggufpipe_agent.wire.protocol import ChatMessage


class Vocabulary:
    def __init__(self, path: str) -> None:
        import llama_cpp

        from ggufpipe_agent.llama.plumbing import init_backend

        init_backend()
        self._lib = llama_cpp
        self.path = str(read_model_files(path).first)
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self._model = llama_cpp.llama_model_load_from_file(self.path.encode(), params)
        if not self._model:
            raise ModelError(f"{self.path}: llama.cpp could not read the vocabulary")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.size = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self._lock = threading.Lock()
        self._formatters: dict[str, Any] = {}

    def token_text(self, token: int) -> str:
        raw = self._lib.llama_vocab_get_text(self._vocab, token)
        return raw.decode("utf-8", errors="replace") if raw else ""

    def piece(self, token: int, special: bool = False) -> bytes:
        buffer = ctypes.create_string_buffer(64)
        length = self._lib.llama_token_to_piece(self._vocab, token, buffer, 64, 0, special)
        if length < 0:
            buffer = ctypes.create_string_buffer(-length)
            length = self._lib.llama_token_to_piece(self._vocab, token, buffer, -length, 0, special)
        return buffer.raw[:length]

    def pieces(self) -> tuple[bytes, ...]:
        """Bytes of every token as output text (control tokens render empty)."""
        return tuple(self.piece(token) for token in range(self.size))

    def special_pieces(self) -> tuple[tuple[int, bytes], ...]:
        """(token, bytes) of the tokens that render only as special text
        (control tokens: ``<|im_start|>``, harmony's ``<|call|>``, ...)."""
        found = []
        for token in range(self.size):
            special = self.piece(token, special=True)
            if special and not self.piece(token):
                found.append((token, special))
        return tuple(found)

    def eog_tokens(self) -> tuple[int, ...]:
        is_eog = self._lib.llama_vocab_is_eog
        return tuple(token for token in range(self.size) if is_eog(self._vocab, token))

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 16
        with self._lock:
            for _ in range(2):
                buffer = (self._lib.llama_token * capacity)()
                count = self._lib.llama_tokenize(
                    self._vocab, data, len(data), buffer, capacity, add_special, True
                )
                if count >= 0:
                    return list(buffer[:count])
                capacity = -count
        raise ModelError(f"{self.path}: tokenization failed")

    def render_chat(self, template: str, messages: Sequence[ChatMessage], tools: str = "") -> str:
        """A conversation in the model's chat template, ready for the next
        assistant turn: the template sees every turn as it was said (with its
        tool calls or the call it answers), and ``tools`` (JSON text of
        OpenAI's list) as the model was trained to see them."""
        formatter = self._formatters.get(template)
        if formatter is None:  # compiling the Jinja template once per model
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            bos = self._lib.llama_vocab_bos(self._vocab)
            eos = self._lib.llama_vocab_eos(self._vocab)
            formatter = Jinja2ChatFormatter(
                template,
                eos_token=self.token_text(eos) if eos >= 0 else "",
                bos_token=self.token_text(bos) if bos >= 0 else "",
                add_generation_prompt=True,
            )
            self._formatters[template] = formatter
        # llama-cpp-python types the messages as its request TypedDicts; these are plain.
        turns: Any = [
            {"role": message.role, "content": message.content, **_fields(message)} for message in messages
        ]
        try:
            listed = json.loads(tools) if tools else None
            return formatter(messages=turns, tools=listed).prompt
        except Exception as error:  # noqa: BLE001 - jinja2 raises many kinds
            raise ModelError(f"{self.path}: the chat template failed: {error}") from None

    def prompt_tokens(
        self, template: str, text: str, chat: bool, messages: Sequence[ChatMessage] = (), tools: str = ""
    ) -> tuple[list[int], str]:
        """The prompt's tokens and the text they came from. ``messages``: a
        whole conversation (it needs the chat template); else ``text`` as the
        one user message (``chat``) or as is."""
        if messages:
            if not chat:
                raise ModelError("a conversation (messages) needs the chat template: chat must be on")
            if not template:
                raise ModelError(f"{self.path}: the model has no chat template to render a conversation with")
            rendered = self.render_chat(template, messages, tools)
        elif chat and template:
            rendered = self.render_chat(template, [ChatMessage("user", text)], tools)
        else:
            rendered = text
        bos = self._lib.llama_vocab_bos(self._vocab)
        # A template that writes the BOS text itself must not get a second BOS.
        add_special = not (bos >= 0 and rendered.startswith(self.token_text(bos)) and chat)
        return self.tokenize(rendered, add_special=add_special), rendered

    def close(self) -> None:
        if self._model:
            self._lib.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        # At interpreter shutdown llama_cpp (and contextlib) may already be gone.
        try:  # noqa: SIM105 - contextlib may be gone too
            self.close()
        except Exception:  # noqa: BLE001 - nothing to report to
            pass


def _fields(message: ChatMessage) -> dict[str, Any]:
    """A turn's other fields (tool calls, the call a tool result answers)."""
    if not message.fields:
        return {}
    try:
        fields = json.loads(message.fields)
    except ValueError as error:
        raise ModelError(f"a {message.role} turn's fields are not JSON: {error}") from None
    if not isinstance(fields, dict):
        raise ModelError(f"a {message.role} turn's fields are not a JSON object")
    return {key: value for key, value in fields.items() if key not in ("role", "content")}


@functools.lru_cache(maxsize=4)
def vocabulary(path: str) -> Vocabulary:
    return Vocabulary(path)
