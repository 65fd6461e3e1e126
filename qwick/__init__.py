"""qwick: a latency-first inference engine for Qwen-family language models."""

from qwick.entrypoints.llm import LLM
from qwick.outputs import CompletionOutput, Logprob, RequestOutput
from qwick.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestOutputKind"]
__version__ = "0.1.0"
