"""`qwick serve` as a user runs it (a subprocess: start-up log, SIGTERM drains in-flight requests, exit 0),
its flags, and `qwick chat` with the engine in-process."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from qwick.entrypoints.cli import build_parser, main
from tests.server.harness import TINY_ENGINE_ARGS, ServerThread, tiny_model_dir

ENGINE = [*TINY_ENGINE_ARGS, "--num-gpu-blocks-override", "64"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory)


def test_serve_flags(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for flag in ("--host", "--port", "--api-key", "--served-model-name", "--max-waiting-requests",
                 "--max-request-body-bytes", "--shutdown-timeout", "--max-num-seqs", "--max-model-len",
                 "--enable-prefix-caching", "--num-gpu-blocks-override", "--dtype"):  # fmt: skip
        assert flag in text, flag
    args = build_parser().parse_args(["serve", "m", "--served-model-name", "a", "b", "--port", "9"])
    assert args.model == "m" and args.served_model_name == ["a", "b"] and args.host == "127.0.0.1"


def test_serve_subprocess_logs_start_and_drains_on_sigterm(model_dir):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "qwick.entrypoints.cli", "serve", model_dir, *ENGINE, "--port", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    log: list[str] = []
    started = threading.Event()

    def read_log() -> None:
        for line in proc.stderr:
            log.append(line)
            if "OpenAI API at" in line:
                started.set()

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    try:
        assert started.wait(120), "".join(log)
        line = next(line for line in log if "OpenAI API at" in line)
        assert model_dir in line and "float32" in line and "KV cache 1008 tokens" in line
        url = re.search(r"OpenAI API at (http://127\.0\.0\.1:\d+)/v1", line).group(1)

        body = {"model": model_dir, "prompt": "hello", "max_tokens": 40, "temperature": 0, "stream": True}
        with httpx.Client(base_url=url, timeout=60) as h, h.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)  # mid-stream: the stream must still finish
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        finish = [json.loads(x[6:])["choices"] for x in rest[:-1]]
        assert [c[0]["finish_reason"] for c in finish if c][-1] == "length"
        assert proc.wait(60) == 0
        reader.join(10)
        text = "".join(log)
        assert "finished (length)" in text and "shut down" in text
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_chat_in_process(model_dir, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nsecond turn\n/reset\nthird\n/exit\n"))
    start = time.monotonic()
    rc = main(
        ["chat", model_dir, *ENGINE, "--max-tokens", "3", "--temperature", "0", "--system", "Be brief."]
    )
    captured = capsys.readouterr()
    assert rc == 0 and len(captured.out.strip("\n").split("\n")) == 3
    assert "conversation cleared" in captured.err
    assert time.monotonic() - start < 120


def test_import_qwick_stays_free_of_server_dependencies():
    code = (
        "import sys, qwick, qwick.server, qwick.entrypoints.cli\n"
        "qwick.entrypoints.cli.build_parser()\n"
        "heavy = [m for m in ('fastapi', 'uvicorn', 'starlette', 'prometheus_client') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_serve_freezes_its_startup_objects(model_dir, monkeypatch):
    """Once started, the API process keeps its startup objects out of the garbage collector
    (`qwick.engine.startup_gc`), then serves. The freeze is recorded here instead of done, so that this
    test process's objects stay collectable."""
    import qwick.engine.startup_gc as startup_gc

    calls = []
    monkeypatch.setattr(startup_gc, "freeze_startup_objects", calls.append)
    with ServerThread([model_dir, *ENGINE], freeze_gc=True) as s:
        assert calls == ["API server"]
        assert httpx.get(f"{s.url}/health", timeout=30).status_code == 200
