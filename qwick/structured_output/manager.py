"""Per-request grammar state and the engine core's compile cache.

Compilation runs on a worker thread, never on the engine's loop: a request whose grammar is still compiling
waits in the queue (the scheduler skips it while `request.structured_output.ready` is False) and the others
keep running. Compiled grammars are cached per `GrammarSpec`; each request (each sample of an `n > 1`
request) gets its own `xgrammar.GrammarMatcher` over the shared compiled grammar.

The matcher is advanced with every token the request accepts and is never rebuilt: preemption by recompute
keeps the request's output tokens, so the matcher's position stays right.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from qwick.structured_output.grammar import GrammarSpec, compile_spec, grammar_spec, import_xgrammar

if TYPE_CHECKING:
    from qwick.core.request import Request

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse (least recently used go first). A compiled grammar for a 152k vocabulary
# takes from a few KB to about 1 MB; xgrammar's own compiler cache gets the same byte budget.
MAX_CACHED_GRAMMARS = 1024
MAX_CACHE_BYTES = 256 << 20


class RequestGrammar:
    """One request's constraint: the compiled grammar (maybe still compiling) and its matcher.

    The scheduler reads `ready`, calls `accept` for each sampled token and checks `is_terminated`; the
    sampler calls `fill_bitmask`. That small interface is all they see, so neither imports xgrammar.
    """

    __slots__ = ("spec", "_future", "_stop_token_ids", "matcher", "ready", "error")

    def __init__(self, spec: GrammarSpec, future: cf.Future, stop_token_ids: list[int]) -> None:
        self.spec = spec
        self._future = future
        self._stop_token_ids = stop_token_ids
        self.matcher: Any = None
        self.ready = False  # compiled and matched: the request may be scheduled
        self.error: str | None = None  # compilation failed: the request must be finished

    def poll(self) -> bool:
        """Build the matcher once compilation is done. True when nothing is left to wait for."""
        if self.ready or self.error is not None:
            return True
        if not self._future.done():
            return False
        try:
            compiled = self._future.result()
            xgr = import_xgrammar()
            self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=self._stop_token_ids or None)
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            return True
        self.ready = True
        return True

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the tokens allowed next into row `row` of an int32 [B, ceil(V / 32)] bitmask."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token. False: the grammar does not allow it (the row was all -inf)."""
        return bool(self.matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: the request is done."""
        return bool(self.matcher.is_terminated())


class StructuredOutputManager:
    """Compiles grammars off the engine loop (cached per spec) and tracks requests waiting on them.

    The tokenizer is needed only here, and only once the first constrained request arrives: pass the
    front end's tokenizer (in-process engine) or the path to load it from (the engine-core process).
    Loading it and building xgrammar's tokenizer tables also happens on the worker thread.
    """

    def __init__(self, vocab_size: int, tokenizer: Any = None, tokenizer_path: str | None = None) -> None:
        if tokenizer is None and tokenizer_path is None:
            raise ValueError("StructuredOutputManager needs a tokenizer or a path to load one from")
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._tokenizer_path = tokenizer_path
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._executor: cf.ThreadPoolExecutor | None = None
        self._cache: OrderedDict[GrammarSpec, cf.Future] = OrderedDict()
        self._pending: dict[str, Request] = {}  # request id -> request whose grammar is not ready yet

    # ---- requests ------------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Attach a `RequestGrammar` to a constrained request and start compiling if needed."""
        params = request.sampling_params
        assert params.structured_outputs is not None
        spec = grammar_spec(params.structured_outputs)
        # The grammar's end: the model's EOS ids (what `all_stop_token_ids` adds to the user's stop ids).
        # User stop ids stay ordinary tokens to the grammar; sampling one still ends the request.
        eos_ids = params.all_stop_token_ids - set(params.stop_token_ids or ())
        grammar = RequestGrammar(spec, self._compile(spec), sorted(eos_ids))
        request.structured_output = grammar
        if not grammar.poll() or grammar.error is not None:
            self._pending[request.request_id] = request

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def poll(self) -> list[Request]:
        """Make requests whose grammar compiled ready; return (and forget) those whose compilation failed."""
        failed = []
        for rid, request in list(self._pending.items()):
            grammar = request.structured_output
            if request.is_finished:  # aborted while waiting
                del self._pending[rid]
            elif grammar.poll():
                del self._pending[rid]
                if grammar.error is not None:
                    logger.error("grammar of request %s failed to compile: %s", rid, grammar.error)
                    failed.append(request)
        return failed

    def wait(self, timeout: float) -> None:
        """Block until some pending grammar finishes compiling (or `timeout` s): an idle engine loop
        waits here instead of spinning."""
        futures = [r.structured_output._future for r in self._pending.values()]
        if futures:
            cf.wait(futures, timeout=timeout, return_when=cf.FIRST_COMPLETED)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- compilation ---------------------------------------------------------------------------------

    def _compile(self, spec: GrammarSpec) -> cf.Future:
        future = self._cache.get(spec)
        if future is not None:
            self._cache.move_to_end(spec)
            return future
        if self._executor is None:
            self._executor = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="qwick-grammar")
        future = self._executor.submit(self._compile_now, spec)
        self._cache[spec] = future
        self._evict()
        return future

    def _evict(self) -> None:
        """Drop the least recently used entries over the count or byte budget (only on a cache miss).
        Requests holding an evicted grammar keep it alive; a failed compilation stays cached (it would
        fail again)."""
        sizes = {
            spec: f.result().memory_size_bytes
            if f.done() and not f.cancelled() and f.exception() is None
            else 0
            for spec, f in self._cache.items()
        }
        total = sum(sizes.values())
        while len(self._cache) > 1 and (len(self._cache) > MAX_CACHED_GRAMMARS or total > MAX_CACHE_BYTES):
            spec, _ = self._cache.popitem(last=False)
            total -= sizes[spec]

    def _compile_now(self, spec: GrammarSpec) -> Any:
        return compile_spec(self._get_compiler(), spec)

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgr = import_xgrammar()
                tokenizer = self._tokenizer
                if tokenizer is None:
                    from transformers import AutoTokenizer

                    tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_path)
                # The model's vocabulary can be larger than the tokenizer's (padding rows of the
                # embedding): xgrammar masks those ids, so they are never sampled.
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
                threads = max(1, min(8, (os.cpu_count() or 2) // 2))
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=threads, cache_limit_bytes=MAX_CACHE_BYTES
                )
            return self._compiler
