"""One decoder-only transformer for the Qwen2 / Qwen2.5 / Qwen3 / Llama family.

The members differ by flags read from their config: QKV bias (Qwen2), per-head q/k RMSNorm (Qwen3),
o_proj/MLP bias (some Llamas), tied embeddings, sliding-window layers. Inputs are flat: all tokens of the
step's rows concatenated, with their positions; the attention backend knows which rows they belong to.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from qwick.layers.activation import SiluAndMul
from qwick.layers.attention.backend import OutputRows
from qwick.layers.attention.layer import Attention
from qwick.layers.linear import Linear, LinearMethod, NormAfter, PairedRows, QuantizedRows, VocabEmbedding
from qwick.layers.norm import RMSNorm
from qwick.layers.rotary import RopeStep, RotaryEmbedding
from qwick.quantization.base import QuantizationConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecoderFlags:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False


def _linear_method(
    quant_config: QuantizationConfig | None, prefix: str, leaves: list[str] | None = None
) -> LinearMethod | None:
    """The quantization method of the layer `prefix` (Hugging Face names), given the checkpoint modules
    (`leaves`, siblings of `prefix`) packed into it; None: unquantized."""
    if quant_config is None:
        return None
    parent = prefix.rpartition(".")[0]
    names = [f"{parent}.{leaf}" if parent else leaf for leaf in leaves] if leaves else [prefix]
    return quant_config.linear_method(prefix, names)


class DecoderAttention(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        flags: DecoderFlags,
        layer_idx: int,
        quant_config: QuantizationConfig | None = None,
    ):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        prefix = f"model.layers.{layer_idx}.self_attn"
        self.qkv_proj = Linear(
            config.hidden_size,
            [self.q_size, self.kv_size, self.kv_size],
            bias=flags.qkv_bias,
            method=_linear_method(quant_config, f"{prefix}.qkv_proj", ["q_proj", "k_proj", "v_proj"]),
        )
        self.qkv_proj.precedes_attention = True
        self.o_proj = Linear(
            self.q_size,
            config.hidden_size,
            bias=flags.o_bias,
            method=_linear_method(quant_config, f"{prefix}.o_proj"),
        )
        if flags.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.head_dim**-0.5,
            _sliding_window(config, layer_idx),
        )

    def forward(
        self,
        rope: RopeStep,
        x: torch.Tensor | QuantizedRows | PairedRows,
        output_rows: OutputRows | None = None,
    ) -> torch.Tensor:
        """Every token's keys and values go into the cache; the output is every token's, or only the
        `output_rows`' ones."""
        return self.o_proj(self.attend(rope, x, output_rows))

    def attend(
        self,
        rope: RopeStep,
        x: torch.Tensor | QuantizedRows | PairedRows,
        output_rows: OutputRows | None = None,
    ) -> torch.Tensor:
        """`forward` up to the output projection: the attention's output, o_proj's input."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        # The backend rotates q and k (with its KV write).
        return self.attn(q.flatten(1), k.flatten(1), v, rope, output_rows)


def _sliding_window(config: PretrainedConfig, layer_idx: int) -> int | None:
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return config.sliding_window if layer_types[layer_idx] == "sliding_attention" else None
    if getattr(config, "use_sliding_window", False) and config.sliding_window:
        return config.sliding_window if layer_idx >= getattr(config, "max_window_layers", 0) else None
    return None


class DecoderMLP(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        flags: DecoderFlags,
        layer_idx: int,
        quant_config: QuantizationConfig | None = None,
    ):
        super().__init__()
        inter = config.intermediate_size
        prefix = f"model.layers.{layer_idx}.mlp"
        self.gate_up_proj = Linear(
            config.hidden_size,
            [inter, inter],
            bias=flags.mlp_bias,
            method=_linear_method(quant_config, f"{prefix}.gate_up_proj", ["gate_proj", "up_proj"]),
        )
        self.down_proj = Linear(
            inter,
            config.hidden_size,
            bias=flags.mlp_bias,
            method=_linear_method(quant_config, f"{prefix}.down_proj"),
        )
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor | QuantizedRows | PairedRows) -> torch.Tensor:
        return self.down_proj(self.activation(x))

    def activation(
        self, x: torch.Tensor | QuantizedRows | PairedRows
    ) -> torch.Tensor | QuantizedRows | PairedRows:
        """silu(gate) * up, the down projection's input (with the codes or pairs it asks for): in the
        gate/up projection's launch where its method can, else SiLU-and-mul apart."""
        quant = self.down_proj.input_quant(_rows(x))
        act = self.gate_up_proj.gated(x, quant)
        if act is None:
            act = self.act(self.gate_up_proj(x), quant=quant)
        return act


def _rows(x: torch.Tensor | QuantizedRows | PairedRows) -> torch.Tensor:
    """The values of an input that may carry its codes or pairs (`input_quant` reads their rows, dtype and
    device)."""
    return x.x if isinstance(x, (QuantizedRows, PairedRows)) else x


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        flags: DecoderFlags,
        layer_idx: int,
        quant_config: QuantizationConfig | None = None,
    ):
        super().__init__()
        self.self_attn = DecoderAttention(config, flags, layer_idx, quant_config)
        self.mlp = DecoderMLP(config, flags, layer_idx, quant_config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        rope: RopeStep,
        x: torch.Tensor | QuantizedRows | PairedRows,
        residual: torch.Tensor | None,
        output_rows: OutputRows | None = None,
        normed: bool = False,
        then: RMSNorm | None = None,
        then_input: Linear | None = None,
    ) -> tuple[torch.Tensor | QuantizedRows | PairedRows, torch.Tensor, bool]:
        """One layer over the step's tokens; with `output_rows`, only those tokens leave it (all of them
        still fill the KV cache). Returns (out, residual, normed).

        `normed`: x is the input norm's output already (the layer before ran it, see below). `then`: the
        RMSNorm that follows this layer (the next layer's input norm or the model's final one), whose
        output `then_input` reads: where the down projection's method runs it in its own launch, the
        layer returns that norm's output and normed=True, else its own output and normed=False."""
        # The norms write the codes of the projections that quantize their input per token (W8A8 on GPUs).
        if normed:
            h = x
        elif residual is None:
            residual = x
            h = self.input_layernorm(x, quant=self.self_attn.qkv_proj.input_quant(x))
        else:
            quant = self.self_attn.qkv_proj.input_quant(x)
            # after the layer before's down projection, quantized as this one's
            early = self.mlp.down_proj.method.lets_next_in
            h, residual = self.input_layernorm(x, residual, quant=quant, early=early)
        a = self.self_attn.attend(rope, h, output_rows)
        if output_rows is not None:
            residual = residual[output_rows.index]
        quant = self.mlp.gate_up_proj.input_quant(a)  # (a has the rows, dtype and device of its input)
        # The o and down projections with the norm after each in their own launch where their method
        # can (`Linear.normed`), else apart.
        post = self.post_attention_layernorm
        h = self.self_attn.o_proj.normed(a, NormAfter(post.weight, post.eps, residual, quant))
        if h is None:
            h, residual = post(self.self_attn.o_proj(a), residual, quant=quant)
        act = self.mlp.activation(h)
        if then is not None:
            quant = then_input.input_quant(_rows(h)) if then_input is not None else None
            out = self.mlp.down_proj.normed(act, NormAfter(then.weight, then.eps, residual, quant))
            if out is not None:
                return out, residual, True
        return self.mlp.down_proj(act), residual, False


class DecoderModel(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        flags: DecoderFlags,
        max_len: int,
        quant_config: QuantizationConfig | None = None,
    ):
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary = RotaryEmbedding(config, head_dim, max_len)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, flags, i, quant_config) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, output_rows: OutputRows | None = None
    ) -> torch.Tensor:
        """Final hidden states of every token, or of the `output_rows` only (in their order).

        Only the tokens that sample need the last layer's output: the others need its keys and values,
        nothing after them. So with output rows, the last layer attends, projects and runs its MLP for
        those tokens alone (a prompt's last token instead of all of them: at qwen2.5-7b shapes about a
        28th of a prefill's work)."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        residual = None
        normed = False
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            if i < last:
                then, then_input = self.layers[i + 1].input_layernorm, self.layers[i + 1].self_attn.qkv_proj
            else:
                then, then_input = self.norm, None
            rows = output_rows if i == last else None
            x, residual, normed = layer(rope, x, residual, rows, normed, then, then_input)
        if not normed:
            x, _ = self.norm(x, residual, early=self.layers[-1].mlp.down_proj.method.lets_next_in)
        return x


# fp8 KV-cache scales in checkpoints (the names vLLM maps): `self_attn.{k,v}_scale` (compressed-tensors,
# vLLM's own `self_attn.attn.*`), `self_attn.{k,v}_proj.{k,v}_scale` (ModelOpt), `self_attn.{k,v}_proj.
# output_scale` (AutoFP8 / older compressed-tensors) and the deprecated `self_attn.kv_scale` (both).
_KV_SCALE_NAME = re.compile(
    r"^(.*\.self_attn)\.(?:"
    r"(?:attn\.|[qkv]_proj\.)?(k|v|kv|q|prob)_scale"
    r"|([qkv])_proj\.output_scale"
    r")$"
)


class DecoderForCausalLM(nn.Module):
    """The served model: flat tokens in, hidden states out; `compute_logits` on the rows that sample."""

    flags = DecoderFlags()
    # checkpoint name fragment -> (our module path fragment, shard index) for packed projections
    packed = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self, config: PretrainedConfig, max_len: int, quant_config: QuantizationConfig | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.quant_config = quant_config
        self.model = DecoderModel(config, self.flags_for(config), max_len, quant_config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        head_method = _linear_method(quant_config, "lm_head")
        if self.tie_word_embeddings and head_method is None:
            self.lm_head = None
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, method=head_method)
        # Tied and quantized (`quantize_lm_head`): the head is its own layer. One that holds a plain weight
        # while loading is filled from the embedding; one without (GGUF blocks) loads its own tensors.
        self.head_copies_embedding = (
            self.tie_word_embeddings and head_method is not None and hasattr(self.lm_head, "weight")
        )
        self.linear_method = LinearMethod()
        for p in self.parameters():
            p.requires_grad_(False)

    @classmethod
    def flags_for(cls, config: PretrainedConfig) -> DecoderFlags:
        return cls.flags

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, output_rows: OutputRows | None = None
    ) -> torch.Tensor:
        return self.model(input_ids, positions, output_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype (as the LM head's matmul writes them): the sampler converts them to
        fp32 only where it needs to (penalties, bias, logprobs, truncation), so that greedy and plain
        temperature sampling read half the bytes of a vocabulary-wide fp32 copy."""
        if self.lm_head is None:  # tied, and the method keeps weights as they are: reuse the embedding
            return self.linear_method.matmul(hidden, self.model.embed_tokens.weight, None)
        return self.lm_head(hidden)

    def process_weights_after_loading(self, method: LinearMethod) -> None:
        """Hand every unquantized linear layer the device's method once the checkpoint is in, and let every
        method prepare its weights (repacking, on-the-fly quantization happen here)."""
        self.linear_method = method
        if self.head_copies_embedding:  # the embedding's values, before the head's method quantizes them
            self.lm_head.weight.data.copy_(self.model.embed_tokens.weight.data)
        if self.lm_head is None and method.repacks_weight:
            # Tied: the embedding table stays plain for lookups; the LM head gets its own repacked copy.
            weight = self.model.embed_tokens.weight
            self.lm_head = Linear(weight.shape[1], weight.shape[0]).to(weight.device)
            self.lm_head.weight.data = weight.data.clone()
        for module in self.modules():
            if isinstance(module, Linear):
                if not module.method.quantized:
                    module.method = method
                module.method.process_weights_after_loading(module)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def checkpoint_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The inverse of `load_weights`: Hugging Face names and tensors, q/k/v and gate/up unpacked.

        Lets a reference model (transformers) run on exactly our weights, dummy ones included.
        """
        unpacked = {target: [] for target, _ in self.packed.values()}
        for leaf, (target, shard) in self.packed.items():
            unpacked[target].append((shard, leaf))
        for name, param in self._dense_parameters():
            if param.layout != torch.strided:
                raise ValueError(
                    f"{name} is stored repacked ({param.layout}); export needs dtype float32 on CPUs"
                )
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # a copy made for repacking; the checkpoint ties it to the embedding
            module_name, _, param_name = name.rpartition(".")
            prefix, _, leaf = module_name.rpartition(".")
            if leaf not in unpacked:
                yield name, param
                continue
            sizes = self.get_submodule(module_name).output_sizes
            for (_, hf_leaf), part in zip(sorted(unpacked[leaf]), param.split(sizes)):
                yield f"{prefix}.{hf_leaf}.{param_name}", part

    def _dense_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Parameters as plain tensors; a quantized layer's weight dequantized (fp32), its scales left out."""
        quantized = {n: m for n, m in self.named_modules() if isinstance(m, Linear) and m.method.quantized}
        for name, param in self.named_parameters():
            module_name, _, param_name = name.rpartition(".")
            module = quantized.get(module_name)
            if module is None or param_name == "bias":
                yield name, param.data
            elif param_name == "weight":
                yield name, module.method.dense_weight(module)

    def _load_kv_scale(self, modules: dict[str, nn.Module], name: str, tensor: torch.Tensor) -> bool:
        """Take a checkpoint's fp8 KV-cache scale (or an attention scale qwick has no use for); False if
        `name` is not one. A per-head scale becomes its maximum (one scale per layer, as in vLLM)."""
        match = _KV_SCALE_NAME.match(name)
        if match is None:
            return False
        prefix, which = match.group(1), match.group(2) or match.group(3)
        if which in ("q", "prob"):
            return True  # query / softmax scales of fp8 attention: qwick keeps q and P in 16 bits
        module = modules.get(prefix)
        if not isinstance(module, DecoderAttention):
            raise ValueError(f"checkpoint tensor {name} has no place in the model")
        value = float(tensor.float().max())
        if not math.isfinite(value) or value <= 0.0:
            logger.warning(
                "ignoring the checkpoint's KV-cache scale %s = %s (not a positive number)", name, value
            )
            return True
        if which in ("k", "kv"):
            module.attn.k_scale = value
        if which in ("v", "kv"):
            module.attn.v_scale = value
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (Hugging Face names) in, packing q/k/v and gate/up; return names loaded."""
        modules = dict(self.named_modules())
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if self._load_kv_scale(modules, name, tensor):
                continue
            if name == "lm_head.weight" and (self.lm_head is None or self.head_copies_embedding):
                continue  # tied: the embedding serves as the LM head (or fills it, see above)
            if name == "model.embed_tokens.weight" and self.head_copies_embedding:
                loaded.add("lm_head.weight")  # copied from the embedding in `process_weights_after_loading`
            module_name, _, param_name = name.rpartition(".")
            leaf = module_name.rpartition(".")[2]
            if leaf in self.packed:
                target, shard = self.packed[leaf]
                module_name = module_name[: -len(leaf)] + target
                module = modules.get(module_name)
                if not isinstance(module, Linear):
                    raise ValueError(f"checkpoint tensor {name} has no place in the model")
                module.load_shard(param_name, tensor, shard)
                loaded.add(f"{module_name}.{param_name}")
                continue
            module = modules.get(module_name)
            if isinstance(module, Linear):  # scales and extra tensors go through the layer's method
                module.load_shard(param_name, tensor, 0)
                loaded.add(name)
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {name} has no place in the model")
            param = params[name]
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model {tuple(param.shape)}"
                )
            param.data.copy_(tensor)
            loaded.add(name)
        return loaded


class Qwen2ForCausalLM(DecoderForCausalLM):
    flags = DecoderFlags(qkv_bias=True)


class Qwen3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def flags_for(cls, config: PretrainedConfig) -> DecoderFlags:
        return DecoderFlags(qkv_bias=bool(getattr(config, "attention_bias", False)), qk_norm=True)


class LlamaForCausalLM(DecoderForCausalLM):
    @classmethod
    def flags_for(cls, config: PretrainedConfig) -> DecoderFlags:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderFlags(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)))
