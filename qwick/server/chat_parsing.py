"""What a chat request's tools and the model's reasoning mean for one request, and the per-choice parser that
splits generated text into reasoning, content and tool calls.

Server settings (`qwick serve` flags, vLLM's names):
- `--tool-call-parser auto|hermes|none`: `auto` (the default) picks `hermes` when the chat template speaks
  Qwen's `<tool_call>` format (Qwen2.5, Qwen3, QwQ), so tools work on Qwen models without flags.
- `--enable-auto-tool-choice / --no-enable-auto-tool-choice`: whether `tool_choice: "auto"` is allowed;
  on by default whenever there is a parser (vLLM requires the flag; it is accepted for compatibility).
- `--reasoning-parser auto|qwen3|none`: `auto` picks `qwen3` when the chat template mentions `<think>`.

Per request:
- `tool_choice` defaults to `auto` with tools, `none` without. `none` leaves the tools out of the prompt
  (the model cannot call what it is not shown) and parses nothing. `auto` shows them and parses the output
  (also an output that is nothing but an untagged JSON call of one of them, as small Qwen models write).
  `required` and a named function show them and constrain the output with a grammar (`tool_grammar`), so
  the call always parses; they work even without a parser, since the grammar fixes the format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from qwick.server import protocol as p
from qwick.server.errors import bad_request
from qwick.server.reasoning import ReasoningParser
from qwick.server.tool_parser import HermesToolParser, ToolCall, ToolCallDelta

TOOL_CALL_PARSERS = ("auto", "hermes", "none")
REASONING_PARSERS = ("auto", "qwen3", "none")


@dataclass(frozen=True)
class ChatParsers:
    """The server's resolved settings."""

    tool_call_parser: str | None = None  # "hermes" or None
    auto_tool_choice: bool = False
    reasoning_parser: str | None = None  # "qwen3" or None


def resolve_chat_parsers(
    chat_template: Any,
    tool_call_parser: str = "auto",
    enable_auto_tool_choice: bool | None = None,
    reasoning_parser: str = "auto",
) -> ChatParsers:
    """The flags' values for a model whose chat template is `chat_template` (a string, a dict of named
    templates, or None). ValueError for contradictory flags."""
    if tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}")
    if reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}")
    template = chat_template if isinstance(chat_template, str) else json.dumps(chat_template or "")
    tools = tool_call_parser
    if tools == "auto":
        tools = "hermes" if "<tool_call>" in template else "none"
    auto = enable_auto_tool_choice
    if auto is None:
        auto = tools != "none"
    elif auto and tools == "none":
        raise ValueError(
            "--enable-auto-tool-choice needs a tool call parser, and this model's chat template has no "
            "<tool_call> format: pass --tool-call-parser hermes if the model uses it"
        )
    reasoning = reasoning_parser
    if reasoning == "auto":
        reasoning = "qwen3" if "<think>" in template else "none"
    return ChatParsers(
        tool_call_parser=None if tools == "none" else tools,
        auto_tool_choice=auto,
        reasoning_parser=None if reasoning == "none" else reasoning,
    )


@dataclass
class ToolPlan:
    """How one request uses its tools."""

    template_tools: list[dict[str, Any]] | None = None  # shown to the model through the chat template
    parse: bool = False  # turn <tool_call> blocks of the output into tool_calls
    constrain: str | dict[str, Any] | None = None  # "required" or a named choice: needs the grammar
    max_calls: int | None = None  # parallel_tool_calls=false: 1
    bare_call_names: list[str] | None = None  # "auto": an untagged JSON call of these tools counts too

    def grammar_tools(self) -> list[dict[str, Any]]:
        return self.template_tools or []


def plan_tools(req: p.ChatCompletionRequest, parsers: ChatParsers) -> ToolPlan:
    """Check `tools` / `tool_choice` together (400 naming the parameter) and decide what they do."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else []
    names = [t["function"]["name"] for t in tools]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise bad_request(f"Tool names must be unique; '{dupes[0]}' is defined twice.", param="tools")
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none" or (choice == "auto" and not tools):
        return ToolPlan()
    if not tools:
        raise bad_request(
            f"tool_choice {json.dumps(choice)} needs 'tools': there is no tool to call.", param="tool_choice"
        )
    max_calls = 1 if req.parallel_tool_calls is False else None
    if choice == "auto":
        if not parsers.auto_tool_choice or parsers.tool_call_parser is None:
            raise bad_request(
                '"auto" tool choice needs a tool call parser, and this server has none (the model\'s chat '
                "template has no <tool_call> format). Start it with --tool-call-parser hermes if the model "
                "uses that format, or use tool_choice 'required' or a named function.",
                param="tool_choice",
            )
        return ToolPlan(template_tools=tools, parse=True, max_calls=max_calls, bare_call_names=names)
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in names:
            raise bad_request(
                f"tool_choice names the function '{name}', which is not in 'tools' "
                f"(there: {', '.join(names)}).",
                param="tool_choice",
            )
    return ToolPlan(template_tools=tools, parse=True, constrain=choice, max_calls=max_calls)


@dataclass
class ParsedDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def add(self, other: ParsedDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


class ChoiceParser:
    """One choice's text through the reasoning split, then the tool-call parser, as deltas arrive. With
    neither, text passes through untouched. Streamed or not, the same deltas give the same result."""

    def __init__(
        self,
        reasoning: bool,
        starts_in_reasoning: bool,
        tools: bool,
        max_calls: int | None = None,
        bare_call_names: list[str] | None = None,
    ) -> None:
        self._reasoning = ReasoningParser(starts_in_reasoning) if reasoning else None
        self._tools = HermesToolParser(max_calls, bare_call_names) if tools else None
        self.reasoning: list[str] = []
        self.content: list[str] = []

    @property
    def active(self) -> bool:
        return self._reasoning is not None or self._tools is not None

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self._tools.calls if self._tools is not None else []

    def feed(self, text: str) -> ParsedDelta:
        return self._step(text, final=False)

    def finish(self) -> ParsedDelta:
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        content = text
        if self._reasoning is not None:
            out.reasoning, content = self._reasoning.finish() if final else self._reasoning.feed(text)
        if self._tools is not None:
            parsed = self._tools.feed(content)
            if final:
                tail = self._tools.finish()
                parsed.content += tail.content
                parsed.tool_calls.extend(tail.tool_calls)
            content, out.tool_calls = parsed.content, parsed.tool_calls
        out.content = content
        if out.reasoning:
            self.reasoning.append(out.reasoning)
        if out.content:
            self.content.append(out.content)
        return out

    def message(self) -> p.ResponseMessage:
        """The whole answer as a response message. Content is None when the answer is only tool calls
        or only reasoning; "" for an empty plain answer (as before any parsing)."""
        reasoning = "".join(self.reasoning) or None
        content: str | None = "".join(self.content)
        calls = self.tool_calls
        if not content and (calls or reasoning is not None):
            content = None
        return p.ResponseMessage(
            content=content,
            reasoning_content=reasoning,
            tool_calls=[
                p.ToolCall(id=c.id, function=p.FunctionCall(name=c.name, arguments=c.arguments))
                for c in calls
            ],
        )

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's "tool_calls" when the model stopped after calling tools; "length" etc. stay, and so does
        "stop" when a streamed call broke off (its arguments closed early: see `tool_parser`)."""
        calls = self.tool_calls
        return "tool_calls" if reason == "stop" and calls and all(c.complete for c in calls) else reason


def delta_tool_calls(deltas: list[ToolCallDelta]) -> list[p.DeltaToolCall]:
    return [
        p.DeltaToolCall(
            index=d.index,
            id=d.id,
            type="function" if d.id is not None else None,
            function=p.DeltaFunctionCall(name=d.name, arguments=d.arguments),
        )
        for d in deltas
    ]
