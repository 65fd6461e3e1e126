"""`qwick serve` (the OpenAI-compatible server) and `qwick chat` (a terminal chat).

Nothing here imports FastAPI or uvicorn until a command runs, so building the `qwick` parser stays cheap.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger("qwick.server")

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


# ---- qwick serve ----------------------------------------------------------------------------------------


def add_serve_parser(subparsers: Any, add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, "
        "/v1/completions, /v1/models, /tokenize, /detokenize, /generate, /health, /metrics).",
    )
    add_engine_args(serve)
    add_server_args(serve)
    serve.set_defaults(func=cmd_serve)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all interfaces)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    g.add_argument(
        "--api-key",
        default=os.environ.get("QWICK_API_KEY"),
        help="require 'Authorization: Bearer <key>' on /v1/*, /tokenize, /detokenize and /generate "
        "(default: $QWICK_API_KEY; unset: no key)",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model name(s) the API answers to; the first is reported in responses "
        "(default: the model's name)",
    )
    g.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="queue bound: past this many waiting sequences, new requests get 503 with Retry-After "
        "(default: 4 x --max-num-seqs)",
    )
    g.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies get 413",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGINT/SIGTERM, seconds to let in-flight requests finish before aborting them",
    )
    g.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn's access log)")
    g.add_argument(
        "--tool-call-parser",
        choices=("auto", "hermes", "none"),
        default="auto",
        help="how tool calls are read from the model's output: 'hermes' is the <tool_call>{...}</tool_call> "
        "format of Qwen2.5 and Qwen3; 'auto' (default) picks it when the chat template uses <tool_call>, so "
        "tools work on Qwen models without flags; 'none' turns tool_choice 'auto' off",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="allow tool_choice 'auto' (the model decides whether to call a tool); on by default whenever "
        "there is a tool call parser (vLLM needs this flag; qwick accepts it). tool_choice 'required' and "
        "named functions always work: a grammar makes the output a call",
    )
    g.add_argument(
        "--reasoning-parser",
        choices=("auto", "qwen3", "none"),
        default="auto",
        help="split <think>...</think> from answers into 'reasoning_content': 'qwen3' for Qwen3 (and "
        "other <think> models); 'auto' (default) picks it when the chat template mentions <think>. Pass "
        'chat_template_kwargs {"enable_thinking": false} in a request to turn Qwen3\'s thinking off',
    )
    g.add_argument(
        "--no-chat-ui",
        dest="chat_ui",
        action="store_false",
        help="do not serve the chat page at / (by default it is served there, and built with npm on the "
        "first start after a change to its sources)",
    )


def cmd_serve(args: argparse.Namespace) -> int:
    asyncio.run(serve(args))
    return 0


def _make_server(config: Any) -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, minus re-raising the signal after a graceful shutdown: `qwick serve` still has
        the engine to stop, and exits 0 when it is done."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server(config)


def bound_port(server: Any) -> int | None:
    for srv in getattr(server, "servers", []):
        for sock in srv.sockets:
            return sock.getsockname()[1]
    return None


async def serve(
    args: argparse.Namespace,
    on_ready: Callable[[Any, Any, str], None] | None = None,
    *,
    freeze_gc: bool = True,
) -> None:
    """Start the engine and the HTTP server; return after a graceful shutdown (SIGINT/SIGTERM, or
    `server.should_exit = True` from `on_ready(engine, server, url)`'s caller). `freeze_gc`: keep this
    process's startup objects out of the garbage collector (`qwick.engine.startup_gc`); off where the
    server shares a process whose objects should stay collectable (the tests' server thread)."""
    import uvicorn

    from qwick.engine.async_llm import AsyncLLM
    from qwick.engine.startup_gc import freeze_startup_objects
    from qwick.entrypoints.cli import engine_config_from_args
    from qwick.server.app import build_app

    config = engine_config_from_args(args)
    page_build = None
    if getattr(args, "chat_ui", True):
        from qwick.server import chat_ui

        # Built (when missing or stale) while the engine loads; the server starts either way.
        page_build = asyncio.ensure_future(asyncio.to_thread(chat_ui.ensure_built))
    try:
        engine = await AsyncLLM.create(config)
    finally:
        if page_build is not None:
            await page_build
    try:
        app = build_app(engine, args)
        uv_config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_config=None,
            access_log=getattr(args, "access_log", False),
            timeout_graceful_shutdown=int(getattr(args, "shutdown_timeout", 30)),
            lifespan="off",
        )
        server = _make_server(uv_config)
        if freeze_gc:
            freeze_startup_objects("API server")

        async def announce() -> None:
            while not server.started:
                if server.should_exit:
                    return
                await asyncio.sleep(0.05)
            port = bound_port(server) or args.port
            host = f"[{args.host}]" if ":" in args.host else args.host
            url = f"http://{host}:{port}"
            names = getattr(args, "served_model_name", None) or [engine.model_name]
            logger.info(
                "qwick serve: %s (%s, %s on %s), max_model_len %d, KV cache %d tokens; "
                "OpenAI API at %s/v1 (health %s/health, metrics %s/metrics)%s",
                names[0],
                engine.model_name,
                getattr(engine, "dtype", config.dtype),
                getattr(engine, "device", "?"),
                engine.max_model_len,
                engine.num_kv_tokens,
                url,
                url,
                url,
                f"; chat page at {url}/" if getattr(args, "chat_ui", True) else "",
            )
            if on_ready is not None:
                on_ready(engine, server, url)

        announcer = asyncio.create_task(announce())
        try:
            await server.serve()
        finally:
            announcer.cancel()
        logger.info("HTTP server stopped; shutting the engine down")
    finally:
        await engine.shutdown(drain_timeout=float(getattr(args, "shutdown_timeout", 30.0)))
        logger.info("qwick serve: shut down")


# ---- qwick chat -----------------------------------------------------------------------------------------


def add_chat_parser(subparsers: Any, add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    chat = subparsers.add_parser(
        "chat",
        help="chat with a model in the terminal",
        description="A terminal chat that streams replies and keeps the conversation. Type /exit to quit, "
        "/reset to start over. Runs the model in this process, or talks to a running `qwick serve` "
        "with --url (then MODEL, if given, is the served model name).",
    )
    add_engine_args(chat)
    g = chat.add_argument_group("chat")
    g.add_argument(
        "--url", default=None, help="base URL of a running qwick server, e.g. http://127.0.0.1:8000"
    )
    g.add_argument("--api-key", default=os.environ.get("QWICK_API_KEY"), help="API key for --url")
    g.add_argument("--system", default=None, help="a system prompt")
    g.add_argument("--max-tokens", type=int, default=512, help="most tokens per reply")
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=0.8)
    g.add_argument("--sampling-seed", type=int, default=None)
    chat.set_defaults(func=cmd_chat)


class _LocalChat:
    """The engine in this process, through `LLM.stream`."""

    def __init__(self, args: argparse.Namespace) -> None:
        from qwick import LLM
        from qwick.entrypoints.cli import engine_config_from_args

        self.llm = LLM(**dataclasses.asdict(engine_config_from_args(args)))
        self.name = self.llm.llm_engine.model_name
        self.max_model_len = self.llm.llm_engine.max_model_len

    def _prompt(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.llm.get_tokenizer().apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def stream(self, messages: list[dict[str, str]], args: argparse.Namespace) -> Iterator[str]:
        from qwick import RequestOutputKind, SamplingParams

        history = list(messages)
        ids = self._prompt(history)
        # Drop the oldest turns (never the system prompt or the new message) until the reply has room.
        while len(ids) + 16 > self.max_model_len and len(history) > 2:
            del history[1 if history[0]["role"] == "system" else 0]
            ids = self._prompt(history)
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ValueError(
                f"the message is {len(ids)} tokens, too long for max_model_len={self.max_model_len}"
            )
        params = SamplingParams(
            max_tokens=min(args.max_tokens, room),
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.sampling_seed,
            output_kind=RequestOutputKind.DELTA,
        )
        for out in self.llm.stream(ids, params):
            yield out.outputs[0].text


class _RemoteChat:
    """A running server, through its streamed /v1/chat/completions (standard library only)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.url = args.url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[: -len("/v1")]
        self.api_key = args.api_key
        self.model = args.model
        if self.model is None:
            models = self._request("GET", "/v1/models", None)
            self.model = json.load(models)["data"][0]["id"]
        self.name = self.model

    def _request(self, method: str, path: str, body: dict | None):
        import urllib.error
        import urllib.request

        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            return urllib.request.urlopen(req, timeout=600)
        except urllib.error.HTTPError as exc:
            try:
                message = json.load(exc)["error"]["message"]
            except Exception:
                message = str(exc)
            raise RuntimeError(f"the server answered {exc.code}: {message}") from None
        except urllib.error.URLError as exc:
            raise RuntimeError(f"cannot reach {self.url}: {exc.reason}") from None

    def stream(self, messages: list[dict[str, str]], args: argparse.Namespace) -> Iterator[str]:
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "stream": True,
        }
        if args.sampling_seed is not None:
            body["seed"] = args.sampling_seed
        with self._request("POST", "/v1/chat/completions", body) as resp:
            for raw in resp:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(event["error"].get("message", "the server failed"))
                for choice in event.get("choices", []):
                    content = choice.get("delta", {}).get("content")
                    if content:
                        yield content


def cmd_chat(args: argparse.Namespace) -> int:
    backend = _RemoteChat(args) if args.url else _LocalChat(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = list(system)
    interactive = sys.stdin.isatty()
    print(f"qwick chat with {backend.name}. /exit to quit, /reset to start over.", file=sys.stderr)
    while True:
        try:
            line = input(">>> " if interactive else "")
        except EOFError:
            break
        except KeyboardInterrupt:
            print(file=sys.stderr)
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit", "/bye"):
            break
        if text == "/reset":
            history = list(system)
            print("(conversation cleared)", file=sys.stderr)
            continue
        history.append({"role": "user", "content": line})
        reply: list[str] = []
        try:
            for piece in backend.stream(history, args):
                reply.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            sys.stdout.write(" [interrupted]")
        except (RuntimeError, ValueError) as exc:
            print(f"\n[error: {exc}]", file=sys.stderr)
            history.pop()
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": "".join(reply)})
    return 0
