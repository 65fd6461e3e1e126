"""`quantization="gguf"`: a .gguf model's linear weights kept in their GGUF blocks' precision, repacked.

GGUF files load through a converted Hugging Face directory whose model.safetensors holds every tensor
dequantized to float32 (qwick/loader/gguf.py). With this mode the decoder's linear layers skip those float
copies and read the GGUF file's own blocks instead: `formats.gguf_quant.repack` turns Q8_0, Q5_0, Q4_K and
Q6_K blocks into `QuantizedWeight` *losslessly* (dequantizing the repacked weight in fp32 gives bit for bit
what `gguf.quants.dequantize` gives, hence what the float32 directory holds; fused shards of mixed types
give the same values, a zero's sign aside), so the model computes with the same weights as the dequantized
load, from fewer bytes (the LM head too with `quantize_lm_head`: the file's `output.weight`, or for a tied
model its token embedding's blocks, the lookups keeping the float table):

    Q4_K -> 4-bit codes, fp32 scale and min per 32        6 bits per weight (the file: 4.5)
    Q5_0 -> 8-bit codes holding 5 bits, fp16 scale per 32  8.5 bits (the file: 5.5)
    Q6_K -> 8-bit codes holding 6 bits, fp32 scale per 16  10 bits (the file: 6.56)
    Q8_0 -> 8-bit codes, fp16 scale per 32                 8.5 bits (the file: 8.5)

against 16 bits in bf16. Shards fused into one layer (q/k/v, gate/up) with different types share one form:
`layout.fuse_n` (the same zero-point form when it can, else 8-bit codes with fp32 scales and mins in the
smallest group, still exact). Layers with another type (F16, Q4_0, Q5_K, IQ*, ...) load dequantized as
without this mode (logged); the embeddings always do, and the LM head unless `quantize_lm_head`.

Why a flag and not the default for GGUF files: on CPUs the reference path dequantizes every weight on
every forward, which is several times slower than the oneDNN bf16 matmul of the dequantized load. The
demo model on this project's 2-core Xeon (`qwick bench latency --input-len 128 --output-len 64`): decode
277 ms/step against 64 ms, time to first token 363 ms against 144 ms; quality is the same (perplexity
4.579 both, teacher-forced top-1 99.8%), the decoder's linear layers take 357 MiB instead of 683 MiB.
On CUDA the W4A16 kernel (`qwick.kernels.w4a16`, BITS=8 and mins included) reads the repacked blocks
directly at decode.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from qwick.layers.linear import Linear
from qwick.quantization.base import QuantizationConfig
from qwick.quantization.formats import gguf_quant
from qwick.quantization.formats.layout import QuantizedWeight, dequantize, fuse_n, take_rows
from qwick.quantization.int4 import PackedLinearMethod

logger = logging.getLogger(__name__)


class GgufConfig(QuantizationConfig):
    name = "gguf"
    can_quantize_lm_head = True

    def __init__(self, gguf_path: str, tensors: dict[str, Any]) -> None:
        self.gguf_path = gguf_path
        self.tensors = tensors  # HF name -> qwick.loader.gguf.StoredTensor, until loaded
        self.kept: set[str] = set()  # weights whose layers keep them quantized
        self.kept_types: set[str] = set()
        self.dequantized: dict[str, str] = {}  # layer -> why it loads dequantized

    @classmethod
    def for_model_dir(cls, path: str | None) -> GgufConfig:
        if path is None:
            raise ValueError(
                "quantization='gguf' keeps a GGUF file's tensors quantized; it cannot be combined with "
                "load_format='dummy' (random weights have no GGUF blocks)"
            )
        from qwick.loader.gguf import source_gguf, stored_tensors

        gguf_path = source_gguf(path)
        return cls(gguf_path, stored_tensors(gguf_path))

    def describe(self) -> str:
        text = f"gguf (linear tensors kept quantized: {', '.join(sorted(self.kept_types)) or 'none'}"
        if self.dequantized:
            text += f"; {len(self.dequantized)} layers dequantized"
        return text + ")"

    def linear_method(self, prefix: str, shard_names: Sequence[str]) -> GgufLinearMethod | None:
        if prefix == "lm_head":
            if self.lm_head_format() is None:  # stays in the model dtype unless asked
                return None
            if "lm_head.weight" not in self.tensors:  # tied: the head keeps the embedding's blocks
                self.tensors["lm_head.weight"] = self.tensors.get("model.embed_tokens.weight")
        names = [f"{n}.weight" for n in shard_names]
        stored = [self.tensors.get(n) for n in names]
        if any(t is None for t in stored):
            missing = [n for n, t in zip(names, stored) if t is None]
            raise ValueError(f"{self.gguf_path} has no tensor for {missing}")
        unsupported = sorted({t.type_name for t in stored if t.qtype not in gguf_quant.SUPPORTED_TYPES})
        if unsupported:
            self.dequantized[prefix] = ", ".join(unsupported)
            logger.info(
                "gguf: %s is stored as %s, which qwick cannot keep quantized: loaded dequantized",
                prefix,
                self.dequantized[prefix],
            )
            return None
        self.kept.update(names)
        self.kept_types.update(t.type_name for t in stored)
        return GgufLinearMethod([t.type_name for t in stored])

    def checkpoint_weights(self, path: str) -> Iterator[tuple[str, Any]]:
        """The converted directory's float tensors except the kept weights, then the kept weights' GGUF
        blocks (`StoredTensor`s, which `GgufLinearMethod.load_extra` repacks)."""
        from qwick.loader.weights import iterate_safetensors

        kept = set(self.kept)
        yield from iterate_safetensors(path, skip=kept.__contains__)
        for name in sorted(kept):
            yield name, self.tensors[name]
        if self.dequantized:
            logger.warning(
                "gguf: %d linear layers hold types qwick cannot keep quantized (%s) and were loaded "
                "dequantized",
                len(self.dequantized),
                ", ".join(sorted(set(self.dequantized.values()))),
            )
        self.tensors = {}  # all loaded: let the file's memory map go


class GgufLinearMethod(PackedLinearMethod):
    """A linear layer whose (packed) weights are GGUF tensors repacked into `QuantizedWeight`.

    No parameter until loaded: each shard's blocks arrive through `load_extra` (as a `StoredTensor`) and
    are repacked at once (the file's bytes are not kept); `process_weights_after_loading` fuses the shards.
    """

    def __init__(self, types: Sequence[str]) -> None:
        self.types = list(types)
        self.parts: dict[int, QuantizedWeight] = {}
        self.device = torch.device("cpu")

    def describe(self) -> str:
        types = "+".join(dict.fromkeys(self.types))
        if not hasattr(self, "bits"):
            return f"gguf {types} kept quantized"
        return f"gguf {types} kept quantized ({self.bits}-bit codes, group {self.internal_group_size})"

    def create_weights(self, layer: Linear) -> None:
        self.device = torch.empty(0).device  # the device the model is being built on

    def load_extra(self, layer: Linear, param_name: str, tensor: Any, shard: int) -> bool:
        if param_name != "weight":
            return False
        from qwick.loader.gguf import StoredTensor, unpermute_qk_rows

        if not isinstance(tensor, StoredTensor):
            raise ValueError(
                "this layer keeps its GGUF blocks quantized and loads them from the .gguf file, not from a "
                f"float tensor (got {type(tensor).__name__})"
            )
        expected = (layer.output_sizes[shard], layer.input_size)
        if tensor.shape != expected:
            raise ValueError(f"GGUF tensor {tensor.hf_name} has shape {tensor.shape}, the layer {expected}")
        qw = gguf_quant.repack(tensor.data, tensor.qtype, tensor.shape)
        if tensor.permute_heads:  # llama: undo llama.cpp's q/k row order (rows are independent)
            order = torch.from_numpy(unpermute_qk_rows(tensor.shape[0], tensor.permute_heads))
            qw = take_rows(qw, order)
        self.parts[shard] = qw
        return True

    def process_weights_after_loading(self, layer: Linear) -> None:
        if hasattr(self, "bits"):  # already processed
            return
        missing = [i for i in range(len(layer.output_sizes)) if i not in self.parts]
        if missing:
            raise ValueError(f"GGUF blocks of shard(s) {missing} of a {self.types} layer were not loaded")
        qw = fuse_n([self.parts[i] for i in range(len(layer.output_sizes))])
        self.parts = {}
        self._install(layer, qw.to(self.device))

    def dense_weight(self, layer: Linear) -> torch.Tensor:
        if not hasattr(self, "bits"):  # not processed yet
            return torch.cat([dequantize(self.parts[i]) for i in sorted(self.parts)])
        return super().dense_weight(layer)
