"""Qwen's tool calls (the Hermes format) in generated text, turned into OpenAI `tool_calls`.

Qwen2.5 and Qwen3 chat templates ask the model to answer a tool call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, several blocks for parallel calls. `HermesToolParser` is fed the text as it is generated
and returns what can be shown so far: content deltas and tool-call deltas. `extract(text)` is the same
parser fed everything at once, so a streamed answer always accumulates to exactly the non-streamed one.

Rules (the same streamed or not):
- Text outside the blocks is content, verbatim; whitespace right before or after a parsed call is
  formatting and is dropped. A partial `<tool_call` at the end of a delta is held back until it is known
  not to start a block, so the tag never leaks into content.
- A block counts as a call only once it is closed and its body is a JSON object with a non-empty string
  `name` and an object `arguments` (or `parameters`; missing means `{}`). Anything else (bad JSON, no name,
  a block still open when the text ends) is given back as content, verbatim: malformed model output
  degrades to text, never to an error or a call whose arguments do not parse.
- So a call's arguments are emitted in one piece when its block closes, not token by token: streaming them
  earlier would commit to a call that may still turn out malformed, and that cannot be taken back.
  Arguments are re-serialized (`json.dumps`, no ASCII escaping): always valid JSON.
- Small Qwen models (the 0.5B demo model among them) often answer a tool call without the tags: the whole
  output is `{"name": ..., "arguments": {...}}`, bare or in a ```json fence. With `bare_call_names`, such
  an output is one call when it names one of those tools. While the output may still be one (it starts
  with the fence or with `{"name": "`), it is held back; anything else is released at once.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Collection
from dataclasses import dataclass, field

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_ALPHABET = string.ascii_letters + string.digits
_WHITESPACE = " \t\r\n"
_FENCE = re.compile(r"```(?:json)?[ \t]*\r?\n")
_FENCE_PARTIAL = re.compile(r"`{0,3}|```(?:j(?:s(?:o(?:n)?)?)?)?[ \t]*\r?")
_HEADER = re.compile(r'\{\s*"name"\s*:\s*"')
_HEADER_PARTIAL = re.compile(r'\{\s*(?:"(?:n(?:a(?:m(?:e(?:"\s*(?::\s*)?)?)?)?)?)?)?')


def make_call_id() -> str:
    """OpenAI's shape of a tool-call id: `call_` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ALPHABET) for _ in range(24))


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object


@dataclass
class ToolCallDelta:
    """One entry of a streamed `delta.tool_calls`: the first for a call carries id and name (arguments
    ""), the next its arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class ParserOutput:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


def parse_call_body(body: str) -> tuple[str, dict] | None:
    """The (name, arguments) of one block's body, or None when it is not a well-formed call."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    return name, args


def _may_be_bare_call(text: str) -> bool:
    """Whether an output that starts with `text` may still be one untagged call (see the module doc)."""
    s = text.lstrip(_WHITESPACE)
    fence = _FENCE.match(s)
    if fence is None:
        if not s or s.startswith("`"):
            return _FENCE_PARTIAL.fullmatch(s) is not None
    else:
        s = s[fence.end() :].lstrip(_WHITESPACE)
    return not s or _HEADER.match(s) is not None or _HEADER_PARTIAL.fullmatch(s) is not None


def parse_bare_call(text: str) -> tuple[str, dict] | None:
    """(name, arguments) when the whole `text` is one untagged call, bare or in a ```json fence."""
    s = text.strip(_WHITESPACE)
    fence = _FENCE.match(s)
    if fence is not None:
        if not s.endswith("```") or len(s) < fence.end() + 3:
            return None
        s = s[fence.end() : -3]
    return parse_call_body(s)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (it may become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HermesToolParser:
    """Streaming parser of one choice's text: `feed(delta)` as text arrives, `finish()` once at the end."""

    def __init__(self, max_calls: int | None = None, bare_call_names: Collection[str] | None = None) -> None:
        self.max_calls = max_calls  # parallel_tool_calls=false: calls past the first are dropped
        self._bare_names = frozenset(bare_call_names or ())
        self._bare: str | None = "" if self._bare_names else None  # the output, while it may be a bare call
        self.calls: list[ToolCall] = []
        self._buf = ""  # outside a block: text not emitted yet (trailing whitespace, a partial tag)
        self._body: str | None = None  # inside a block: its body so far
        self._pending_ws = ""  # whitespace right before the open block (dropped if it parses)
        self._after_call = False  # drop whitespace that directly follows a parsed call
        self.content: list[str] = []  # everything emitted as content, for the non-streamed answer

    def feed(self, text: str) -> ParserOutput:
        out = ParserOutput()
        if not text:
            return out
        if self._bare is not None:
            self._bare += text
            if _may_be_bare_call(self._bare):
                return out
            text, self._bare = self._bare, None
        if self._body is not None:
            self._body += text
        else:
            self._buf += text
        self._advance(out, final=False)
        return out

    def finish(self) -> ParserOutput:
        out = ParserOutput()
        if self._bare is not None:
            text, self._bare = self._bare, None
            parsed = parse_bare_call(text)
            if parsed is not None and parsed[0] in self._bare_names:
                self._add_call(out, *parsed)
                return out
            self._buf += text
        self._advance(out, final=True)
        if self._body is not None:  # a block still open: not a call
            self._emit(out, self._pending_ws + TOOL_CALL_START + self._body)
            self._body, self._pending_ws = None, ""
        if self._buf:
            if not (self._after_call or (self.calls and not self._buf.strip(_WHITESPACE))):
                self._emit(out, self._buf)
            self._buf = ""
        return out

    def _emit(self, out: ParserOutput, text: str) -> None:
        if text:
            out.content += text
            self.content.append(text)
            self._after_call = False

    def _advance(self, out: ParserOutput, final: bool) -> None:
        while True:
            if self._body is None:
                if self._after_call:
                    stripped = self._buf.lstrip(_WHITESPACE)
                    if not stripped:
                        self._buf = ""
                        return
                    self._buf = stripped
                    self._after_call = False
                start = self._buf.find(TOOL_CALL_START)
                if start < 0:
                    if final:
                        return  # finish() decides about what is left
                    hold = _partial_suffix(self._buf, TOOL_CALL_START)
                    head = self._buf[: len(self._buf) - hold]
                    keep = len(head) - len(head.rstrip(_WHITESPACE)) + hold  # whitespace may precede a call
                    self._emit(out, self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return
                before = self._buf[:start]
                text = before.rstrip(_WHITESPACE)
                self._emit(out, text)
                self._pending_ws = before[len(text) :]
                self._body = self._buf[start + len(TOOL_CALL_START) :]
                self._buf = ""
            end = self._body.find(TOOL_CALL_END)
            if end < 0:
                return
            body, rest = self._body[:end], self._body[end + len(TOOL_CALL_END) :]
            self._body = None
            parsed = parse_call_body(body)
            if parsed is None:
                self._emit(out, self._pending_ws + TOOL_CALL_START + body + TOOL_CALL_END)
            else:
                self._add_call(out, *parsed)
            self._pending_ws = ""
            self._buf = rest

    def _add_call(self, out: ParserOutput, name: str, args: dict) -> None:
        self._after_call = True  # whitespace right after a call is dropped (a call past max_calls too)
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            return
        call = ToolCall(make_call_id(), name, json.dumps(args, ensure_ascii=False))
        index = len(self.calls)
        self.calls.append(call)
        out.tool_calls.append(ToolCallDelta(index, "", id=call.id, name=name))
        out.tool_calls.append(ToolCallDelta(index, call.arguments))


def extract(
    text: str, max_calls: int | None = None, bare_call_names: Collection[str] | None = None
) -> tuple[str, list[ToolCall]]:
    """The content and the parsed calls of a whole text (what streaming it would accumulate to)."""
    parser = HermesToolParser(max_calls, bare_call_names)
    parser.feed(text)
    parser.finish()
    return "".join(parser.content), parser.calls
