"""From StructuredOutputsParams to a grammar spec, and the validation errors users see."""

from __future__ import annotations

import json
import random

import pytest
import torch

from qwick.sampling_params import StructuredOutputsParams as S
from qwick.structured_output.grammar import (
    _CHAR,
    GrammarSpec,
    compile_spec,
    grammar_spec,
    validate_structured_outputs,
)
from tests.utils import EOS_ID, VOCAB, tiny_tokenizer

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
    """xgrammar 0.2's minLength/maxLength path admits raw control characters (invalid JSON), and `.` in a
    pattern ill-formed UTF-8; `_CHAR` is one well-formed code point (tested below)."""
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
    assert props["a"] == {"type": "string", "pattern": f"^{_CHAR}{{0,5}}$"}
    assert props["b"] == {"type": ["string", "null"], "pattern": f"^{_CHAR}{{2,}}$"}
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


# ---- bounded strings on the byte-level tiny tokenizer: only well-formed UTF-8, within the bounds -----------

BOUNDED = {"type": "string", "minLength": 1, "maxLength": 12}


@pytest.fixture(scope="module")
def compiled_bounded():
    """The bounded string's compiled grammar, the tokenizer's bytes per token, and each byte's own token."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tiny_tokenizer(), vocab_size=VOCAB)
    compiled = compile_spec(xgr.GrammarCompiler(info), grammar_spec(S(json=BOUNDED)))
    token_bytes = list(info.decoded_vocab)
    byte_token = {}
    for i, b in enumerate(token_bytes):
        if len(b) == 1 and i != EOS_ID:
            byte_token.setdefault(b[0], i)
    assert len(byte_token) == 256  # a byte-level vocabulary: every byte is a token of its own
    return compiled, token_bytes, byte_token


def _matcher(compiled):
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled, override_stop_tokens=[EOS_ID])


# (name, bytes between the quotes, a complete valid string?)
_BYTES = [
    ("2-byte", b"\xc2\x80", True),
    ("3-byte lowest", b"\xe0\xa0\x80", True),
    ("3-byte below the surrogates", b"\xed\x9f\xbf", True),
    ("3-byte highest", b"\xef\xbf\xbf", True),
    ("4-byte lowest", b"\xf0\x90\x80\x80", True),
    ("4-byte highest", b"\xf4\x8f\xbf\xbf", True),
    ("12 characters", "aé€😀" * 3, True),
    ("13 characters", "aé€😀" * 3 + "a", False),
    ("overlong 2-byte", b"\xc1\xbf", False),
    ("overlong 3-byte", b"\xe0\x80\x80", False),
    ("overlong 3-byte, highest", b"\xe0\x9f\xbf", False),
    ("overlong 4-byte", b"\xf0\x8f\xbf\xbf", False),
    ("high surrogate", b"\xed\xa0\x80", False),
    ("low surrogate", b"\xed\xbf\xbf", False),
    ("past U+10FFFF", b"\xf4\x90\x80\x80", False),
    ("lone continuation byte", b"\x80", False),
    ("raw control character", b"a\x0c", False),
    ("raw quote", b'"', False),
    ("raw backslash", b"\\\xe4\xb8\x8b", False),
]


@pytest.mark.parametrize("name, inner, valid", _BYTES, ids=[n for n, _, _ in _BYTES])
def test_bounded_string_takes_only_well_formed_utf8_byte_by_byte(compiled_bounded, name, inner, valid):
    compiled, _, byte_token = compiled_bounded
    if isinstance(inner, str):
        inner = inner.encode()
    matcher = _matcher(compiled)
    accepted = all(matcher.accept_token(byte_token[b]) for b in b'"' + inner + b'"')
    assert (accepted and matcher.accept_token(EOS_ID)) == valid


def test_bounded_strings_sampled_at_random_are_valid_utf8_within_bounds(compiled_bounded):
    """A random walk over the allowed tokens (bytes, merges, the stop token) decodes to the string it
    counted: no U+FFFD from ill-formed UTF-8 (which `.` let through, about one walk in twenty)."""
    import xgrammar as xgr

    compiled, token_bytes, _ = compiled_bounded
    rng = random.Random(0)
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    for _ in range(300):
        matcher, out = _matcher(compiled), []
        while not matcher.is_terminated():
            assert len(out) < 64
            matcher.fill_next_token_bitmask(bitmask, 0)
            bits = ((bitmask[0].unsqueeze(1) >> torch.arange(32)) & 1).flatten()[:VOCAB]
            token = rng.choice(torch.nonzero(bits).flatten().tolist())
            assert matcher.accept_token(token)
            out.append(token)
        raw = b"".join(token_bytes[t] for t in out[:-1])
        value = json.loads(raw.decode("utf-8"))  # UnicodeDecodeError: ill-formed UTF-8
        assert isinstance(value, str) and 1 <= len(value) <= 12, raw
