"""Qwen3 reasoning split: `<think>` blocks opened by the model or by the prompt, no block at all, tags split
across deltas, and streaming accumulating to exactly the non-streamed split."""

from __future__ import annotations

import pytest

from qwick.server.chat_parsing import ChoiceParser
from qwick.server.reasoning import ReasoningParser, prompt_think_state, split_reasoning
from tests.server.test_tool_parser import splits

CASES = {
    # (text, starts_in_reasoning): (reasoning, content)
    "model opens": (("<think>\nLet me think.\n</think>\n\nParis.", False), ("Let me think.", "Paris.")),
    "prompt opened, only </think>": (
        ("Let me think.\n</think>\n\nParis.", True),
        ("Let me think.", "Paris."),
    ),
    "no think": (("Paris is in France.", False), (None, "Paris is in France.")),
    "no think, leading newline": (("\nParis.", False), (None, "\nParis.")),
    "think later is content": (("Answer: <think>x</think>", False), (None, "Answer: <think>x</think>")),
    "empty block": (("<think>\n\n</think>\n\nHi", False), (None, "Hi")),
    "unclosed (max_tokens)": (("<think>\nstill thinking", False), ("still thinking", "")),
    "prompt opened, unclosed": (("thinking on\n", True), ("thinking on", "")),
    "only reasoning": (("<think>a < b</think>", False), ("a < b", "")),
    "tag-like text in reasoning": (("x </thin y </think>z", True), ("x </thin y", "z")),
    "partial tag at the end": (("<thi", False), (None, "<thi")),
    "empty": (("", False), (None, "")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_split(name):
    (text, opened), expected = CASES[name]
    assert split_reasoning(text, opened) == expected


@pytest.mark.parametrize("name", list(CASES))
def test_streaming_equals_non_streaming_at_every_split(name):
    (text, opened), expected = CASES[name]
    for pieces in splits(text or "x", seed=len(name)) if text else [[""]]:
        parser = ReasoningParser(opened)
        reasoning, content = "", ""
        for piece in pieces:
            r, c = parser.feed(piece)
            reasoning, content = reasoning + r, content + c
        r, c = parser.finish()
        reasoning, content = reasoning + r, content + c
        assert (reasoning or None, content) == expected, pieces


def test_tags_never_leak_while_streaming():
    parser = ReasoningParser(False)
    shown_r = shown_c = ""
    for ch in "<think>\nhmm\n</think>\n\nHi":
        r, c = parser.feed(ch)
        shown_r, shown_c = shown_r + r, shown_c + c
        assert "<" not in shown_r + shown_c
    assert (shown_r, shown_c) == ("hmm", "Hi")


def test_prompt_think_state():
    assert prompt_think_state("<|im_start|>assistant\n<think>\n") == "open"
    assert prompt_think_state("<|im_start|>assistant\n<think>\n\n</think>\n\n") == "closed"  # thinking off
    assert prompt_think_state("<|im_start|>assistant\n") is None
    assert prompt_think_state("user said <think> then <|im_end|>\n<|im_start|>assistant\n") is None


def test_reasoning_then_tool_call_through_one_choice_parser():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    text = "I need the weather.\n</think>\n\n" + call
    for pieces in splits(text):
        parser = ChoiceParser(reasoning=True, starts_in_reasoning=True, tools=True)
        reasoning = content = ""
        calls = {}
        for out in [parser.feed(piece) for piece in pieces] + [parser.finish()]:
            reasoning, content = reasoning + out.reasoning, content + out.content
            for d in out.tool_calls:
                calls.setdefault(d.index, ["", ""])
                calls[d.index][0] += d.name or ""
                calls[d.index][1] += d.arguments
        assert (reasoning, content) == ("I need the weather.", "")
        assert calls == {0: ["get_weather", '{"city": "Paris"}']}
        message = parser.message()
        assert message.content is None and message.reasoning_content == "I need the weather."
        assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
            ("get_weather", '{"city": "Paris"}')
        ]
        assert parser.finish_reason("stop") == "tool_calls" and parser.finish_reason("length") == "length"


def test_inactive_choice_parser_passes_text_through():
    parser = ChoiceParser(reasoning=False, starts_in_reasoning=False, tools=False)
    assert not parser.active
    assert parser.feed("<think>x</think><tool_call>").content == "<think>x</think><tool_call>"
    assert (
        parser.message().content == "<think>x</think><tool_call>" and parser.finish_reason("stop") == "stop"
    )
    assert ChoiceParser(False, False, False).message().content == ""
