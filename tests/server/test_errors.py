"""Bad requests: each answers OpenAI's error envelope with the right status and parameter, and the server
keeps answering good requests after every one of them.

Policy on unknown fields: 400 "Unrecognized request argument supplied: <name>" (what OpenAI itself does),
so a typo such as `max_token` is never silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
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
BODY_LIMIT = 64 * 1024
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hello"}]


def chat(**fields):
    return {"model": MODEL, "messages": USER, **fields}


def completion(**fields):
    return {"model": MODEL, "prompt": "hello", **fields}


JSON = {"content-type": "application/json"}
ANY = object()  # any param, including None
GEN = "/generate"


@dataclass
class Case:
    name: str
    path: str
    body: dict | bytes | None  # bytes: sent as they are
    status: int
    param: str | None | object  # the error's "param" (ANY: not checked)
    text: str = ""  # the error message must contain it
    headers: dict | None = None
    method: str = "POST"


TOOL_F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def image_part() -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]


CASES = [
    # the body itself
    Case("malformed json", CHAT, b'{"model": "tiny", "messages": [', 400, None, "parse the JSON", JSON),
    Case("garbage bytes", CHAT, b"\x00\xff\xfe\x01garbage", 400, None, "JSON", JSON),
    Case("json array body", CHAT, b"[1, 2, 3]", 400, None, "JSON object", JSON),
    Case("empty body", CHAT, b"", 400, None, "JSON", JSON),
    Case("NaN", CHAT, b'{"model": "tiny", "messages": [], "temperature": NaN}', 400, ANY, "", JSON),
    Case("text/plain", CHAT, b'{"model": "tiny"}', 415, None, "JSON", {"content-type": "text/plain"}),
    Case("form body", COMPLETIONS, b"prompt=hi", 415, None, "Content-Type",
         {"content-type": "application/x-www-form-urlencoded"}),
    Case("body too large", COMPLETIONS, completion(prompt="x" * 2 * BODY_LIMIT), 413, None, str(BODY_LIMIT)),
    Case("GET on a POST route", CHAT, None, 405, None, "not allowed", method="GET"),
    Case("unknown path", "/v1/nothing", {}, 404, None, "/v1/nothing"),
    # messages
    Case("missing messages", CHAT, {"model": MODEL}, 400, "messages", "Missing"),
    Case("messages not a list", CHAT, chat(messages="hello"), 400, "messages"),
    Case("empty messages", CHAT, chat(messages=[]), 400, "messages"),
    Case("unknown role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role",
         "wizard"),
    Case("tool message without tool_call_id", CHAT, chat(messages=[{"role": "tool", "content": "x"}]), 400,
         "messages[0].tool_call_id", "tool_call_id"),
    Case("function role", CHAT, chat(messages=[{"role": "function", "content": "x", "name": "f"}]), 400,
         "messages[0].role", "use 'tool'"),
    Case("tool call arguments not JSON", CHAT, chat(messages=[*USER, {"role": "assistant", "tool_calls": [
         {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]), 400,
         "messages[1].tool_calls[0].function.arguments", "JSON"),
    Case("missing role", CHAT, chat(messages=[{"content": "x"}]), 400, "messages[0].role"),
    Case("content wrong type", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, ANY),
    Case("user without content", CHAT, chat(messages=[{"role": "user"}]), 400, "messages[0].content"),
    Case("image part", CHAT, chat(messages=image_part()), 400, "messages[0].content[0].type", "image_url"),
    Case("reserved template kwarg", CHAT, chat(chat_template_kwargs={"tokenize": False}), 400,
         "chat_template_kwargs"),
    # sampling fields
    Case("temperature -1", CHAT, chat(temperature=-1), 400, "temperature", "greater than"),
    Case("temperature 2.5", CHAT, chat(temperature=2.5), 400, "temperature"),
    Case("temperature string", CHAT, chat(temperature="hot"), 400, "temperature"),
    Case("top_p 2", CHAT, chat(top_p=2), 400, "top_p"),
    Case("top_p 0", CHAT, chat(top_p=0), 400, "top_p"),
    Case("n 0", CHAT, chat(n=0), 400, "n"),
    Case("huge n", CHAT, chat(n=100000), 400, "n"),
    Case("n not an integer", CHAT, chat(n=1.5), 400, "n"),
    Case("negative max_tokens", CHAT, chat(max_tokens=-5), 400, "max_tokens"),
    Case("zero max_tokens", COMPLETIONS, completion(max_tokens=0), 400, "max_tokens"),
    Case("max_tokens over context", CHAT, chat(max_tokens=1000), 400, "messages",
         "maximum context length is 256 tokens. However, you requested 10"),
    Case("max_completion_tokens over context", CHAT, chat(max_completion_tokens=300), 400, "messages",
         "300 in the completion"),
    Case("prompt over context", COMPLETIONS, completion(prompt=[5] * 300, max_tokens=1), 400, "prompt",
         "resulted in 300 tokens"),
    Case("presence_penalty 3", CHAT, chat(presence_penalty=3), 400, "presence_penalty"),
    Case("seed string", CHAT, chat(seed="abc"), 400, "seed"),
    Case("stream not a bool", CHAT, chat(stream="yes"), 400, "stream"),
    Case("stop wrong type", CHAT, chat(stop=123), 400, "stop", "string"),
    Case("too many stops", CHAT, chat(stop=[str(i) for i in range(40)]), 400, "stop"),
    Case("empty stop", CHAT, chat(stop=[""]), 400, "stop", "empty"),
    Case("stop_token_ids out of vocab", CHAT, chat(stop_token_ids=[99999]), 400, "stop_token_ids"),
    Case("min_tokens > max_tokens", CHAT, chat(min_tokens=10, max_tokens=5), 400, "min_tokens"),
    Case("repetition_penalty 0", CHAT, chat(repetition_penalty=0), 400, "repetition_penalty"),
    Case("top_k -2", CHAT, chat(top_k=-2), 400, "top_k"),
    Case("logit_bias out of vocab", CHAT, chat(logit_bias={"100000": 5}), 400, "logit_bias", "vocabulary"),
    Case("logit_bias value", CHAT, chat(logit_bias={"5": 500}), 400, "logit_bias", "[-100, 100]"),
    Case("logit_bias key", CHAT, chat(logit_bias={"abc": 1}), 400, "logit_bias", "token ids"),
    Case("top_logprobs 25", CHAT, chat(logprobs=True, top_logprobs=25), 400, "top_logprobs"),
    Case("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs", "logprobs"),
    # fields nobody knows, and fields qwick does not implement
    Case("unknown field", CHAT, chat(max_token=5), 400, "max_token",
         "Unrecognized request argument supplied: max_token"),
    Case("unknown nested field", CHAT, chat(stream_options={"include_usage": True, "x": 1}), 400,
         "stream_options.x", "Unrecognized"),
    # tools (this model's template has no <tool_call> format, so no parser: "auto" is refused)
    Case("tools with auto choice, no parser", CHAT, chat(tools=[TOOL_F]), 400, "tool_choice",
         "--tool-call-parser"),
    Case("tool_choice required without tools", CHAT, chat(tool_choice="required"), 400, "tool_choice",
         "tools"),
    Case("tool_choice names a missing function", CHAT, chat(tools=[TOOL_F], tool_choice=named("g")), 400,
         "tool_choice", "'g'"),
    Case("tool_choice bad value", CHAT, chat(tools=[TOOL_F], tool_choice="sometimes"), 400, "tool_choice"),
    Case("tool without function", CHAT, chat(tools=[{"type": "function"}]), 400, "tools[0].function",
         "Missing"),
    Case("tool of another type", CHAT, chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]), 400,
         "tools[0].type"),
    Case("tool unknown key", CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "x": 1}}]), 400,
         "tools[0].function.x", "Unrecognized"),
    Case("duplicate tool names", CHAT, chat(tools=[TOOL_F, TOOL_F], tool_choice="required"), 400, "tools",
         "unique"),
    Case("tool schema not a grammar", CHAT, chat(tools=[{"type": "function", "function": {
         "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}],
         tool_choice="required"), 400, "tools"),
    Case("required tool_choice with response_format", CHAT, chat(tools=[TOOL_F], tool_choice="required",
         response_format={"type": "json_object"}), 400, "tool_choice", "response_format"),
    Case("json_schema", CHAT, chat(response_format={"type": "json_schema"}), 400, "response_format"),
    Case("suffix", COMPLETIONS, completion(suffix="x"), 400, "suffix"),
    Case("best_of > n", COMPLETIONS, completion(best_of=3), 400, "best_of"),
    Case("echo with logprobs", COMPLETIONS, completion(echo=True, logprobs=1), 400, "echo"),
    # models
    Case("unknown model", CHAT, chat(model="gpt-4o"), 404, "model", "gpt-4o"),
    Case("unknown model (completions)", COMPLETIONS, completion(model="nope"), 404, "model"),
    # completion prompts
    Case("missing prompt", COMPLETIONS, {"model": MODEL}, 400, "prompt", "Missing"),
    Case("empty prompt list", COMPLETIONS, completion(prompt=[]), 400, "prompt"),
    Case("empty prompt", COMPLETIONS, completion(prompt=""), 400, "prompt", "empty"),
    Case("mixed prompt list", COMPLETIONS, completion(prompt=[1, "a"]), 400, "prompt"),
    Case("prompt ids out of vocab", COMPLETIONS, completion(prompt=[1, 999999]), 400, "prompt", "999999"),
    Case("completion logprobs 50", COMPLETIONS, completion(logprobs=50), 400, "logprobs"),
    # the other endpoints
    Case("generate: bad sampling param", GEN, {"prompt": "x", "sampling_params": {"temperature": -1}}, 400,
         "sampling_params.temperature", "non-negative"),
    Case("generate: unknown sampling param", GEN, {"prompt": "x", "sampling_params": {"temprature": 1}}, 400,
         "sampling_params.temprature", "Unrecognized"),
    Case("generate: prompt wrong type", GEN, {"prompt": {"a": 1}}, 400, "prompt"),
    Case("generate: logit_bias out of vocab", GEN,
         {"prompt": "x", "sampling_params": {"logit_bias": {"100000": 5}}}, 400, "sampling_params.logit_bias",
         "vocabulary"),
    Case("detokenize: out of vocab", "/detokenize", {"tokens": [1, -4]}, 400, "tokens"),
    Case("tokenize: nothing to tokenize", "/tokenize", {}, 400, "prompt", "exactly one"),
]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def server(model_dir):
    argv = [model_dir, *TINY_ENGINE_ARGS, "--num-gpu-blocks-override", "64", "--served-model-name", MODEL,
            "--max-request-body-bytes", str(BODY_LIMIT)]  # fmt: skip
    with ServerThread(argv) as s:
        yield s


def good_request(h: httpx.Client) -> None:
    r = h.post(COMPLETIONS, json=completion(max_tokens=1))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"


def check_envelope(r: httpx.Response, status: int, param, text: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not ANY:
        assert err["param"] == param, err
    assert text in err["message"], err
    return err


def test_at_least_30_cases():
    assert len(CASES) >= 30


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_request(server, case: Case):
    with server.http() as h:
        if isinstance(case.body, bytes):
            r = h.request(case.method, case.path, content=case.body, headers=case.headers)
        elif case.body is None:
            r = h.request(case.method, case.path, headers=case.headers)
        else:
            r = h.request(case.method, case.path, json=case.body, headers=case.headers)
        check_envelope(r, case.status, case.param, case.text)
        good_request(h)


def test_bad_requests_leave_nothing_behind(server):
    assert wait_until(lambda: engine_idle(server.engine), timeout=5)
    assert server.engine.num_unfinished == 0
    assert server.serving.inflight_seqs == 0


# ---- a second instance: API key, and a waiting queue bounded at zero ------------------------------------


@pytest.fixture(scope="module")
def guarded(model_dir):
    argv = [model_dir, *TINY_ENGINE_ARGS, "--num-gpu-blocks-override", "64", "--served-model-name", MODEL,
            "--api-key", "s3cret", "--max-num-seqs", "1", "--max-waiting-requests", "0"]  # fmt: skip
    with ServerThread(argv) as s:
        yield s


def test_api_key(guarded):
    with guarded.http() as h:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            err = check_envelope(
                h.post(COMPLETIONS, json=completion(), headers=headers), 401, None, "API key"
            )
            assert err["code"] == "invalid_api_key"
        check_envelope(h.get("/v1/models"), 401, None, "")
        assert h.get("/health").status_code == 200 and h.get("/metrics").status_code == 200
        ok = h.post(COMPLETIONS, json=completion(max_tokens=1), headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
    client = guarded.client(api_key="s3cret")
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=1).usage.completion_tokens == 1


def test_queue_bound_answers_503_with_retry_after(guarded):
    """max_num_seqs 1 and no waiting room: while one request runs, the next gets 503 + Retry-After."""
    auth = {"Authorization": "Bearer s3cret"}
    body = completion(max_tokens=200, ignore_eos=True, stream=True)
    with (
        httpx.Client(base_url=guarded.url, timeout=60, headers=auth) as h,
        h.stream("POST", COMPLETIONS, json=body) as r,
    ):
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        with engine_paused(guarded.engine):  # it stays running for as long as this takes
            refused = h.post(COMPLETIONS, json=completion(max_tokens=1, stream=False))
            err = check_envelope(refused, 503, None, "overloaded")
            assert err["code"] == "server_overloaded" and int(refused.headers["retry-after"]) >= 1
            assert check_envelope(h.post("/generate", json={"prompt": "x"}), 503, None, "overloaded")
    assert wait_until(lambda: engine_idle(guarded.engine), timeout=5)
    assert wait_until(lambda: guarded.serving.inflight_seqs == 0, timeout=5)
    with guarded.http(headers=auth) as h:
        good_request(h)
