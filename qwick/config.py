"""Engine settings. Torch-free: the scheduler, KV manager and API process import it.

Names follow vLLM's engine arguments so users can carry their flags over.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qwick.quantization import quantization_names

# Accepted `kv_cache_dtype` values (vLLM's names) -> the canonical one. "auto": the model's dtype;
# "fp8" / "fp8_e4m3": float8 e4m3 with per-layer scales, half the bytes of bf16 per cached token.
KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8", "fp8_e4m3": "fp8"}


@dataclass
class CacheConfig:
    block_size: int = 16
    num_gpu_blocks: int = 0  # decided by the runner from memory, or num_gpu_blocks_override
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # or "priority": lower `priority` value first, then arrival
    max_waiting_requests: int | None = None  # the server's queue bound; None: unbounded
    # Schedule step n+1 before step n's sampled tokens reach the host (the engine core overlaps them).
    async_scheduling: bool = False


@dataclass
class EngineConfig:
    """Everything `LLM(...)` and `qwick serve` accept, validated in one place."""

    model: str | None = None  # None: the built-in demo model
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 4.0  # KV pool size when running on the CPU
    enforce_eager: bool = False
    # Prepare and launch step n+1 while step n runs on the device (see qwick/engine/engine_core.py).
    # None: on with a GPU (it hides the host's per-step work), off on the CPU (nothing runs alongside).
    async_scheduling: bool | None = None
    seed: int = 0
    quantization: str | None = None  # "fp8", "int8", ... (qwick.quantization); a checkpoint's is detected
    # The LM head quantized too, by the modes that quantize while loading (fp8, int8, int4) or keep a GGUF
    # file's blocks (gguf). None: an 8-bit head for fp8, int8 and int4 (int4's in int8: +0.1% perplexity
    # where a 4-bit head costs +1.8%; 2-7% faster batch-1 decode on an H200), none for gguf; True: the
    # body's format (int4 too); False: the model dtype. A quantized checkpoint keeps its head as it ships.
    # See BENCHMARKS.md ("The LM head quantized too").
    quantize_lm_head: bool | None = None
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) or "fp8" (= "fp8_e4m3"): see KV_CACHE_DTYPES
    tensor_parallel_size: int = 1
    load_format: str = "auto"  # "auto", "safetensors", "gguf", "dummy"
    attention_backend: str = "auto"  # "auto" (triton on CUDA, torch elsewhere), "torch", "triton"
    device: str = "auto"  # "auto", "cuda", "cpu"
    revision: str | None = None
    trust_remote_code: bool = False
    scheduling_policy: str = "fcfs"
    hf_overrides: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(f"block_size must be a power of two up to 256, got {self.block_size}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(
                f"num_gpu_blocks_override must be at least 1, got {self.num_gpu_blocks_override}."
            )
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy", "pt"):
            raise ValueError(
                f"load_format must be one of auto, safetensors, gguf, dummy, got {self.load_format!r}."
            )
        if self.dtype not in ("auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp32"):
            raise ValueError(f"dtype must be one of auto, float32, float16, bfloat16, got {self.dtype!r}.")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}."
            )
        if self.quantization == "none":
            self.quantization = None
        if self.quantization is not None and self.quantization not in quantization_names():
            supported = ", ".join(quantization_names())
            raise ValueError(f"unknown quantization {self.quantization!r}; qwick supports: {supported}.")
        if self.quantize_lm_head and self.quantization is None:
            raise ValueError(
                "quantize_lm_head needs quantization=fp8, int8, int4 or gguf: the head is quantized (or kept "
                "packed) while loading; an unquantized model, or a quantized checkpoint, keeps its head."
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}."
            )
        self.kv_cache_dtype = KV_CACHE_DTYPES[self.kv_cache_dtype]
        if self.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size > 1 is not supported yet.")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}."
            )


def default_max_num_batched_tokens(config: EngineConfig, max_model_len: int) -> int:
    """Tokens one step may schedule: `max_num_batched_tokens`, or by default 8192 (at least max_model_len
    without chunked prefill, where a whole prompt must fit in one step). The scheduler spends it; the
    runner's memory profile runs a step of this size."""
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens
    return 8192 if config.enable_chunked_prefill else max(8192, max_model_len)
