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

from qwick.config import EngineConfig
from qwick.engine.engine_core import EngineCore
from qwick.engine.processor import build_frontend
from qwick.outputs import RequestOutput
from qwick.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        start = time.perf_counter()
        front = build_frontend(config)
        self.model_name, self.model_path = front.model_name, front.model_path
        self.hf_config, self.tokenizer = front.hf_config, front.tokenizer
        self.max_model_len = front.max_model_len
        self.vocab_size = front.hf_config.vocab_size
        self.input_processor, self.output_processor = front.input_processor, front.output_processor
        self.config = config
        self.core = EngineCore(
            config, self.hf_config, self.model_path, self.max_model_len, tokenizer=self.tokenizer
        )
        self._ids = itertools.count()
        self.load_time = time.perf_counter() - start
        runner = self.core.runner
        logger.info(
            "qwick ready: %s (%s) on %s, %s, max_model_len=%d, KV cache %d tokens, loaded in %.1fs",
            self.model_name,
            front.model_source,
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
