"""The OpenAI-compatible endpoints' logic: requests in, engine requests out, responses and SSE streams back.

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
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from qwick.engine.async_llm import EngineDeadError
from qwick.outputs import CompletionOutput, Logprob, RequestOutput
from qwick.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from qwick.server import protocol as p
from qwick.server.chat_parsing import ChatParsers, ChoiceParser, ToolPlan, delta_tool_calls, plan_tools
from qwick.server.errors import (
    APIError,
    bad_request,
    engine_dead,
    internal_error,
    model_not_found,
    overloaded,
)
from qwick.server.metrics import ServerMetrics
from qwick.server.reasoning import prompt_think_state
from qwick.server.tool_grammar import tool_call_grammar
from qwick.structured_output.grammar import validate_structured_outputs

logger = logging.getLogger("qwick.server")

SSE_DONE = "data: [DONE]\n\n"
_LONG_TEXT = 4096  # characters: chat templates and tokenization of longer inputs run off the event loop
_NEG_INF_LOGPROB = -9999.0  # what OpenAI (and vLLM) report for a logprob of -inf
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "tokenize", "add_generation_prompt", "continue_final_message", "return_dict",
     "chat_template", "tools", "documents", "padding", "truncation", "max_length", "return_tensors"}
)  # fmt: skip
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


def _sse(model: p.ResponseModel, drop_none: tuple[str, ...] = ("usage", "qwick")) -> str:
    exclude = {name for name in drop_none if getattr(model, name, None) is None}
    return f"data: {model.model_dump_json(exclude=exclude)}\n\n"


def _sse_error(err: APIError) -> str:
    return f"data: {err.json()}\n\n"


def _clean_logprob(value: float) -> float:
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


async def _merge(runs: list[EngineRun]) -> AsyncIterator[tuple[int, RequestOutput]]:
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

    def sampling_params(
        self, req: p.SamplingFields, max_tokens: int | None, logprobs: int | None
    ) -> SamplingParams:
        bias = {int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None
        if bias and max(bias) >= self.vocab_size:
            raise bad_request(
                f"logit_bias has token id {max(bias)}, outside the vocabulary (size {self.vocab_size}).",
                param="logit_bias",
            )
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
            merged = _merge(runs)
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

    # ---- chat completions ----------------------------------------------------------------------------

    def _check_chat_unsupported(self, req: p.ChatCompletionRequest) -> None:
        if req.functions or req.function_call not in (None, "none", "auto"):
            raise bad_request("Function calling is not supported.", param="functions")
        if req.modalities not in (None, ["text"]):
            raise bad_request("Only the 'text' modality is supported.", param="modalities")
        for name in ("audio", "prediction", "reasoning_effort"):
            if getattr(req, name) is not None:
                raise bad_request(f"'{name}' is not supported.", param=name)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("logprobs must be set to true if top_logprobs is used.", param="top_logprobs")
        if req.add_generation_prompt and req.continue_final_message:
            raise bad_request(
                "add_generation_prompt and continue_final_message cannot both be true.",
                param="continue_final_message",
            )

    def conversation(self, messages: list[p.ChatMessage]) -> list[dict[str, Any]]:
        conv: list[dict[str, Any]] = []
        for i, msg in enumerate(messages):
            content = msg.content
            if isinstance(content, list):
                parts = []
                for j, part in enumerate(content):
                    if part.type != "text" or part.text is None:
                        raise bad_request(
                            f"Content parts of type '{part.type}' are not supported; only 'text'.",
                            param=f"messages[{i}].content[{j}].type",
                        )
                    parts.append(part.text)
                content = "\n".join(parts)
            if content is None:
                if msg.role != "assistant":
                    raise bad_request(
                        f"Messages with role '{msg.role}' must have content.", param=f"messages[{i}].content"
                    )
                content = ""
            role = "system" if msg.role == "developer" else msg.role
            entry: dict[str, Any] = {"role": role, "content": content}
            if msg.name:
                entry["name"] = msg.name
            if msg.tool_calls:
                if msg.role != "assistant":
                    raise bad_request(
                        "Only assistant messages can have tool_calls.", param=f"messages[{i}].tool_calls"
                    )
                entry["tool_calls"] = [_template_tool_call(call, f"messages[{i}].tool_calls[{j}]")
                                       for j, call in enumerate(msg.tool_calls)]  # fmt: skip
            if msg.role == "tool":
                if not msg.tool_call_id:
                    raise bad_request(
                        "Messages with role 'tool' must have a 'tool_call_id' (the call they answer).",
                        param=f"messages[{i}].tool_call_id",
                    )
                entry["tool_call_id"] = msg.tool_call_id
            conv.append(entry)
        return conv

    async def chat_prompt_ids(
        self,
        messages: list[p.ChatMessage],
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: dict[str, Any] | None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        conv = self.conversation(messages)
        kwargs = dict(template_kwargs or {})
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise bad_request(
                f"chat_template_kwargs cannot set {', '.join(reserved)}.", param="chat_template_kwargs"
            )
        if tools:
            kwargs["tools"] = tools  # OpenAI's tool dicts, which Qwen's templates print as they are
        tokenizer = self.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise bad_request(
                "This model has no chat template; use /v1/completions with a plain prompt.", param="messages"
            )

        def render() -> list[int]:
            ids = tokenizer.apply_chat_template(
                conv,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=True,
                **kwargs,
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)

        try:
            if sum(len(m["content"]) for m in conv) > _LONG_TEXT:
                return await asyncio.to_thread(render)
            return render()
        except APIError:
            raise
        except Exception as exc:  # jinja's TemplateError, the template's raise_exception, bad kwargs...
            raise bad_request(f"Could not apply the chat template: {exc}", param="messages") from None

    async def chat(self, req: p.ChatCompletionRequest, raw: Request, received: float) -> Response:
        model = self.check_model(req.model)
        self._check_chat_unsupported(req)
        plan = plan_tools(req, self.chat_parsers)
        prompt_ids = await self.chat_prompt_ids(
            req.messages,
            req.add_generation_prompt,
            req.continue_final_message,
            req.chat_template_kwargs,
            tools=plan.template_tools,
        )
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        self.check_context(len(prompt_ids), max_tokens, "messages")
        top_k = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, top_k)
        reasoning = self.chat_parsers.reasoning_parser is not None
        # Qwen3 thinking templates open the think block in the prompt (the output then starts inside it);
        # enable_thinking=false closes an empty one there (the output has none).
        think = prompt_think_state(self.tokenizer.decode(prompt_ids[-16:])) if reasoning else None
        in_reasoning = think == "open"
        if plan.constrain is not None:
            mode = "enabled" if think == "open" else "auto" if reasoning and think is None else "disabled"
            params.structured_outputs = self._tool_call_constraint(req, plan, mode, params.structured_outputs)

        def new_parser() -> ChoiceParser:
            return ChoiceParser(reasoning, in_reasoning, plan.parse, plan.max_calls, plan.bare_call_names)

        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        ticket = self.admit(req.n)
        try:
            run = EngineRun(self, request_id, prompt_ids, params, req.priority, received)
        except BaseException:
            ticket.release()
            raise

        async def collect() -> Response:
            accs = [SampleAccumulator() for _ in range(req.n)]
            while (out := await run.next()) is not None:
                for c in out.outputs:
                    accs[c.index].add(c)
            final = run.final
            choices = []
            for i, acc in enumerate(accs):
                parser = new_parser()
                parser.feed(acc.full_text)
                parser.finish()
                choices.append(
                    p.ChatChoice(
                        index=i,
                        message=parser.message(),
                        logprobs=self._chat_logprobs(acc.token_ids, acc.logprobs, top_k)
                        if top_k is not None
                        else None,
                        finish_reason=parser.finish_reason(acc.finish_reason),
                        stop_reason=acc.stop_reason,
                    )
                )
            resp = p.ChatCompletionResponse(
                id=request_id,
                created=created,
                model=model,
                choices=choices,
                usage=_usage(len(prompt_ids), sum(run.tokens), final.num_cached_tokens if final else 0),
                qwick=run.timing,
            )
            return _json(resp, request_id)

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

        async def stream_body(first, merged) -> AsyncIterator[str]:
            def chunk(choices: list[p.ChatChunkChoice], **extra: Any) -> p.ChatCompletionChunk:
                return p.ChatCompletionChunk(
                    id=request_id, created=created, model=model, choices=choices, **extra
                )

            drop = ("qwick",) if include_usage else ("usage", "qwick")
            pieces = [
                _sse(
                    chunk([p.ChatChunkChoice(index=i, delta=p.DeltaMessage(role="assistant", content=""))]),
                    drop,
                )
                for i in range(req.n)
            ]
            parsers = [new_parser() for _ in range(req.n)]
            item = first
            while item is not None:
                _, out = item
                chunks: list[p.ChatCompletionChunk] = []
                for c in out.outputs:
                    lp = None
                    if top_k is not None and c.logprobs:
                        lp = self._chat_logprobs(c.token_ids, c.logprobs, top_k)
                    parser = parsers[c.index]
                    parsed = parser.feed(c.text)
                    if c.finish_reason is not None:
                        parsed.add(parser.finish())
                    if parsed.content or parsed.reasoning or lp is not None:
                        delta = p.DeltaMessage(
                            content=parsed.content if parsed.content or not parsed.reasoning else None,
                            reasoning_content=parsed.reasoning or None,
                        )
                        chunks.append(chunk([p.ChatChunkChoice(index=c.index, delta=delta, logprobs=lp)]))
                    for call in delta_tool_calls(parsed.tool_calls):
                        delta = p.DeltaMessage(tool_calls=[call])
                        chunks.append(chunk([p.ChatChunkChoice(index=c.index, delta=delta)]))
                    if c.finish_reason is not None:
                        choice = p.ChatChunkChoice(
                            index=c.index,
                            delta=p.DeltaMessage(),
                            finish_reason=parser.finish_reason(c.finish_reason),
                            stop_reason=c.stop_reason,
                        )
                        chunks.append(chunk([choice]))
                if continuous:
                    for ch in chunks:
                        ch.usage = _usage(len(prompt_ids), sum(run.tokens), out.num_cached_tokens)
                if out.finished and not include_usage:
                    if not chunks:
                        chunks.append(chunk([]))
                    chunks[-1].qwick = run.timing
                pieces.extend(_sse(ch, drop) for ch in chunks)
                if out.finished and include_usage:
                    usage = _usage(len(prompt_ids), sum(run.tokens), out.num_cached_tokens)
                    pieces.append(_sse(chunk([], usage=usage, qwick=run.timing), ()))
                if out.finished:
                    pieces.append(SSE_DONE)
                if pieces:
                    yield "".join(pieces)
                    pieces = []
                item = await _anext_or_none(merged)
            if run.final is None:
                yield SSE_DONE

        return await self.respond(raw, [run], ticket, req.stream, collect, stream_body, request_id=request_id)

    def _tool_call_constraint(
        self,
        req: p.ChatCompletionRequest,
        plan: ToolPlan,
        reasoning_mode: str,
        existing: StructuredOutputsParams | None,
    ) -> StructuredOutputsParams:
        """`tool_choice` "required" or a named function: the grammar of Qwen's tool-call blocks (after the
        think block, when the model reasons: `reasoning_mode` as in `tool_call_grammar`), so the answer is
        always a call that parses."""
        if existing is not None:
            raise bad_request(
                f"tool_choice {json.dumps(plan.constrain)} cannot be combined with response_format or "
                "guided_*: both constrain the output.",
                param="tool_choice",
            )
        try:
            parallel = req.parallel_tool_calls is not False
            grammar = tool_call_grammar(plan.grammar_tools(), plan.constrain, parallel, reasoning_mode)
        except ImportError:
            raise bad_request(
                f"tool_choice {json.dumps(plan.constrain)} needs the xgrammar package on the server "
                "(pip install xgrammar); 'auto' works without it.",
                param="tool_choice",
            ) from None
        except ValueError as exc:
            raise bad_request(f"The tools cannot be turned into a grammar: {exc}", param="tools") from None
        constraint = StructuredOutputsParams(grammar=grammar)
        self.check_structured_outputs(constraint, "tools")
        return constraint

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

    def _chat_logprobs(
        self, token_ids: list[int], entries: list[dict[int, Logprob]] | None, k: int
    ) -> p.ChoiceLogprobs:
        content = []
        for tok, entry in zip(token_ids, entries or []):
            lp = entry[tok]
            tops = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:k] if k else []
            content.append(
                p.TokenLogprob(
                    token=self._piece(tok, lp),
                    logprob=_clean_logprob(lp.logprob),
                    bytes=self.token_bytes(tok, lp.decoded_token),
                    top_logprobs=[
                        p.TopLogprob(
                            token=self._piece(t, v),
                            logprob=_clean_logprob(v.logprob),
                            bytes=self.token_bytes(t, v.decoded_token),
                        )
                        for t, v in tops
                    ],
                )
            )
        return p.ChoiceLogprobs(content=content)

    # ---- completions ---------------------------------------------------------------------------------

    async def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) > _LONG_TEXT:
            return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def completion_prompts(self, req: p.CompletionRequest) -> list[tuple[str | None, list[int]]]:
        prompt = req.prompt
        if isinstance(prompt, str):
            items: list[str | list[int]] = [prompt]
        elif prompt and isinstance(prompt[0], int):
            items = [prompt]  # type: ignore[list-item]
        else:
            items = list(prompt)  # type: ignore[arg-type]
        out = []
        for i, item in enumerate(items):
            param = "prompt" if len(items) == 1 else f"prompt[{i}]"
            if isinstance(item, str):
                if not item:
                    raise bad_request("The prompt is empty.", param=param)
                out.append((item, await self._encode(item, req.add_special_tokens)))
            else:
                self.check_token_ids(item, param)
                out.append((None, list(item)))
        return out

    async def completions(self, req: p.CompletionRequest, raw: Request, received: float) -> Response:
        model = self.check_model(req.model)
        if req.suffix:
            raise bad_request("suffix is not supported.", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of must equal n (or be left out).", param="best_of")
        if req.echo and req.logprobs is not None:
            raise bad_request("echo with logprobs is not supported (no prompt logprobs yet).", param="echo")
        prompts = await self.completion_prompts(req)
        for _, ids in prompts:
            self.check_context(len(ids), req.max_tokens, "prompt")
        params = self.sampling_params(req, req.max_tokens, req.logprobs)
        base_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        n = req.n
        ticket = self.admit(n * len(prompts))
        runs: list[EngineRun] = []
        try:
            for i, (_, ids) in enumerate(prompts):
                rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                runs.append(EngineRun(self, rid, ids, params, req.priority, received))
        except BaseException:
            for run in runs:
                await run.close()
            ticket.release()
            raise
        echo_texts = [
            (text if text is not None else self.tokenizer.decode(ids)) if req.echo else ""
            for text, ids in prompts
        ]
        k = req.logprobs

        def usage() -> p.Usage:
            cached = sum(r.final.num_cached_tokens for r in runs if r.final is not None)
            return _usage(sum(len(ids) for _, ids in prompts), sum(sum(r.tokens) for r in runs), cached)

        def timing() -> p.Timing | None:
            return _combine_timings([r.timing for r in runs])

        async def collect() -> Response:
            accs = [[SampleAccumulator() for _ in range(n)] for _ in runs]
            async for i, out in _merge(runs):
                for c in out.outputs:
                    accs[i][c.index].add(c)
            choices = []
            for i, per_prompt in enumerate(accs):
                for acc in per_prompt:
                    lp = None
                    if k is not None:
                        lp = self._completion_logprobs(acc.token_ids, acc.logprobs, k, 0)
                    choices.append(
                        p.CompletionChoice(
                            index=len(choices),
                            text=echo_texts[i] + acc.full_text,
                            logprobs=lp,
                            finish_reason=acc.finish_reason,
                            stop_reason=acc.stop_reason,
                        )
                    )
            resp = p.CompletionResponse(
                id=base_id, created=created, model=model, choices=choices, usage=usage(), qwick=timing()
            )
            return _json(resp, base_id)

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

        async def stream_body(first, merged) -> AsyncIterator[str]:
            offsets = [[len(echo_texts[i])] * n for i in range(len(runs))]
            echoed = [[False] * n for _ in runs]
            # Finished as far as this stream has written (a run's next output may already be read ahead).
            finished = [False] * len(runs)
            drop = ("qwick",) if include_usage else ("usage", "qwick")

            def chunk(choices: list[p.CompletionChoice], **extra: Any) -> p.CompletionResponse:
                return p.CompletionResponse(
                    id=base_id, created=created, model=model, choices=choices, **extra
                )

            item = first
            pieces: list[str] = []
            while item is not None:
                i, out = item
                chunks = []
                for c in out.outputs:
                    index = i * n + c.index
                    text = c.text
                    if not echoed[i][c.index]:
                        echoed[i][c.index] = True
                        text = echo_texts[i] + text
                    lp = None
                    if k is not None and c.logprobs:
                        lp = self._completion_logprobs(c.token_ids, c.logprobs, k, offsets[i][c.index])
                        offsets[i][c.index] += sum(len(t) for t in lp.tokens)
                    if text or lp is not None:
                        chunks.append(chunk([p.CompletionChoice(index=index, text=text, logprobs=lp)]))
                    if c.finish_reason is not None:
                        choice = p.CompletionChoice(
                            index=index,
                            text="",
                            finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                        )
                        chunks.append(chunk([choice]))
                if continuous:
                    for ch in chunks:
                        ch.usage = usage()
                finished[i] = finished[i] or out.finished
                done = all(finished)
                if done and not include_usage:
                    if not chunks:
                        chunks.append(chunk([]))
                    chunks[-1].qwick = timing()
                pieces.extend(_sse(ch, drop) for ch in chunks)
                if done and include_usage:
                    pieces.append(_sse(chunk([], usage=usage(), qwick=timing()), ()))
                if done:
                    pieces.append(SSE_DONE)
                if pieces:
                    yield "".join(pieces)
                    pieces = []
                item = await _anext_or_none(merged)
            if not all(finished):
                yield SSE_DONE

        return await self.respond(raw, runs, ticket, req.stream, collect, stream_body, request_id=base_id)

    def _completion_logprobs(
        self, token_ids: list[int], entries: list[dict[int, Logprob]] | None, k: int, offset: int
    ) -> p.CompletionLogprobs:
        out = p.CompletionLogprobs()
        for tok, entry in zip(token_ids, entries or []):
            lp = entry[tok]
            piece = self._piece(tok, lp)
            out.tokens.append(piece)
            out.token_logprobs.append(_clean_logprob(lp.logprob))
            tops = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:k]
            top = {self._piece(t, v): _clean_logprob(v.logprob) for t, v in tops}
            top.setdefault(piece, _clean_logprob(lp.logprob))
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(piece)
        return out

    # ---- /generate -----------------------------------------------------------------------------------

    async def generate(self, req: p.GenerateRequest, raw: Request, received: float) -> Response:
        sp = req.sampling_params
        if isinstance(req.prompt, str):
            if not req.prompt:
                raise bad_request("The prompt is empty.", param="prompt")
            prompt_text, prompt_ids = req.prompt, await self._encode(req.prompt, True)
        else:
            self.check_token_ids(req.prompt, "prompt")
            prompt_text, prompt_ids = "", list(req.prompt)
        self.check_context(len(prompt_ids), sp.max_tokens, "prompt")
        bias = {int(k): v for k, v in sp.logit_bias.items()} if sp.logit_bias else None
        if bias and max(bias) >= self.vocab_size:
            raise bad_request(
                f"logit_bias has token id {max(bias)}, outside the vocabulary (size {self.vocab_size}).",
                param="sampling_params.logit_bias",
            )
        if sp.stop_token_ids:
            self.check_token_ids(sp.stop_token_ids, "sampling_params.stop_token_ids")
        params = self._make_params("sampling_params.", **{**sp.model_dump(), "logit_bias": bias})
        request_id = f"gen-{uuid.uuid4().hex}"
        ticket = self.admit(params.n)
        try:
            run = EngineRun(self, request_id, prompt_ids, params, req.priority, received)
        except BaseException:
            ticket.release()
            raise
        accs = [SampleAccumulator() for _ in range(params.n)]

        def result(final: bool) -> dict[str, Any]:
            body: dict[str, Any] = {"text": [prompt_text + acc.full_text for acc in accs]}
            if final:
                body["finish_reason"] = [acc.finish_reason for acc in accs]
                if run.timing is not None:
                    body["qwick"] = run.timing.model_dump()
            return body

        async def collect() -> Response:
            while (out := await run.next()) is not None:
                for c in out.outputs:
                    accs[c.index].add(c)
            return JSONResponse(result(True), headers={"X-Request-Id": request_id})

        async def stream_body(first, merged) -> AsyncIterator[str]:
            item = first
            while item is not None:
                _, out = item
                for c in out.outputs:
                    accs[c.index].add(c)
                yield json.dumps(result(out.finished), ensure_ascii=False) + "\n"
                item = await _anext_or_none(merged)

        return await self.respond(
            raw,
            [run],
            ticket,
            req.stream,
            collect,
            stream_body,
            media_type="application/x-ndjson",
            request_id=request_id,
        )


# ---- helpers ------------------------------------------------------------------------------------------


async def _anext_or_none(it: AsyncIterator[Any]) -> Any:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return None


def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> p.Usage:
    return p.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=p.PromptTokensDetails(cached_tokens=cached),
    )


def _json(model: p.ResponseModel, request_id: str) -> Response:
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


def _combine_timings(timings: list[p.Timing | None]) -> p.Timing | None:
    """Several prompts in one completions request: the slowest one's breakdown, the tokens of all."""
    done = [t for t in timings if t is not None]
    if len(done) < len(timings) or not done:
        return None
    if len(done) == 1:
        return done[0]
    slowest = max(done, key=lambda t: t.e2e_ms or 0.0)
    return slowest.model_copy(
        update={
            "prompt_tokens": sum(t.prompt_tokens for t in done),
            "completion_tokens": sum(t.completion_tokens for t in done),
            "cached_tokens": sum(t.cached_tokens for t in done),
        }
    )


def _template_tool_call(call: p.ToolCallParam, param: str) -> dict[str, Any]:
    """An assistant's earlier call as chat templates take it: Qwen's prints `arguments | tojson`, so the
    JSON text OpenAI clients send is parsed back into an object (as vLLM does)."""
    args: Any = call.function.arguments
    where = param + ".function.arguments"
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            args = None
    if not isinstance(args, dict):
        raise bad_request("The arguments of a tool call must be (JSON text of) an object.", param=where)
    entry: dict[str, Any] = {"type": "function", "function": {"name": call.function.name, "arguments": args}}
    if call.id is not None:
        entry["id"] = call.id
    return entry
