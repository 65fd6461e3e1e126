"""Async scheduling end to end: the same tokens as the synchronous engine, whatever the mix of requests.

Greedy and seeded requests are deterministic, so they must match token for token (and in logprobs);
unseeded random sampling draws from the engine's generator in a different order and is not compared.
Runs on the CPU (the overlap only pays on a GPU, but the bookkeeping is the same everywhere)."""

from __future__ import annotations

import pytest
import torch

from qwick import LLM, SamplingParams


def _requests():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 70, (14,), generator=g).tolist()
    prompts = [torch.randint(2, 300, (n,), generator=g).tolist() for n in lengths]
    prompts[5] = prompts[2][:]  # a prefix-cache hit (the whole prompt)
    params = []
    for i in range(14):
        kw = dict(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=i % 4 != 0)
        if i % 3 == 0:
            kw.update(temperature=0.9, seed=100 + i)  # seeded: waits for its token each step
        if i == 4:
            kw.update(repetition_penalty=1.3, presence_penalty=0.5)
        if i == 7:
            kw.update(logprobs=3)
        if i == 8:
            kw.update(min_tokens=6, stop_token_ids=[7, 8, 9])
        if i == 10:
            kw.update(stop=["e"], ignore_eos=False)
        params.append(SamplingParams(**kw))
    params.append(SamplingParams(n=2, max_tokens=9, temperature=0.7, seed=3))
    prompts.append(prompts[0])
    return prompts, params


def _run(path, async_scheduling, **engine):
    engine = {"max_model_len": 256, "dtype": "float32", **engine}
    llm = LLM(path, block_size=4, async_scheduling=async_scheduling, **engine)
    prompts, params = _requests()
    outs = llm.generate(prompts, params, use_tqdm=False)
    core = llm.llm_engine.core
    assert not core.has_unfinished_requests() and core.scheduler.kv_cache.usage == 0
    result = [
        [
            (c.token_ids, c.finish_reason, c.text, [sorted(lp.items()) for lp in (c.logprobs or [])])
            for c in o.outputs
        ]
        for o in outs
    ]
    return result, core.scheduler.num_preemptions


@pytest.mark.parametrize(
    "engine",
    [
        dict(num_gpu_blocks_override=512),
        dict(num_gpu_blocks_override=512, max_num_batched_tokens=32),  # chunked prefill
        dict(num_gpu_blocks_override=40, max_num_seqs=6, max_model_len=128),  # preemption
    ],
    ids=["roomy", "chunked", "preempting"],
)
def test_async_scheduling_gives_the_synchronous_tokens(tiny_qwen2_dir, engine):
    sync, _ = _run(tiny_qwen2_dir, False, **engine)
    asynced, preemptions = _run(tiny_qwen2_dir, True, **engine)
    if engine.get("num_gpu_blocks_override") == 40:
        assert preemptions > 0
    assert len(sync) == len(asynced)
    for i, (a, b) in enumerate(zip(sync, asynced)):
        for (tok_a, fin_a, text_a, lp_a), (tok_b, fin_b, text_b, lp_b) in zip(a, b):
            assert (tok_a, fin_a, text_a) == (tok_b, fin_b, text_b), f"request {i}"
            for step_a, step_b in zip(lp_a, lp_b):
                assert [t for t, _ in step_a] == [t for t, _ in step_b]
                for (_, x), (_, y) in zip(step_a, step_b):
                    assert x.logprob == pytest.approx(y.logprob, abs=1e-5)


def test_async_engine_runs_ahead(tiny_qwen2_dir):
    """Plain greedy decoding really is scheduled a step ahead: rows with a placeholder input appear."""
    llm = LLM(tiny_qwen2_dir, dtype="float32", block_size=4, max_model_len=256, async_scheduling=True)
    core = llm.llm_engine.core
    seen = []
    launch = core.runner.launch

    def spy(scheduler_output):
        seen.extend(row.placeholder_input for row in scheduler_output.scheduled)
        return launch(scheduler_output)

    core.runner.launch = spy
    out = llm.generate(
        [[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 12
    assert sum(seen) == 11  # every decode step after the prompt


def test_served_engine_with_async_scheduling_streams_stops_and_aborts(tiny_qwen2_dir):
    """The engine-core process runs the async loop too: streamed greedy tokens equal the synchronous
    offline engine's, a stop string ends a request, and an abort mid-stream frees everything."""
    import asyncio

    from qwick.config import EngineConfig
    from qwick.engine.async_llm import AsyncLLM

    args = dict(dtype="float32", num_gpu_blocks_override=256, block_size=4, max_model_len=256)
    prompts, _ = _requests()
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    offline = LLM(tiny_qwen2_dir, **args).generate(prompts[:4], greedy, use_tqdm=False)
    expected = [o.outputs[0].token_ids for o in offline]
    full_text = offline[0].outputs[0].text
    stop_text = full_text[3:6]

    async def main():
        async with await AsyncLLM.create(
            EngineConfig(model=tiny_qwen2_dir, async_scheduling=True, **args)
        ) as llm:

            async def tokens(prompt, params, rid):
                return [out async for out in llm.generate(prompt, params, rid)][-1].outputs[0]

            got = await asyncio.gather(*(tokens(p, greedy, f"g{i}") for i, p in enumerate(prompts[:4])))
            assert [g.token_ids for g in got] == expected
            stopped = await tokens(
                prompts[0], SamplingParams(max_tokens=20, temperature=0, stop=[stop_text]), "s"
            )
            assert stopped.finish_reason == "stop" and stopped.text == full_text[: full_text.index(stop_text)]
            gen = llm.generate(
                prompts[1], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True), "a"
            )
            await gen.__anext__()
            await llm.abort("a")
            outs = [o async for o in gen]
            assert outs[-1].outputs[0].finish_reason == "abort"
            for _ in range(200):
                stats = llm.get_stats()
                if llm.num_unfinished == 0 and stats.num_running == 0 and stats.kv_cache_usage == 0:
                    break
                await asyncio.sleep(0.02)
            else:
                pytest.fail("the aborted request was not freed")

    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.gpu
def test_async_scheduling_on_the_gpu_gives_the_synchronous_tokens(tiny_qwen2_dir):
    """On CUDA the in-flight tokens are patched into the decode graph's input buffer on the device, and
    results come back through pinned memory and an event: same tokens as the synchronous engine (fp32:
    steps batch rows differently in the two modes, and bf16 near-ties could flip on that alone)."""
    if not torch.cuda.is_available():
        pytest.fail("GPU test run without a GPU")
    engine = dict(device="cuda", num_gpu_blocks_override=512)
    auto = LLM(
        tiny_qwen2_dir,
        dtype="float32",
        block_size=4,
        max_model_len=64,
        device="cuda",
        num_gpu_blocks_override=32,
    )
    core = auto.llm_engine.core
    assert core.async_scheduling is True and core.runner.async_scheduling is True
    assert [o.outputs[0].token_ids for o in auto.generate(["hello", "a b c"], use_tqdm=False)]
    del auto, core
    sync, _ = _run(tiny_qwen2_dir, False, **engine)
    asynced, _ = _run(tiny_qwen2_dir, True, **engine)
    assert [[c[:3] for c in o] for o in sync] == [[c[:3] for c in o] for o in asynced]


def test_async_scheduling_defaults_to_off_on_the_cpu(tiny_qwen2_dir):
    """`async_scheduling=None` (the default) resolves per device: on the CPU the forward runs on the host
    itself, so there is nothing to overlap and the synchronous loop is kept."""
    llm = LLM(tiny_qwen2_dir, dtype="float32", block_size=4, max_model_len=64)
    assert llm.llm_engine.config.async_scheduling is None
    assert llm.llm_engine.core.async_scheduling is False
    assert llm.llm_engine.core.runner.async_scheduling is False
    assert llm.llm_engine.core.scheduler.config.async_scheduling is False
