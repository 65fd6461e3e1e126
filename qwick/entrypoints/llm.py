"""`LLM`: the offline engine, with vLLM's constructor arguments and `generate` / `chat` methods."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm import tqdm

from qwick.config import EngineConfig
from qwick.engine.llm_engine import LLMEngine
from qwick.outputs import RequestOutput
from qwick.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | Sequence[int] | dict


def _final_only(params: list[SamplingParams]) -> list[SamplingParams]:
    """`generate` keeps only finished outputs, so a cumulative output of an unfinished request would be
    assembled every step (token list copied, text joined) and thrown away; FINAL_ONLY gives the same final
    output without that. Copies (one per distinct object), so the caller's params are untouched."""
    copies: dict[int, SamplingParams] = {}
    out = []
    for p in params:
        if p.output_kind == RequestOutputKind.CUMULATIVE:
            if id(p) not in copies:
                copies[id(p)] = p.clone()
                copies[id(p)].output_kind = RequestOutputKind.FINAL_ONLY
            p = copies[id(p)]
        out.append(p)
    return out


def _as_prompt(prompt: Prompt) -> str | list[int]:
    """Accept vLLM's prompt forms: text, token ids, {"prompt": ...} or {"prompt_token_ids": ...}."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError("a prompt dict needs a 'prompt' or 'prompt_token_ids' key")
    if isinstance(prompt, str):
        return prompt
    return list(prompt)


class LLM:
    """Generate with a Qwen-family model in this process.

    >>> llm = LLM()  # the built-in demo model
    >>> llm.generate(["def fib(n):"], SamplingParams(max_tokens=32))[0].outputs[0].text
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine(EngineConfig(model=model, **kwargs))

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def _normalize(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> tuple[list[str | list[int]], list[SamplingParams]]:
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # a single prompt
        items = [_as_prompt(p) for p in prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError(f"got {len(items)} prompts but {len(params)} sampling params")
        return items, params

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts to completion, batched; outputs come back in prompt order."""
        items, params = self._normalize(prompts, sampling_params)
        params = _final_only(params)
        engine = self.llm_engine
        ids = self._add_all(items, params, priority)
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        start, generated = time.perf_counter(), 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[order[out.request_id]] = out
                        generated += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        bar.set_postfix_str(f"{generated / (time.perf_counter() - start):.1f} tok/s")
        except BaseException:
            for rid in ids:
                engine.abort_request(rid)
            while engine.has_unfinished_requests():
                engine.step()
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield outputs as they are produced: one per request per step in which it progressed.

        Set `sampling_params.output_kind = RequestOutputKind.DELTA` to get only the new text and tokens.
        Stopping iteration early aborts what is still running.
        """
        items, params = self._normalize(prompts, sampling_params)
        engine = self.llm_engine
        ids = self._add_all(items, params, None)
        try:
            while engine.has_unfinished_requests():
                yield from engine.step()
        finally:
            for rid in ids:
                engine.abort_request(rid)
            while engine.has_unfinished_requests():
                engine.step()

    def _add_all(self, items, params, priority) -> list[str]:
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(items, params)):
                ids.append(engine.add_request(prompt, p, priority=priority[i] if priority else 0))
        except BaseException:
            for rid in ids:  # one bad prompt rejects the batch, leaving nothing behind
                engine.abort_request(rid)
            while engine.has_unfinished_requests():
                engine.step()
            raise
        return ids

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate the assistant's reply."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.llm_engine.tokenizer
        prompts = []
        for conv in conversations:
            ids = tokenizer.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, tokenize=True, chat_template=chat_template
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            prompts.append(list(ids))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
