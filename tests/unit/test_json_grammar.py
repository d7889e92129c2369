"""A schema's GBNF in llama-server's whitespace (json_grammar.as_llama_server)."""

from __future__ import annotations

import json

from llama_cpp.llama_grammar import json_schema_to_gbnf

from ggufpipe_agent.llama.sampler import grammar_problem
from ggufpipe_tui.server.json_grammar import (
    CHAR,
    SPACE,
    ChatFormText,
    as_llama_server,
    chat_form,
    unwrap_chat_form,
)
from ggufpipe_tui.server.sampling import schema_grammar

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "integer"}}},
    "required": ["name"],
    "additionalProperties": False,
}


def rules(grammar: str) -> dict[str, str]:
    return dict(line.split(" ::= ", 1) for line in grammar.strip().splitlines())


def test_no_value_carries_a_space_after_it_and_closers_may_have_one_before():
    found = rules(as_llama_server(json_schema_to_gbnf(json.dumps(PERSON))))
    assert found["root"] == '"{" space name-kv ( "," space ( tags-kv ) )? space "}"'
    assert found["tags"] == '"[" space (integer ("," space integer)*)? space "]"'
    assert found["string"] == '"\\"" char* "\\""'
    assert found["integer"] == '("-"? integral-part)'
    assert f"space ::= {found['space']}" == SPACE
    assert f"char ::= {found['char']}" == CHAR
    assert not any(body.endswith(" space") for body in found.values())


def test_an_empty_object_keeps_one_space():
    found = rules(as_llama_server(json_schema_to_gbnf(json.dumps({"type": "object", "properties": {}}))))
    assert found["root"].count("space") == 1


def test_the_servers_schema_grammar_is_llama_servers_and_parses():
    for schema in (PERSON, {"type": "object"}, {"enum": ["a", "b"]}, {"type": "string", "format": "date"}):
        grammar = schema_grammar(schema, "json_schema")
        assert 'space ::= | " "' in grammar or "space" not in grammar
        assert grammar_problem(grammar) == ""


# ----------------------------------------------------------- the chat form


def test_chat_form_wraps_the_schema_in_optional_whitespace_and_a_fence():
    schema = {"type": "object", "properties": {"root": {"type": "string"}}, "required": ["root"]}
    grammar = chat_form(schema_grammar(schema, "json_schema"))
    found = rules(grammar)
    assert found["root"].startswith('space ( "```json" space response-format-schema space "```"')
    assert found["response-format-schema"].startswith('"{" space root-kv')  # a property's rule keeps its name
    assert '"\\"root\\""' in found["root-kv"]
    assert grammar_problem(grammar) == ""
    assert grammar_problem(chat_form(schema_grammar({"type": "string"}, "json_schema"))) == ""


def test_chat_form_text_gives_the_json_inside():
    whole = '```json\n{\n    "a": "x ``` y"\n}\n```'
    assert unwrap_chat_form(whole) == '{\n    "a": "x ``` y"\n}'
    assert unwrap_chat_form('  {"a": 1} \n') == '{"a": 1}'
    for size in range(1, len(whole) + 1):
        reader = ChatFormText()
        shown = "".join(reader.feed(whole[i : i + size]) for i in range(0, len(whole), size)) + reader.end()
        assert shown == '{\n    "a": "x ``` y"\n}', size
    reader = ChatFormText()
    assert reader.feed("``") == "" and reader.end() == "``"  # cut before the JSON: what it wrote
