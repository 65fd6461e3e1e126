"""Tool calling and reasoning through the HTTP API and the `openai` SDK, on a tiny random Qwen3 whose chat
template speaks Qwen3's formats (tools, `<tool_call>`, `<think>`, `enable_thinking`).

- The template picks the parsers (hermes + qwen3) without flags, and `chat_template_kwargs` / `tools`
  reach it (checked on the rendered prompt).
- `tool_choice` "required" / a named function: the grammar makes even random weights produce a call that
  parses and fits the schema, streamed or not; streamed, its arguments come in several deltas.
- What the server makes of given model text (calls split over deltas, reasoning, malformed blocks): the
  engine's `generate` is replaced by a script of text deltas, so the output is exactly the one under test.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from qwick.outputs import CompletionOutput, RequestOutput
from qwick.server.chat_parsing import ChatParsers
from tests.server.harness import ServerThread
from tests.utils import make_tiny_model

MODEL = "tiny"
pytest.importorskip("xgrammar")

# Qwen3's chat template, shortened: tools in the system turn, calls as <tool_call> blocks (arguments as
# objects), tool results as <tool_response>, and the think switch at the generation prompt. `open_think`
# stands in for the Qwen3 thinking models' template, which opens the think block in the prompt.
QWEN3_LIKE_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a function as <tool_call>
{"name": <name>, "arguments": <args>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{% if m.content %}{{ m.content }}{% endif %}
{%- for tc in m.tool_calls or [] %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% elif open_think is defined and open_think %}<think>
{% endif %}
{%- endif %}"""

SET_MODE = {
    "type": "function",
    "function": {
        "name": "set_mode",
        "description": "Set the device mode",
        "parameters": {
            "type": "object",
            "properties": {
                "mode": {"type": "string", "enum": ["eco", "fast"]},
                "level": {"type": "integer", "minimum": 1, "maximum": 3},
            },
            "required": ["mode", "level"],
        },
    },
}
GET_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
            "required": ["city"],
        },
    },
}
TOOLS = [SET_MODE, GET_WEATHER]
USER = [{"role": "user", "content": "hello"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("tiny-qwen3-tools"))
    make_tiny_model("qwen3", path, max_position_embeddings=2048)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = QWEN3_LIKE_TEMPLATE
    tokenizer.save_pretrained(path)
    argv = [path, "--dtype", "float32", "--max-model-len", "2048", "--block-size", "16",
            "--num-gpu-blocks-override", "256", "--served-model-name", MODEL]  # fmt: skip
    with ServerThread(argv) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def accumulate(stream, fragments: dict[int, list[str]] | None = None) -> dict:
    """A streamed chat completion put together the way OpenAI clients do (one choice). `fragments`, when
    given, gets each call's non-empty `function.arguments` deltas."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        (choice,) = chunk.choices
        delta = choice.delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for tc in delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.type == "function" and tc.function.name, tc
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None and tc.function.name is None, tc
            calls[tc.index]["arguments"] += tc.function.arguments or ""
            if fragments is not None and tc.function.arguments:
                fragments.setdefault(tc.index, []).append(tc.function.arguments)
        finish = choice.finish_reason or finish
    assert sorted(calls) == list(range(len(calls)))
    return {
        "content": content or None,
        "reasoning": reasoning or None,
        "calls": [calls[i] for i in sorted(calls)],
        "finish": finish,
    }


def summary(resp) -> dict:
    (choice,) = resp.choices
    msg = choice.message
    calls = [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in msg.tool_calls or []
    ]
    return {
        "content": msg.content,
        "reasoning": getattr(msg, "reasoning_content", None),
        "calls": calls,
        "finish": choice.finish_reason,
    }


def without_ids(result: dict) -> dict:
    return {**result, "calls": [{k: v for k, v in c.items() if k != "id"} for c in result["calls"]]}


def both(client, fragments: dict[int, list[str]] | None = None, **kw) -> dict:
    """Non-streamed and streamed answers to the same request; they must be the same (up to call ids), and
    every call's arguments parse."""
    full = summary(client.chat.completions.create(model=MODEL, **kw))
    streamed = accumulate(client.chat.completions.create(model=MODEL, stream=True, **kw), fragments)
    assert without_ids(streamed) == without_ids(full)
    for call in full["calls"]:
        assert isinstance(json.loads(call["arguments"]), dict)
    return full


# ---- the template -----------------------------------------------------------------------------------


def render(server, **body) -> str:
    with server.http() as h:
        r = h.post("/tokenize", json={"model": MODEL, "messages": USER, **body})
        assert r.status_code == 200, r.text
        d = h.post("/detokenize", json={"model": MODEL, "tokens": r.json()["tokens"]})
        return d.json()["prompt"]


def test_parsers_come_from_the_chat_template(server):
    assert server.serving.chat_parsers == ChatParsers("hermes", True, "qwen3")


def test_chat_template_kwargs_and_tools_reach_the_template(server):
    assert render(server).endswith("<|im_start|>assistant\n")
    assert render(server, **NO_THINKING).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render(server, chat_template_kwargs={"open_think": True}).endswith("assistant\n<think>\n")
    with_tools = render(server, tools=TOOLS)
    assert "# Tools" in with_tools and json.dumps(SET_MODE) in with_tools


def test_tool_messages_are_rendered_with_arguments_as_objects(server):
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    text = render(server, messages=messages, tools=TOOLS)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text


# ---- grammar-constrained calls ----------------------------------------------------------------------


def check_args(call: dict) -> dict:
    args = json.loads(call["arguments"])
    if call["name"] == "set_mode":
        assert (
            set(args) == {"mode", "level"} and args["mode"] in ("eco", "fast") and args["level"] in (1, 2, 3)
        )
    else:
        assert call["name"] == "get_weather" and args in ({"city": "Paris"}, {"city": "Tokyo"})
    return args


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_tool_choice_always_gives_a_call_that_parses(client, temperature):
    result = both(
        client,
        messages=USER,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=temperature,
        seed=7,
        max_tokens=300,
        extra_body=NO_THINKING,
    )
    assert result["finish"] == "tool_calls" and result["content"] is None, result
    (call,) = result["calls"]
    check_args(call)
    assert call["id"].startswith("call_")


def test_named_tool_choice_calls_that_function(client):
    result = both(
        client,
        messages=USER,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0.0,
        max_tokens=300,
        extra_body=NO_THINKING,
    )
    assert result["finish"] == "tool_calls"
    assert [c["name"] for c in result["calls"]] == ["get_weather"]
    check_args(result["calls"][0])


def test_constrained_call_arguments_stream_in_several_deltas(client):
    fragments: dict[int, list[str]] = {}
    result = both(
        client,
        fragments,
        messages=USER,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "set_mode"}},
        parallel_tool_calls=False,
        temperature=0.0,
        max_tokens=300,
        extra_body=NO_THINKING,
    )
    assert result["finish"] == "tool_calls"
    (call,) = result["calls"]
    assert call["name"] == "set_mode" and check_args(call)
    # {"mode": ...} once its value is complete, then ', "level": ...', then "}" (or with it)
    assert len(fragments[0]) >= 2, fragments
    assert "".join(fragments[0]) == call["arguments"]


def test_tool_choice_none_leaves_tools_out_and_parses_nothing(server, client):
    full = client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice="none", temperature=0.0, max_tokens=8
    )
    assert full.choices[0].message.tool_calls in (None, [])
    assert full.usage.prompt_tokens == len(render_ids(server))  # the same prompt as without tools


def render_ids(server, **body) -> list[int]:
    with server.http() as h:
        return h.post("/tokenize", json={"model": MODEL, "messages": USER, **body}).json()["tokens"]


# ---- given model output -----------------------------------------------------------------------------


@pytest.fixture
def script(server, monkeypatch):
    """`script(deltas, finish_reason="stop")`: the next requests get exactly these text deltas."""

    def use(deltas: list[str], finish_reason: str = "stop") -> None:
        async def generate(prompt, params, request_id, priority=0) -> AsyncIterator[RequestOutput]:
            for i, text in enumerate(deltas):
                last = i == len(deltas) - 1
                out = CompletionOutput(0, text, [5], finish_reason=finish_reason if last else None)
                yield RequestOutput(request_id, None, list(prompt), [out], finished=last)

        monkeypatch.setattr(server.engine, "generate", generate)

    return use


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_reasoning_then_a_call_split_over_deltas(client, script, size):
    script(pieces("<think>\nThe user wants Paris.\n</think>\n\n" + CALL, size))
    result = both(client, messages=USER, tools=TOOLS)
    assert result["reasoning"] == "The user wants Paris." and result["content"] is None
    assert [(c["name"], json.loads(c["arguments"])) for c in result["calls"]] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert result["finish"] == "tool_calls"


def test_two_calls_and_text(client, script):
    second = CALL.replace("Paris", "Tokyo")
    script(pieces("Checking both.\n" + CALL + "\n" + second, 4))
    result = both(client, messages=USER, tools=TOOLS)
    assert result["content"] == "Checking both." and result["finish"] == "tool_calls"
    assert [json.loads(c["arguments"])["city"] for c in result["calls"]] == ["Paris", "Tokyo"]
    assert len({c["id"] for c in result["calls"]}) == 2


def test_thinking_opened_by_the_prompt(client, script):
    script(pieces("Easy one.\n</think>\n\nIt is sunny.", 2))
    result = both(client, messages=USER, extra_body={"chat_template_kwargs": {"open_think": True}})
    assert (result["reasoning"], result["content"], result["calls"]) == ("Easy one.", "It is sunny.", [])
    assert result["finish"] == "stop"


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}}\n</tool_call>',  # bad JSON
        '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',  # no name
        'Sure: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # never closed
    ],
)
def test_malformed_tool_call_text_stays_content(client, script, text):
    script(pieces(text, 5))
    result = both(client, messages=USER, tools=TOOLS)
    assert result == {"content": text, "reasoning": None, "calls": [], "finish": "stop"}


LONG_CALL = (
    '<tool_call>\n{"name": "set_mode", "arguments": {"mode": "eco", "level": 2, "note": "quiet at night", '
    '"tags": ["a", "b"]}}\n</tool_call>'
)


def test_auto_call_arguments_stream_argument_by_argument(client, script):
    script(pieces(LONG_CALL, 3))
    fragments: dict[int, list[str]] = {}
    result = both(client, fragments, messages=USER, tools=TOOLS)
    assert result["finish"] == "tool_calls" and result["content"] is None
    args = '{"mode": "eco", "level": 2, "note": "quiet at night", "tags": ["a", "b"]}'
    assert [(c["name"], c["arguments"]) for c in result["calls"]] == [("set_mode", args)]
    # one argument at a time (the last one may come with the closing brace, as the text arrived)
    assert fragments[0][:3] == ['{"mode": "eco"', ', "level": 2', ', "note": "quiet at night"']
    assert "".join(fragments[0][3:]) == ', "tags": ["a", "b"]}'


def test_call_broken_off_by_max_tokens_keeps_its_complete_arguments(client, script):
    script(pieces(LONG_CALL[: LONG_CALL.index("quiet") + 5], 4), finish_reason="length")
    result = both(client, messages=USER, tools=TOOLS)
    (call,) = result["calls"]
    assert (call["name"], call["arguments"]) == ("set_mode", '{"mode": "eco", "level": 2}')
    assert result["content"] == ', "note": "quiet' and result["finish"] == "length"


def test_truncated_call_keeps_finish_reason_length(client, script):
    script(pieces(CALL[:30], 7), finish_reason="length")
    result = both(client, messages=USER, tools=TOOLS)
    assert result == {"content": CALL[:30], "reasoning": None, "calls": [], "finish": "length"}


def test_untagged_call_of_a_known_tool_under_auto(client, script):
    script(pieces('```json\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n```', 6))
    result = both(client, messages=USER, tools=TOOLS)
    assert [c["name"] for c in result["calls"]] == ["get_weather"] and result["content"] is None


def test_without_tools_text_is_not_parsed(client, script):
    script(pieces(CALL, 9))
    assert both(client, messages=USER)["content"] == CALL
