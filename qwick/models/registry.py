"""Which model class serves which `architectures` entry of a config.json."""

from __future__ import annotations

from transformers import PretrainedConfig

from qwick.models.decoder import DecoderForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
}


def resolve_model_class(config: PretrainedConfig) -> type[DecoderForCausalLM]:
    architectures = getattr(config, "architectures", None) or []
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(
        f"unsupported model architecture {architectures or '(none in config.json)'}; "
        f"qwick supports: {', '.join(sorted(MODEL_REGISTRY))}"
    )
