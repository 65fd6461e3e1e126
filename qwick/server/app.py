"""The FastAPI app: routes, request parsing, authentication and the error envelope.

`build_app(engine, args)` wraps a running `AsyncLLM`. Request bodies are read and validated here, not by
FastAPI's body parsing, so that every failure (a wrong content type, a body over the limit, malformed JSON,
a wrong type, an unknown field) answers in OpenAI's envelope with the right status, and a bad request
never costs the engine anything.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from qwick.server import protocol as p
from qwick.server.chat_parsing import resolve_chat_parsers
from qwick.server.cli import DEFAULT_MAX_BODY_BYTES
from qwick.server.errors import (
    NOT_FOUND,
    APIError,
    bad_request,
    engine_dead,
    error_body,
    from_validation_errors,
    invalid_api_key,
)
from qwick.server.metrics import ServerMetrics
from qwick.server.serving_chat import ChatServing
from qwick.server.serving_completions import CompletionServing

logger = logging.getLogger("qwick.server")

_DRAIN_LIMIT = 64 * 1024 * 1024  # read (and drop) at most this much of an oversized body before answering 413


class Serving(ChatServing, CompletionServing):
    """Every endpoint over one engine: chat, completions and /generate, sharing `OpenAIServing`'s checks,
    admission and in-flight count."""


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers or None)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, after checking its content type and size (413 past `max_bytes`)."""
    ctype = request.headers.get("content-type")
    if ctype is not None:
        main = ctype.split(";", 1)[0].strip().lower()
        if main != "application/json" and not main.endswith("+json"):
            raise APIError(
                415,
                f"Unsupported content type '{main}': send the body as JSON with "
                "'Content-Type: application/json'.",
                code="unsupported_media_type",
            )
    length = request.headers.get("content-length")
    too_big = APIError(
        413,
        f"The request body is larger than this server's limit of {max_bytes} bytes.",
        code="request_too_large",
    )
    declared_too_big = length is not None and length.isdigit() and int(length) > max_bytes
    body = bytearray()
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if declared_too_big or received > max_bytes:
            # Keep reading (and dropping) so that the client, still sending, gets to read the 413.
            if received > _DRAIN_LIMIT:
                break
            continue
        body += chunk
    if declared_too_big or received > max_bytes:
        raise too_big
    return bytes(body)


async def parse(request: Request, model: type[BaseModel], max_bytes: int) -> Any:
    body = await read_body(request, max_bytes)
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors(include_url=False)) from None


def build_app(engine: Any, args: argparse.Namespace | Any = None) -> FastAPI:
    """The ASGI app serving `engine` (a started `AsyncLLM`). `args` are `qwick serve`'s options; any of
    api_key, served_model_name, max_waiting_requests, max_request_body_bytes may be left out."""
    args = args if args is not None else argparse.Namespace()
    names = getattr(args, "served_model_name", None) or [engine.model_name]
    if isinstance(names, str):
        names = [names]
    config = getattr(engine, "config", None)
    max_num_seqs = getattr(config, "max_num_seqs", None) or getattr(args, "max_num_seqs", 256)
    max_waiting = getattr(args, "max_waiting_requests", None)
    if max_waiting is None:
        max_waiting = 4 * max_num_seqs
    max_body = getattr(args, "max_request_body_bytes", None) or DEFAULT_MAX_BODY_BYTES
    api_key = getattr(args, "api_key", None)

    parsers = resolve_chat_parsers(
        getattr(engine.tokenizer, "chat_template", None),
        tool_call_parser=getattr(args, "tool_call_parser", None) or "auto",
        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", None),
        reasoning_parser=getattr(args, "reasoning_parser", None) or "auto",
    )
    logger.info(
        "tool call parser: %s (tool_choice auto %s); reasoning parser: %s",
        parsers.tool_call_parser or "none",
        "on" if parsers.auto_tool_choice else "off",
        parsers.reasoning_parser or "none",
    )

    metrics = ServerMetrics(engine, names[0])
    serving = Serving(engine, list(names), metrics, max_waiting, max_num_seqs, parsers)

    from qwick import __version__

    app = FastAPI(title="qwick", version=__version__, summary="OpenAI-compatible server for Qwen models")
    app.state.engine = engine
    app.state.serving = serving
    app.state.metrics = metrics

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise invalid_api_key()

    def endpoint(protected: bool = True):
        """Wrap a handler: API key, then any failure as an enveloped error (500 for the unexpected)."""

        def wrap(fn: Callable[..., Awaitable[Response | Any]]):
            @functools.wraps(fn)
            async def handler(request: Request, *a, **kw):
                received = time.monotonic()
                try:
                    if protected:
                        authorize(request)
                    return await fn(request, received, *a, **kw)
                except Exception as exc:
                    err = serving.engine_errors(exc)
                    if err.status >= 500:
                        logger.warning(
                            "%s %s -> %d: %s", request.method, request.url.path, err.status, err.message
                        )
                    return _error_response(err)

            # FastAPI reads the handler's parameters from its signature: hide `received`, ours to pass.
            sig = inspect.signature(fn)
            handler.__signature__ = sig.replace(  # type: ignore[attr-defined]
                parameters=[v for k, v in sig.parameters.items() if k != "received"]
            )
            return handler

        return wrap

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(from_validation_errors(list(exc.errors()) or [{"msg": "invalid request"}]))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message, kind = f"Unknown path: {request.method} {request.url.path}", NOT_FOUND
        elif exc.status_code == 405:
            message, kind = (
                f"Method {request.method} is not allowed on {request.url.path}.",
                "invalid_request_error",
            )
        else:
            message, kind = str(exc.detail), "invalid_request_error"
        return JSONResponse(
            error_body(message, kind), status_code=exc.status_code, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return JSONResponse(
            error_body("The server had an internal error while processing the request.", "server_error"),
            status_code=500,
        )

    # ---- operational ---------------------------------------------------------------------------------

    @app.get("/health")
    @endpoint(protected=False)
    async def health(request: Request, received: float) -> Response:
        if not engine.is_healthy:
            return _error_response(engine_dead(engine.dead_reason))
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    @endpoint(protected=False)
    async def metrics_page(request: Request, received: float) -> Response:
        body, ctype = metrics.render()
        return Response(body, media_type=ctype)

    @app.get("/version")
    @endpoint(protected=False)
    async def version(request: Request, received: float) -> Response:
        return JSONResponse({"version": __version__})

    if getattr(args, "chat_ui", True):
        from qwick.server import chat_ui

        chat_ui.add_routes(app)  # the chat page at `/`, served without an API key

    # ---- OpenAI ----------------------------------------------------------------------------------------

    def model_card(name: str) -> p.ModelCard:
        return p.ModelCard(id=name, root=engine.model_path, max_model_len=engine.max_model_len)

    @app.get("/v1/models")
    @endpoint()
    async def list_models(request: Request, received: float) -> Response:
        return JSONResponse(p.ModelList(data=[model_card(n) for n in names]).model_dump())

    @app.get("/v1/models/{model_id:path}")
    @endpoint()
    async def get_model(request: Request, received: float, model_id: str) -> Response:
        return JSONResponse(model_card(serving.check_model(model_id)).model_dump())

    @app.post("/v1/chat/completions")
    @endpoint()
    async def chat_completions(request: Request, received: float) -> Response:
        req = await parse(request, p.ChatCompletionRequest, max_body)
        return await serving.chat(req, request, received)

    @app.post("/v1/completions")
    @endpoint()
    async def completions(request: Request, received: float) -> Response:
        req = await parse(request, p.CompletionRequest, max_body)
        return await serving.completions(req, request, received)

    # ---- vLLM's extras ---------------------------------------------------------------------------------

    @app.post("/tokenize")
    @endpoint()
    async def tokenize(request: Request, received: float) -> Response:
        req = await parse(request, p.TokenizeRequest, max_body)
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("Give exactly one of 'prompt' and 'messages'.", param="prompt")
        if req.messages is not None:
            if not req.messages:
                raise bad_request("messages must not be empty.", param="messages")
            ids = await serving.chat_prompt_ids(
                req.messages,
                req.add_generation_prompt,
                req.continue_final_message,
                req.chat_template_kwargs,
                tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
            )
        else:
            ids = await serving._encode(req.prompt, req.add_special_tokens)
        strs = serving.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        resp = p.TokenizeResponse(
            count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs
        )
        return JSONResponse(resp.model_dump(exclude_none=True))

    @app.post("/detokenize")
    @endpoint()
    async def detokenize(request: Request, received: float) -> Response:
        req = await parse(request, p.DetokenizeRequest, max_body)
        serving.check_model(req.model)
        serving.check_token_ids(req.tokens, "tokens")
        return JSONResponse(p.DetokenizeResponse(prompt=serving.tokenizer.decode(req.tokens)).model_dump())

    @app.post("/generate")
    @endpoint()
    async def generate(request: Request, received: float) -> Response:
        req = await parse(request, p.GenerateRequest, max_body)
        return await serving.generate(req, request, received)

    return app
