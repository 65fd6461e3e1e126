"""The model runner: owns the model, the KV pool and the sampler; turns a SchedulerOutput into tokens.

Per step: flatten the scheduled rows into one token batch (ids, positions, attention metadata), run the
model once, compute logits only for rows that reach their last token, and sample them in one batched call.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig

from qwick.config import EngineConfig, default_max_num_batched_tokens
from qwick.core.scheduler_output import SchedulerOutput
from qwick.device_upload import to_device
from qwick.forward_context import set_forward_context
from qwick.kernels import token_patch
from qwick.layers.attention.backend import (
    AttentionBackend,
    AttentionRow,
    OutputRows,
    is_fp8_kv,
    kv_cache_tensor,
    kv_cache_torch_dtype,
)
from qwick.layers.attention.torch_ref import TorchAttentionBackend
from qwick.layers.linear import Linear
from qwick.loader.model_loader import build_model, resolve_dtype
from qwick.runner.sampler import Sampler, SamplerOutput, SamplingMetadata

logger = logging.getLogger(__name__)


@dataclass
class TokenLogprobs:
    """The sampled token's logprob and rank, and the top candidates (token id, logprob), best first."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class RunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)


@dataclass
class LaunchedStep:
    """A step queued on the device: its sampling rows and their samples, being copied to pinned host
    memory; `ready` (CUDA) fires when the copy is done. Waiting on it, not on the stream, leaves any step
    launched after this one running."""

    sampling_rows: list
    sampled: SamplerOutput
    ready: torch.cuda.Event | None = None


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' was requested but no CUDA GPU is available")
    return torch.device(name)


def zeros_on_demand(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose CPU memory is committed only as it is touched.

    `torch.zeros` writes every byte up front (4.6 s for a 4 GiB KV pool on the CPU); calloc'd memory from
    numpy comes from zero-filled pages of the OS instead, so allocation is instant. Zeros (not garbage)
    matter: masked-out slots must not hold NaNs, which would leak through the attention softmax.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    buffer = np.zeros(math.prod(shape) * itemsize, dtype=np.uint8)
    return torch.from_numpy(buffer).view(dtype).view(shape)


def select_attention_backend(
    name: str, block_size: int, device: torch.device, early_decode: bool = False
) -> AttentionBackend:
    """Triton kernels on CUDA GPUs; the PyTorch reference everywhere else (and on request).
    `early_decode`: the QKV projections let decode attention launch early (`LinearMethod.lets_next_in`)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        if device.type != "cuda":
            raise ValueError("attention_backend='triton' needs a CUDA device")
        from qwick.layers.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(block_size, device, early_decode=early_decode)
    return TorchAttentionBackend(block_size, device)


def qkv_lets_next_in(model: nn.Module) -> bool:
    """Whether the model's QKV projections let the kernel after them (decode attention) launch early."""
    return any(
        name.endswith("qkv_proj") and isinstance(m, Linear) and m.method.lets_next_in
        for name, m in model.named_modules()
    )


class ModelRunner:
    def __init__(
        self,
        engine_config: EngineConfig,
        hf_config: PretrainedConfig,
        model_path: str | None,
        max_model_len: int,
    ) -> None:
        self.config = engine_config
        self.hf_config = hf_config
        self.device = pick_device(engine_config.device)
        # None (auto): overlap the host's per-step work with the device's only where they run side by side
        self.async_scheduling = engine_config.async_scheduling
        if self.async_scheduling is None:
            self.async_scheduling = self.device.type == "cuda"
        self.dtype = resolve_dtype(engine_config.dtype, hf_config, self.device)
        self.kv_cache_dtype = kv_cache_torch_dtype(engine_config.kv_cache_dtype, self.dtype)
        self.max_model_len = max_model_len
        self.block_size = engine_config.block_size
        torch.manual_seed(engine_config.seed)
        self.model = build_model(
            hf_config,
            model_path,
            dtype=self.dtype,
            device=self.device,
            max_len=max_model_len,
            load_format=engine_config.load_format,
            seed=engine_config.seed,
            quantization=engine_config.quantization,
            quantize_lm_head=engine_config.quantize_lm_head,
        )
        self.vocab_size = hf_config.vocab_size
        self.backend = select_attention_backend(
            engine_config.attention_backend, self.block_size, self.device, qkv_lets_next_in(self.model)
        )
        self._check_kv_cache_dtype()
        self.sampler = Sampler(seed=engine_config.seed)
        self.graph_runner = self._make_graph_runner()
        self.prefill_graphs = self._make_prefill_graph_runner()
        # The last launched step's sampled ids (device) and each request's row in them: the inputs of
        # rows scheduled before those ids reach the host (async scheduling).
        self._prev_sampled: torch.Tensor | None = None
        self._prev_rows: dict[str, int] = {}
        self._patch_index: tuple[tuple, torch.Tensor] | None = None  # `_patch`'s last slots, on the device
        # Eager steps run the model's last layer past its KV write only for the tokens that sample
        # (`OutputRows`); off, every token goes through the whole model (for A/B measurements).
        self.sampled_rows_only = True
        # Steps of decode rows and one prompt chunk of at most this many tokens run as two graph replays,
        # the decode rows' and then the chunk's, instead of one eager forward (0: off). Each replay reads
        # every weight, but an eager forward of a short chunk waits on the host (~0.5 ms a layer at 7b
        # shapes). H200, 7b shapes, TTFT of a prompt arriving beside 8 / 64 decoders, split against eager
        # (`gpu_session.sh mixedsplit`, bf16): 128 tokens 13.6 / 21.4 and 15.3 / 33.5 ms, 512 tokens
        # 19.4 / 20.9 and 20.6 / 22.7, 1024 tokens 28.9 / 27.4 and 30.2 / 30.1 (no gain).
        self.split_mixed_max_tokens = 512
        self.graph_reserve_bytes = 0  # set by the GPU memory profile when graphs are on
        self.num_blocks = self._decide_num_blocks()
        self._allocate_kv_cache(self.num_blocks)
        self._log_kv_cache()
        if self.graph_runner is not None:
            self._capture_graphs()
        if self.device.type == "cuda" and engine_config.num_gpu_blocks_override is None:
            # Leave the allocator's cache holding the profiled worst step's blocks (graph capture emptied
            # it), so that later steps carve theirs out of those. From an empty cache, a batch growing
            # step by step needs slightly larger sampler blocks each time, each a fresh segment: the
            # reserved memory then grows far past the profiled peak (16 GB instead of 1.7 in a simulation
            # of the allocator, 256 rows of a 152k vocabulary reached 4 rows a step).
            self._run_worst_step()
        if self.device.type == "cuda":
            self._compile_serving_kernels()
        elif self._has_cpu_int4_layers():
            self._warm_up_cpu_decode()

    # ---- CUDA graphs ---------------------------------------------------------------------------------
    def _make_graph_runner(self):
        """Decode steps replay CUDA graphs on CUDA with the Triton backend, unless enforce_eager."""
        if self.device.type != "cuda" or self.backend.name != "triton" or self.config.enforce_eager:
            return None
        from qwick.runner.cuda_graphs import DecodeGraphRunner

        return DecodeGraphRunner(
            self.model,
            self.backend,
            max_batch=self.config.max_num_seqs,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            device=self.device,
        )

    def _make_prefill_graph_runner(self):
        """Steps of up to `PREFILL_GRAPH_ROWS` rows (a prompt chunk, alone or beside decode rows) and up to
        `PREFILL_GRAPH_TOKENS` tokens replay CUDA graphs too, where decode steps do."""
        from qwick.runner.prefill_graphs import PREFILL_GRAPH_ROWS, PREFILL_GRAPH_TOKENS, PrefillGraphRunner

        max_tokens = min(
            PREFILL_GRAPH_TOKENS, default_max_num_batched_tokens(self.config, self.max_model_len)
        )
        if self.graph_runner is None or max_tokens < 2:
            return None
        return PrefillGraphRunner(
            self.model,
            self.backend,
            max_rows=PREFILL_GRAPH_ROWS,
            max_tokens=max_tokens,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            device=self.device,
            dtype=self.dtype,
        )

    def _capture_graphs(self) -> None:
        try:
            self.graph_runner.capture()
        except Exception:  # a layer that syncs or allocates on the host: serve eagerly rather than fail
            logger.exception("CUDA graph capture failed; decode and prefill steps run eagerly")
            self.graph_runner = self.prefill_graphs = None
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            return
        if self.prefill_graphs is None:
            return
        try:
            self.prefill_graphs.capture(self.graph_runner.pool)
        except Exception:
            logger.exception("prefill CUDA graph capture failed; prefill steps run eagerly")
            self.prefill_graphs = None
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    @property
    def num_graph_replays(self) -> int:
        """Decode steps run as CUDA graph replays."""
        return self.graph_runner.num_replays if self.graph_runner is not None else 0

    @property
    def num_prefill_graph_replays(self) -> int:
        """Prompt-chunk steps run as CUDA graph replays."""
        return self.prefill_graphs.num_replays if self.prefill_graphs is not None else 0

    @torch.inference_mode()
    def _compile_serving_kernels(self) -> None:
        """Run once, at startup, every kernel variant that serving can reach outside the captured graphs,
        so that Triton compiles none of them on a user's request (each compile costs 0.3-1 s of TTFT):
        the prefill attention at its launch shapes (short, long and very long queries), prefills whose
        last layer runs only the last token (decode attention outside the graphs), the fp8 mid-M GEMM's
        two K splits (17-64 and 65-128 rows), int4's tiled kernel's launch shapes (2-16, 17-32, 33-64 and
        65-128 rows; graphs capture them only up to `max_num_seqs`), the LM head's skinny GEMM at every
        decode batch size, and the sampling kernels. Writes only to the null block."""
        t0 = time.perf_counter()
        for tokens in (16, 17, 33, 65, 160):
            hidden = self._null_forward([min(tokens, self.max_model_len)])
            self._null_forward([min(tokens, self.max_model_len)], last_tokens_only=True)
        # The longest prompt chunk a step can hold, and the backend's deeper-pipelined launch for long ones.
        longest = min(self.max_model_len, default_max_num_batched_tokens(self.config, self.max_model_len))
        long_queries = getattr(self.backend, "long_prefill_queries", None)
        if long_queries is not None and longest >= long_queries:
            self._null_forward([long_queries], last_tokens_only=True)
        # Prefills sampling 64 rows or more: the decode attention's large-batch tiles, outside the graphs.
        self._null_forward([16] * min(64, self.config.max_num_seqs), last_tokens_only=True)
        for m in range(1, min(16, self.config.max_num_seqs, hidden.shape[0]) + 1):
            self.model.compute_logits(hidden[:m])
        self.sampler.warm_up(self.vocab_size, self.device, self.dtype)
        token_patch.warm_up(self.device)
        torch.cuda.synchronize(self.device)
        logger.info("compiled the serving kernels in %.1f s", time.perf_counter() - t0)

    def _has_cpu_int4_layers(self) -> bool:
        """Whether some layer will repack its weight for torch's CPU int4 GEMM at its first decode-sized
        call (4-bit layers of a bf16 model, on a CPU that runs the kernel)."""
        from qwick.quantization.formats import cpu_int4
        from qwick.quantization.int4 import PackedLinearMethod

        if self.dtype != torch.bfloat16 or not cpu_int4.available():
            return False
        return any(isinstance(getattr(m, "method", None), PackedLinearMethod) for m in self.model.modules())

    @torch.inference_mode()
    def _warm_up_cpu_decode(self) -> None:
        """One 1-token forward at startup, so that 4-bit layers repack their codes for torch's CPU int4 GEMM
        now rather than on a user's first token (~0.7 s for the demo model, ~10 s at 7B). Writes only to
        the null block."""
        t0 = time.perf_counter()
        self._null_forward([1])
        logger.info("prepared the CPU decode path in %.1f s", time.perf_counter() - t0)

    # ---- KV pool -------------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        layers = self.model.attention_layers()
        per_layer = 2 * self.block_size * layers[0].num_kv_heads * layers[0].head_dim
        return per_layer * len(layers) * self.kv_cache_dtype.itemsize

    def _check_kv_cache_dtype(self) -> None:
        if not is_fp8_kv(self.kv_cache_dtype):
            return
        if self.backend.name == "triton" and torch.cuda.get_device_capability(self.device) < (8, 9):
            raise ValueError(
                "kv_cache_dtype='fp8' with Triton attention needs a GPU with fp8 support (compute "
                "capability 8.9+: Ada, Hopper or newer); use attention_backend='torch' on this GPU"
            )
        layers = self.model.attention_layers()
        calibrated = sum(layer.k_scale != 1.0 or layer.v_scale != 1.0 for layer in layers)
        if calibrated:
            logger.info(
                "fp8 KV cache: k/v scales from the checkpoint in %d of %d layers", calibrated, len(layers)
            )
        else:
            logger.info("fp8 KV cache: the checkpoint has no k/v scales; using 1.0 (values beyond 448 clip)")

    def _log_kv_cache(self) -> None:
        per_block = self.kv_bytes_per_block()
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens), %s, %.2f GiB",
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.block_size,
            str(self.kv_cache_dtype).removeprefix("torch."),
            self.num_blocks * per_block / 1024**3,
        )

    def _decide_num_blocks(self) -> int:
        if self.config.num_gpu_blocks_override is not None:
            return self.config.num_gpu_blocks_override
        per_block = self.kv_bytes_per_block()
        if self.device.type == "cpu":
            budget = int(self.config.cpu_kv_cache_gib * 1024**3)
        else:
            budget = self._profile_free_gpu_memory()
        return budget // per_block

    def _profile_free_gpu_memory(self) -> int:
        """Bytes left for the KV cache within gpu_memory_utilization, after what serving needs besides it.

        Measured, not guessed: the peak of the worst step (`_run_worst_step`) over everything already
        held (weights, GEMV workspace), as bytes the caching allocator reserves (its rounding and splitting
        included, from an emptied cache), plus the CUDA graphs' pool with a 25% margin. Never more than
        what the device has free now, less the same needs (the CUDA context and other processes hold
        memory that gpu_memory_utilization does not see).
        """
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._allocate_kv_cache(2)
        self._run_worst_step()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_reserved(self.device)
        graph_reserve = 0
        if self.graph_runner is not None:
            graph_bytes = self.graph_runner.profile_pool_bytes()
            if self.prefill_graphs is not None:  # the same pool: a sum over-counts what they share
                graph_bytes += self.prefill_graphs.profile_pool_bytes()
            graph_reserve = int(1.25 * graph_bytes) + (64 << 20)
        self.graph_reserve_bytes = graph_reserve
        self._release_kv_cache()
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        budget = int(total * self.config.gpu_memory_utilization) - peak - graph_reserve
        free, _ = torch.cuda.mem_get_info(self.device)
        available = free - (peak - torch.cuda.memory_reserved(self.device)) - graph_reserve
        if available < budget:
            logger.warning(
                "gpu_memory_utilization=%.2f asks for %.2f GiB more than the GPU has free; the KV cache "
                "gets what is free",
                self.config.gpu_memory_utilization,
                (budget - available) / 1024**3,
            )
        kv_budget = max(0, min(budget, available))
        logger.info(
            "memory profile: %.2f GiB in use at the worst step (weights included), %.2f GiB kept for CUDA "
            "graphs, %.2f GiB left for the KV cache (gpu_memory_utilization=%.2f of %.2f GiB)",
            peak / 1024**3,
            graph_reserve / 1024**3,
            kv_budget / 1024**3,
            self.config.gpu_memory_utilization,
            total / 1024**3,
        )
        return kv_budget

    @torch.inference_mode()
    def _run_worst_step(self) -> None:
        """The step whose activations need the most memory: a forward of every token a step may schedule
        (in rows of at most max_model_len, as chunked prefill packs prompts), then logits and sampling for
        max_num_seqs rows with every sampler feature on. Sampling matters as much as the forward: top-p
        sorts a [rows, vocab] fp32 tensor, and with penalties, softmax, cumsum and noise the sampler holds
        about ten of those at once (1.6 GB at 256 rows of a 152k vocabulary, more than a small model's
        prefill). Writes only to the null block."""
        max_len = self.max_model_len
        tokens = min(default_max_num_batched_tokens(self.config, max_len), self.config.max_num_seqs * max_len)
        hidden = self._null_forward([min(max_len, tokens - start) for start in range(0, tokens, max_len)])
        num_rows = min(self.config.max_num_seqs, tokens)
        logits = self.model.compute_logits(hidden[-num_rows:])
        meta = SamplingMetadata.worst_case(num_rows, self.vocab_size, max_len, self.device)
        Sampler(seed=0)(logits, meta)  # its own generator: the engine's random stream stays untouched

    def _null_forward(self, lengths: list[int], last_tokens_only: bool = False) -> torch.Tensor:
        """A forward of whole prompts of these lengths (token id 0) whose keys and values all land in the
        null block: for warm-ups and memory profiles, which need the kernels and the memory, not the cache.
        `last_tokens_only`: only each prompt's last token leaves the last layer, as in serving."""
        blocks = [[0] * ((n + self.block_size - 1) // self.block_size) for n in lengths]
        rows = [AttentionRow(0, n, b) for n, b in zip(lengths, blocks)]
        md = self.backend.build_metadata(rows)
        md.slot_mapping.zero_()
        ids = torch.zeros(sum(lengths), dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lengths])
        out = None
        if last_tokens_only:
            ends = np.cumsum(lengths) - 1
            out = OutputRows(self.backend, ends.tolist(), [r.last_query() for r in rows])
        with set_forward_context(md):
            return self.model(ids, positions, out)

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        for layer in self.model.attention_layers():
            layer.kv_cache = kv_cache_tensor(
                lambda shape: zeros_on_demand(shape, self.kv_cache_dtype, self.device),
                num_blocks,
                self.block_size,
                layer.num_kv_heads,
                layer.head_dim,
                self.backend.kv_layout,
            )
            layer.backend = self.backend

    def _release_kv_cache(self) -> None:
        for layer in self.model.attention_layers():
            layer.kv_cache = None

    # ---- one step ------------------------------------------------------------------------------------
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Run one step and return what it sampled (waits for the device)."""
        return self.collect(self.launch(scheduler_output))

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput) -> LaunchedStep | None:
        """Queue one step's work on the device and return without waiting for it; `collect` reads the
        result. Rows whose last input token is still in flight (async scheduling) take it from the
        previous launched step's sampled ids, on the device. None when the step runs nothing."""
        scheduled = scheduler_output.scheduled
        if not scheduled:
            return None
        token_ids: list[int] = []
        positions: list[int] = []
        rows: list[AttentionRow] = []
        logits_indices: list[int] = []
        sampling_rows = []
        sampling_row_index: list[int] = []  # each sampling row's index in `rows`
        patch_dst: list[int] = []  # input slots filled from the previous step's sampled ids
        patch_src: list[int] = []
        for item in scheduled:
            start, num = item.start_pos, item.num_tokens
            if item.placeholder_input:
                token_ids.extend(item.token_ids)
                patch_dst.append(len(token_ids))
                patch_src.append(self._prev_rows[item.request_id])
                token_ids.append(0)
            elif num == 1:  # a decode row: no slice, no range (the common case at large batch)
                token_ids.append(item.request.all_token_ids[start])
            else:
                token_ids.extend(item.token_ids)
            if num == 1:
                positions.append(start)
            else:
                positions.extend(range(start, start + num))
            rows.append(AttentionRow(start, num, item.block_table))
            if item.sample:
                logits_indices.append(len(token_ids) - 1)
                sampling_rows.append(item)
                sampling_row_index.append(len(rows) - 1)
        selected = self._run_forward(
            scheduled, rows, token_ids, positions, logits_indices, sampling_row_index, patch_dst, patch_src
        )
        if selected is None:  # nothing samples (a long prompt's middle chunk): the cache is filled
            return None
        logits = self.model.compute_logits(selected)
        requests = [item.request for item in sampling_rows]
        meta = SamplingMetadata.build(requests, self.vocab_size, self.device)
        sampled = self.sampler(logits, meta)
        ready = None
        if self.async_scheduling:  # the next step may read these on the device
            self._prev_sampled = sampled.sampled_token_ids
            self._prev_rows = {item.request_id: i for i, item in enumerate(sampling_rows)}
            if self.device.type == "cuda":
                sampled = sampled.to_host_async()
                ready = torch.cuda.Event()
                ready.record()
        return LaunchedStep(sampling_rows, sampled, ready)

    def _run_forward(
        self,
        scheduled: list,
        rows: list[AttentionRow],
        token_ids: list[int],
        positions: list[int],
        logits_indices: list[int],
        sampling_row_index: list[int],
        patch_dst: list[int],
        patch_src: list[int],
    ) -> torch.Tensor | None:
        """Run the step's forward: a decode graph (every row one token), a prefill graph (up to its
        `max_rows` rows, a prompt chunk among them), both (`_split_replay`) or eagerly. Returns the final
        hidden states of the sampling rows, in sampling order (None when nothing samples). Each branch
        uploads the in-flight patch it needs once."""
        graphs, prefill_graphs = self.graph_runner, self.prefill_graphs
        out = None
        if (
            graphs is not None
            and len(token_ids) == len(rows)  # pure decode: one token per row
            and graphs.can_run(len(rows), max(len(r.block_table) for r in rows))
        ):
            patch = self._patch(patch_dst, patch_src)
            hidden = graphs.replay(token_ids, positions, [r.block_table for r in rows], patch=patch)
        elif (
            prefill_graphs is not None
            and self.sampled_rows_only
            and prefill_graphs.can_run(len(token_ids), len(rows), max(len(r.block_table) for r in rows))
        ):  # one prompt chunk alone (or with `max_rows` > 1, a few rows)
            step, at = [], 0
            for r in rows:
                step.append((token_ids[at : at + r.num_tokens], r.start_pos, r.block_table))
                at += r.num_tokens
            last = prefill_graphs.replay(step, patch=self._patch(patch_dst, patch_src))  # rows' last tokens
            if not logits_indices:
                return None
            if len(rows) == 1:
                return last[:1]  # the graph's rows past the step's are unused
            return last[to_device(sampling_row_index, torch.long, self.device)]
        elif (
            split := self._split_replay(rows, token_ids, positions, patch_dst, patch_src, sampling_row_index)
        ) is not None:
            return split if logits_indices else None
        else:
            metadata = self.backend.build_metadata(rows)
            ids = to_device(token_ids, torch.long, self.device)
            if (patch := self._patch(patch_dst, patch_src)) is not None:
                patch(ids)
            pos = to_device(positions, torch.long, self.device)
            if self.sampled_rows_only and len(logits_indices) < len(token_ids):
                out = self._output_rows(scheduled, rows, logits_indices, len(token_ids))
            with set_forward_context(metadata):
                hidden = self.model(ids, pos, out)
        if not logits_indices:
            return None
        if out is not None:
            return hidden  # the output rows alone, in sampling order
        if len(logits_indices) == len(token_ids) and hidden.shape[0] >= len(token_ids):
            return hidden[: len(token_ids)]  # every row samples its only token: no gather
        return hidden[to_device(logits_indices, torch.long, self.device)]

    def _patch(self, dst: list[int], src: list[int]) -> Callable[[torch.Tensor], None] | None:
        """A function that fills input slots `dst` of a step's token ids (on the device) with the previous
        launched step's sampled ids at `src` (async scheduling); None when there are none. The slots are
        uploaded once while they stay the same (every step of a steady decode batch)."""
        if not dst:
            return None
        key = (tuple(dst), tuple(src))
        if self._patch_index is None or self._patch_index[0] != key:
            self._patch_index = (key, to_device(dst + src, torch.long, self.device))
        index, prev, n = self._patch_index[1], self._prev_sampled, len(dst)

        def patch(ids: torch.Tensor) -> None:
            token_patch.patch_token_ids(ids, prev, index, n)

        return patch

    def _split_replay(
        self,
        rows: list[AttentionRow],
        token_ids: list[int],
        positions: list[int],
        patch_dst: list[int],
        patch_src: list[int],
        sampling_row_index: list[int],
    ) -> torch.Tensor | None:
        """A step of decode rows and one prompt chunk of at most `split_mixed_max_tokens` tokens: the decode
        rows replay a decode graph, then the chunk a prefill graph (a row's attention reads only its own
        context, so the halves are independent). Returns the sampling rows' hidden states in sampling
        order, or None when the step does not qualify.

        In this order the decode graph's output survives the prefill replay: it was alive while the
        prefill graphs were captured into the shared pool, so none of their tensors lies over it."""
        graphs, prefill_graphs = self.graph_runner, self.prefill_graphs
        if self.split_mixed_max_tokens <= 0 or graphs is None or prefill_graphs is None:
            return None
        chunks = [i for i, r in enumerate(rows) if r.num_tokens > 1]
        if len(chunks) != 1 or len(rows) < 2 or not self.sampled_rows_only:
            return None
        c = chunks[0]
        chunk, n = rows[c], rows[c].num_tokens
        decode = rows[:c] + rows[c + 1 :]
        if (
            n > self.split_mixed_max_tokens
            or not prefill_graphs.can_run(n, 1, len(chunk.block_table))
            or not graphs.can_run(len(decode), max(len(r.block_table) for r in decode))
            or any(c <= t < c + n for t in patch_dst)  # the chunk's own input in flight
        ):
            return None
        # Flat token t is decode row t before the chunk (t < c), decode row t - n after it (t >= c + n).
        dec_tokens = [*range(c), *range(c + n, len(token_ids))]
        dec_patch = self._patch([t if t < c else t - n for t in patch_dst], patch_src)
        hidden = graphs.replay(
            [token_ids[t] for t in dec_tokens],
            [positions[t] for t in dec_tokens],
            [r.block_table for r in decode],
            patch=dec_patch,
        )
        last = prefill_graphs.replay([(token_ids[c : c + n], chunk.start_pos, chunk.block_table)])
        both = torch.cat([hidden[: len(decode)], last[:1]])  # decode rows in order, then the chunk's token
        order = [len(decode) if i == c else i - (i > c) for i in sampling_row_index]
        return both[to_device(order, torch.long, self.device)]

    def _output_rows(
        self, scheduled: list, rows: list[AttentionRow], logits_indices: list[int], num_tokens: int
    ) -> OutputRows:
        """The step's sampling tokens, each a one-query row over its context. When nothing samples (a
        long prompt's middle chunk), the last token stands in: its output is computed and unused."""
        if not logits_indices:
            return OutputRows(self.backend, [num_tokens - 1], [rows[-1].last_query()])
        sampling = [row.last_query() for row, item in zip(rows, scheduled) if item.sample]
        return OutputRows(self.backend, logits_indices, sampling)

    def collect(self, step: LaunchedStep | None) -> RunnerOutput:
        """Wait for a launched step and turn its samples into host lists."""
        out = RunnerOutput()
        if step is None:
            return out
        sampling_rows, sampled = step.sampling_rows, step.sampled
        if step.ready is not None:
            step.ready.synchronize()
        token_list = sampled.sampled_token_ids.tolist()
        for item, token in zip(sampling_rows, token_list):
            out.sampled_token_ids[item.request_id] = token
        if sampled.logprobs is not None:
            ids_l, lps_l, ranks = sampled.logprobs.tolists()
            for i, item in enumerate(sampling_rows):
                k = item.request.sampling_params.logprobs
                if k is None:
                    continue
                top = list(zip(ids_l[i][1 : 1 + k], lps_l[i][1 : 1 + k]))
                out.logprobs[item.request_id] = TokenLogprobs(lps_l[i][0], ranks[i], top)
        return out
