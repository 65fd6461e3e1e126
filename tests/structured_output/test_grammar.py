"""From StructuredOutputsParams to a grammar spec, and the validation errors users see."""

from __future__ import annotations

import json

import pytest

from qwick.sampling_params import StructuredOutputsParams as S
from qwick.structured_output.grammar import GrammarSpec, grammar_spec, validate_structured_outputs

pytest.importorskip("xgrammar")


def test_schema_key_keeps_property_order_and_text_equals_dict():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    spec = grammar_spec(S(json=schema))
    assert spec.kind == "json" and list(json.loads(spec.text)["properties"]) == ["b", "a"]
    assert grammar_spec(S(json=json.dumps(schema))) == spec  # dict or JSON text: one cache entry


def test_json_object_is_the_object_schema_and_choice_is_ebnf():
    assert grammar_spec(S(json_object=True)) == grammar_spec(S(json={"type": "object"}))
    spec = grammar_spec(S(choice=['say "hi"', "a\\b", "line\nbreak"]))
    assert spec.kind == "ebnf"
    assert spec.text == 'root ::= "say \\"hi\\"" | "a\\\\b" | "line\\nbreak"'
    validate_structured_outputs(S(choice=['say "hi"', "a\\b", "line\nbreak"]))  # parses


def test_length_bounded_strings_become_patterns_except_in_data():
    """xgrammar 0.2's minLength/maxLength path admits raw control characters (invalid JSON)."""
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "maxLength": 5},
            "b": {"type": ["string", "null"], "minLength": 2},
            "c": {"type": "string", "maxLength": 3, "pattern": "^x+$"},  # left alone
            "d": {"const": {"type": "string", "maxLength": 1}},  # data, not a schema
        },
    }
    props = json.loads(grammar_spec(S(json=schema)).text)["properties"]
    assert props["a"] == {"type": "string", "pattern": "^.{0,5}$"}
    assert props["b"] == {"type": ["string", "null"], "pattern": "^.{2,}$"}
    assert props["c"] == schema["properties"]["c"] and props["d"] == schema["properties"]["d"]
    plain = '{"type": "string"}'
    assert grammar_spec(S(json=plain)) == GrammarSpec("json", plain)  # untouched text when nothing to do


@pytest.mark.parametrize(
    "params, words",
    [
        (S(json={"type": "foo"}), ["invalid JSON schema", 'Unsupported type "foo"']),
        (S(json='{"type": '), ["invalid JSON schema", "parse JSON"]),
        (S(regex="[a-"), ["invalid regex", "Unclosed '['"]),
        (S(grammar="root ::= foo"), ["invalid grammar", 'Rule "foo" is not defined']),
    ],
)
def test_invalid_specs_say_what_is_wrong(params, words):
    with pytest.raises(ValueError) as info:
        validate_structured_outputs(params)
    message = str(info.value)
    assert all(w in message for w in words), message
    assert ".cc:" not in message and "Check failed" not in message  # no C++ noise


def test_unserializable_schema():
    with pytest.raises(ValueError, match="not JSON-serializable"):
        grammar_spec(S(json={"type": "object", "default": object()}))
