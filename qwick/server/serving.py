"""What the OpenAI-compatible endpoints share: requests in, engine requests out, responses and SSE streams
back. The endpoints are subclasses of `OpenAIServing`: `serving_chat.ChatServing` (chat completions) and
`serving_completions.CompletionServing` (completions, /generate); the app serves one `Serving`, both.

Every request asks the engine for DELTA outputs: one output per engine step per request, so a streamed
response makes one write per step (whatever the number of tokens or choices in it), and a non-streamed one
just concatenates. Validation happens before anything reaches the engine, so a bad request costs the
engine nothing and answers 400 with the parameter named; the engine's own checks (ValueError) map to 400
too. A client that disconnects (streamed or not) has its request aborted, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from qwick.engine.async_llm import EngineDeadError
from qwick.outputs import CompletionOutput, Logprob, RequestOutput
from qwick.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from qwick.server import protocol as p
from qwick.server.chat_parsing import ChatParsers
from qwick.server.errors import (
    APIError,
    bad_request,
    engine_dead,
    internal_error,
    model_not_found,
    overloaded,
)
from qwick.server.metrics import ServerMetrics
from qwick.structured_output.grammar import validate_structured_outputs

logger = logging.getLogger("qwick.server")

SSE_DONE = "data: [DONE]\n\n"
LONG_TEXT = 4096  # characters: chat templates and tokenization of longer inputs run off the event loop
_NEG_INF_LOGPROB = -9999.0  # what OpenAI (and vLLM) report for a logprob of -inf
_SAMPLING_FIELDS = {
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k",
    "min_p", "seed", "stop", "stop_token_ids", "max_tokens", "min_tokens", "logprobs", "logit_bias",
}  # fmt: skip


_GUIDED_FIELDS = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                  ("guided_grammar", "grammar"))  # fmt: skip


def _response_format_constraint(response_format: dict[str, Any]) -> dict[str, Any] | None:
    """OpenAI's `response_format` as StructuredOutputsParams fields; None for plain text."""
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request(
                "response_format of type 'json_schema' needs a 'json_schema' object: "
                "{'name': ..., 'schema': {...}, 'strict': true}.",
                param="response_format",
            )
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise bad_request(
                "response_format.json_schema.schema must be a JSON Schema object.", param="response_format"
            )
        return {"json": schema}  # enforced whatever `strict` says: the grammar always holds
    raise bad_request(
        f"Invalid value for response_format.type: {json.dumps(kind)[:60]}. "
        "Supported values are 'text', 'json_object' and 'json_schema'.",
        param="response_format",
    )


class ClientDisconnected(Exception):
    """The HTTP client went away before its answer was ready."""


def sse_event(model: p.ResponseModel, drop_none: tuple[str, ...] = ("usage", "qwick")) -> str:
    exclude = {name for name in drop_none if getattr(model, name, None) is None}
    return f"data: {model.model_dump_json(exclude=exclude)}\n\n"


def _sse_error(err: APIError) -> str:
    return f"data: {err.json()}\n\n"


def clean_logprob(value: float) -> float:
    return value if value > float("-inf") else _NEG_INF_LOGPROB


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a byte-level BPE token uses -> the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


# ---- one engine request -------------------------------------------------------------------------------


@dataclass
class SampleAccumulator:
    """What one choice got so far (non-streamed responses, /generate)."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, c: CompletionOutput) -> None:
        if c.text:
            self.text.append(c.text)
        self.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(c.logprobs)
        if c.finish_reason is not None:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason

    @property
    def full_text(self) -> str:
        return "".join(self.text)


class EngineRun:
    """One request in the engine, consumed output by output (DELTA). Closing it aborts what still runs."""

    def __init__(
        self,
        serving: OpenAIServing,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: int,
        received: float,
    ) -> None:
        self.serving = serving
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.n = params.n
        self.received = received
        self._gen = serving.engine.generate(prompt_ids, params, request_id, priority=priority)
        self._last_token_time: float | None = None
        self.tokens = [0] * params.n
        self.final: RequestOutput | None = None
        self.timing: p.Timing | None = None
        self._closed = False

    async def next(self) -> RequestOutput | None:
        """The next output, or None once the request finished."""
        if self.final is not None:
            return None
        try:
            out = await self._gen.__anext__()
        except StopAsyncIteration:
            return None
        now = time.monotonic()
        new = 0
        for c in out.outputs:
            self.tokens[c.index] += len(c.token_ids)
            new += len(c.token_ids)
        if new:
            if self._last_token_time is not None:
                self.serving.metrics.observe_itl(now - self._last_token_time)
            self._last_token_time = now
        if out.finished:
            self.final = out
            self.timing = self.serving.finish(self, out)
        return out

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._gen.aclose()  # aborts the request if it is still running
        except Exception:  # the engine may be gone; nothing is left to free then
            logger.debug("closing %s", self.request_id, exc_info=True)
        if self.final is None:
            logger.info("%s aborted after %d tokens", self.request_id, sum(self.tokens))


async def merge_runs(runs: list[EngineRun]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several runs as they come: (run index, output)."""
    if len(runs) == 1:
        while (out := await runs[0].next()) is not None:
            yield 0, out
        return
    pending = {asyncio.ensure_future(run.next()): i for i, run in enumerate(runs)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                out = task.result()
                if out is not None:
                    pending[asyncio.ensure_future(runs[i].next())] = i
                    yield i, out
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)


class _Ticket:
    """A request's place in the server's admission count; released exactly once."""

    def __init__(self, serving: OpenAIServing, num_seqs: int) -> None:
        self.serving = serving
        self.num_seqs = num_seqs
        serving.inflight_seqs += num_seqs
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.serving.inflight_seqs -= self.num_seqs


class _ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always runs its cleanup (abort the request, release its admission), even
    when the client left before the first byte or the stream was cancelled between two writes."""

    def __init__(self, content, cleanup: Callable[[], Awaitable[None]], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                await self._cleanup()


# ---- the endpoints' logic -----------------------------------------------------------------------------


class OpenAIServing:
    def __init__(
        self,
        engine: Any,
        served_model_names: list[str],
        metrics: ServerMetrics,
        max_waiting_requests: int,
        max_num_seqs: int,
        chat_parsers: ChatParsers | None = None,
    ) -> None:
        self.engine = engine
        self.chat_parsers = chat_parsers or ChatParsers()  # tool-call and reasoning parsing
        self.served_model_names = served_model_names
        self.model_name = served_model_names[0]
        self.metrics = metrics
        self.max_waiting_requests = max_waiting_requests
        self.max_num_seqs = max_num_seqs
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.inflight_seqs = 0  # sequences admitted and not yet finished (n counts n times)
        self._token_bytes: dict[int, list[int]] = {}

    # ---- checks shared by the endpoints --------------------------------------------------------------

    def check_model(self, model: str | None) -> str:
        if model is None:
            return self.model_name
        if model in self.served_model_names:
            return model
        raise model_not_found(model)

    def check_health(self) -> None:
        if not self.engine.is_healthy:
            raise engine_dead(self.engine.dead_reason)
        if not getattr(self.engine, "is_accepting", True):
            raise APIError(
                503,
                "The server is shutting down.",
                type="server_error",
                code="shutting_down",
                headers={"Retry-After": "5"},
            )

    def admit(self, num_seqs: int) -> _Ticket:
        """Take a request in, or answer 503 (+ Retry-After) when the waiting queue is over its bound."""
        self.check_health()
        bound = self.max_waiting_requests
        if num_seqs > self.max_num_seqs + bound:
            raise bad_request(
                f"The request asks for {num_seqs} sequences; this server runs at most {self.max_num_seqs} "
                f"at once and queues at most {bound}.",
                param="n",
            )
        stats = self.engine.get_stats()
        would_wait = self.inflight_seqs + num_seqs - self.max_num_seqs
        if stats.num_waiting > 0:
            would_wait = max(would_wait, stats.num_waiting + num_seqs)
        if would_wait > bound:
            raise overloaded(max(would_wait - num_seqs, 0), bound)
        return _Ticket(self, num_seqs)

    def check_context(self, num_prompt: int, max_tokens: int | None, what: str) -> None:
        limit = self.max_model_len
        if num_prompt == 0:
            raise bad_request(f"The {what} is empty.", param=what)
        if num_prompt >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your {what} resulted in "
                f"{num_prompt} tokens, which leaves no room for the completion. Please reduce the length "
                f"of the {what}.",
                param=what,
                code="context_length_exceeded",
            )
        if max_tokens is not None and num_prompt + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the {what}, {max_tokens} in the "
                f"completion). Please reduce the length of the {what} or completion.",
                param=what,
                code="context_length_exceeded",
            )

    def check_token_ids(self, ids: list[int], param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(
                f"Token ids must be in [0, {self.vocab_size}); got {bad[:5]}.",
                param=param,
                code="invalid_value",
            )

    def logit_bias(self, raw: dict | None, param: str) -> dict[int, float] | None:
        """A request's logit_bias with int token ids, each inside the vocabulary (else 400)."""
        bias = {int(k): v for k, v in raw.items()} if raw else None
        if bias and max(bias) >= self.vocab_size:
            raise bad_request(
                f"logit_bias has token id {max(bias)}, outside the vocabulary (size {self.vocab_size}).",
                param=param,
            )
        return bias

    def sampling_params(
        self, req: p.SamplingFields, max_tokens: int | None, logprobs: int | None
    ) -> SamplingParams:
        bias = self.logit_bias(req.logit_bias, "logit_bias")
        if req.stop_token_ids:
            self.check_token_ids(req.stop_token_ids, "stop_token_ids")
        return self._make_params(
            n=req.n,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logit_bias=bias,
            structured_outputs=self.structured_outputs(req),
        )

    def structured_outputs(self, req: p.SamplingFields) -> StructuredOutputsParams | None:
        """The request's constraint from `response_format` (json_object / json_schema) or vLLM's `guided_*`
        fields: at most one of them. Validated here (cached per spec), so a bad schema, regex or grammar
        answers 400 naming the field and saying what is wrong before the engine sees it."""
        given: list[tuple[str, dict[str, Any]]] = []
        response_format = getattr(req, "response_format", None)
        if response_format is not None:
            kwargs = _response_format_constraint(response_format)
            if kwargs is not None:
                given.append(("response_format", kwargs))
        for name, key in _GUIDED_FIELDS:
            value = getattr(req, name, None)
            if value is not None:
                given.append((name, {key: value}))
        if not given:
            return None
        if len(given) > 1:
            names = " and ".join(name for name, _ in given)
            raise bad_request(
                f"Only one structured-output constraint per request: got {names}.", param=given[1][0]
            )
        param, kwargs = given[0]
        try:
            params = StructuredOutputsParams(**kwargs)
        except ValueError as exc:
            raise bad_request(f"Invalid {param}: {exc}", param=param) from None
        self.check_structured_outputs(params, param)
        return params

    @staticmethod
    def check_structured_outputs(params: StructuredOutputsParams, param: str) -> None:
        """400 naming `param` when the constraint does not parse (e.g. a tool's schema for tool_choice)."""
        try:
            validate_structured_outputs(params)
        except ValueError as exc:
            raise bad_request(f"Invalid {param}: {exc}.", param=param) from None

    @staticmethod
    def _make_params(prefix: str = "", **kwargs: Any) -> SamplingParams:
        try:
            return SamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA)
        except ValueError as exc:
            msg = str(exc)
            first = msg.split(" ", 1)[0]
            raise bad_request(msg, param=prefix + first if first in _SAMPLING_FIELDS else None) from None

    # ---- running requests ----------------------------------------------------------------------------

    async def until_disconnect(self, raw: Request, awaitable: Awaitable[Any]) -> Any:
        """Await `awaitable`; if the client disconnects first, cancel it (aborting its engine request)."""
        task = asyncio.ensure_future(awaitable)

        async def wait_disconnect() -> None:
            while (await raw.receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(wait_disconnect())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            watcher.cancel()
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.wait({task})
        raise ClientDisconnected()

    def engine_errors(self, exc: BaseException) -> APIError:
        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, EngineDeadError):
            return engine_dead(str(exc))
        if isinstance(exc, ValueError):
            return bad_request(str(exc))
        logger.error("request failed", exc_info=exc)
        return internal_error()

    def finish(self, run: EngineRun, out: RequestOutput) -> p.Timing:
        """A request finished: its timing breakdown, metrics and log line."""
        timing = make_timing(out, run.received, sum(run.tokens), max(run.tokens))
        reasons = [c.finish_reason for c in out.outputs]
        self.metrics.observe_finished(timing, reasons)
        logger.info(
            "%s finished (%s): prompt %d tokens (%d cached), completion %d tokens; queue %s ms, "
            "prefill %s ms, decode %s ms (%s ms/token), e2e %s ms",
            run.request_id,
            ",".join(str(r) for r in reasons),
            timing.prompt_tokens,
            timing.cached_tokens,
            timing.completion_tokens,
            _fmt(timing.queue_ms),
            _fmt(timing.prefill_ms),
            _fmt(timing.decode_ms),
            _fmt(timing.tpot_ms),
            _fmt(timing.e2e_ms),
        )
        return timing

    async def respond(
        self,
        raw: Request,
        runs: list[EngineRun],
        ticket: _Ticket,
        stream: bool,
        collect: Callable[[], Awaitable[Response]],
        stream_body: Callable[[Any, AsyncIterator[tuple[int, RequestOutput]]], AsyncIterator[str]],
        media_type: str = "text/event-stream",
        request_id: str = "",
    ) -> Response:
        """Run `runs` to a response: collected (non-streamed), or streamed after the first output."""

        async def cleanup() -> None:
            for run in runs:
                await run.close()
            ticket.release()

        handed_over = False
        try:
            if not stream:
                try:
                    return await self.until_disconnect(raw, collect())
                except ClientDisconnected:
                    logger.info("%s: client disconnected; request aborted", request_id)
                    return Response(status_code=499)
            merged = merge_runs(runs)
            try:
                # Wait for the first output before answering 200, so that errors the engine finds in the
                # request (or a dead engine) still get a proper status code.
                first = await self.until_disconnect(raw, merged.__anext__())
            except StopAsyncIteration:
                first = None
            except ClientDisconnected:
                logger.info("%s: client disconnected while queued; request aborted", request_id)
                return Response(status_code=499)

            async def body() -> AsyncIterator[str]:
                try:
                    async for piece in stream_body(first, merged):
                        yield piece
                except Exception as exc:  # the engine died mid-stream, or a bug: end the stream cleanly
                    err = self.engine_errors(exc)
                    yield _sse_error(err) if media_type == "text/event-stream" else err.json() + "\n"
                    if media_type == "text/event-stream":
                        yield SSE_DONE
                finally:
                    await merged.aclose()

            handed_over = True
            headers = {"X-Request-Id": request_id, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return _ClosingStreamingResponse(body(), cleanup, media_type=media_type, headers=headers)
        finally:
            if not handed_over:
                await cleanup()

    def token_bytes(self, token_id: int, decoded: str | None) -> list[int]:
        cached = self._token_bytes.get(token_id)
        if cached is not None:
            return cached
        raw = self.tokenizer.convert_ids_to_tokens(token_id)
        decoder = _byte_decoder()
        if isinstance(raw, str) and raw and all(ch in decoder for ch in raw):
            value = [decoder[ch] for ch in raw]
        else:
            value = list((decoded or "").encode("utf-8"))
        if len(self._token_bytes) < 1_000_000:
            self._token_bytes[token_id] = value
        return value

    def _piece(self, token_id: int, lp: Logprob) -> str:
        return lp.decoded_token if lp.decoded_token is not None else self.tokenizer.decode([token_id])

    async def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) > LONG_TEXT:
            return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)


# ---- helpers ------------------------------------------------------------------------------------------


async def anext_or_none(it: AsyncIterator[Any]) -> Any:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return None


def make_usage(prompt_tokens: int, completion_tokens: int, cached: int) -> p.Usage:
    return p.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=p.PromptTokensDetails(cached_tokens=cached),
    )


def json_response(model: p.ResponseModel, request_id: str) -> Response:
    exclude = {"qwick"} if getattr(model, "qwick", None) is None else None
    return Response(
        model.model_dump_json(exclude=exclude),
        media_type="application/json",
        headers={"X-Request-Id": request_id},
    )


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def make_timing(
    out: RequestOutput, received: float, completion_tokens: int, max_sample_tokens: int
) -> p.Timing:
    m = out.metrics
    now = time.monotonic()

    def ms(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(max(b - a, 0.0) * 1000.0, 3)

    if m is None:
        return p.Timing(prompt_tokens=len(out.prompt_token_ids), completion_tokens=completion_tokens)
    finished = m.finished_time if m.finished_time is not None else now
    decode = ms(m.first_token_time, finished)
    tpot = (
        round(decode / (max_sample_tokens - 1), 3) if decode is not None and max_sample_tokens > 1 else None
    )
    return p.Timing(
        queue_ms=ms(m.arrival_time, m.first_scheduled_time),
        prefill_ms=ms(m.first_scheduled_time, m.first_token_time),
        decode_ms=decode,
        e2e_ms=ms(m.arrival_time, finished),
        ttft_ms=ms(m.arrival_time, m.first_token_time),
        tpot_ms=tpot,
        preprocess_ms=ms(received, m.arrival_time),
        prompt_tokens=len(out.prompt_token_ids),
        completion_tokens=completion_tokens,
        cached_tokens=out.num_cached_tokens,
    )
