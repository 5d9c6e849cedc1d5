"""Specs become grammars, or RequestErrors that name the problem."""

from __future__ import annotations

import pytest

from blockspec.errors import RequestError
from blockspec.structured.grammar import build_grammar, spec_key, unenforced_keyword
from blockspec.structured.spec import StructuredSpec


@pytest.mark.parametrize("spec", [
    StructuredSpec("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}}),
    StructuredSpec("json_schema", {"type": "string", "format": "email"}),
    StructuredSpec("json_object"),
    StructuredSpec("regex", r"\d{3}-\d{4}"),
    StructuredSpec("choice", ["yes", "no", 'say "hi"\n', "café"]),
    StructuredSpec("grammar", 'root ::= "a" [0-9]+'),
    StructuredSpec("grammar", '?start: expr\nexpr: NUM ("+" NUM)*\nNUM: /[0-9]+/'),
])
def test_valid_specs_build(spec):
    build_grammar(spec)


@pytest.mark.parametrize("spec, words", [
    (StructuredSpec("json_schema", {"type": "foo"}), ["invalid JSON schema", "type"]),
    (StructuredSpec("json_schema", {"type": "object", "required": "a"}), ["invalid JSON schema at required"]),
    (StructuredSpec("json_schema", {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}),
     ["invalid JSON schema", "nope"]),
    (StructuredSpec("json_schema", [1, 2]), ["JSON object"]),
    (StructuredSpec("json_schema", {"type": "integer", "multipleOf": 3}), ["multipleOf", "not supported"]),
    (StructuredSpec("json_schema", {"type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}}),
     ["uniqueItems at /properties/t"]),
    (StructuredSpec("json_schema", {"type": "string", "format": "color"}), ["format 'color'"]),
    (StructuredSpec("regex", "(("), ["invalid regex", "parenthesis"]),
    (StructuredSpec("regex", ""), ["invalid regex"]),
    (StructuredSpec("regex", "a\x00"), ["NUL"]),
    (StructuredSpec("choice", []), ["invalid choice"]),
    (StructuredSpec("choice", ["a", 3]), ["invalid choice"]),
    (StructuredSpec("grammar", "root ::= foo"), ["invalid EBNF grammar", "foo"]),
    (StructuredSpec("grammar", "start: foo"), ["invalid Lark grammar", "foo"]),
    (StructuredSpec("grammar", "  "), ["invalid grammar"]),
])
def test_invalid_specs_name_the_problem(spec, words):
    with pytest.raises(RequestError) as info:
        build_grammar(spec)
    message = str(info.value)
    assert all(w in message for w in words), message
    assert ".cc:" not in message  # the engine's source location is not the user's business


def test_spec_key_ignores_dict_order_only():
    a = StructuredSpec("json_schema", {"type": "object", "properties": {"x": {"type": "string"}}})
    b = StructuredSpec("json_schema", {"properties": {"x": {"type": "string"}}, "type": "object"})
    assert spec_key(a) == spec_key(b)
    assert spec_key(a) != spec_key(StructuredSpec("json_object"))
    assert spec_key(StructuredSpec("choice", ["a", "b"])) != spec_key(StructuredSpec("choice", ["b", "a"]))


def test_unenforced_keywords_are_found_anywhere():
    assert unenforced_keyword({"type": "object", "properties": {"multipleOf": {"type": "string"}}}) is None
    nested = {"anyOf": [{"type": "string"}, {"type": ["number", "null"], "multipleOf": 2}]}
    assert unenforced_keyword(nested) == "multipleOf at /anyOf/1"
    assert unenforced_keyword({"type": "string", "pattern": "a+", "maxLength": 3}).startswith("minLength/maxLength")
