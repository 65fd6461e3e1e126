"""A tool-calling conversation with the built-in demo model (Qwen2.5-Coder-0.5B-Instruct) through the `openai`
SDK, streamed and not: the model calls get_weather for Paris, the test answers with the tool's result, and
the model's final answer uses it.

What the 0.5B model does at temperature 0 (so what the test relies on):
- tool_choice "auto": it does call, but without Qwen's <tool_call> tags: a ```json fenced
  {"name": "get_weather", "arguments": {"city": "Paris"}}, which the parser takes as a call because the whole
  answer is one call of a known tool. The conversation itself uses "required" (grammar-constrained), which
  cannot come out otherwise.
- right after the tool result it repeats the call as text instead of answering; with one more user turn
  ("So, what is the weather...") it answers from the result. The test sends that turn.
"""

from __future__ import annotations

import json

import pytest

from tests.server.harness import ServerThread
from tests.server.test_tool_calling import accumulate, summary, without_ids

pytestmark = [pytest.mark.demo, pytest.mark.slow]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name"}},
            "required": ["city"],
        },
    },
}
QUESTION = {"role": "user", "content": "What's the weather in Paris?"}
RESULT = {"city": "Paris", "temperature_c": 18, "condition": "sunny"}
FOLLOW_UP = {"role": "user", "content": "So, what is the weather in Paris? Answer in plain English."}


@pytest.fixture(scope="module")
def server(demo_model_dir):
    with ServerThread([], startup_timeout=600) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def ask(client, stream: bool, **kw) -> dict:
    model = client.models.list().data[0].id
    resp = client.chat.completions.create(model=model, temperature=0, max_tokens=60, stream=stream, **kw)
    return accumulate(resp) if stream else summary(resp)


@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
def test_tool_conversation(client, stream):
    first = ask(client, stream, messages=[QUESTION], tools=[WEATHER], tool_choice="required")
    assert first["finish"] == "tool_calls" and first["content"] is None, first
    (call,) = first["calls"]
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    args = json.loads(call["arguments"])
    assert set(args) == {"city"} and "Paris" in args["city"]

    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": call["id"], "type": "function", "function": {"name": call["name"],
                        "arguments": call["arguments"]}}],
    }  # fmt: skip
    tool = {"role": "tool", "tool_call_id": call["id"], "content": json.dumps(RESULT)}
    final = ask(client, stream, messages=[QUESTION, assistant, tool, FOLLOW_UP], tools=[WEATHER])
    assert final["finish"] == "stop" and final["calls"] == [], final
    answer = final["content"].lower()
    assert "18" in answer and "sunny" in answer, answer  # only the tool's result says so


def test_auto_tool_choice_at_temperature_0(client):
    full = ask(client, False, messages=[QUESTION], tools=[WEATHER])
    streamed = ask(client, True, messages=[QUESTION], tools=[WEATHER])
    assert without_ids(streamed) == without_ids(full)
    assert full["finish"] == "tool_calls" and full["content"] is None, full
    assert [(c["name"], json.loads(c["arguments"])) for c in full["calls"]] == [
        ("get_weather", {"city": "Paris"})
    ]
