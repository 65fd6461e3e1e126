"""Structured output over HTTP (tiny random Qwen2 behind a real `qwick serve`, the openai SDK): OpenAI's
`response_format` on chat and completions, vLLM's `guided_*` fields, streamed and not, and the 400s for
constraints that do not parse. The engine core runs in its own process: the constraint crosses the wire
and the core loads its own tokenizer to compile it."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.server.harness import TINY_ENGINE_ARGS, ServerThread, tiny_model_dir

pytest.importorskip("xgrammar")

MODEL = "tiny"
USER = [{"role": "user", "content": "hello"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    argv = [tiny_model_dir(tmp_path_factory), *TINY_ENGINE_ARGS, "--num-gpu-blocks-override", "160",
            "--served-model-name", MODEL]  # fmt: skip
    with ServerThread(argv) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_chat_json_schema_streamed_and_not(client):
    full = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        response_format=RESPONSE_FORMAT,
        n=3,
        temperature=1.0,
        seed=5,
        max_tokens=64,
    )
    for choice in full.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    stream = client.chat.completions.create(
        model=MODEL, messages=USER, response_format=RESPONSE_FORMAT, temperature=1.0, seed=5, max_tokens=64,
        stream=True,
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert text == full.choices[0].message.content  # same seed, same first sample


def test_chat_json_object(server, client):
    with server.http() as h:
        close = h.post("/tokenize", json={"prompt": "}", "add_special_tokens": False}).json()["tokens"][0]
    resp = client.chat.completions.create(
        model=MODEL, messages=USER, response_format={"type": "json_object"}, temperature=0, max_tokens=32,
        logit_bias={str(close): 20},  # a random model would fill free-form keys forever
    )  # fmt: skip
    assert isinstance(json.loads(resp.choices[0].message.content), dict)
    text = client.chat.completions.create(
        model=MODEL, messages=USER, response_format={"type": "text"}, max_tokens=3, temperature=0
    )
    assert text.choices[0].finish_reason == "length"


def test_guided_choice_regex_grammar_on_chat_and_completions(client):
    chat = client.chat.completions.create(
        model=MODEL, messages=USER, n=4, temperature=1.0, max_tokens=16,
        extra_body={"guided_choice": ["alpha", "beta", "gamma delta"]},
    )  # fmt: skip
    assert all(c.message.content in ("alpha", "beta", "gamma delta") for c in chat.choices)
    regex = client.completions.create(
        model=MODEL,
        prompt="id:",
        max_tokens=16,
        temperature=1.0,
        extra_body={"guided_regex": r"[A-Z]{2}-\d{3}"},
    )
    assert re.fullmatch(r"[A-Z]{2}-\d{3}", regex.choices[0].text)
    grammar = client.completions.create(
        model=MODEL, prompt="sum:", max_tokens=16, temperature=0,
        extra_body={"guided_grammar": 'root ::= [1-9] " + " [1-9] " = " [0-9]+'},
    )  # fmt: skip
    assert re.fullmatch(r"[1-9] \+ [1-9] = [0-9]+", grammar.choices[0].text)


def test_completions_response_format_and_guided_json_streamed(client):
    resp = client.completions.create(
        model=MODEL,
        prompt="json:",
        max_tokens=64,
        temperature=0,
        extra_body={"response_format": RESPONSE_FORMAT},
    )
    jsonschema.validate(json.loads(resp.choices[0].text), SCHEMA)
    stream = client.completions.create(
        model=MODEL, prompt="json:", max_tokens=64, temperature=0, stream=True,
        extra_body={"guided_json": json.dumps(SCHEMA)},
    )  # fmt: skip
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert text == resp.choices[0].text


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", 'Unsupported type "foo"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "'json_schema'"),
    ({"guided_regex": "[a-"}, "guided_regex", "Unclosed '['"),
    ({"guided_json": '{"type": '}, "guided_json", "invalid JSON schema"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_grammar": "root ::= nothing"}, "guided_grammar", 'Rule "nothing" is not defined'),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "Only one"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", "Only one"),
]  # fmt: skip


@pytest.mark.parametrize("extra, param, words", BAD)
def test_bad_constraints_answer_400_naming_the_field(server, client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, extra_body=extra)
    err = info.value.body
    assert err["param"] == param and words in err["message"], err
    assert err["type"] == "invalid_request_error"
    with server.http() as h:  # completions name the same field
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
