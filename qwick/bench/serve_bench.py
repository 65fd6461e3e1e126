"""`qwick bench serve`: a running server over HTTP with streaming, at a fixed concurrency.

Sends random token-id prompts to `/v1/completions` (greedy, `ignore_eos`), `concurrency` at a time, and
reports request/token throughput with TTFT, TPOT and end-to-end latency percentiles. The workload is the
same one `qwick bench throughput` runs offline, so the two together give the server's overhead.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

from qwick.bench.workloads import BenchRequest


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _summary(values: list[float]) -> dict:
    return {
        "mean": statistics.fmean(values) if values else float("nan"),
        "p50": _pct(values, 0.5),
        "p90": _pct(values, 0.9),
        "p99": _pct(values, 0.99),
    }


async def _one(client, url: str, model: str, req: BenchRequest, headers: dict) -> dict:
    body = {
        "model": model,
        "prompt": req.prompt_token_ids,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    token_times: list[float] = []
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"server answered {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                token_times.append(time.perf_counter())
    end = time.perf_counter()
    ttft = token_times[0] - start if token_times else end - start
    tpot = (end - start - ttft) / (tokens - 1) if tokens > 1 else 0.0
    itl = [b - a for a, b in zip(token_times, token_times[1:])]
    return {"ttft": ttft, "tpot": tpot, "e2e": end - start, "tokens": tokens, "itl": itl}


async def run(url: str, requests: list[BenchRequest], concurrency: int, api_key: str | None = None) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=None) as client:
        model = (await client.get(f"{url}/v1/models", headers=headers)).json()["data"][0]["id"]
        await _one(client, url, model, BenchRequest(requests[0].prompt_token_ids[:8], 4), headers)  # warm-up
        gate = asyncio.Semaphore(concurrency)

        async def limited(req: BenchRequest) -> dict:
            async with gate:
                return await _one(client, url, model, req, headers)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(r) for r in requests))
        seconds = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    ms = lambda xs: {k: 1000 * v for k, v in _summary(xs).items()}  # noqa: E731
    return {
        "seconds": seconds,
        "requests_per_s": len(results) / seconds,
        "output_tokens_per_s": tokens / seconds,
        "ttft_ms": ms([r["ttft"] for r in results]),
        "tpot_ms": ms([r["tpot"] for r in results]),
        "itl_ms": ms([x for r in results for x in r["itl"]]),
        "e2e_ms": ms([r["e2e"] for r in results]),
    }
