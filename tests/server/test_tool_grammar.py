"""The tool-call grammar (tool_choice "required" / a named function), checked with xgrammar directly: the EBNF
text the engine receives accepts exactly well-formed calls of the allowed tools."""

from __future__ import annotations

import json

import pytest

from qwick.server.tool_grammar import tool_call_grammar
from qwick.server.tool_parser import extract

xgr = pytest.importorskip("xgrammar")
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402  (xgrammar's own test helper)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: any object
TOOLS = [WEATHER, NOW]


def call(name: str, args: dict | str) -> str:
    text = args if isinstance(args, str) else json.dumps(args)
    return f'<tool_call>\n{{"name": "{name}", "arguments": {text}}}\n</tool_call>'


def accepts(grammar: str, text: str) -> bool:
    return _is_grammar_accept_string(xgr.Grammar.from_ebnf(grammar), text)


def test_required_accepts_calls_of_any_tool_and_nothing_else():
    g = tool_call_grammar(TOOLS, "required")
    good = [
        call("get_weather", {"city": "Paris"}),
        call("get_weather", {"city": "Paris", "unit": "c"}),
        call("now", {}),
        call("now", {"anything": [1, 2]}),
        call("get_weather", {"city": "Paris"}) + "\n" + call("now", {}),  # parallel calls
    ]
    for text in good:
        assert accepts(g, text), text
        assert extract(text)[1], text  # and the parser reads what the grammar allows
    bad = [
        "",
        "Sure! " + call("get_weather", {"city": "Paris"}),  # text first
        call("get_time", {}),  # not a tool
        call("get_weather", {"city": 3}),  # wrong type
        call("get_weather", {"unit": "c"}),  # required property missing
        call("get_weather", {"city": "Paris", "unit": "k"}),  # not in the enum
        call("get_weather", {"city": "Paris", "extra": 1}),  # unknown property
        call("get_weather", '{"city": "Paris"'),  # unclosed
        call("get_weather", '{\n    "city": "Paris"\n}'),  # whitespace runs are bounded
    ]
    for text in bad:
        assert not accepts(g, text), text


def test_named_choice_allows_only_that_function():
    g = tool_call_grammar(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert accepts(g, call("get_weather", {"city": "Paris"}))
    assert not accepts(g, call("now", {}))


def test_parallel_tool_calls_false_allows_one_call():
    g = tool_call_grammar(TOOLS, "required", parallel_tool_calls=False)
    one = call("get_weather", {"city": "Paris"})
    assert accepts(g, one)
    assert not accepts(g, one + "\n" + call("now", {}))


def test_reasoning_modes():
    one = call("now", {})
    enabled = tool_call_grammar(TOOLS, "required", reasoning="enabled")  # the prompt opened <think>
    assert accepts(enabled, "The user wants the time.</think>\n\n" + one)
    assert not accepts(enabled, one)
    auto = tool_call_grammar(TOOLS, "required", reasoning="auto")  # an optional full block
    assert accepts(auto, one) and accepts(auto, "<think>Hmm.</think>\n\n" + one)
    assert not accepts(tool_call_grammar(TOOLS, "required"), "<think>Hmm.</think>\n\n" + one)


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError):
        tool_call_grammar(TOOLS, {"type": "function", "function": {"name": "missing"}})
    with pytest.raises(ValueError):
        tool_call_grammar(TOOLS, "required", reasoning="sometimes")
