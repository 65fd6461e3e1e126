"""The grammar that makes `tool_choice: "required"` (or a named function) always produce a call that parses.

xgrammar ships Qwen's tool-call format as a structural tag (`qwen_3`, the Hermes format of Qwen2.5 and
Qwen3): `<tool_call>\\n{"name": "<name>", "arguments": <the tool's parameters schema>}\\n</tool_call>`, one
or more calls (one when `parallel_tool_calls` is false), nothing else, optionally after a think block. It
is compiled to a `Grammar` and handed to the engine as EBNF text (`StructuredOutputsParams.grammar`), so
the engine needs no notion of tools. Whitespace inside the JSON is limited to one character in a row: with
free whitespace small models tend to emit newlines until max_tokens instead of closing the object.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

REASONING_MODES = ("enabled", "disabled", "auto")


def tool_call_grammar(
    tools: list[dict[str, Any]],
    tool_choice: str | dict[str, Any],
    parallel_tool_calls: bool = True,
    reasoning: str = "disabled",
) -> str:
    """EBNF for calls to `tools` (OpenAI's tool dicts) under `tool_choice` ("required" or a named
    function). `reasoning`: "enabled" (the prompt opened a think block: reasoning, `</think>`, then the
    calls), "auto" (an optional `<think>...</think>` block first) or "disabled".

    Raises ImportError without xgrammar, ValueError when xgrammar rejects the tools (e.g. a schema).
    """
    if reasoning not in REASONING_MODES:
        raise ValueError(f"reasoning must be one of {REASONING_MODES}, got {reasoning!r}")
    key = json.dumps([tools, tool_choice], sort_keys=False, ensure_ascii=False)
    return _grammar(key, parallel_tool_calls, reasoning)


@lru_cache(maxsize=256)
def _grammar(key: str, parallel_tool_calls: bool, reasoning: str) -> str:
    import xgrammar as xgr

    tools, tool_choice = json.loads(key)
    try:
        tag = xgr.get_model_structural_tag(
            "qwen_3",
            tools=tools,
            tool_choice=tool_choice,
            reasoning=reasoning,
            parallel_tool_calls=parallel_tool_calls,
            max_whitespace_cnt=1,
        )
        return str(xgr.Grammar.from_structural_tag(tag))
    except ValueError:
        raise
    except Exception as exc:  # xgrammar's own errors (invalid schema, ...) carry no common base class
        raise ValueError(str(exc)) from None
