"""The in-process engine behind `LLM`: text in, `RequestOutput`s out.

Input processor (tokenize, validate, fan out `n > 1`) -> engine core (schedule, run the model) ->
output processor (detokenize, stop strings, assemble). The server uses the same two processors around an
engine core that runs in its own process.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

from transformers import AutoTokenizer

from qwick.config import EngineConfig
from qwick.engine.engine_core import EngineCore
from qwick.engine.output_processor import OutputProcessor
from qwick.engine.processor import InputProcessor, ProcessorLimits, eos_token_ids
from qwick.loader.model_loader import derive_max_model_len, load_config, resolve_model
from qwick.outputs import RequestOutput
from qwick.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        start = time.perf_counter()
        resolved = resolve_model(config.model, config.revision)
        self.model_name = resolved.name
        self.model_path = resolved.path
        self.hf_config = load_config(resolved.path)
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or resolved.path)
        self.max_model_len = derive_max_model_len(self.hf_config, config.max_model_len)
        self.config = config
        self.core = EngineCore(config, self.hf_config, resolved.path, self.max_model_len)
        self.vocab_size = self.hf_config.vocab_size
        limits = ProcessorLimits(self.vocab_size, self.max_model_len, config.enable_prefix_caching)
        self.input_processor = InputProcessor(
            self.tokenizer, eos_token_ids(resolved.path, self.tokenizer), limits
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self.load_time = time.perf_counter() - start
        runner = self.core.runner
        logger.info(
            "qwick ready: %s (%s) on %s, %s, max_model_len=%d, KV cache %d tokens, loaded in %.1fs",
            self.model_name,
            resolved.source,
            runner.device,
            str(runner.dtype).removeprefix("torch."),
            self.max_model_len,
            self.core.num_kv_tokens,
            self.load_time,
        )

    @property
    def eos_token_ids(self) -> set[int]:
        return self.input_processor.eos_ids

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.output_processor.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        state, requests = self.input_processor.process(request_id, prompt, params, priority=priority)
        self.output_processor.add(state)
        for request in requests:
            self.core.add_request(request)
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.core.abort_requests(self.output_processor.core_ids(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return an output for every request that progressed."""
        outputs, stopped = self.output_processor.process(self.core.step())
        if stopped:
            self.core.finish_requests(stopped)
        return outputs
