"""Killing the engine-core process: /health turns 503 and in-flight requests fail promptly, never hang."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.server.harness import TINY_ENGINE_ARGS, ServerThread, engine_paused, tiny_model_dir, wait_until

MODEL = "tiny"
LONG = dict(model=MODEL, prompt="hello world", max_tokens=200, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    argv = [tiny_model_dir(tmp_path_factory), *TINY_ENGINE_ARGS, "--num-gpu-blocks-override", "64",
            "--served-model-name", MODEL]  # fmt: skip
    with ServerThread(argv) as s:
        yield s


def test_killing_the_engine_fails_requests_promptly(server):
    client = server.client(timeout=60)
    results: dict[str, object] = {}
    streaming = threading.Event()

    def streamed() -> None:
        try:
            for _ in client.completions.create(stream=True, **LONG):
                streaming.set()
            results["stream"] = "finished"
        except openai.APIError as exc:
            results["stream"] = exc
        results["stream_at"] = time.monotonic()

    def plain() -> None:
        try:
            client.completions.create(**LONG)
            results["plain"] = "finished"
        except openai.APIError as exc:
            results["plain"] = exc
        results["plain_at"] = time.monotonic()

    threads = [threading.Thread(target=streamed), threading.Thread(target=plain)]
    threads[0].start()
    assert streaming.wait(60)
    with engine_paused(server.engine):  # both stay in flight until the kill, however fast the engine is
        threads[1].start()
        assert wait_until(lambda: server.serving.inflight_seqs == 2, timeout=10)
        killed_at = time.monotonic()
        server.engine.engine_process.kill()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a request hangs after the engine died"

    stream_error, plain_error = results["stream"], results["plain"]
    assert isinstance(stream_error, openai.APIError) and "engine" in stream_error.message
    assert isinstance(plain_error, openai.APIStatusError) and plain_error.status_code == 503
    assert plain_error.body["code"] == "engine_dead"
    assert results["stream_at"] - killed_at < 5.0 and results["plain_at"] - killed_at < 5.0

    with server.http() as h:
        health = h.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        fresh = h.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert fresh.status_code == 503 and "retry-after" in fresh.headers
        assert set(fresh.json()["error"]) == {"message", "type", "param", "code"}
        stream = h.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True
        })  # fmt: skip
        assert stream.status_code == 503
        # The API process itself still answers what needs no engine.
        assert h.post("/tokenize", json={"prompt": "hello"}).status_code == 200
        assert h.get("/v1/models").status_code == 200
    assert server.metric("qwick:engine_healthy") == 0.0
    assert "qwick:time_to_first_token_seconds" in httpx.get(server.url + "/metrics").text
