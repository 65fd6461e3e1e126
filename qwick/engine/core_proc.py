"""The engine-core process: an `EngineCore` stepped in a loop behind two ZMQ sockets.

The API process (`AsyncLLM`) starts `run_engine_core` with multiprocessing's "spawn" context. The loop never
waits on HTTP: while any request is unfinished it takes whatever input is pending without blocking, runs one
step and pushes that step's outputs as one message; when nothing is unfinished it blocks on the input socket
(with a timeout, to notice a dead parent).

Sockets: the core binds the input PULL socket and connects its output PUSH socket to the API's bound PULL.
Both sending sides connect, so a send never blocks on a peer that is not there yet (ZMQ queues on the
connecting side), and both queues are unbounded (HWM 0): the core never stalls on a slow API process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
import traceback

import msgspec
import zmq

from qwick.config import EngineConfig
from qwick.engine import messages as m
from qwick.engine.startup_gc import freeze_startup_objects

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 500  # while idle, how often to check that the parent is still alive


def run_engine_core(
    config: EngineConfig,
    model_path: str,
    max_model_len: int,
    input_addr: str,
    output_addr: str,
    log_level: int | None = None,
) -> None:
    """The engine-core process's main: build the core, report READY (or FAILED and exit), then serve."""
    _setup_logging(log_level)
    # Ctrl-C reaches the whole process group; the API process decides when the core stops (SHUTDOWN).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent_pid = os.getppid()
    ctx = zmq.Context(1)
    input_sock = ctx.socket(zmq.PULL)
    input_sock.setsockopt(zmq.RCVHWM, 0)
    output_sock = ctx.socket(zmq.PUSH)
    output_sock.setsockopt(zmq.SNDHWM, 0)
    encoder = m.output_encoder()
    exit_code = 0
    proc: EngineCoreProc | None = None
    try:
        input_sock.bind(input_addr)
        output_sock.connect(output_addr)
        try:
            core = _build_core(config, model_path, max_model_len)
        except Exception as exc:
            logger.error("engine core failed to start: %s", exc, exc_info=True)
            error = f"{type(exc).__name__}: {exc}"
            output_sock.send(encoder.encode(m.EngineFailed(error, traceback.format_exc())))
            exit_code = 1
            return
        runner = core.runner
        freeze_startup_objects("engine core")
        ready = m.EngineReady(
            pid=os.getpid(),
            max_model_len=core.max_model_len,
            num_kv_tokens=core.num_kv_tokens,
            num_blocks=runner.num_blocks,
            block_size=config.block_size,
            device=str(runner.device),
            dtype=str(runner.dtype).removeprefix("torch."),
            vocab_size=runner.vocab_size,
        )
        output_sock.send(encoder.encode(ready))
        proc = EngineCoreProc(core, input_sock, output_sock, parent_pid)
        exit_code = proc.run()
    finally:
        orphaned = proc is not None and proc.orphaned
        # Linger so READY/FAILED/the last step reach the API process before the sockets go away.
        input_sock.close(linger=0)
        output_sock.close(linger=0 if orphaned else 2000)
        ctx.term()
        if orphaned:  # nobody else will clean up the socket files
            _remove_ipc_files(input_addr, output_addr)
        if exit_code:
            sys.exit(exit_code)


def _setup_logging(level: int | None) -> None:
    root = logging.getLogger()
    if not root.handlers:  # a spawned process starts with no logging configuration
        logging.basicConfig(
            level=logging.INFO if level is None else level,
            format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s",
        )
    elif level is not None:
        root.setLevel(level)


def _remove_ipc_files(*addrs: str) -> None:
    paths = [a.removeprefix("ipc://") for a in addrs if a.startswith("ipc://")]
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)
    for directory in {os.path.dirname(p) for p in paths}:
        with contextlib.suppress(OSError):
            os.rmdir(directory)  # only if empty: it is the API process's private temp dir


def _build_core(config: EngineConfig, model_path: str, max_model_len: int):
    from qwick.engine.engine_core import EngineCore
    from qwick.loader.model_loader import load_config

    return EngineCore(config, load_config(model_path), model_path, max_model_len)


class EngineCoreProc:
    """The loop: drain input, step, push outputs + stats; block on input while idle."""

    def __init__(self, core, input_sock: zmq.Socket, output_sock: zmq.Socket, parent_pid: int) -> None:
        self.core = core
        self.input_sock = input_sock
        self.output_sock = output_sock
        self.parent_pid = parent_pid
        self.decoder = m.input_decoder()
        self.encoder = m.output_encoder()
        self._need_step = False  # aborted requests still to be reported by a step
        self._prompt_lens: dict[str, int] = {}  # requests not yet counted in prompt_tokens_total
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._last_stats: m.EngineStats | None = None
        self.orphaned = False  # the API process died: exit without lingering

    def run(self) -> int:
        """Serve until SHUTDOWN (0), the parent's death (0) or a failing step (1)."""
        while True:
            busy = self.core.has_unfinished_requests() or self._need_step
            if not busy and not self._wait_for_input():
                return self._orphan()
            if not self._drain_input():
                logger.info("engine core shutting down")
                return 0
            if self.core.has_unfinished_requests() or self._need_step:
                if os.getppid() != self.parent_pid:
                    return self._orphan()
                try:
                    self._step()
                except Exception as exc:
                    logger.critical("engine step failed: %s", exc, exc_info=True)
                    fatal = m.EngineFatal(f"{type(exc).__name__}: {exc}", traceback.format_exc())
                    self.output_sock.send(self.encoder.encode(fatal))
                    return 1
            else:
                self._publish([])  # e.g. a stop string finished the last request: report the freed blocks

    def _orphan(self) -> int:
        logger.warning("the API process is gone; engine core exiting")
        self.orphaned = True
        return 0

    # ---- input ---------------------------------------------------------------------------------------

    def _wait_for_input(self) -> bool:
        """Block until input is pending. False: the parent process died meanwhile."""
        while not self.input_sock.poll(IDLE_POLL_MS):
            if os.getppid() != self.parent_pid:
                return False
        return True

    def _drain_input(self) -> bool:
        """Apply every pending input message without blocking. False: SHUTDOWN received."""
        while True:
            try:
                buf = self.input_sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            try:
                msg = self.decoder.decode(buf.buffer)
            except Exception as exc:  # never die on one bad message
                self._bad_message(buf.buffer, exc)
                continue
            if isinstance(msg, m.Shutdown):
                return False
            try:
                self._handle(msg)
            except Exception as exc:
                logger.error("engine core could not apply %s: %s", type(msg).__name__, exc, exc_info=True)
                if isinstance(msg, m.AddRequest):
                    self._reject(msg.request_id)

    def _handle(self, msg: m.EngineInput) -> None:
        if isinstance(msg, m.AddRequest):
            self.core.add_request(msg.to_request())
            self._prompt_lens[msg.request_id] = len(msg.prompt_token_ids)
        elif isinstance(msg, m.AbortRequests):
            self.core.abort_requests(msg.request_ids)
            self._need_step = True  # the next step reports them ("abort") and the freed blocks
        elif isinstance(msg, m.FinishRequests):
            self.core.finish_requests(msg.request_ids)
            for rid in msg.request_ids:
                self._prompt_lens.pop(rid, None)

    def _bad_message(self, buf, exc: Exception) -> None:
        logger.error("engine core got a message it cannot decode (%s); ignoring it", exc)
        try:  # an ADD whose id is readable gets an "abort" back, so the API side never waits on it
            raw = msgspec.msgpack.decode(buf)
        except Exception:
            return
        if isinstance(raw, list) and len(raw) > 1 and raw[0] == "add" and isinstance(raw[1], str):
            self._reject(raw[1])

    def _reject(self, request_id: str) -> None:
        """Report a request the core could not take as aborted (unless it is live under that id)."""
        if request_id in self.core.scheduler.requests:
            return
        from qwick.engine.engine_core import EngineCoreOutput

        now = time.monotonic()
        out = EngineCoreOutput(request_id, [], None, "abort", None, 0, now, None, None, now)
        self._publish([out])

    # ---- one step ------------------------------------------------------------------------------------

    def _step(self) -> None:
        self._need_step = False
        outputs = self.core.step()
        for out in outputs:
            if out.new_token_ids:
                self._generation_tokens_total += len(out.new_token_ids)
                n = self._prompt_lens.pop(out.request_id, None)
                if n is not None:
                    self._prompt_tokens_total += n
            if out.finish_reason is not None:
                self._prompt_lens.pop(out.request_id, None)
        self._publish(outputs)

    def _publish(self, outputs: list) -> None:
        """Send the step's outputs with a stats snapshot; nothing at all if neither has news."""
        s = self.core.scheduler.get_stats()
        stats = m.EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_cache_usage=s.kv_cache_usage,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
        )
        if not outputs and stats == self._last_stats:
            return
        self._last_stats = stats
        msg = m.EngineStepOutputs(outputs, stats, time.monotonic())
        self.output_sock.send(self.encoder.encode(msg), copy=False)
