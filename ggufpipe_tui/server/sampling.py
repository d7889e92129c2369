"""llama-server's sampling and grammar fields, checked for every front door.

Each field llama-server takes in a completion request is honoured with
llama.cpp's samplers in the last stage (ggufpipe_agent/llama/sampler.py) or
refused by name (:data:`REFUSED`): none is silently ignored. The ranges are
the stage's own (:data:`ggufpipe_agent.wire.records.SAMPLER_RANGES`), so a
request the server takes is one the stage takes.

The reply's form: llama-server's ``grammar`` (GBNF) and ``json_schema``, and
OpenAI's ``response_format`` (``json_object``, ``json_schema``), become one
grammar the last stage samples under; a schema is converted by llama.cpp's
own JSON-schema-to-grammar conversion (the Python port llama-cpp-python
ships, which the dependencies hold already; llguidance would be a new native
dependency for what this conversion does).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from ggufpipe_agent.llama.sampler import grammar_problem
from ggufpipe_agent.wire.records import (
    DRY_BREAKERS_MAX,
    GRAMMAR_MAX,
    LOGIT_BIAS_MAX,
    SAMPLER_ORDER,
    SAMPLER_RANGES,
    sampler_field_problem,
)
from ggufpipe_tui.server.fields import bad, shown
from ggufpipe_tui.server.json_grammar import as_llama_server

#: llama-server's request fields this server does not do, and why; refused
#: (a 400 naming the field) when given a value other than their default.
REFUSED: dict[str, tuple[tuple[object, ...], str]] = {
    "adaptive_target": ((-1, -1.0), "adaptive-p sampling is not supported"),
    "post_sampling_probs": (
        (False,),
        "probabilities after sampling are not supported (logprobs are of the raw logits)",
    ),
    "n_keep": ((0, -1), "context shifting is not supported: a reply longer than the context is refused"),
    "n_discard": ((0,), "context shifting is not supported"),
    "t_max_predict_ms": ((0, -1), "a time limit on the reply is not supported"),
    "lora": (([],), "LoRA adapters are not supported"),
    "id_slot": ((-1,), "the server chooses the slot"),
    "n_indent": ((0,), "n_indent is not supported"),
    "backend_sampling": ((False,), "backend sampling is not supported"),
    "best_of": ((1,), "best_of is not supported: use n"),
}

#: Aliases llama-server takes for the same field.
ALIASES = {"typ_p": "typical_p", "penalty_last_n": "repeat_last_n"}

#: llama-server's CLI default when dry_base is given below 1.
DRY_BASE_DEFAULT = 1.75
#: The DRY sequence breakers' most characters each.
BREAKER_MAX = 256


def refuse_unsupported(body: Mapping[str, Any]) -> None:
    """A 400 naming the first field of :data:`REFUSED` given a value that matters."""
    for name, (defaults, why) in REFUSED.items():
        value = body.get(name)
        if value is not None and not any(_same(value, d) for d in defaults):
            raise bad(name, f"{shown(value)}: {why}")


def _same(value: object, default: object) -> bool:
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    return value == default


def sampler_fields(body: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """llama-server's other sampling fields of ``body`` (by their names in
    ggufpipe_agent.wire.records.SamplingParams), checked: a field absent
    keeps llama-server's default."""
    refuse_unsupported(body)
    extra: dict[str, Any] = {}
    for given, name in [(n, n) for n in SAMPLER_RANGES] + list(ALIASES.items()):
        value = body.get(given)
        if value is None or name in extra:
            continue
        if (
            name == "dry_base"
            and isinstance(value, int | float)
            and not isinstance(value, bool)
            and value < 1
        ):
            value = DRY_BASE_DEFAULT  # as llama-server: below 1 means its default
        if name in ("repeat_last_n", "dry_penalty_last_n") and value == -1:
            value = -1  # -1: the whole context (llama.cpp)
        problem = sampler_field_problem(name, value)
        if problem:
            raise bad(given, problem)
        extra[name] = int(value) if isinstance(value, int) and not isinstance(value, bool) else value
    breakers = body.get("dry_sequence_breakers")
    if breakers is not None:
        if (
            not isinstance(breakers, list)
            or not all(isinstance(b, str) and 0 < len(b) <= BREAKER_MAX for b in breakers)
            or len(breakers) > DRY_BREAKERS_MAX
        ):
            raise bad("dry_sequence_breakers", f"a list of at most {DRY_BREAKERS_MAX} non-empty strings")
        extra["dry_sequence_breakers"] = tuple(breakers)
    samplers = body.get("samplers")
    if samplers is not None:
        extra["samplers"] = _samplers(samplers)
    bias = body.get("logit_bias")
    if bias is not None:
        pairs = _logit_bias(bias)
        if pairs:
            extra["logit_bias"] = pairs
    return tuple(extra.items())


#: llama-server's one-letter names of its samplers (its ``samplers`` may be a string of them).
_LETTERS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p", "p": "top_p"}
_LETTERS |= {"m": "min_p", "x": "xtc", "t": "temperature"}
_NAMES = {name: name for name in SAMPLER_ORDER} | {"typical_p": "typ_p", "temp": "temperature"}
_NAMES |= {
    "top-k": "top_k",
    "top-p": "top_p",
    "min-p": "min_p",
    "typ-p": "typ_p",
    "top-n-sigma": "top_n_sigma",
}


def _samplers(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        names = [_LETTERS.get(letter, letter) for letter in value]
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        names = [_NAMES.get(str(v), str(v)) for v in value]
    else:
        raise bad("samplers", "a list of sampler names or a string of their letters")
    unknown = [name for name in names if name not in SAMPLER_ORDER]
    if unknown or len(names) > 4 * len(SAMPLER_ORDER):
        raise bad(
            "samplers", f"{shown(unknown[0]) if unknown else 'too many'}: one of {', '.join(SAMPLER_ORDER)}"
        )
    return tuple(names)


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} or llama-server's [[id, bias], ...] (bias
    false: the token never comes)."""
    if isinstance(value, dict):
        items: list[Any] = list(value.items())
    elif isinstance(value, list):
        items = value
    else:
        raise bad("logit_bias", "an object of token ids to biases, or a list of [token id, bias]")
    if len(items) > LOGIT_BIAS_MAX:
        raise bad("logit_bias", f"at most {LOGIT_BIAS_MAX} entries")
    pairs = []
    for item in items:
        if not isinstance(item, list | tuple) or len(item) != 2:
            raise bad("logit_bias", f"{shown(item)} is not a [token id, bias] pair")
        token, bias = item
        try:
            token_id = int(token) if isinstance(token, str) else token
        except ValueError:
            raise bad("logit_bias", f"{shown(token)}: give token ids (POST /tokenize finds them)") from None
        if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < 1 << 31:
            raise bad("logit_bias", f"{shown(token)} is not a token id")
        if bias is False:
            weight = -math.inf
        elif isinstance(bias, int | float) and not isinstance(bias, bool) and math.isfinite(bias):
            weight = float(bias)
        else:
            raise bad("logit_bias", f"the bias of token {token_id} is {shown(bias)}, not a number or false")
        pairs.append((token_id, weight))
    return tuple(pairs)


# ------------------------------------------------------------- the form


def reply_form(body: Mapping[str, Any]) -> tuple[str, Mapping[str, Any] | None]:
    """(GBNF, the schema it came from) for llama-server's ``grammar`` and
    ``json_schema`` and OpenAI's ``response_format``; ("", None) for free text."""
    grammar = body.get("grammar")
    schema = body.get("json_schema")
    response_format = body.get("response_format")
    given = [name for name, v in (("grammar", grammar), ("json_schema", schema)) if v is not None]
    if response_format is not None and response_format != {"type": "text"}:
        given.append("response_format")
    if len(given) > 1:
        raise bad(
            given[1], f"only one of grammar, json_schema and response_format, not {' and '.join(given)}"
        )
    if grammar is not None:
        if not isinstance(grammar, str):
            raise bad("grammar", "GBNF text is required")
        if len(grammar.encode()) > GRAMMAR_MAX:
            raise bad("grammar", f"at most {GRAMMAR_MAX} bytes")
        problem = grammar_problem(grammar)
        if problem:
            raise bad("grammar", problem)
        return grammar, None
    if schema is not None:
        return schema_grammar(schema, "json_schema"), schema
    if response_format is None or response_format == {"type": "text"}:
        return "", None
    if not isinstance(response_format, dict):
        raise bad("response_format", "an object with a type is required")
    kind = response_format.get("type")
    if kind == "json_object":
        # llama-server's: an object, of anything unless a schema is given with it.
        given_schema = response_format.get("schema") or {"type": "object"}
        return schema_grammar(given_schema, "response_format.schema"), given_schema
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise bad("response_format.json_schema", "an object with a schema is required")
        inner = spec.get("schema") or {}
        return schema_grammar(inner, "response_format.json_schema.schema"), inner
    raise bad("response_format.type", f"{shown(kind)} is not one of text, json_object, json_schema")


def schema_grammar(schema: object, where: str) -> str:
    """GBNF for JSON valid against ``schema``, or a 400 naming ``where``:
    a schema JSON Schema does not take, or one the conversion cannot express."""
    import jsonschema
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    if not isinstance(schema, dict):
        raise bad(where, "a JSON schema (an object) is required")
    # Agents send the same schema with every request: converted once. The key
    # keeps the properties' order, which the grammar follows.
    key = json.dumps(schema)
    known = _converted.get(key)
    if known is not None:
        grammar, problem_where, problem = known
        if problem:
            raise bad(where + problem_where, problem)
        return grammar
    try:
        grammar = _schema_grammar(schema, json_schema_to_gbnf, jsonschema)
    except _Refused as refused:
        _remember(key, ("", refused.where, refused.message))
        raise bad(where + refused.where, refused.message) from None
    _remember(key, (grammar, "", ""))
    return grammar


class _Refused(Exception):
    def __init__(self, where: str, message: str) -> None:
        super().__init__(message)
        self.where, self.message = where, message


#: Converted schemas by their JSON text: (grammar, where, why refused).
_converted: dict[str, tuple[str, str, str]] = {}
_CONVERTED_MAX = 64


def _remember(key: str, value: tuple[str, str, str]) -> None:
    if len(_converted) >= _CONVERTED_MAX:
        _converted.pop(next(iter(_converted)))
    _converted[key] = value


def _schema_grammar(schema: dict[str, Any], json_schema_to_gbnf: Any, jsonschema: Any) -> str:
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as error:
        path = "/".join(str(p) for p in error.absolute_path)
        raise _Refused(f".{path}" if path else "", f"not a valid JSON schema: {error.message}") from None
    try:
        # llama-server's whitespace (json_grammar): the same reply as its for the same schema.
        grammar = as_llama_server(json_schema_to_gbnf(json.dumps(schema)))
    except Exception as error:  # noqa: BLE001 - the converter raises what it cannot express
        said = str(error).replace(" (use --allow-fetch for force)", "") or type(error).__name__
        raise _Refused("", f"the grammar cannot express this schema: {said}") from None
    problem = grammar_problem(grammar)
    if problem:
        raise _Refused("", f"the grammar cannot express this schema: {problem}")
    return grammar
