"""`AsyncLLM`: the engine core in its own process, driven from asyncio, on a tiny random Qwen2.

One shared engine serves most tests (its event loop lives as long as the module); the kill and start-up
failure tests start their own. Every wait is bounded, so a broken engine fails a test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import zmq

from qwick import LLM, RequestOutputKind, SamplingParams
from qwick.config import EngineConfig
from qwick.engine import messages as m
from qwick.engine.async_llm import AsyncLLM, EngineDeadError
from qwick.engine.core_proc import EngineCoreProc
from qwick.engine.engine_core import EngineCore
from qwick.loader.model_loader import load_config
from tests.utils import VOCAB

ENGINE_ARGS = dict(dtype="float32", num_gpu_blocks_override=256, block_size=4, max_model_len=256)
TEXTS = ["hello world", "def fib(n):", "你好，世界", "The quick brown fox", "tiny test corpus"]


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def run(loop):
    """Run a coroutine on the module's event loop (the shared engine is bound to it), with a time limit."""

    def run(coro, timeout: float = 30.0):
        return loop.run_until_complete(asyncio.wait_for(coro, timeout))

    return run


@pytest.fixture(scope="module")
def engine(tiny_qwen2_dir, run):
    llm = run(AsyncLLM.create(EngineConfig(model=tiny_qwen2_dir, **ENGINE_ARGS)))
    yield llm
    run(llm.shutdown(drain_timeout=5))


@pytest.fixture(scope="module")
def offline(tiny_qwen2_dir):
    return LLM(tiny_qwen2_dir, **ENGINE_ARGS)


async def collect(engine: AsyncLLM, prompt, params: SamplingParams, request_id: str) -> list:
    return [out async for out in engine.generate(prompt, params, request_id)]


async def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out waiting for the engine"
        await asyncio.sleep(0.01)


def idle(engine: AsyncLLM) -> bool:
    stats = engine.get_stats()
    return (
        engine.num_unfinished == 0
        and stats.num_running == 0
        and stats.num_waiting == 0
        and stats.kv_cache_usage == 0
    )


def test_ready_reports_model_info(engine, tiny_qwen2_dir):
    assert engine.is_healthy and engine.engine_process.is_alive()
    assert engine.model_path == tiny_qwen2_dir and engine.vocab_size == VOCAB
    assert engine.max_model_len == 256 and engine.device == "cpu" and engine.dtype == "float32"
    assert engine.num_kv_tokens == 255 * 4 and engine.eos_token_ids == {1}
    assert engine.tokenizer is not None and engine.input_processor is not None


def test_concurrent_requests_match_offline_llm(engine, offline, run):
    prompts, params = [], []
    for i in range(32):
        if i % 2:
            prompts.append(TEXTS[i % len(TEXTS)] + " " * (i % 3))
        else:
            prompts.append([(7 * i + j) % (VOCAB - 10) + 10 for j in range(3 + i)])
        params.append(SamplingParams(max_tokens=4 + i % 13, temperature=0, ignore_eos=i % 4 != 1))
    expected = offline.generate(prompts, params, use_tqdm=False)

    async def main():
        return await asyncio.gather(
            *(collect(engine, p, sp, f"c{i}") for i, (p, sp) in enumerate(zip(prompts, params)))
        )

    streams = run(main())
    for i, (outs, want) in enumerate(zip(streams, expected)):
        final = outs[-1]
        assert final.finished and all(not o.finished for o in outs[:-1])
        assert final.request_id == f"c{i}"
        assert final.prompt_token_ids == want.prompt_token_ids
        got, ref = final.outputs[0], want.outputs[0]
        assert (got.token_ids, got.text, got.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)
    run(wait_until(lambda: idle(engine)))
    stats = engine.get_stats()
    assert stats.kv_cache_usage == 0 and stats.num_running == 0
    assert stats.generation_tokens_total >= sum(len(o.outputs[0].token_ids) for o in expected)
    assert stats.prompt_tokens_total >= sum(len(o.prompt_token_ids) for o in expected)


def test_delta_stream_concatenates_and_stop_strings(engine, offline, run):
    base = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    text = offline.generate("hello", base, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip() and stop in text

    async def main():
        delta = SamplingParams(
            max_tokens=20, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        final_only = SamplingParams(
            max_tokens=20, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
        )
        stopped = SamplingParams(
            max_tokens=20, temperature=0, ignore_eos=True, stop=[stop], output_kind=RequestOutputKind.DELTA
        )
        return await asyncio.gather(
            collect(engine, "hello", delta, "d-delta"),
            collect(engine, "hello", final_only, "d-final"),
            collect(engine, "hello", stopped, "d-stop"),
        )

    deltas, finals, stops = run(main())
    assert len(deltas) > 1 and "".join(o.outputs[0].text for o in deltas) == text
    assert len(finals) == 1 and finals[0].finished and finals[0].outputs[0].text == text
    assert sum((o.outputs[0].token_ids for o in deltas), []) == finals[0].outputs[0].token_ids
    assert len(finals[0].outputs[0].token_ids) == 20
    assert "".join(o.outputs[0].text for o in stops) == text[: text.index(stop)]
    assert stops[-1].outputs[0].finish_reason == "stop" and stops[-1].outputs[0].stop_reason == stop
    run(wait_until(lambda: idle(engine)))  # the stop string's FINISH freed the request in the core


def test_consumer_leaving_early_aborts_and_frees_blocks(engine, run):
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def leave_with_aclose():
        gen = engine.generate(list(range(10, 60)), long, "early-aclose")
        first = await gen.__anext__()
        assert not first.finished
        await gen.aclose()

    async def leave_by_cancel():
        got_one = asyncio.Event()

        async def consume():
            async for _ in engine.generate(list(range(60, 90)), long, "early-cancel"):
                got_one.set()

        task = asyncio.create_task(consume())
        await got_one.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def abort_by_id():
        gen = engine.generate(list(range(90, 120)), long, "early-abort")
        await gen.__anext__()
        await engine.abort("early-abort")
        outs = [o async for o in gen]
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        assert len(outs[-1].outputs[0].token_ids) < 200

    for scenario in (leave_with_aclose, leave_by_cancel, abort_by_id):
        before = engine.get_stats().generation_tokens_total
        run(scenario())
        run(wait_until(lambda: idle(engine)))
        # Freed within a few steps, not after running on to its 200 tokens.
        assert engine.get_stats().generation_tokens_total - before < 100, scenario.__name__


@pytest.mark.parametrize(
    "prompt, kwargs, match",
    [
        ("", {}, "empty"),
        ([], {}, "empty"),
        (list(range(10, 10 + 300)), {}, "max_model_len"),
        ([5, VOCAB + 3], {}, "out of range"),
        ([5, 6, 7], {"logit_bias": {VOCAB + 5: 1.0}}, "logit_bias"),
    ],
)
def test_bad_input_raises_before_sending_and_engine_keeps_serving(engine, run, prompt, kwargs, match):
    async def main():
        with pytest.raises(ValueError, match=match):
            await collect(engine, prompt, SamplingParams(max_tokens=4, **kwargs), "bad")
        assert engine.num_unfinished == 0
        outs = await collect(
            engine, [5, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), "bad"
        )
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4

    run(main())


def test_duplicate_request_id_rejected(engine, run):
    async def main():
        gen = engine.generate([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True), "dup")
        await gen.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await collect(engine, [5, 6], SamplingParams(max_tokens=2), "dup")
        await gen.aclose()
        await wait_until(lambda: idle(engine))

    run(main())


def test_n_samples_and_logprobs_cross_the_wire(engine, offline, run):
    params = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=7, logprobs=2, ignore_eos=True)
    want = offline.generate([[12, 13, 14, 15]], params, use_tqdm=False)[0]
    got = run(collect(engine, [12, 13, 14, 15], params, "n3"))[-1]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    for g, w in zip(got.outputs, want.outputs):
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-4)
        assert [sorted(e) for e in g.logprobs] == [sorted(e) for e in w.logprobs]
    run(wait_until(lambda: idle(engine)))


def test_slow_delta_consumer_gets_merged_outputs(engine, run):
    async def main():
        params = SamplingParams(
            n=2, max_tokens=30, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        final = SamplingParams(n=2, max_tokens=30, temperature=0, ignore_eos=True)
        ref = (await collect(engine, "hello world", final, "slow-ref"))[-1]
        outs = []
        async for out in engine.generate("hello world", params, "slow"):
            outs.append(out)
            await asyncio.sleep(0.02)  # the engine runs ahead; missed deltas get merged
        assert len(outs) < 30 and outs[-1].finished
        for i in range(2):
            assert "".join(o.outputs[i].text for o in outs) == ref.outputs[i].text
            assert sum((o.outputs[i].token_ids for o in outs), []) == ref.outputs[i].token_ids
            assert outs[-1].outputs[i].finish_reason == "length"

    run(main())


def test_bad_wire_message_is_ignored(engine, run):
    engine._input_sock.send(b"\xc1 not msgpack")
    engine._input_sock.send(b"\x93\xa3add\xa1x\x01")  # an ADD with fields of the wrong types
    outs = run(collect(engine, [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), "after-garbage"))
    assert outs[-1].finished and engine.is_healthy and engine.engine_process.is_alive()


def test_shutdown_drains_in_flight_request(engine, run):
    """Last test on the shared engine: it shuts it down."""

    async def main():
        params = SamplingParams(
            max_tokens=40, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        task = asyncio.create_task(collect(engine, [8, 9, 10, 11], params, "drain"))
        await asyncio.sleep(0)  # let it send its request
        await wait_until(lambda: engine.num_unfinished == 1)
        await engine.shutdown(drain_timeout=20)
        outs = await task
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        assert len(sum((o.outputs[0].token_ids for o in outs), [])) == 40
        assert not engine.is_healthy and not engine.engine_process.is_alive()
        with pytest.raises(EngineDeadError):
            await collect(engine, [5, 6], SamplingParams(max_tokens=2), "after")
        await engine.shutdown()  # twice is fine

    tmpdir = engine._tmpdir
    run(main())
    assert tmpdir is not None and not os.path.exists(tmpdir)


def test_killed_core_fails_in_flight_requests(tiny_qwen2_dir):
    async def main():
        async with await AsyncLLM.create(EngineConfig(model=tiny_qwen2_dir, **ENGINE_ARGS)) as llm:
            gen = llm.generate(list(range(10, 40)), SamplingParams(max_tokens=220, ignore_eos=True), "doomed")
            await gen.__anext__()
            llm.engine_process.kill()
            killed = time.monotonic()
            with pytest.raises(EngineDeadError, match="died"):
                async for _ in gen:
                    pass
            assert time.monotonic() - killed < 3
            assert not llm.is_healthy and "exit code" in llm.dead_reason
            with pytest.raises(EngineDeadError):
                await collect(llm, [5, 6], SamplingParams(max_tokens=2), "next")

    asyncio.run(asyncio.wait_for(main(), 30))


def test_core_start_failure_raises_runtime_error(tiny_qwen2_dir):
    # 8 blocks of 4 tokens cannot hold one max_model_len=256 request: the core refuses to start.
    config = EngineConfig(model=tiny_qwen2_dir, **{**ENGINE_ARGS, "num_gpu_blocks_override": 8})
    with pytest.raises(RuntimeError, match="fewer than max_model_len"):
        asyncio.run(asyncio.wait_for(AsyncLLM.create(config), 30))


def test_core_loop_survives_bad_input_and_reports_a_failing_step(tiny_qwen2_dir, tmp_path):
    """The core loop in this process (a thread), on real sockets: bad messages are skipped, a step that
    raises is reported as EngineFatal and ends the loop."""
    config = EngineConfig(model=tiny_qwen2_dir, **ENGINE_ARGS)
    core = EngineCore(config, load_config(tiny_qwen2_dir), tiny_qwen2_dir, 256)
    ctx = zmq.Context()
    core_in, api_out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    core_out, api_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    core_in.bind(f"ipc://{tmp_path}/in")
    api_out.connect(f"ipc://{tmp_path}/in")
    api_in.bind(f"ipc://{tmp_path}/out")
    core_out.connect(f"ipc://{tmp_path}/out")
    proc = EngineCoreProc(core, core_in, core_out, os.getppid())
    result = []
    thread = threading.Thread(target=lambda: result.append(proc.run()), daemon=True)
    thread.start()
    try:
        enc, dec = m.input_encoder(), m.output_decoder()
        api_out.send(b"junk")
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        params.all_stop_token_ids = {1}
        add = m.AddRequest("a", [5, 6, 7], params, [1], time.monotonic(), 3)
        api_out.send(enc.encode(add))
        tokens = []
        while not tokens or tokens[-1].finish_reason is None:
            assert api_in.poll(10_000)
            msg = dec.decode(api_in.recv())
            assert isinstance(msg, m.EngineStepOutputs)
            tokens += msg.outputs
        assert sum(len(o.new_token_ids) for o in tokens) == 3 and tokens[-1].finish_reason == "length"
        assert msg.stats.kv_cache_usage == 0 and msg.stats.generation_tokens_total == 3

        def boom():
            raise RuntimeError("boom")

        core.step = boom
        api_out.send(enc.encode(m.AddRequest("b", [5, 6], params, [1], time.monotonic(), 3)))
        assert api_in.poll(10_000)
        fatal = dec.decode(api_in.recv())
        assert isinstance(fatal, m.EngineFatal) and "boom" in fatal.error
        thread.join(10)
        assert result == [1]
    finally:
        api_out.send(enc.encode(m.Shutdown()))
        thread.join(10)
        for sock in (core_in, api_out, core_out, api_in):
            sock.close(linger=0)
        ctx.term()
