"""/v1/chat/completions: messages through the chat template (tools and reasoning included), the engine's
outputs back as chat choices, streamed or whole, with tool calls and reasoning parsed out of the text."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from qwick.outputs import Logprob
from qwick.sampling_params import StructuredOutputsParams
from qwick.server import protocol as p
from qwick.server.chat_parsing import ChoiceParser, ToolPlan, delta_tool_calls, plan_tools
from qwick.server.errors import APIError, bad_request
from qwick.server.reasoning import prompt_think_state
from qwick.server.serving import (
    LONG_TEXT,
    SSE_DONE,
    EngineRun,
    OpenAIServing,
    SampleAccumulator,
    anext_or_none,
    clean_logprob,
    json_response,
    make_usage,
    sse_event,
)
from qwick.server.tool_grammar import tool_call_grammar

_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "tokenize", "add_generation_prompt", "continue_final_message", "return_dict",
     "chat_template", "tools", "documents", "padding", "truncation", "max_length", "return_tensors"}
)  # fmt: skip


class ChatServing(OpenAIServing):
    """The chat endpoint on top of the shared checks, admission and response plumbing."""

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
            if sum(len(m["content"]) for m in conv) > LONG_TEXT:
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
                usage=make_usage(len(prompt_ids), sum(run.tokens), final.num_cached_tokens if final else 0),
                qwick=run.timing,
            )
            return json_response(resp, request_id)

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

        async def stream_body(first, merged) -> AsyncIterator[str]:
            def chunk(choices: list[p.ChatChunkChoice], **extra: Any) -> p.ChatCompletionChunk:
                return p.ChatCompletionChunk(
                    id=request_id, created=created, model=model, choices=choices, **extra
                )

            drop = ("qwick",) if include_usage else ("usage", "qwick")
            pieces = [
                sse_event(
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
                        ch.usage = make_usage(len(prompt_ids), sum(run.tokens), out.num_cached_tokens)
                if out.finished and not include_usage:
                    if not chunks:
                        chunks.append(chunk([]))
                    chunks[-1].qwick = run.timing
                pieces.extend(sse_event(ch, drop) for ch in chunks)
                if out.finished and include_usage:
                    usage = make_usage(len(prompt_ids), sum(run.tokens), out.num_cached_tokens)
                    pieces.append(sse_event(chunk([], usage=usage, qwick=run.timing), ()))
                if out.finished:
                    pieces.append(SSE_DONE)
                if pieces:
                    yield "".join(pieces)
                    pieces = []
                item = await anext_or_none(merged)
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
                    logprob=clean_logprob(lp.logprob),
                    bytes=self.token_bytes(tok, lp.decoded_token),
                    top_logprobs=[
                        p.TopLogprob(
                            token=self._piece(t, v),
                            logprob=clean_logprob(v.logprob),
                            bytes=self.token_bytes(t, v.decoded_token),
                        )
                        for t, v in tops
                    ],
                )
            )
        return p.ChoiceLogprobs(content=content)


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
