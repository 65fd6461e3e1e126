"""`AsyncLLM`: the API process's asyncio client of an engine core running in its own process.

The API process tokenizes and validates (`InputProcessor`), sends requests to the core over ZMQ, and turns
the core's per-step token outputs into `RequestOutput`s (`OutputProcessor`: detokenize, stop strings). The
model never runs on the event loop, and the core never waits on HTTP.

    engine = await AsyncLLM.create(EngineConfig(model=...))
    async for out in engine.generate("Hello", SamplingParams(max_tokens=32), request_id="r1"):
        print(out.outputs[0].text)
    await engine.shutdown()

One background task reads the core's output socket: one message per engine step, folded into the output
processor at once, each resulting `RequestOutput` handed to its request's collector. A consumer that lags
behind gets the outputs it missed merged into one (DELTA: concatenated; CUMULATIVE / FINAL_ONLY: the newest),
so a slow client never makes the reader queue work. While the socket is quiet the same task watches the core
process; if it dies, every in-flight `generate()` raises `EngineDeadError` within a fraction of a second.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import AsyncIterator, Sequence

import zmq
import zmq.asyncio

from qwick.config import EngineConfig
from qwick.engine import messages as m
from qwick.engine.core_proc import run_engine_core
from qwick.engine.processor import build_frontend
from qwick.outputs import RequestOutput
from qwick.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 0.2  # how often the reader checks the core process while the socket is quiet


class EngineDeadError(RuntimeError):
    """The engine-core process is gone (crashed, killed or shut down): no request can be served."""


class _Collector:
    """The outputs of one request that its consumer has not taken yet (at most one, merged)."""

    __slots__ = ("output", "dead_reason", "event", "delta")

    def __init__(self, delta: bool) -> None:
        self.output: RequestOutput | None = None
        self.dead_reason: str | None = None
        self.event = asyncio.Event()
        self.delta = delta

    def put(self, output: RequestOutput) -> None:
        if self.output is None or not self.delta:
            self.output = output  # CUMULATIVE / FINAL_ONLY: the newest output holds everything
        else:
            _merge_delta(self.output, output)
        self.event.set()

    def fail(self, reason: str) -> None:
        self.dead_reason = reason
        self.event.set()

    async def get(self) -> RequestOutput:
        while True:
            output = self.output
            if output is not None:
                self.output = None
                return output
            if self.dead_reason is not None:
                raise EngineDeadError(self.dead_reason)
            self.event.clear()
            await self.event.wait()


def _merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    """Append a DELTA output to one the consumer has not taken yet."""
    by_index = {c.index: c for c in into.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            into.outputs.append(c)
            continue
        old.text += c.text
        old.token_ids = old.token_ids + c.token_ids
        if c.logprobs is not None:
            old.logprobs = (old.logprobs or []) + c.logprobs
        old.cumulative_logprob = c.cumulative_logprob
        old.finish_reason = c.finish_reason
        old.stop_reason = c.stop_reason
    into.finished = new.finished
    into.num_cached_tokens = new.num_cached_tokens
    into.metrics = new.metrics


async def _wait_exit(proc: multiprocessing.process.BaseProcess, timeout: float) -> None:
    """Wait for a process to exit, without blocking the event loop (and without a thread)."""
    deadline = time.monotonic() + timeout
    while proc.is_alive() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


class AsyncLLM:
    """An engine core in a child process, driven from asyncio: build it with `await AsyncLLM.create(...)`."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.engine_process: multiprocessing.process.BaseProcess | None = None
        self.dead_reason: str | None = None
        self._accepting = False
        self._closed = False
        self._stopping = False  # SHUTDOWN sent (or about to be): the core exiting is expected
        self._collectors: dict[str, _Collector] = {}
        self._stats = m.EngineStats()
        self._reader: asyncio.Task | None = None
        self._zmq_ctx: zmq.Context | None = None
        self._input_sock: zmq.Socket | None = None
        self._output_sock: zmq.asyncio.Socket | None = None
        self._tmpdir: str | None = None
        self._encoder = m.input_encoder()
        self._decoder = m.output_decoder()

    # ---- start-up ------------------------------------------------------------------------------------

    @classmethod
    async def create(cls, config: EngineConfig, *, startup_timeout: float | None = None) -> AsyncLLM:
        """Load the tokenizer here, start the core process, and wait (without blocking) until it is ready.

        Raises RuntimeError with the core's error when it cannot start (or dies, or times out, starting).
        """
        self = cls(config)
        try:
            await self._start(startup_timeout)
        except BaseException:
            await self._teardown(graceful=False)
            raise
        return self

    def _load_api_side(self) -> None:
        front = build_frontend(self.config)
        self.model_name, self.model_path = front.model_name, front.model_path
        self.model_source = front.model_source
        self.hf_config, self.tokenizer = front.hf_config, front.tokenizer
        self.max_model_len = front.max_model_len
        self.vocab_size = front.hf_config.vocab_size
        self.input_processor, self.output_processor = front.input_processor, front.output_processor

    async def _start(self, startup_timeout: float | None) -> None:
        start = time.perf_counter()
        # Resolving may download or convert a model, and the tokenizer takes a moment: off the event loop.
        await asyncio.to_thread(self._load_api_side)

        self._tmpdir = tempfile.mkdtemp(prefix="qwick-engine-")
        weakref.finalize(self, shutil.rmtree, self._tmpdir, ignore_errors=True)
        input_addr = f"ipc://{os.path.join(self._tmpdir, 'input')}"
        output_addr = f"ipc://{os.path.join(self._tmpdir, 'output')}"
        self._zmq_ctx = zmq.Context(1)
        # The core binds its input PULL; we connect (a connecting PUSH queues until the peer is there).
        self._input_sock = self._zmq_ctx.socket(zmq.PUSH)
        self._input_sock.setsockopt(zmq.SNDHWM, 0)
        self._input_sock.setsockopt(zmq.LINGER, 0)
        self._input_sock.connect(input_addr)
        self._output_sock = zmq.asyncio.Socket(self._zmq_ctx, zmq.PULL)
        self._output_sock.setsockopt(zmq.RCVHWM, 0)
        self._output_sock.setsockopt(zmq.LINGER, 0)
        self._output_sock.bind(output_addr)

        spawn = multiprocessing.get_context("spawn")
        self.engine_process = spawn.Process(
            target=run_engine_core,
            args=(self.config, self.model_path, self.max_model_len, input_addr, output_addr),
            kwargs={"log_level": logging.getLogger("qwick").getEffectiveLevel()},
            name="qwick-engine-core",
            daemon=True,
        )
        self.engine_process.start()

        ready = await self._wait_ready(startup_timeout)
        self.num_kv_tokens = ready.num_kv_tokens
        self.num_blocks = ready.num_blocks
        self.block_size = ready.block_size
        self.device = ready.device
        self.dtype = ready.dtype
        self.load_time = time.perf_counter() - start
        self._accepting = True
        self._reader = asyncio.create_task(self._read_outputs(), name="qwick-engine-output-reader")
        logger.info(
            "qwick ready: %s (%s) on %s, %s, max_model_len=%d, KV cache %d tokens, engine core pid %d, "
            "loaded in %.1fs",
            self.model_name,
            self.model_source,
            self.device,
            self.dtype,
            self.max_model_len,
            self.num_kv_tokens,
            ready.pid,
            self.load_time,
        )

    async def _wait_ready(self, timeout: float | None) -> m.EngineReady:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        sock, proc = self._output_sock, self.engine_process
        while True:
            if not await sock.poll(int(WATCHDOG_INTERVAL_S * 1000)):
                if not proc.is_alive():
                    # It may have said why just before exiting: give the message a moment to arrive.
                    if not await sock.poll(200):
                        raise RuntimeError(
                            f"the engine core process exited with code {proc.exitcode} during start-up"
                        )
                elif deadline is not None and loop.time() > deadline:
                    raise RuntimeError(f"the engine core did not start within {timeout:.0f}s")
                else:
                    continue
            msg = self._decoder.decode(await sock.recv())
            if isinstance(msg, m.EngineReady):
                return msg
            if isinstance(msg, m.EngineFailed):
                raise RuntimeError(f"the engine core failed to start: {msg.error}")
            logger.warning("ignoring %s from the engine core during start-up", type(msg).__name__)

    # ---- properties ----------------------------------------------------------------------------------

    @property
    def eos_token_ids(self) -> set[int]:
        return self.input_processor.eos_ids

    @property
    def is_healthy(self) -> bool:
        """True while the core process serves requests (False once it died or was shut down)."""
        return self.dead_reason is None and not self._closed

    @property
    def is_accepting(self) -> bool:
        """True while new `generate()` calls are taken (False once shutdown began or the core died)."""
        return self._accepting and self.is_healthy

    @property
    def num_unfinished(self) -> int:
        """User requests the API process still tracks (running, waiting, or aborted and not yet confirmed)."""
        return len(self.output_processor.states)

    def get_tokenizer(self):
        return self.tokenizer

    def get_stats(self) -> m.EngineStats:
        """The latest snapshot from the core (updated every step): num_running, num_waiting, kv_cache_usage,
        prefix_cache_queries, prefix_cache_hits, num_preemptions, prompt_tokens_total,
        generation_tokens_total. Token and preemption counts are totals since start."""
        return self._stats

    async def check_health(self) -> None:
        if not self.is_healthy:
            raise EngineDeadError(self.dead_reason or "the engine is shut down")

    # ---- requests ------------------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as the engine produces them (per `params.output_kind`).

        Bad input raises ValueError before anything reaches the core. Leaving the loop early (break,
        aclose, task cancelled) aborts the request in the core. Raises EngineDeadError if the core dies.
        """
        if not self.is_accepting:
            raise EngineDeadError(self.dead_reason or "the engine is shutting down")
        if request_id in self._collectors:  # its consumer is still iterating
            raise ValueError(f"request id {request_id!r} is already in use")
        state, requests = self.input_processor.process(request_id, prompt, params, priority=priority)
        self.output_processor.add(state)  # ValueError if the id is in use
        collector = _Collector(params.output_kind == RequestOutputKind.DELTA)
        self._collectors[request_id] = collector
        finished = False
        try:
            for request in requests:
                self._send(m.AddRequest.from_request(request))
            while True:
                out = await collector.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if self._collectors.get(request_id) is collector:
                del self._collectors[request_id]
            if not finished and self.is_healthy:
                # The consumer left (or the send failed): free the request's KV blocks in the core. Its
                # state here goes when the core confirms the abort.
                self._send_abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a request: its generate() ends with finish_reason "abort" once the core confirms."""
        self._send_abort(request_id)

    def _send_abort(self, request_id: str) -> None:
        core_ids = self.output_processor.core_ids(request_id)
        if core_ids and self.is_healthy:
            try:
                self._send(m.AbortRequests(core_ids))
            except Exception as exc:  # never raise from a generator's cleanup
                logger.warning("could not abort %s: %s", request_id, exc)

    def _send(self, msg: m.EngineInput) -> None:
        # Non-blocking by construction: a connecting PUSH socket with no high-water mark.
        self._input_sock.send(self._encoder.encode(msg), zmq.NOBLOCK, copy=False)

    # ---- outputs -------------------------------------------------------------------------------------

    async def _read_outputs(self) -> None:
        sock, proc = self._output_sock, self.engine_process
        timeout_ms = int(WATCHDOG_INTERVAL_S * 1000)
        try:
            while True:
                if not await sock.poll(timeout_ms):
                    if proc.is_alive():
                        continue
                    # Deliver what it sent before it went, then fail everything else.
                    while await sock.poll(100):
                        frame = await sock.recv(copy=False)
                        if not self._handle(self._decoder.decode(frame.buffer)):
                            return
                    if self._stopping:
                        self._set_dead("the engine was shut down")
                    else:
                        self._set_dead(f"the engine core process died (exit code {proc.exitcode})")
                    return
                frame = await sock.recv(copy=False)
                if not self._handle(self._decoder.decode(frame.buffer)):
                    return
                await asyncio.sleep(0)  # let consumers run between steps
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("the engine output reader failed")
            self._set_dead(f"the engine output reader failed: {type(exc).__name__}: {exc}")
            if proc.is_alive():
                proc.kill()

    def _handle(self, msg: m.EngineOutput) -> bool:
        """Apply one message from the core. False: the core is going down (reader stops)."""
        if isinstance(msg, m.EngineStepOutputs):
            self._stats = msg.stats
            if msg.outputs:
                outputs, stopped = self.output_processor.process(msg.outputs)
                if stopped and self.is_healthy:
                    self._send(m.FinishRequests(stopped))
                for out in outputs:
                    collector = self._collectors.get(out.request_id)
                    if collector is not None:
                        collector.put(out)
            return True
        if isinstance(msg, m.EngineFatal):
            logger.error("engine core failed: %s\n%s", msg.error, msg.traceback)
            self._set_dead(f"the engine core failed: {msg.error}")
            return False
        logger.warning("ignoring unexpected %s from the engine core", type(msg).__name__)
        return True

    def _set_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        if not self._stopping:
            logger.error("%s; failing %d in-flight request(s)", reason, len(self._collectors))
        self.dead_reason = reason
        self._accepting = False
        for collector in self._collectors.values():
            collector.fail(reason)

    # ---- shutdown ------------------------------------------------------------------------------------

    async def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop taking requests, let in-flight ones finish (up to `drain_timeout` s, then abort them),
        stop the core process and release its sockets and temp dir. Safe to call twice."""
        if self._closed:
            return
        self._accepting = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout
        while self.num_unfinished and self.dead_reason is None and loop.time() < deadline:
            await asyncio.sleep(0.01)
        if self.num_unfinished and self.dead_reason is None:
            logger.warning("shutdown: aborting %d request(s) still running", self.num_unfinished)
            states = list(self.output_processor.states.values())
            self._send(m.AbortRequests([core_id for state in states for core_id in state.samples]))
            abort_deadline = loop.time() + 1.0
            while self.num_unfinished and self.dead_reason is None and loop.time() < abort_deadline:
                await asyncio.sleep(0.01)
        await self._teardown(graceful=True)

    async def _teardown(self, graceful: bool) -> None:
        self._accepting = False
        proc = self.engine_process
        self._stopping = True
        if graceful and proc is not None and proc.is_alive() and self._input_sock is not None:
            try:
                self._send(m.Shutdown())
            except Exception as exc:
                logger.warning("could not send SHUTDOWN to the engine core: %s", exc)
            await _wait_exit(proc, 5.0)
        if proc is not None and proc.pid is not None:
            if proc.is_alive():
                proc.terminate()
                await _wait_exit(proc, 2.0)
            if proc.is_alive():
                proc.kill()
                await _wait_exit(proc, 2.0)
        self._closed = True
        if self.dead_reason is None:
            self.dead_reason = "the engine was shut down"
            for collector in self._collectors.values():
                collector.fail(self.dead_reason)
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.wait([self._reader])  # without re-raising its CancelledError
            self._reader = None
        for sock in (self._input_sock, self._output_sock):
            if sock is not None:
                sock.close(linger=0)
        self._input_sock = self._output_sock = None
        if self._zmq_ctx is not None:
            self._zmq_ctx.term()
            self._zmq_ctx = None
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.shutdown()
