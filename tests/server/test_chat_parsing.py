"""Which tool-call and reasoning parsers a server runs with: picked from the chat template unless flags say
otherwise (vLLM's flags), and contradictory flags refused at start-up."""

from __future__ import annotations

import pytest

from qwick.server.chat_parsing import ChatParsers, resolve_chat_parsers

QWEN25 = "{% if tools %}...<tool_call>\n{...}\n</tool_call>{% endif %}"  # Qwen2.5: tools, no thinking
QWEN3 = QWEN25 + "{% if enable_thinking is false %}<think>\n\n</think>{% endif %}"
PLAIN = "{% for m in messages %}{{ m.content }}{% endfor %}"


def test_defaults_follow_the_template():
    assert resolve_chat_parsers(QWEN25) == ChatParsers("hermes", True, None)
    assert resolve_chat_parsers(QWEN3) == ChatParsers("hermes", True, "qwen3")
    assert resolve_chat_parsers(PLAIN) == ChatParsers(None, False, None)
    assert resolve_chat_parsers(None) == ChatParsers(None, False, None)
    assert resolve_chat_parsers({"default": QWEN3}) == ChatParsers("hermes", True, "qwen3")  # named templates


def test_flags_override():
    assert resolve_chat_parsers(PLAIN, tool_call_parser="hermes") == ChatParsers("hermes", True, None)
    assert resolve_chat_parsers(QWEN3, tool_call_parser="none", reasoning_parser="none") == ChatParsers()
    assert resolve_chat_parsers(QWEN25, enable_auto_tool_choice=False) == ChatParsers("hermes", False, None)
    assert resolve_chat_parsers(PLAIN, reasoning_parser="qwen3").reasoning_parser == "qwen3"
    assert resolve_chat_parsers(PLAIN, "hermes", True) == ChatParsers("hermes", True, None)  # vLLM's flags


def test_contradictory_or_unknown_flags():
    with pytest.raises(ValueError, match="--tool-call-parser hermes"):
        resolve_chat_parsers(PLAIN, enable_auto_tool_choice=True)
    with pytest.raises(ValueError):
        resolve_chat_parsers(QWEN25, tool_call_parser="mistral")
    with pytest.raises(ValueError):
        resolve_chat_parsers(QWEN25, reasoning_parser="deepseek")
