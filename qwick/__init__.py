"""qwick: a latency-first inference engine for Qwen-family language models.

`LLM` is imported lazily so that torch-free parts (scheduler, KV cache manager, sampling params) can be
imported without torch.
"""

from typing import TYPE_CHECKING

from qwick.outputs import CompletionOutput, Logprob, RequestOutput
from qwick.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from qwick.entrypoints.llm import LLM

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "RequestOutputKind",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from qwick.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'qwick' has no attribute {name!r}")
