"""The server on the built-in demo model (Qwen2.5-Coder-0.5B-Instruct): a Chinese answer streamed and not,
greedy, must be the same text, with no broken characters."""

from __future__ import annotations

import re

import pytest

from tests.server.harness import ServerThread

pytestmark = [pytest.mark.demo, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(demo_model_dir):
    # No arguments: `qwick serve` on the demo model with its default settings, as `LLM()` runs it.
    with ServerThread([], startup_timeout=600) as s:
        yield s


def test_chinese_chat_streamed_equals_non_streamed(server):
    client = server.client()
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "用一句话解释什么是快速排序。"}]
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
    text = full.choices[0].message.content
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=24, temperature=0, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == text
    assert "\ufffd" not in text and all("\ufffd" not in p for p in pieces)
    assert re.search(r"[\u4e00-\u9fff]", text), text
