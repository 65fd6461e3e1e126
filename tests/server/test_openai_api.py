"""A real `qwick serve` on loopback (tiny random Qwen2, fp32, max_model_len 256), driven with the official
`openai` SDK: chat and completions, streamed and not, and the server's extras."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import socket
import threading

import httpx
import openai
import pytest

from tests.server.harness import (
    TINY_ENGINE_ARGS,
    ServerThread,
    engine_idle,
    engine_paused,
    tiny_model_dir,
    wait_until,
)

MODEL = "tiny"
GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tiny_model_dir(tmp_path_factory)
    argv = [
        path,
        *TINY_ENGINE_ARGS,
        "--num-gpu-blocks-override",
        "160",
        "--served-model-name",
        MODEL,
        "alias",
    ]
    with ServerThread(argv) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def sse_events(text: str) -> list[str]:
    """The data payloads of an SSE body, in order (checking the framing on the way)."""
    assert text.endswith("\n\n")
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        events.append(block[len("data: ") :])
    return events


def chat(client, content: str, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def stream_text(stream) -> tuple[str, list]:
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


# ---- models, health, tokenize ----------------------------------------------------------------------------


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL, "alias"]
    card = client.models.retrieve("alias")
    assert card.id == "alias" and card.model_extra["max_model_len"] == 256
    with server.http() as h:
        assert h.get("/health").status_code == 200
        assert h.get("/version").json()["version"]
        missing = h.get("/v1/models/nope")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_tokenize_detokenize_round_trip(server):
    text = "hello world, 你好，世界！ def fib(n):"
    with server.http() as h:
        tok = h.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
        assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) and tok["max_model_len"] == 256
        assert h.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": text}
        conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
        by_messages = h.post("/tokenize", json={"messages": conv}).json()
        as_developer = [{"role": "developer", "content": "Be brief."}, conv[1]]
        assert h.post("/tokenize", json={"messages": as_developer}).json() == by_messages
        rendered = h.post("/detokenize", json={"tokens": by_messages["tokens"]}).json()["prompt"]
        assert rendered.endswith("<|im_start|>assistant\n") and "Be brief." in rendered


# ---- chat completions ------------------------------------------------------------------------------------


def test_chat_non_streamed_shape_usage_and_timing(client):
    resp = chat(client, "hello", max_tokens=6, **GREEDY)
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion" and resp.model == MODEL
    assert isinstance(resp.created, int)
    (choice,) = resp.choices
    assert choice.index == 0 and choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.message.content and choice.logprobs is None
    usage = resp.usage
    assert usage.completion_tokens == 6 and usage.total_tokens == usage.prompt_tokens + 6
    timing = resp.model_extra["qwick"]
    assert timing["prompt_tokens"] == usage.prompt_tokens and timing["completion_tokens"] == 6
    for key in ("queue_ms", "prefill_ms", "decode_ms", "e2e_ms", "ttft_ms", "tpot_ms"):
        assert timing[key] >= 0.0, key
    assert timing["e2e_ms"] >= timing["ttft_ms"] >= timing["prefill_ms"]
    assert abs(timing["queue_ms"] + timing["prefill_ms"] + timing["decode_ms"] - timing["e2e_ms"]) < 1.0


def test_chat_streamed_equals_non_streamed_and_sse_framing(server, client):
    full = chat(client, "The quick brown fox", max_tokens=10, **GREEDY)
    text, chunks = stream_text(
        chat(
            client,
            "The quick brown fox",
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].model_extra["qwick"]["completion_tokens"] == 10

    # The raw stream, exactly: role chunk, content deltas, finish chunk (empty delta), [DONE].
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    with server.http() as h:
        r = h.post("/v1/chat/completions", json={**body, **GREEDY})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    assert parsed[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert parsed[-1]["choices"][0]["delta"] == {} and parsed[-1]["choices"][0]["finish_reason"] == "length"
    assert "qwick" in parsed[-1] and all("qwick" not in p for p in parsed[:-1])
    assert all("usage" not in p for p in parsed)
    assert len({p["id"] for p in parsed}) == 1 and all(p["object"] == "chat.completion.chunk" for p in parsed)


def test_multi_turn_chat_with_system_prompt(server, client):
    messages = [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi there"},
        {"role": "user", "content": "def fib(n):"},
    ]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, **GREEDY)
    with server.http() as h:
        count = h.post("/tokenize", json={"messages": messages}).json()["count"]
    assert resp.usage.prompt_tokens == count
    # The conversation matters: without the earlier turns the prompt is shorter.
    short = client.chat.completions.create(model=MODEL, messages=messages[-1:], max_tokens=5, **GREEDY)
    assert short.usage.prompt_tokens < count
    # An SDK response message goes back in as the assistant turn.
    again = client.chat.completions.create(
        model=MODEL,
        messages=[*messages, resp.choices[0].message.model_dump(), {"role": "user", "content": "more"}],
        max_tokens=3,
        **GREEDY,
    )
    assert again.usage.prompt_tokens > count


def test_n2_seed_reproducibility(client):
    kw = dict(max_tokens=8, temperature=1.0, seed=1234)
    a = chat(client, "tiny test corpus", n=2, **kw)
    b = chat(client, "tiny test corpus", n=2, **kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.usage.completion_tokens == 16
    other = chat(client, "tiny test corpus", n=2, max_tokens=8, temperature=1.0, seed=99)
    assert [c.message.content for c in other.choices] != [c.message.content for c in a.choices]
    # Streamed with the same seed: the same samples.
    chunks = list(chat(client, "tiny test corpus", n=2, stream=True, **kw))
    streamed = ["", ""]
    for c in chunks:
        for choice in c.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == [c.message.content for c in a.choices]
    assert sum(1 for c in chunks for ch in c.choices if ch.delta.role == "assistant") == 2


def test_chat_logprobs(client):
    resp = chat(client, "hello", max_tokens=5, logprobs=True, top_logprobs=3, **GREEDY)
    content = resp.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.token == entry.top_logprobs[0].token and entry.logprob == pytest.approx(values[0])
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    assert "".join(e.token for e in content) == resp.choices[0].message.content
    plain = chat(client, "hello", max_tokens=2, logprobs=True, **GREEDY)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    streamed = list(chat(client, "hello", max_tokens=5, logprobs=True, top_logprobs=3, stream=True, **GREEDY))
    tokens = [
        e.token
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert tokens == [e.token for e in content]


# ---- completions -----------------------------------------------------------------------------------------


def test_completions_prompt_forms_and_usage(server, client):
    one = client.completions.create(model=MODEL, prompt="hello world", max_tokens=4, **GREEDY)
    assert one.id.startswith("cmpl-") and one.object == "text_completion"
    assert one.choices[0].finish_reason == "length" and one.usage.completion_tokens == 4
    with server.http() as h:
        ids = h.post("/tokenize", json={"prompt": "hello world"}).json()["tokens"]
        fib_count = h.post("/tokenize", json={"prompt": "def fib(n):"}).json()["count"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, **GREEDY)
    assert by_ids.choices[0].text == one.choices[0].text
    many = client.completions.create(
        model=MODEL, prompt=["hello world", "def fib(n):"], max_tokens=4, n=2, **GREEDY
    )
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == one.choices[0].text
    assert many.usage.completion_tokens == 16
    assert many.usage.prompt_tokens == len(ids) + fib_count
    lists = client.completions.create(model=MODEL, prompt=[ids, ids[:2]], max_tokens=3, **GREEDY)
    assert lists.usage.prompt_tokens == len(ids) + 2 and len(lists.choices) == 2
    echo = client.completions.create(model=MODEL, prompt="hello world", max_tokens=4, echo=True, **GREEDY)
    assert echo.choices[0].text == "hello world" + one.choices[0].text


def test_completions_streamed_equals_non_streamed(client):
    prompts = ["The quick brown fox", "你好，世界！这是一个测试。"]  # the second: multi-byte text
    full = client.completions.create(model=MODEL, prompt=prompts, max_tokens=12, **GREEDY)
    stream = client.completions.create(
        model=MODEL,
        prompt=prompts,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    texts = ["", ""]
    finish = [None, None]
    chunks = list(stream)
    for c in chunks:
        for choice in c.choices:
            assert "\ufffd" not in choice.text
            texts[choice.index] += choice.text
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert texts == [c.text for c in full.choices]
    assert finish == ["length", "length"]
    assert chunks[-1].usage.completion_tokens == 24 and chunks[-1].choices == []
    assert chunks[-1].model_extra["qwick"]["completion_tokens"] == 24


def test_stop_strings(client):
    prompt = "return n if n < 2"
    base = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, **GREEDY).choices[0].text
    stop = base[len(base) // 2 : len(base) // 2 + 2]
    expected = base[: base.find(stop)]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, stop=[stop, "never"], **GREEDY)
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop
    kept = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=16,
        stop=stop,
        extra_body={"include_stop_str_in_output": True},
        **GREEDY,
    )
    assert kept.choices[0].text == expected + stop
    chunks = list(
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, stop=stop, stream=True, **GREEDY)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="hello world", max_tokens=5, logprobs=2, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert (
            len(top) == 2 and top[token] == pytest.approx(value) and value == pytest.approx(max(top.values()))
        )


def test_vllm_extra_sampling_fields(client):
    out = client.completions.create(
        model=MODEL,
        prompt="hello world",
        max_tokens=6,
        temperature=0.8,
        seed=5,
        extra_body={
            "top_k": 5,
            "min_p": 0.01,
            "repetition_penalty": 1.2,
            "min_tokens": 6,
            "ignore_eos": True,
        },
    )
    assert out.usage.completion_tokens == 6


# ---- /generate -------------------------------------------------------------------------------------------


def test_generate_endpoint(server):
    body = {"prompt": "hello world", "sampling_params": {"max_tokens": 6, "temperature": 0}}
    with server.http() as h:
        full = h.post("/generate", json=body).json()
        lines = h.post("/generate", json={**body, "stream": True}).text.strip().split("\n")
        by_ids = h.post("/generate", json={**body, "prompt": [5, 6, 7]}).json()
    assert full["text"][0].startswith("hello world") and full["finish_reason"] == ["length"]
    assert full["qwick"]["completion_tokens"] == 6
    parsed = [json.loads(line) for line in lines]
    assert parsed[-1]["text"] == full["text"] and parsed[-1]["finish_reason"] == ["length"]
    assert len(parsed) >= 2 and all(len(p["text"][0]) <= len(full["text"][0]) for p in parsed)
    assert by_ids["finish_reason"] == ["length"]


# ---- concurrency, disconnects, metrics -------------------------------------------------------------------


def test_32_concurrent_streaming_clients(server, client):
    prompts = [f"{' '.join(['hello'] * (1 + i % 7))} world {i}" for i in range(32)]
    expected = [chat(client, prompt, max_tokens=8, **GREEDY).choices[0].message.content for prompt in prompts]

    async def one(aclient, prompt: str) -> tuple[str, str | None]:
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=8, stream=True, **GREEDY
        )
        text, finish = "", None
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        return text, finish

    async def all_clients() -> list[tuple[str, str | None]]:
        async with server.async_client() as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    results = asyncio.run(all_clients())
    assert [text for text, _ in results] == expected
    assert all(finish == "length" for _, finish in results)
    assert wait_until(lambda: engine_idle(server.engine), timeout=10), server.engine.get_stats()
    assert server.engine.num_unfinished == 0


def test_client_disconnect_aborts_and_frees_blocks(server):
    assert wait_until(lambda: engine_idle(server.engine), timeout=10)
    engine, serving = server.engine, server.serving
    before = engine.get_stats().generation_tokens_total
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 240, "ignore_eos": True, "temperature": 0}

    # Streamed: the client hangs up after the first chunk, while the request holds KV blocks.
    with contextlib.ExitStack() as paused:
        with (
            httpx.Client(base_url=server.url, timeout=60) as h,
            h.stream("POST", "/v1/completions", json={**body, "stream": True}) as r,
        ):
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            paused.enter_context(engine_paused(engine))
            stats = engine.get_stats()
            assert stats.num_running == 1 and stats.kv_cache_usage > 0
        assert wait_until(lambda: serving.inflight_seqs == 0, timeout=5)  # the server saw the disconnect
    assert wait_until(lambda: engine_idle(engine), timeout=5), engine.get_stats()

    # Not streamed: the client leaves while its request waits for the engine.
    with engine_paused(engine):
        sock = socket.create_connection((server.host, server.port))
        payload = json.dumps(body).encode()
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        assert wait_until(lambda: serving.inflight_seqs == 1, timeout=5)
        sock.close()
        assert wait_until(lambda: serving.inflight_seqs == 0, timeout=5)
    assert wait_until(lambda: engine_idle(engine) and engine.num_unfinished == 0, timeout=5), (
        engine.get_stats()
    )
    # Neither ran to its 240 tokens.
    assert engine.get_stats().generation_tokens_total - before < 240


def test_metrics_exposed_and_moving(server, client):
    names = [
        "qwick:time_to_first_token_seconds_count",
        "qwick:time_per_output_token_seconds_count",
        "qwick:e2e_request_latency_seconds_count",
        "qwick:request_queue_time_seconds_count",
        "qwick:inter_token_latency_seconds_count",
        "qwick:num_requests_running",
        "qwick:num_requests_waiting",
        "qwick:kv_cache_usage_perc",
        "qwick:prefix_cache_queries_total",
        "qwick:prefix_cache_hits_total",
        "qwick:prompt_tokens_total",
        "qwick:generation_tokens_total",
        "qwick:num_preemptions_total",
    ]
    before = {n: server.metric(n) for n in names}
    chat(client, "metrics please", max_tokens=4, **GREEDY)
    chat(client, "metrics please", max_tokens=4, **GREEDY)  # the same prompt again: a prefix-cache hit
    after = {n: server.metric(n) for n in names}
    for name in names[:4]:  # one observation per request
        assert after[name] == before[name] + 2, name
    # One per engine step that gave a request tokens, after its first: 3 per request here (fewer if a
    # lagging reader got two steps at once).
    itl = "qwick:inter_token_latency_seconds_count"
    assert before[itl] + 2 <= after[itl] <= before[itl] + 6
    assert after["qwick:generation_tokens_total"] == before["qwick:generation_tokens_total"] + 8
    assert after["qwick:prompt_tokens_total"] > before["qwick:prompt_tokens_total"]
    assert after["qwick:prefix_cache_hits_total"] > before["qwick:prefix_cache_hits_total"]
    assert after["qwick:prefix_cache_queries_total"] > before["qwick:prefix_cache_queries_total"]
    assert after["qwick:kv_cache_usage_perc"] == 0.0 and after["qwick:num_requests_running"] == 0.0
    text = httpx.get(server.url + "/metrics").text
    assert 'qwick:request_success_total{finished_reason="length",model_name="tiny"}' in text


def test_terminal_chat_against_the_server(server, monkeypatch, capsys):
    from qwick.entrypoints.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n\nsecond turn\n/exit\nnever sent\n"))
    rc = main(["chat", MODEL, "--url", server.url, "--max-tokens", "3", "--temperature", "0"])
    out = capsys.readouterr().out
    assert rc == 0 and len(out.strip("\n").split("\n")) == 2


def test_bad_request_mid_stream_does_not_disturb_others(server, client):
    """A stream runs while bad requests come and go; it ends exactly as it does alone."""
    alone = (
        client.completions.create(model=MODEL, prompt="0123456789", max_tokens=20, **GREEDY).choices[0].text
    )
    result: dict[str, str] = {}

    def run() -> None:
        chunks = client.completions.create(
            model=MODEL, prompt="0123456789", max_tokens=20, stream=True, **GREEDY
        )
        result["text"] = "".join(c.choices[0].text for c in chunks if c.choices)

    t = threading.Thread(target=run)
    t.start()
    with server.http() as h:
        for _ in range(10):
            assert h.post("/v1/completions", content=b"{nope").status_code == 400
            assert h.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 0}).status_code == 400
    t.join(60)
    assert result["text"] == alone


def test_sdk_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, "x", temperature=-1)
    assert info.value.body["param"] == "temperature"
