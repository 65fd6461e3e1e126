"""Qwen/Hermes tool-call parsing: calls, content around them, malformed blocks kept as text, and streaming at
every split point accumulating to exactly the non-streamed result."""

from __future__ import annotations

import json
import random

import pytest

from qwick.server.tool_parser import HermesToolParser, extract

CALL_PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
CALL_NOW = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'


def stream(text: str, pieces: list[str], max_calls: int | None = None):
    """Feed `pieces`; return (content, [(id, name, arguments)]) accumulated the way an OpenAI client does."""
    assert "".join(pieces) == text
    parser = HermesToolParser(max_calls)
    content, calls = [], {}
    outs = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    for out in outs:
        content.append(out.content)
        for d in out.tool_calls:
            if d.index not in calls:
                assert d.id is not None and d.name is not None, "a call's first delta names it"
                calls[d.index] = [d.id, d.name, ""]
            else:
                assert d.id is None and d.name is None
            calls[d.index][2] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return "".join(content), [tuple(calls[i]) for i in sorted(calls)]


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
    "unclosed": ('Sure: <tool_call>\n{"name": "f", "arguments": {"a": 1}}', SAME, []),
    "truncated": ('<tool_call>\n{"name": "get_weather", "argu', SAME, []),
    "bad then good": ("<tool_call>oops</tool_call>\n" + CALL_NOW, "<tool_call>oops</tool_call>",
                      [("now", {})]),
    "good then unclosed": (CALL_NOW + "\n<tool_call>{", "<tool_call>{", [("now", {})]),
}  # fmt: skip


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


def test_call_deltas_arrive_when_the_block_closes():
    parser = HermesToolParser()
    body, end = CALL_PARIS[: -len("</tool_call>")], "</tool_call>"
    assert not parser.feed(body)
    out = parser.feed(end)
    header, args = out.tool_calls
    assert (header.index, header.name, header.arguments) == (0, "get_weather", "") and header.id
    assert (args.index, args.id, args.name) == (0, None, None)
    assert json.loads(args.arguments) == {"city": "Paris", "unit": "c"}


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
