"""The wire between the API process and the engine-core process: msgspec Structs, sent as msgpack.

Two ZMQ PUSH/PULL channels (see `core_proc.py` and `async_llm.py`):

- requests in (API -> core): `AddRequest`, `AbortRequests`, `FinishRequests`, `Shutdown`;
- outputs out (core -> API): `EngineReady` or `EngineFailed` once at start-up, then one `EngineStepOutputs`
  per engine step (every request's new tokens of that step plus a stats snapshot), and `EngineFatal` if a
  step raises (the core exits after sending it).

Every message is a tagged, array-like Struct, so one decoder per direction tells them apart and field names
never travel. `EngineCoreOutput` and `TokenLogprobs` (defined next to the code that makes them) are plain
dataclasses, which msgspec encodes and decodes as they are, so the engine itself never imports msgspec.
"""

from __future__ import annotations

import msgspec

from qwick.core.request import Request
from qwick.engine.engine_core import EngineCoreOutput
from qwick.sampling_params import SamplingParams

# ---- requests in -------------------------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag="add", array_like=True, omit_defaults=True):
    """Everything the core needs to rebuild a `qwick.core.request.Request`."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # `SamplingParams.__post_init__` resets `all_stop_token_ids` when the core rebuilds the params, so the
    # full stop set (user stop ids + the model's EOS ids) travels on its own.
    all_stop_token_ids: list[int]
    arrival_time: float
    max_tokens: int
    priority: int = 0
    cache_salt: str | None = None

    @classmethod
    def from_request(cls, request: Request) -> AddRequest:
        params = request.sampling_params
        return cls(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=params,
            all_stop_token_ids=sorted(params.all_stop_token_ids),
            arrival_time=request.arrival_time,
            max_tokens=request.max_tokens,
            priority=request.priority,
            cache_salt=request.cache_salt,
        )

    def to_request(self) -> Request:
        params = self.sampling_params
        params.all_stop_token_ids = set(self.all_stop_token_ids)
        return Request(
            self.request_id,
            self.prompt_token_ids,
            params,
            arrival_time=self.arrival_time,
            priority=self.priority,
            cache_salt=self.cache_salt,
            max_tokens=self.max_tokens,
        )


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    """Drop these core requests (freeing their KV blocks); the core reports each with reason "abort"."""

    request_ids: list[str]


class FinishRequests(msgspec.Struct, tag="finish", array_like=True):
    """These core requests hit a stop string in the API process: finish them as "stop", no report."""

    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


EngineInput = AddRequest | AbortRequests | FinishRequests | Shutdown


# ---- outputs out -------------------------------------------------------------------------------------


class EngineReady(msgspec.Struct, tag="ready", array_like=True):
    """The core built its model and KV cache and is ready for requests."""

    pid: int
    max_model_len: int
    num_kv_tokens: int
    num_blocks: int
    block_size: int
    device: str
    dtype: str
    vocab_size: int


class EngineFailed(msgspec.Struct, tag="failed", array_like=True):
    """The core could not start; `error` is what to show the user, `traceback` is for the log."""

    error: str
    traceback: str = ""


class EngineStats(msgspec.Struct, array_like=True):
    """A snapshot after one step: the scheduler's stats plus the core's running token counters."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # tokens, since start
    prefix_cache_hits: int = 0  # tokens, since start
    num_preemptions: int = 0  # since start
    prompt_tokens_total: int = 0  # prompt tokens of requests that got their first token, since start
    generation_tokens_total: int = 0  # tokens generated, since start


class EngineStepOutputs(msgspec.Struct, tag="step", array_like=True):
    """One engine step: what every request that progressed (or finished) got, and the stats after it."""

    outputs: list[EngineCoreOutput]
    stats: EngineStats
    timestamp: float  # time.monotonic() in the core when the step ended (same clock in both processes)


class EngineFatal(msgspec.Struct, tag="fatal", array_like=True):
    """A step raised: the core is going down. `error` says why."""

    error: str
    traceback: str = ""


EngineOutput = EngineReady | EngineFailed | EngineStepOutputs | EngineFatal


def input_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineInput)


def output_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def output_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineOutput)
