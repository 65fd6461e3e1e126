"""Real models' shapes with random weights, for benchmarks where no checkpoint can be downloaded.

`model_dir_for_shape("qwen2.5-7b")` writes a config.json with the public config's shapes and a word-level
tokenizer covering the whole vocabulary (prompts are random token ids; every sampled id must decode), into
the qwick cache once. Load it with `load_format="dummy"`.
"""

from __future__ import annotations

import json
import os

SHAPES: dict[str, dict] = {
    # name: hidden, intermediate, layers, heads, kv heads, vocab, tied, architecture (values of bench.md)
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
    ),
    "qwen2.5-7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
    ),
    "qwen2.5-14b": dict(
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
        tie_word_embeddings=False,
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
    ),
    "qwen3-8b": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=151936,
        tie_word_embeddings=False,
        head_dim=128,
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
    ),
}
_COMMON = dict(
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
    hidden_act="silu",
    torch_dtype="bfloat16",
    bos_token_id=None,
    eos_token_id=0,
)


def model_dir_for_shape(name: str, cache_root: str | None = None) -> str:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    from qwick.loader.gguf import default_cache_root

    path = os.path.join(cache_root or default_cache_root(), "shapes", name)
    config_path = os.path.join(path, "config.json")
    if os.path.isfile(config_path) and os.path.isfile(os.path.join(path, "tokenizer.json")):
        return path
    os.makedirs(path, exist_ok=True)
    config = {**_COMMON, **SHAPES[name]}
    _word_level_tokenizer(config["vocab_size"]).save_pretrained(path)
    tmp = config_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(config, f, indent=2)
    os.replace(tmp, config_path)  # config.json last: its presence means the directory is complete
    return path


def _word_level_tokenizer(vocab_size: int):
    """One token per id ("t0", "t1", ...), so any id decodes; id 0 doubles as end-of-sequence."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins tokens with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0", unk_token="t1")
