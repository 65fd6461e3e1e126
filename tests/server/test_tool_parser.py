"""Qwen/Hermes tool-call parsing: calls, content around them, malformed blocks kept as text, arguments
streamed argument by argument (and closed early, still parseable, when a call breaks off), and streaming at
every split point accumulating to exactly the non-streamed result."""

from __future__ import annotations

import json
import random

import pytest

from qwick.server.chat_parsing import ChoiceParser
from qwick.server.tool_parser import HermesToolParser, JsonPrefix, extract, parse_call_body

CALL_PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
CALL_NOW = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'


FRAGMENTS: dict[int, list[str]] = {}  # the last stream(): each call's non-empty arguments fragments


def stream(text: str, pieces: list[str], max_calls: int | None = None):
    """Feed `pieces`; return (content, [(id, name, arguments)]) accumulated the way an OpenAI client does.
    After every delta, the arguments sent so far of each call are a whole object, or become one with a
    "}" (what a call that breaks off there gets), so a client never holds a call that cannot be closed."""
    assert "".join(pieces) == text
    parser = HermesToolParser(max_calls)
    content, calls = [], {}
    FRAGMENTS.clear()
    for out in [parser.feed(piece) for piece in pieces] + [parser.finish()]:
        content.append(out.content)
        for d in out.tool_calls:
            if d.index not in calls:
                assert d.id is not None and d.name is not None, "a call's first delta names it"
                assert d.arguments == "", "OpenAI's first delta: arguments empty"
                calls[d.index] = [d.id, d.name, ""]
                FRAGMENTS[d.index] = []
            else:
                assert d.id is None and d.name is None and d.arguments
                FRAGMENTS[d.index].append(d.arguments)
            calls[d.index][2] += d.arguments
        for _, _, args in calls.values():
            assert args.startswith("{")
            assert _closes(args), args
    assert sorted(calls) == list(range(len(calls)))
    for _, _, args in calls.values():
        assert isinstance(json.loads(args), dict)
    return "".join(content), [tuple(calls[i]) for i in sorted(calls)]


def _closes(args: str) -> bool:
    for text in (args, args + "}"):
        try:
            return isinstance(json.loads(text), dict)
        except ValueError:
            pass
    return False


def nonstream(text: str, max_calls: int | None = None):
    content, calls = extract(text, max_calls)
    return content, [(c.id, c.name, c.arguments) for c in calls]


def splits(text: str, seed: int = 0):
    """Char by char, every two-piece split, and random chunkings."""
    yield list(text)
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    rng = random.Random(seed)
    for _ in range(30):
        cuts = (
            sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
            if len(text) > 1
            else []
        )
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


def without_ids(result):
    content, calls = result
    return content, [(name, args) for _, name, args in calls]


SAME = object()  # content: the whole text, verbatim
CASES = {
    # name: (text, content (None: ""), [(call name, arguments or None: not checked)])
    "one call": (CALL_PARIS, None, [("get_weather", {"city": "Paris", "unit": "c"})]),
    "two calls": (CALL_PARIS + "\n" + CALL_NOW, None, [("get_weather", None), ("now", {})]),
    "text before": ("Let me check.\n" + CALL_PARIS, "Let me check.", [("get_weather", None)]),
    "text after": (CALL_PARIS + "\n\nDone, see above.", "Done, see above.", [("get_weather", None)]),
    "text between": (CALL_PARIS + "\nand\n" + CALL_NOW, "and", [("get_weather", None), ("now", {})]),
    "plain text": ("Paris is sunny <today>.\n", SAME, []),
    "plain text, tag-like end": ("use a <tool_c", SAME, []),
    "parameters key": ('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>', None,
                       [("f", {"x": 1})]),
    "no arguments": ('<tool_call>{"name": "now"}</tool_call>', None, [("now", {})]),
    "unicode args": ('<tool_call>{"name": "f", "arguments": {"q": "北京 \\u00e9"}}</tool_call>', None,
                     [("f", {"q": "北京 é"})]),
    "empty": ("", None, []),
    # malformed: the text stays content, verbatim
    "bad json": ('<tool_call>\n{"name": "f", "arguments": {city: Paris}}\n</tool_call>', SAME, []),
    "missing name": ('<tool_call>{"arguments": {}}</tool_call>', SAME, []),
    "name not a string": ('<tool_call>{"name": 3}</tool_call>', SAME, []),
    "arguments not an object": ('<tool_call>{"name": "f", "arguments": "x"}</tool_call>', SAME, []),
    "not an object": ("<tool_call>[1, 2]</tool_call>", SAME, []),
    "unclosed, nothing complete": ('Sure: <tool_call>\n{"name": "f", "arguments": {"a": 1', SAME, []),
    "truncated": ('<tool_call>\n{"name": "get_weather", "argu', SAME, []),
    "first argument malformed": ('<tool_call>\n{"name": "f", "arguments": {"p": "C:\\dir"}}\n</tool_call>',
                                 SAME, []),  # an invalid escape: nothing was sent, the block is text
    "single quotes": ("<tool_call>\n{'name': 'f', 'arguments': {'a': 1}}\n</tool_call>", SAME, []),
    "NaN is not JSON": ('<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>', SAME, []),
    "raw control character": ('<tool_call>{"name": "f", "arguments": {"a": "x\ty"}}</tool_call>', SAME, []),
    "empty name": ('<tool_call>{"name": "", "arguments": {}}</tool_call>', SAME, []),
    # streamed: complete once the arguments close, whatever follows
    "no closing tag": ('Sure: <tool_call>\n{"name": "f", "arguments": {"a": 1}}', "Sure:", [("f", {"a": 1})]),
    "no closing brace": ('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}', None,
                         [("f", {"a": [1, 2]})]),
    "half a closing tag": ('<tool_call>{"name": "f", "arguments": {}}\n</tool_ca', None, [("f", {})]),
    "tag inside a string": ('<tool_call>{"name": "f", "arguments": {"s": "</tool_call>"}}</tool_call>', None,
                            [("f", {"s": "</tool_call>"})]),
    "extra brace is content": ('<tool_call>{"name": "f", "arguments": {}}}\n</tool_call>', "}\n</tool_call>",
                               [("f", {})]),
    "nested and escapes": ('<tool_call>\n{"name": "f", "arguments": {"a": {"b": [1, -2.5e3, true, null]}, '
                           '"c": "q\\"\\u00e9\\n", "d": false}}\n</tool_call>', None,
                           [("f", {"a": {"b": [1, -2500.0, True, None]}, "c": 'q"\u00e9\n', "d": False})]),
    "name after arguments": ('<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>', None,
                             [("f", {"x": 1})]),
    # broken off after the first argument went out: closed there, the rest is content
    "malformed later": ('<tool_call>\n{"name": "f", "arguments": {"a": 1, b: 2}}\n</tool_call> ok',
                        ', b: 2}}\n</tool_call> ok', [("f", {"a": 1})]),
    "cut inside an argument": ('<tool_call>\n{"name": "f", "arguments": {"a": "x", "b": "Par', ', "b": "Par',
                               [("f", {"a": "x"})]),
    "cut after a comma": ('<tool_call>{"name": "f", "arguments": {"a": [1], ', ", ", [("f", {"a": [1]})]),
    "bad then good": ("<tool_call>oops</tool_call>\n" + CALL_NOW, "<tool_call>oops</tool_call>",
                      [("now", {})]),
    "good then unclosed": (CALL_NOW + "\n<tool_call>{", "<tool_call>{", [("now", {})]),
}  # fmt: skip
BROKEN_OFF = {"malformed later", "cut inside an argument", "cut after a comma"}


@pytest.mark.parametrize("name", list(CASES))
def test_extract(name):
    text, content, expected = CASES[name]
    got_content, calls = extract(text)
    content = text if content is SAME else content or ""
    assert got_content == content
    assert [c.name for c in calls] == [n for n, _ in expected]
    for call, (_, args) in zip(calls, expected):
        assert isinstance(json.loads(call.arguments), dict)
        if args is not None:
            assert json.loads(call.arguments) == args
        assert call.complete == (name not in BROKEN_OFF)
    assert len({c.id for c in calls}) == len(calls)
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in calls)


@pytest.mark.parametrize("name", list(CASES))
def test_streaming_equals_non_streaming_at_every_split(name):
    text = CASES[name][0]
    expected = without_ids(nonstream(text))
    for pieces in splits(text, seed=len(name)):
        assert without_ids(stream(text, pieces)) == expected, pieces


def test_the_tag_never_leaks_into_content_while_streaming():
    text = "Checking." + CALL_PARIS
    parser = HermesToolParser()
    shown = ""
    for ch in text:
        shown += parser.feed(ch).content
        assert "<" not in shown, shown
    shown += parser.finish().content
    assert shown == "Checking." and len(parser.calls) == 1


LONG_ARGS = (
    '{"city": "Paris", "unit": "c", "days": 3, "hourly": true, "fields": ["temp", "wind"], '
    '"where": {"lat": 48.85, "lon": 2.35}, "note": null}'
)
LONG_CALL = f'<tool_call>\n{{"name": "get_weather", "arguments": {LONG_ARGS}}}\n</tool_call>'


def tokens(text: str) -> list[str]:
    """Roughly how a BPE tokenizer cuts text: words with their leading space, punctuation runs."""
    import re

    return re.findall(r" ?\w+|\s+|[^\w\s]+", text)


def test_arguments_stream_argument_by_argument():
    parser = HermesToolParser()
    deltas = []
    for piece in tokens(LONG_CALL):
        out = parser.feed(piece)
        assert not out.content
        deltas.append((piece, out.tool_calls))
    assert not parser.finish()
    sent = [(piece, d) for piece, ds in deltas for d in ds]
    (_, header), fragments = sent[0], [d.arguments for _, d in sent[1:]]
    assert (header.index, header.name, header.arguments) == (0, "get_weather", "") and header.id
    assert all(d.index == 0 and d.id is None and d.name is None for _, d in sent[1:])
    # one fragment per argument, each out as soon as its value is complete, then the closing brace
    assert fragments == ['{"city": "Paris"', ', "unit": "c"', ', "days": 3', ', "hourly": true',
                         ', "fields": ["temp", "wind"]', ', "where": {"lat": 48.85, "lon": 2.35}',
                         ', "note": null', "}"]  # fmt: skip
    assert "".join(fragments) == LONG_ARGS == parser.calls[0].arguments  # the model's own text
    assert [piece for piece, d in sent[1:]][:2] == ['",', '",']  # the string's closing quote releases it
    assert parser.calls[0].complete


def test_arguments_are_the_models_text_not_re_serialized():
    args = '{"b":2,  "a" : "\u00e9", "c":[1,2.50]}'
    for text in (f'<tool_call>{{"name": "f", "arguments": {args}}}</tool_call>',  # streamed
                 f'<tool_call>{{"arguments": {args}, "name": "f"}}</tool_call>',  # read whole
                 f'{{"name": "f", "arguments": {args}}}'):  # untagged  # fmt: skip
        (call,) = extract(text, bare_call_names=["f"])[1]
        assert call.arguments == args


def test_a_broken_off_call_keeps_finish_reason():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c'
    parser = ChoiceParser(reasoning=False, starts_in_reasoning=False, tools=True)
    for piece in tokens(text):
        parser.feed(piece)
    parser.finish()
    msg = parser.message()
    assert msg.content == ', "unit": "c' and msg.tool_calls[0].function.arguments == '{"city": "Paris"}'
    assert parser.finish_reason("length") == "length" and parser.finish_reason("stop") == "stop"
    whole = ChoiceParser(reasoning=False, starts_in_reasoning=False, tools=True)
    whole.feed(LONG_CALL)
    whole.finish()
    assert whole.finish_reason("stop") == "tool_calls"


def test_long_arguments_come_in_several_fragments_at_every_split():
    text = "Checking.\n" + LONG_CALL + "\n" + CALL_NOW
    expected = without_ids(nonstream(text))
    assert expected[1][0] == ("get_weather", LONG_ARGS)
    for pieces in [list(text), tokens(text), *splits(text, seed=3)]:
        assert without_ids(stream(text, pieces)) == expected, pieces
        if len(pieces) > 10:  # fed in small pieces: the arguments arrive argument by argument
            assert len(FRAGMENTS[0]) >= 5, FRAGMENTS
        assert "".join(FRAGMENTS[0]) == LONG_ARGS


def test_max_calls_keeps_the_first():
    text = CALL_PARIS + "\n" + CALL_NOW + "\nbye"
    content, calls = extract(text, max_calls=1)
    assert [c.name for c in calls] == ["get_weather"] and content == "bye"
    for pieces in splits(text):
        assert without_ids(stream(text, pieces, max_calls=1)) == without_ids(nonstream(text, 1))


def test_plain_text_is_passed_through_verbatim_at_every_split():
    text = "  indented\n\n<b>bold</b> and <tool_calls> and a trailing newline\n"
    for pieces in splits(text):
        assert stream(text, pieces) == (text, [])


BARE_NAMES = ["get_weather", "now"]
FENCED = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'
BARE_CASES = {
    # untagged calls, as the 0.5B demo model writes them under tool_choice "auto"
    "bare": ('{"name": "get_weather", "arguments": {"city": "Tokyo"}}', "",
             [("get_weather", {"city": "Tokyo"})]),
    "fenced": (FENCED, "", [("get_weather", {"city": "Paris"})]),
    "tagged still works": (CALL_NOW, "", [("now", {})]),
    "not a tool's name": ('{"name": "John", "age": 3}', SAME, []),
    "text after the object": ('{"name": "now", "arguments": {}} and more', SAME, []),
    "another fence": ("```python\nprint(1)\n```", SAME, []),
    "unclosed fence": ('```json\n{"name": "now", "arguments": {}}\n', SAME, []),
    "plain": ("Hello!", SAME, []),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BARE_CASES))
def test_untagged_calls_of_known_tools(name):
    text, content, expected = BARE_CASES[name]
    got_content, calls = extract(text, bare_call_names=BARE_NAMES)
    assert got_content == (text if content is SAME else content)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    assert extract(text)[1] == [] or name == "tagged still works"  # without the names: plain content
    for pieces in splits(text, seed=len(name)):
        parser_result = stream_bare(text, pieces)
        assert without_ids(parser_result) == without_ids(nonstream_bare(text)), pieces


def stream_bare(text, pieces):
    parser = HermesToolParser(bare_call_names=BARE_NAMES)
    content, calls = "", {}
    for out in [parser.feed(p) for p in pieces] + [parser.finish()]:
        content += out.content
        for d in out.tool_calls:
            calls.setdefault(d.index, [d.id, d.name, ""])[2] += d.arguments
    return content, [tuple(v) for _, v in sorted(calls.items())]


def nonstream_bare(text):
    content, calls = extract(text, bare_call_names=BARE_NAMES)
    return content, [(c.id, c.name, c.arguments) for c in calls]


def test_text_that_cannot_be_an_untagged_call_is_not_held_back():
    parser = HermesToolParser(bare_call_names=BARE_NAMES)
    assert parser.feed("Hel").content == "Hel"
    parser = HermesToolParser(bare_call_names=BARE_NAMES)
    assert parser.feed("```").content == ""  # may still open a ```json fence
    assert parser.feed("py").content == "```py"
    parser = HermesToolParser(bare_call_names=BARE_NAMES)
    assert parser.feed('{"na').content == ""
    assert parser.feed("me_list").content == '{"name_list'


# ---- the streaming JSON check ------------------------------------------------------------------------

VALID_JSON = ['{"a": [1, -0.5, 2e10, 1E-3, 0], "b": {"c": null, "d": true, "e": false}}', "[]", "{}", '"x"',
              '{"s": "\\" \\\\ \\/ \\b \\f \\n \\r \\t \\u00e9 \\ud83d\\ude00 北京"}',
              " [ 1 , { } , [ ] ] ", "-0", "[[[[[[[[[[1]]]]]]]]]]",
              '{"a": {"b": {"c": {"d": "deep"}}}}']  # fmt: skip


def json_value(text: str):
    j = JsonPrefix()
    j.feed(text)
    return j.done and not text[j.pos :].strip(" \t\r\n"), j.failed


@pytest.mark.parametrize("text", VALID_JSON)
def test_json_prefix_accepts_json_at_every_prefix(text):
    json.loads(text)
    for i in range(len(text)):
        j = JsonPrefix()
        j.feed(text[:i])
        j.feed(text[i:])  # two pieces: the same as one
        assert not j.failed
    j = JsonPrefix()
    for ch in text:
        j.feed(ch)
        assert not j.failed, (text, j.pos)
    assert j.done or text.strip() in ("-0",)  # a number is complete only once something follows it


def loads(text: str) -> bool:
    try:
        json.loads(text, parse_constant=lambda c: 1 / 0)  # no NaN / Infinity
        return True
    except (ValueError, ZeroDivisionError):
        return False


def test_json_prefix_agrees_with_json_loads():
    rng = random.Random(5)
    alphabet = list('{}[]:,"\\ 0123456789-+.eEtrufalsn\t\nxu') + ["true", "null", '"k"', "\\u00e9", "1.5"]
    complete_seen = 0
    for _ in range(20000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 14)))
        complete, _ = json_value(text + " ")  # a space ends a trailing number
        assert complete == loads(text), text
        complete_seen += complete
        if prefix_fails(text):  # a failure is final: no continuation makes it JSON
            for more in ("}", "]", '"', "0}", '"}', "]}", '": 1}', "e1]"):
                assert not loads(text + more), (text, more)
    assert complete_seen > 500


def prefix_fails(text: str) -> bool:
    j = JsonPrefix()
    j.feed(text)
    return j.failed


def test_call_bodies_need_strict_json():
    assert parse_call_body('{"name": "f", "arguments": {"a": Infinity}}') is None
    assert parse_call_body('{"name": "f", "arguments": {"a": 1}} x') is None
    assert parse_call_body(' {"name": "f", "arguments": {"a": 1}}\n') == ("f", '{"a": 1}')
    assert parse_call_body('{"name": "f", "parameters": {"a": 1}, "arguments": {}}') == ("f", "{}")
