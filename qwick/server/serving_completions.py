"""/v1/completions and /generate: prompts (text or token ids) straight to the engine, its outputs back as
completion choices or as qwick's token-level /generate records, streamed or whole."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from qwick.outputs import Logprob
from qwick.server import protocol as p
from qwick.server.errors import bad_request
from qwick.server.serving import (
    SSE_DONE,
    EngineRun,
    OpenAIServing,
    SampleAccumulator,
    anext_or_none,
    clean_logprob,
    json_response,
    make_usage,
    merge_runs,
    sse_event,
)


class CompletionServing(OpenAIServing):
    """The completions and /generate endpoints on top of the shared checks, admission and plumbing."""

    # ---- completions ---------------------------------------------------------------------------------

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
            return make_usage(sum(len(ids) for _, ids in prompts), sum(sum(r.tokens) for r in runs), cached)

        def timing() -> p.Timing | None:
            return _combine_timings([r.timing for r in runs])

        async def collect() -> Response:
            accs = [[SampleAccumulator() for _ in range(n)] for _ in runs]
            async for i, out in merge_runs(runs):
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
            return json_response(resp, base_id)

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
                pieces.extend(sse_event(ch, drop) for ch in chunks)
                if done and include_usage:
                    pieces.append(sse_event(chunk([], usage=usage(), qwick=timing()), ()))
                if done:
                    pieces.append(SSE_DONE)
                if pieces:
                    yield "".join(pieces)
                    pieces = []
                item = await anext_or_none(merged)
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
            out.token_logprobs.append(clean_logprob(lp.logprob))
            tops = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:k]
            top = {self._piece(t, v): clean_logprob(v.logprob) for t, v in tops}
            top.setdefault(piece, clean_logprob(lp.logprob))
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
        bias = self.logit_bias(sp.logit_bias, "sampling_params.logit_bias")
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
                item = await anext_or_none(merged)

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
