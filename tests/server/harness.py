"""A real `qwick serve` (the CLI's own `serve()`) on loopback in a background thread, for the server tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from qwick.entrypoints.cli import build_parser
from qwick.server.cli import serve
from tests.utils import make_tiny_model

TINY_ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "256", "--block-size", "16"]


def tiny_model_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-qwen2"))
    make_tiny_model("qwen2", path)
    return path


class ServerThread:
    """`qwick serve ARGV...` on 127.0.0.1 and a free port, its event loop in a thread of this process, so
    that tests can reach the engine (stats, its process) directly."""

    def __init__(self, argv: list[str], startup_timeout: float = 120.0, freeze_gc: bool = False) -> None:
        self.args = build_parser().parse_args(["serve", *argv, "--host", "127.0.0.1", "--port", "0"])
        self.startup_timeout = startup_timeout
        # Off by default: the test process's objects stay collectable (no gc.freeze() in it; the engine
        # core's own process still freezes its startup objects).
        self.freeze_gc = freeze_gc
        self.engine: Any = None
        self.server: Any = None
        self.url = ""
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="qwick-test-server", daemon=True)

    def _on_ready(self, engine: Any, server: Any, url: str) -> None:
        self.engine, self.server, self.url = engine, server, url
        self.loop = asyncio.get_running_loop()
        self._ready.set()

    def _main(self) -> None:
        try:
            asyncio.run(serve(self.args, on_ready=self._on_ready, freeze_gc=self.freeze_gc))
        except BaseException as exc:  # surfaced by start()
            self._error = exc
        finally:
            self._ready.set()

    def start(self) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(self.startup_timeout) or self._error is not None or not self.url:
            raise RuntimeError(f"the test server did not start: {self._error!r}")
        return self

    def stop(self, timeout: float = 60.0) -> None:
        if self.server is not None:
            self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def serving(self) -> Any:
        """The app's `OpenAIServing` (admission counts and such)."""
        return self.server.config.app.state.serving

    def client(self, **kwargs: Any):
        import openai

        kwargs.setdefault("api_key", "unused")
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 120.0)
        return openai.OpenAI(base_url=self.url + "/v1", **kwargs)

    def async_client(self, **kwargs: Any):
        import openai

        kwargs.setdefault("api_key", "unused")
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 120.0)
        return openai.AsyncOpenAI(base_url=self.url + "/v1", **kwargs)

    def http(self, **kwargs: Any) -> httpx.Client:
        kwargs.setdefault("timeout", 120.0)
        return httpx.Client(base_url=self.url, **kwargs)

    def metric(self, name: str) -> float:
        """The value of one unlabelled-by-us sample of /metrics (`qwick:x` or `qwick:x_total`)."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        if match is None:
            raise KeyError(f"{name} not in /metrics")
        return float(match.group(1))


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def engine_idle(engine: Any) -> bool:
    stats = engine.get_stats()
    return stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0


@contextlib.contextmanager
def engine_paused(engine: Any) -> Iterator[None]:
    """Freeze the engine-core process (SIGSTOP) so that requests stay in flight for as long as a test
    needs, whatever the engine's speed; it resumes (SIGCONT) on exit."""
    pid = engine.engine_process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
