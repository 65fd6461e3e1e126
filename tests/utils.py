"""Shared test helpers: tiny random models built with transformers, saved as real checkpoints."""

from __future__ import annotations

import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 320
EOS_ID = 1
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    eos_token_id=EOS_ID,
    bos_token_id=None,
    pad_token_id=0,
)
ARCHS = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=32, tie_word_embeddings=False)),
    "llama": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False)),
}

_CORPUS = [
    "hello world, this is a tiny test corpus for a tiny tokenizer.",
    "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)",
    "你好，世界！这是一个测试。",
    "The quick brown fox jumps over the lazy dog 0123456789.",
]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE like Qwen's, trained on a few lines, with <pad>=0 and <eos>=1."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8,
        special_tokens=["<pad>", "<eos>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return fast


def make_tiny_model(arch: str, path: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """Save a random fp32 transformers model of `arch` with a tokenizer to `path`; return the model."""
    config_cls, model_cls, extra = ARCHS[arch]
    config = config_cls(**{**_COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # Random init leaves logits nearly flat; scale up so greedy choices are decisive, as in real models.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
        # Tokens that are lone bytes of a multi-byte character never win a greedy pick, so generated
        # text is readable and stop-string tests can pick substrings of it.
        tokenizer = tiny_tokenizer()
        partial = [i for i in range(VOCAB) if "\ufffd" in tokenizer.decode([i])]
        model.get_output_embeddings().weight[partial] = 0.0
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def hf_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position of `token_ids` in one full forward: the oracle for every step."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


# (N, K) of every linear layer of qwen2.5-7b and -14b (qkv, o, gate_up, down each), for the GPU layer and
# kernel tests, and the M (rows) they run at: decode batches through prefill chunks.
QWEN_7B_14B_LINEAR_SHAPES = [
    (4608, 3584),
    (3584, 3584),
    (37888, 3584),
    (3584, 18944),
    (7168, 5120),
    (5120, 5120),
    (27648, 5120),
    (5120, 13824),
]
ROWS_1_TO_4096 = [1, 2, 7, 16, 17, 64, 256, 1024, 4096]


def gpu_graph_llm(path: str, dtype: str, enforce_eager: bool, max_model_len: int):
    """An `LLM` of a tiny model on the GPU with Triton attention, CUDA graphs on or off (`enforce_eager`):
    the graph tests' eager-against-graphs pair."""
    from qwick import LLM

    return LLM(
        path,
        dtype=dtype,
        device="cuda",
        attention_backend="triton",
        enforce_eager=enforce_eager,
        max_model_len=max_model_len,
        max_num_seqs=8,
        num_gpu_blocks_override=256,
    )


def record_sampled_logits(runner, sink: list[torch.Tensor]) -> None:
    """Append a copy of every step's logits to `sink` as the runner's sampler receives them, whichever path
    computed them (the tests compare what sampling sees, not how the logits came about)."""
    sample = runner.sampler

    class Recording:
        def __getattr__(self, name: str):
            return getattr(sample, name)

        def __call__(self, logits: torch.Tensor, meta):
            sink.append(logits.detach().clone())
            return sample(logits, meta)

    runner.sampler = Recording()
