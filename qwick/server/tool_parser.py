"""Qwen's tool calls (the Hermes format) in generated text, turned into OpenAI `tool_calls`.

Qwen2.5 and Qwen3 chat templates ask the model to answer a tool call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, several blocks for parallel calls. `HermesToolParser` is fed the text as it is generated
and returns what can be shown so far: content deltas and tool-call deltas. `extract(text)` is the same
parser fed everything at once, so a streamed answer always accumulates to exactly the non-streamed one.

Rules (the same streamed or not):
- Text outside the blocks is content, verbatim; whitespace right before or after a call is formatting and
  is dropped. A partial `<tool_call` at the end of a delta is held back until it is known not to start a
  block, so the tag never leaks into content.
- A call's `arguments` are the model's own JSON text, never re-serialized, and always strict JSON that
  parses (RFC 8259: no NaN/Infinity, no raw control characters in strings), streamed or not.
- Streaming (OpenAI's shape): a block that starts `{"name": "<tool>", "arguments": {` is read by a streaming
  JSON checker (`JsonPrefix`) as it arrives. The call's first delta (index, id, name, arguments "") comes
  with its first complete argument, then each further top-level argument (`"key": value`) follows as an
  `arguments` fragment as soon as its value is complete, and the closing `}` last; the fragments concatenate
  to the arguments text. An argument is released only once its value is complete (a long string value
  arrives in one piece): then a call that breaks off can always be closed without cutting a value.
- A call breaks off when, after its first argument went out, the text stops being JSON (possible only
  under `tool_choice: "auto"`; "required" and named choices are grammar-constrained) or ends first
  (max_tokens, a stop string). Sent text cannot be taken back, so the call keeps exactly its complete
  arguments and gets its `}` (arguments that parse, holding only what the model fully wrote), the rest of
  the text from there is content, verbatim, and `finish_reason` stays the engine's ("length", "stop")
  rather than "tool_calls": the client sees that the call did not finish.
- A block whose arguments never got a complete argument, or whose body does not start as above (other key
  order, no arguments, a call past `max_calls`), is read whole as before: it is a call only once closed
  and its body is a JSON object with a non-empty string `name` and an object `arguments` (or `parameters`;
  missing means `{}`), sent in one delta. Anything else (bad JSON, no name, a block still open when the
  text ends) is given back as content, verbatim: malformed output degrades to text, never to an error.
- A streamed call is complete once its arguments object closes: the body's `}` and `</tool_call>` after it
  are formatting (dropped, also when the text ends without them); anything else there is content.
- Why `auto` is not constrained with xgrammar's structural tag triggered by `<tool_call>` (which would
  rule out malformed calls): every auto request with tools, text answers included, would pay the token
  mask each step (about 0.35 ms per constrained row per step in the sampler: host bitmask, copy, apply;
  the matcher itself is cheap) plus a grammar compile per new tool set before its first token (about 40
  ms on CPU for one small tool); it could not be combined with `response_format`; `auto` would need
  xgrammar; and a `<tool_call>` the model merely mentions in prose would be forced into a call. A grammar
  does not prevent truncation either (max_tokens, stop strings), so the break-off rule is needed anyway,
  and with it the prefix check alone keeps every call a client receives parseable.
- Small Qwen models (the 0.5B demo model among them) often answer a tool call without the tags: the whole
  output is `{"name": ..., "arguments": {...}}`, bare or in a ```json fence. With `bare_call_names`, such
  an output is one call when it names one of those tools. While the output may still be one (it starts
  with the fence or with `{"name": "`), it is held back; anything else is released at once. Whether it is
  a call is known only when the output ends, so its arguments come in one delta then.
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
_CALL_TAIL = re.compile(r"[ \t\r\n]*(?:\}[ \t\r\n]*)?")  # what may follow a streamed call's arguments

# JSON, as JsonPrefix reads it
_WS_RUN = re.compile(r"[ \t\r\n]+")
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_NUMBER_RUN = re.compile(r"[-+0-9.eE]+")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_NUMBER_PREFIX = re.compile(r"-?(?:(?:0|[1-9][0-9]*)(?:\.[0-9]*)?(?:(?<=[0-9])[eE][-+]?[0-9]*)?)?")
_HEX = frozenset("0123456789abcdefABCDEF")
_ESCAPES = frozenset('"\\/bfnrtu')
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_DIGITS = frozenset("-0123456789")
# JsonPrefix states: between tokens (a value, an array's first item or "]", an object's first key or "}",
# a key, ":", "," or a closer), and inside a string, an escape, a \\u escape, a number, a literal
_VALUE, _FIRST_ITEM, _FIRST_KEY, _KEY, _COLON, _AFTER, _STRING, _ESCAPE, _UNICODE, _NUM, _LITERAL = range(11)


def make_call_id() -> str:
    """OpenAI's shape of a tool-call id: `call_` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ALPHABET) for _ in range(24))


class JsonPrefix:
    """One strict JSON value checked as its text arrives (json.loads' grammar without NaN and Infinity,
    which other parsers reject), which `json.JSONDecoder` cannot do with a prefix.

    `feed(text)` appends and checks; `failed` once the text can no longer begin a JSON value (`pos` is the
    offending character), `done` once the value is complete (`pos` is just past it; what follows is not
    read). `events` lists, in order, keys `("key", depth, start, end)`, value starts `("open", depth, pos,
    first char)` and value ends `("close", depth, end)` down to depth `track` (the value itself is depth
    0, its members 1, ...), positions in the text. A number is complete only once a character follows it.
    """

    def __init__(self, track: int = 1) -> None:
        self.text = ""
        self.pos = 0
        self.failed = False
        self.done = False
        self.events: list[tuple] = []
        self._track = track
        self._stack: list[str] = []  # the open containers: "{" or "["
        self._state = _VALUE
        self._start = 0  # where the current key, string, number or literal starts
        self._key = False  # the current string is an object key
        self._word = ""  # the current literal
        self._hex = 0  # digits of a \u escape still to come

    def feed(self, text: str) -> None:
        self.text += text
        if not (self.failed or self.done):
            self._scan()

    def _scan(self) -> None:
        t, i, n, stack = self.text, self.pos, len(self.text), self._stack
        while i < n and not self.done:
            st, c = self._state, t[i]
            if st == _STRING:
                m = _STRING_RUN.match(t, i)
                if m is not None:
                    i = m.end()
                elif c == '"':
                    i += 1
                    if self._key:
                        self._event("key", len(stack), self._start, i)
                        self._state = _COLON
                    else:
                        self._close(i)
                elif c == "\\":
                    self._state, i = _ESCAPE, i + 1
                else:
                    break  # a raw control character
            elif st == _ESCAPE:
                if c not in _ESCAPES:
                    break
                self._state, self._hex, i = (_UNICODE if c == "u" else _STRING), 4, i + 1
            elif st == _UNICODE:
                if c not in _HEX:
                    break
                self._hex -= 1
                i += 1
                if not self._hex:
                    self._state = _STRING
            elif st == _NUM:
                m = _NUMBER_RUN.match(t, i)
                end = i if m is None else m.end()
                if end == n:  # the number may go on
                    if _NUMBER_PREFIX.fullmatch(t, self._start, n) is None:
                        break
                    i = n
                else:
                    if _NUMBER.fullmatch(t, self._start, end) is None:
                        break
                    i = end
                    self._close(i)
            elif st == _LITERAL:
                if c != self._word[i - self._start]:
                    break
                i += 1
                if i - self._start == len(self._word):
                    self._close(i)
            elif c in _WHITESPACE:
                i = _WS_RUN.match(t, i).end()
            elif st == _COLON:
                if c != ":":
                    break
                self._state, i = _VALUE, i + 1
            elif st == _AFTER:
                if c == ",":
                    self._state, i = (_KEY if stack[-1] == "{" else _VALUE), i + 1
                elif c == ("}" if stack[-1] == "{" else "]"):
                    stack.pop()
                    i += 1
                    self._close(i)
                else:
                    break
            elif st in (_KEY, _FIRST_KEY):
                if c == '"':
                    self._state, self._key, self._start, i = _STRING, True, i, i + 1
                elif c == "}" and st == _FIRST_KEY:
                    stack.pop()
                    i += 1
                    self._close(i)
                else:
                    break
            elif c == "]" and st == _FIRST_ITEM:
                stack.pop()
                i += 1
                self._close(i)
            else:  # a value starts
                if c == "{" or c == "[":
                    self._event("open", len(stack), i, c)
                    stack.append(c)
                    self._state, i = (_FIRST_KEY if c == "{" else _FIRST_ITEM), i + 1
                elif c == '"':
                    self._event("open", len(stack), i, c)
                    self._state, self._key, self._start, i = _STRING, False, i, i + 1
                elif c in _DIGITS:
                    self._event("open", len(stack), i, c)
                    self._state, self._start = _NUM, i  # read from its first character on
                elif c in _LITERALS:
                    self._event("open", len(stack), i, c)
                    self._state, self._start, self._word = _LITERAL, i, _LITERALS[c]
                else:
                    break
        else:
            self.pos = i
            return
        if not self.done:
            self.failed = True
        self.pos = i

    def _event(self, kind: str, depth: int, *where) -> None:
        if depth <= self._track:
            self.events.append((kind, depth, *where))

    def _close(self, end: int) -> None:
        """A value ends at `end`."""
        self._event("close", len(self._stack), end)
        if self._stack:
            self._state = _AFTER
        else:
            self.done = True


def _key(text: str, event: tuple) -> str:
    return json.loads(text[event[2] : event[3]])


def parse_call_body(body: str) -> tuple[str, str] | None:
    """The (name, arguments JSON text) of one block's body, or None when it is not a well-formed call:
    a JSON object (whitespace around it allowed) with a non-empty string `name` and an object `arguments`
    (or `parameters`; missing means `{}`). Arguments are the body's own text of that object."""
    j = JsonPrefix(track=1)
    j.feed(body)
    if not j.done or body[j.pos :].strip(_WHITESPACE) or j.events[0][3] != "{":
        return None
    members: dict[str, tuple[int, int]] = {}  # key: span of its value (the last one, as json.loads)
    key, start = "", 0
    for ev in j.events[1:]:
        if ev[1] != 1:
            continue
        if ev[0] == "key":
            key = _key(body, ev)
        elif ev[0] == "open":
            start = ev[2]
        else:
            members[key] = (start, ev[2])
    if "name" not in members:
        return None
    name = json.loads(body[slice(*members["name"])])
    if not isinstance(name, str) or not name:
        return None
    span = members.get("arguments", members.get("parameters"))
    if span is None:
        return name, "{}"
    if body[span[0]] != "{":
        return None
    return name, body[slice(*span)]


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


def parse_bare_call(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) when the whole `text` is one untagged call, bare or in a ```json fence."""
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


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object (while streaming: what has been sent so far)
    complete: bool = True  # False: broken off, closed after its last complete argument


@dataclass
class ToolCallDelta:
    """One entry of a streamed `delta.tool_calls`: the first for a call carries id and name (arguments
    ""), the next ones pieces of its arguments text."""

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


# How far a streamed block has been read: the body's "{", the "name" key, its value's start and end, the
# "arguments" (or "parameters") key, its "{"; then its arguments, then what follows them.
_OPEN, _NAME_KEY, _NAME_OPEN, _NAME_CLOSE, _ARGS_KEY, _ARGS_OPEN, _ARGS, _TAIL = range(8)
_STAGE_KEYS = {_NAME_KEY: ("name",), _ARGS_KEY: ("arguments", "parameters")}


@dataclass
class _Block:
    """One `<tool_call>` block being read: its body so far, and while it may be streamed, the JSON check."""

    pending_ws: str  # whitespace right before the block (dropped if it is a call)
    body: str = ""
    json: JsonPrefix | None = None  # None: read whole, once closed
    stage: int = _OPEN
    seen: int = 0  # events of `json` handled
    name_start: int = 0
    name: str = ""
    args_start: int = 0
    ready: int = 0  # end of the last complete argument (or of the arguments)
    sent: int = 0  # end of the arguments text sent (0: the call is not out yet)
    call: ToolCall | None = None
    index: int = 0


class HermesToolParser:
    """Streaming parser of one choice's text: `feed(delta)` as text arrives, `finish()` once at the end."""

    def __init__(self, max_calls: int | None = None, bare_call_names: Collection[str] | None = None) -> None:
        self.max_calls = max_calls  # parallel_tool_calls=false: calls past the first are dropped
        self._bare_names = frozenset(bare_call_names or ())
        self._bare: str | None = "" if self._bare_names else None  # the output, while it may be a bare call
        self.calls: list[ToolCall] = []
        self._buf = ""  # outside a block: text not emitted yet (trailing whitespace, a partial tag)
        self._block: _Block | None = None  # inside a block
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
        if self._block is not None:
            self._block_feed(text)
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

    def _block_feed(self, text: str) -> None:
        block = self._block
        block.body += text
        if block.json is not None:
            block.json.feed(text)

    def _advance(self, out: ParserOutput, final: bool) -> None:
        while True:
            if self._block is None:
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
                streamed = self.max_calls is None or len(self.calls) < self.max_calls
                self._block = _Block(before[len(text) :], json=JsonPrefix(track=2) if streamed else None)
                body, self._buf = self._buf[start + len(TOOL_CALL_START) :], ""
                self._block_feed(body)
            block = self._block
            if block.json is not None and not self._stream(out, block, final):
                return
            if block.json is None and not self._whole(out, block, final):
                return

    def _whole(self, out: ParserOutput, block: _Block, final: bool) -> bool:
        """A block read whole: a call (or content) once closed. Whether it ended."""
        end = block.body.find(TOOL_CALL_END)
        if end < 0:
            if final:  # a block still open: not a call
                self._emit(out, block.pending_ws + TOOL_CALL_START + block.body)
                self._block = None
            return False
        body, self._buf = block.body[:end], block.body[end + len(TOOL_CALL_END) :]
        self._block = None
        parsed = parse_call_body(body)
        if parsed is None:
            self._emit(out, block.pending_ws + TOOL_CALL_START + body + TOOL_CALL_END)
        else:
            self._add_call(out, *parsed)
        return True

    def _stream(self, out: ParserOutput, block: _Block, final: bool) -> bool:
        """A block streamed argument by argument. Whether it ended or is now read whole (go on)."""
        j, body = block.json, block.body
        if block.stage < _TAIL:
            for ev in j.events[block.seen :]:
                block.seen += 1
                kind, stage = ev[0], block.stage
                if stage == _ARGS:
                    if kind == "close":
                        block.ready = ev[2]
                        if ev[1] == 1:  # the arguments are complete
                            block.stage = _TAIL
                            break
                    continue
                if stage == _OPEN:
                    ok = kind == "open" and ev[3] == "{"
                elif stage in _STAGE_KEYS:
                    ok = kind == "key" and _key(body, ev) in _STAGE_KEYS[stage]
                elif stage == _NAME_OPEN:
                    ok, block.name_start = kind == "open" and ev[3] == '"', ev[2]
                elif stage == _NAME_CLOSE:  # a string has no events inside: this is its end
                    block.name = json.loads(body[block.name_start : ev[2]])
                    ok = bool(block.name)
                else:  # _ARGS_OPEN
                    ok, block.args_start = kind == "open" and ev[3] == "{", ev[2]
                if not ok:
                    block.json = None  # not the shape to stream: read it whole
                    return True
                block.stage += 1
            if block.ready > block.sent:
                self._send(out, block, body[block.sent or block.args_start : block.ready])
                block.sent = block.ready
            if block.stage < _TAIL:
                if not (j.failed or final):
                    return False
                if block.call is None:  # nothing sent: read it whole (it is content, or a call closed later)
                    block.json = None
                    return True
                # Broken off: close the arguments after the last complete one; the rest is content.
                self._send(out, block, "}")
                self._block, self._buf, self._after_call = None, body[block.sent :], False
                return True
            block.call.complete = True
        tail = body[block.ready :]
        rest = tail[_CALL_TAIL.match(tail).end() :]
        if rest.startswith(TOOL_CALL_END):
            rest = rest[len(TOOL_CALL_END) :]
        elif TOOL_CALL_END.startswith(rest):  # nothing else yet, or the closing tag may be coming
            if not final:
                return False
            rest = ""
        self._block, self._buf, self._after_call = None, rest, True
        return True

    def _send(self, out: ParserOutput, block: _Block, arguments: str) -> None:
        """Arguments text of the streamed call in `block`, announcing the call first."""
        if block.call is None:
            block.call = ToolCall(make_call_id(), block.name, "", complete=False)
            block.index = len(self.calls)
            self.calls.append(block.call)
            out.tool_calls.append(ToolCallDelta(block.index, "", id=block.call.id, name=block.name))
        block.call.arguments += arguments
        out.tool_calls.append(ToolCallDelta(block.index, arguments))

    def _add_call(self, out: ParserOutput, name: str, arguments: str) -> None:
        """A call known whole: announced and its arguments sent in one delta."""
        self._after_call = True  # whitespace right after a call is dropped (a call past max_calls too)
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            return
        call = ToolCall(make_call_id(), name, arguments)
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
