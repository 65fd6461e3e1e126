"""GGUF -> Hugging Face directory conversion, on tiny GGUF files written here with gguf.GGUFWriter.

The reference is transformers' own GGUF loader: the converted state dict, config and logits must be
exactly what transformers gets from the same file.
"""

from __future__ import annotations

import json
import os
import threading

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from safetensors.torch import load_file

from qwick.loader import gguf as qg
from qwick.loader.gguf import convert_gguf, gguf_to_hf_dir, is_converted

# --------------------------------------------------------------------------------------------------
# writing tiny GGUF files the way llama.cpp's converter does

DIMS = {
    "qwen2": dict(hidden=64, layers=2, heads=4, kv=2, head_dim=16, ffn=128, theta=1_000_000.0),
    "llama": dict(hidden=64, layers=2, heads=4, kv=2, head_dim=16, ffn=128, theta=10_000.0),
    # transformers' GGUF loader ignores qwen3's key_length and uses Qwen3Config's head_dim=128
    "qwen3": dict(hidden=64, layers=2, heads=4, kv=2, head_dim=128, ffn=128, theta=1_000_000.0),
}
HF_CLASSES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
MERGES = ["Ġ w", "o r", "l d", "Ġw or", "Ġwor ld", "H e", "l l", "He ll", "Hell o"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet, in byte order: the base of every byte-level BPE vocabulary."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


TOKENS = _byte_tokens() + [m.replace(" ", "") for m in MERGES] + SPECIALS
EOT, IM_START, IM_END = (TOKENS.index(s) for s in SPECIALS)


def _llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_tokenizer(w: gguf.GGUFWriter, arch: str) -> None:
    """The test vocabulary (byte tokens, a few merges, Qwen's specials) and chat template as GGUF metadata."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch != "llama" else "llama-bpe")
    w.add_token_list(TOKENS)
    w.add_token_types([1] * (len(TOKENS) - len(SPECIALS)) + [3] * len(SPECIALS))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(EOT)
    w.add_eos_token_id(IM_END)
    w.add_pad_token_id(EOT)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def write_gguf(
    path,
    arch: str = "qwen2",
    qtype: QT = QT.F32,
    *,
    tied: bool = False,
    tokenizer: bool = True,
    key_length: bool = True,
    rope_scaling: dict | None = None,
    drop: tuple[str, ...] = (),
    extra: tuple[str, ...] = (),
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Write a tiny `arch` GGUF; returns its weights in HF layout and names, before quantization."""
    d = DIMS[arch]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(256)
    w.add_embedding_length(d["hidden"])
    w.add_block_count(d["layers"])
    w.add_feed_forward_length(d["ffn"])
    w.add_head_count(d["heads"])
    w.add_head_count_kv(d["kv"])
    w.add_rope_freq_base(d["theta"])
    w.add_layer_norm_rms_eps(1e-6)
    if arch == "llama":
        w.add_rope_dimension_count(d["head_dim"])
    if arch == "qwen3" and key_length:
        w.add_key_length(d["head_dim"])
        w.add_value_length(d["head_dim"])
    if rope_scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling["type"]))
        w.add_rope_scaling_factor(rope_scaling["factor"])
        w.add_rope_scaling_orig_ctx_len(rope_scaling["original"])
    if tokenizer:
        add_tokenizer(w, arch)

    hidden, heads, kv, hd, ffn = d["hidden"], d["heads"], d["kv"], d["head_dim"], d["ffn"]
    hf: dict[str, np.ndarray] = {}

    def tensor(gguf_name: str, hf_name: str, shape: tuple[int, ...], norm: bool = False) -> None:
        if gguf_name in drop:
            return
        value = (1.0 + 0.1 * rng.standard_normal(shape) if norm else rng.standard_normal(shape) * 0.5).astype(
            np.float32
        )
        hf[hf_name] = value
        stored = value
        if arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            stored = _llama_cpp_permute(value, heads, heads if ".attn_q." in gguf_name else kv)
        if stored.ndim == 2 and qtype != QT.F32:
            w.add_tensor(gguf_name, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, stored)

    tensor("token_embd.weight", "model.embed_tokens.weight", (len(TOKENS), hidden))
    for i in range(d["layers"]):
        p, q = f"blk.{i}.", f"model.layers.{i}."
        tensor(p + "attn_norm.weight", q + "input_layernorm.weight", (hidden,), norm=True)
        tensor(p + "attn_q.weight", q + "self_attn.q_proj.weight", (heads * hd, hidden))
        tensor(p + "attn_k.weight", q + "self_attn.k_proj.weight", (kv * hd, hidden))
        tensor(p + "attn_v.weight", q + "self_attn.v_proj.weight", (kv * hd, hidden))
        if arch == "qwen2":
            tensor(p + "attn_q.bias", q + "self_attn.q_proj.bias", (heads * hd,))
            tensor(p + "attn_k.bias", q + "self_attn.k_proj.bias", (kv * hd,))
            tensor(p + "attn_v.bias", q + "self_attn.v_proj.bias", (kv * hd,))
        if arch == "qwen3":
            tensor(p + "attn_q_norm.weight", q + "self_attn.q_norm.weight", (hd,), norm=True)
            tensor(p + "attn_k_norm.weight", q + "self_attn.k_norm.weight", (hd,), norm=True)
        tensor(p + "attn_output.weight", q + "self_attn.o_proj.weight", (hidden, heads * hd))
        tensor(p + "ffn_norm.weight", q + "post_attention_layernorm.weight", (hidden,), norm=True)
        tensor(p + "ffn_gate.weight", q + "mlp.gate_proj.weight", (ffn, hidden))
        tensor(p + "ffn_up.weight", q + "mlp.up_proj.weight", (ffn, hidden))
        tensor(p + "ffn_down.weight", q + "mlp.down_proj.weight", (hidden, ffn))
    tensor("output_norm.weight", "model.norm.weight", (hidden,), norm=True)
    if not tied:
        tensor("output.weight", "lm_head.weight", (len(TOKENS), hidden))
    for name in extra:
        w.add_tensor(name, rng.standard_normal((hidden,)).astype(np.float32))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QWICK_CACHE", str(tmp_path / "cache"))


CASES = [
    ("qwen2", QT.F32, True),
    ("qwen2", QT.Q8_0, False),
    ("llama", QT.F32, False),
    ("llama", QT.Q8_0, True),
    ("qwen3", QT.Q8_0, False),
    ("qwen3", QT.Q4_0, True),
]


@pytest.fixture(
    scope="module", params=CASES, ids=[f"{a}-{q.name}-{'tied' if t else 'untied'}" for a, q, t in CASES]
)
def converted(request, tmp_path_factory):
    arch, qtype, tied = request.param
    root = tmp_path_factory.mktemp(f"{arch}-{qtype.name}")
    path = root / f"tiny-{arch}.gguf"
    original = write_gguf(path, arch, qtype, tied=tied)
    out = gguf_to_hf_dir(path, str(root / "cache"), progress=False)
    return dict(arch=arch, qtype=qtype, tied=tied, path=str(path), out=out, original=original)


# --------------------------------------------------------------------------------------------------
# conversion equals transformers


def test_state_dict_equals_transformers(converted, load_transformers_gguf):
    ours = load_file(os.path.join(converted["out"], "model.safetensors"))
    ref = load_transformers_gguf(converted["path"]).state_dict()
    expected = set(ref) - ({"lm_head.weight"} if converted["tied"] else set())
    assert set(ours) == expected
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, ref[name]), name
    if converted["tied"]:
        assert torch.equal(ref["lm_head.weight"], ours["model.embed_tokens.weight"])


def test_config_matches_transformers(converted):
    from transformers import AutoConfig

    dims = DIMS[converted["arch"]]
    directory, name = os.path.split(converted["path"])
    ours = AutoConfig.from_pretrained(converted["out"])
    ref = AutoConfig.from_pretrained(directory, gguf_file=name)
    for field in (
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "tie_word_embeddings",
    ):
        assert getattr(ours, field) == getattr(ref, field), field
    # transformers' qwen2 config has no head_dim; the model uses hidden_size // num_attention_heads
    head_dim = getattr(ref, "head_dim", None) or ref.hidden_size // ref.num_attention_heads
    assert ours.head_dim == head_dim
    assert ours.rope_parameters == ref.rope_parameters
    assert np.float32(ours.rms_norm_eps) == np.float32(ref.rms_norm_eps)

    with open(os.path.join(converted["out"], "config.json")) as f:
        raw = json.load(f)
    assert raw["architectures"] == [HF_CLASSES[converted["arch"]]]
    assert raw["head_dim"] == dims["head_dim"]
    assert raw["rms_norm_eps"] == 1e-6  # float32 metadata written as its shortest decimal
    assert raw["rope_theta"] == dims["theta"]
    assert raw["tie_word_embeddings"] is converted["tied"]
    assert raw["torch_dtype"] == "float32"
    assert (raw["bos_token_id"], raw["eos_token_id"]) == (EOT, IM_END)


def test_logits_equal_transformers(converted, load_transformers_gguf):
    from transformers import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(converted["out"]).eval()
    ref = load_transformers_gguf(converted["path"])
    ids = torch.tensor([[1, 5, 200, 17, 33, 260, 99, 7]])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, ref(ids).logits)


def test_weights_are_the_originals_in_hf_layout(converted):
    """Independently of transformers: undoing the llama permutation (and nothing for qwen) gives back
    the original HF tensors, exactly from F32 files and within quantization error from the others."""
    ours = load_file(os.path.join(converted["out"], "model.safetensors"))
    assert set(ours) == set(converted["original"])
    for name, value in converted["original"].items():
        original = torch.from_numpy(value)
        if converted["qtype"] == QT.F32 or value.ndim == 1:
            assert torch.equal(ours[name], original), name
        else:  # a wrong permutation would be as far off as unrelated weights
            assert (ours[name] - original).abs().mean() < 0.1 * original.abs().mean(), name


def test_tokenizer_chat_template_and_generation_config(converted):
    from transformers import AutoTokenizer

    out = converted["out"]
    with open(os.path.join(out, "tokenizer_config.json")) as f:
        tok_cfg = json.load(f)
    assert tok_cfg["chat_template"] == CHAT_TEMPLATE
    assert tok_cfg["model_max_length"] == 256
    tok = AutoTokenizer.from_pretrained(out)
    for text in ("Hello world", "Hello world, 你好，世界! def f(x): return x"):
        ids = tok(text).input_ids
        assert tok.decode(ids) == text
    assert tok("Hello world").input_ids == [TOKENS.index("Hello"), TOKENS.index("Ġworld")]
    assert tok.eos_token == "<|im_end|>"
    assert tok.convert_tokens_to_ids("<|im_start|>") == IM_START
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    with open(os.path.join(out, "generation_config.json")) as f:
        gen = json.load(f)
    assert gen == {"bos_token_id": EOT, "eos_token_id": [IM_END, EOT], "pad_token_id": EOT}
    with open(os.path.join(out, "qwick_gguf.json")) as f:
        marker = json.load(f)
    assert marker["architecture"] == converted["arch"] and marker["tokenizer"] is True


# --------------------------------------------------------------------------------------------------
# metadata corner cases


def test_qwen3_head_dim_without_key_length(tmp_path):
    write_gguf(tmp_path / "q3.gguf", "qwen3", key_length=False)
    out = gguf_to_hf_dir(tmp_path / "q3.gguf", progress=False)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["head_dim"] == 128  # from the q projection's rows, not hidden / heads (16)


def test_yarn_rope_scaling(tmp_path):
    from transformers import AutoConfig

    write_gguf(tmp_path / "yarn.gguf", rope_scaling={"type": "yarn", "factor": 4.0, "original": 32768})
    out = gguf_to_hf_dir(tmp_path / "yarn.gguf", progress=False)
    with open(os.path.join(out, "config.json")) as f:
        scaling = json.load(f)["rope_scaling"]
    assert scaling == {
        "rope_type": "yarn",
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    }
    assert AutoConfig.from_pretrained(out).rope_parameters["rope_type"] == "yarn"


def test_no_tokenizer_still_converts(tmp_path, caplog):
    write_gguf(tmp_path / "notok.gguf", tokenizer=False)
    out = gguf_to_hf_dir(tmp_path / "notok.gguf", progress=False)
    assert not os.path.exists(os.path.join(out, "tokenizer.json"))
    assert os.path.exists(os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "qwick_gguf.json")) as f:
        assert json.load(f)["tokenizer"] is False
    assert "Could not build a tokenizer" in caplog.text


def test_rope_freqs_tensor_is_ignored(tmp_path, caplog):
    write_gguf(tmp_path / "l3.gguf", "llama", extra=("rope_freqs.weight",))
    out = gguf_to_hf_dir(tmp_path / "l3.gguf", progress=False)
    assert "rope_freqs" not in str(load_file(os.path.join(out, "model.safetensors")).keys())
    assert "rope_freqs" in caplog.text


# --------------------------------------------------------------------------------------------------
# cache behaviour


def test_cached_second_call_does_not_convert(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    write_gguf(path)
    first = gguf_to_hf_dir(path, progress=False)
    assert first.startswith(str(tmp_path / "cache" / "gguf"))  # QWICK_CACHE is honoured
    assert is_converted(first)

    def boom(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(qg, "_convert_into", boom)
    monkeypatch.setattr(qg, "_open_reader", boom)
    assert gguf_to_hf_dir(path, progress=False) == first


def test_changed_file_converts_again(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, seed=1)
    first = gguf_to_hf_dir(path, progress=False)
    write_gguf(path, seed=2)
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    second = gguf_to_hf_dir(path, progress=False)
    assert second != first
    a = load_file(os.path.join(first, "model.safetensors"))["model.norm.weight"]
    b = load_file(os.path.join(second, "model.safetensors"))["model.norm.weight"]
    assert not torch.equal(a, b)


def test_crash_leaves_no_partial_cache(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    write_gguf(path)
    out = qg.cache_dir_for(path)

    def crash(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(qg, "_write_safetensors", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        gguf_to_hf_dir(path, progress=False)
    parent = os.path.dirname(out)
    assert not os.path.exists(out)
    assert [e for e in os.listdir(parent) if ".tmp-" in e] == []

    monkeypatch.undo()
    monkeypatch.setenv("QWICK_CACHE", str(tmp_path / "cache"))
    # a leftover from a killed process is cleaned up by the next conversion
    os.makedirs(os.path.join(parent, f".{os.path.basename(out)}.tmp-999-deadbeef"))
    assert gguf_to_hf_dir(path, progress=False) == out
    assert is_converted(out)
    assert [e for e in os.listdir(parent) if ".tmp-" in e] == []


def test_concurrent_callers_convert_once(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    write_gguf(path)
    calls = []
    real = qg._convert_into

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(qg, "_convert_into", counting)
    results: list[str] = []
    threads = [
        threading.Thread(target=lambda: results.append(gguf_to_hf_dir(path, progress=False)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and len(set(results)) == 1
    assert len(calls) == 1


def test_convert_gguf_to_explicit_dir(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    out = convert_gguf(
        tmp_path / "m.gguf", tmp_path / "explicit", progress=False, source_info={"sha256": "x"}
    )
    assert out == str(tmp_path / "explicit") and is_converted(out)
    with open(os.path.join(out, "qwick_gguf.json")) as f:
        assert json.load(f)["sha256"] == "x"


def test_default_cache_root(monkeypatch):
    monkeypatch.setenv("QWICK_CACHE", "/some/where")
    assert qg.default_cache_root() == "/some/where"
    monkeypatch.delenv("QWICK_CACHE")
    assert qg.default_cache_root() == os.path.join(os.path.expanduser("~"), ".cache", "qwick")


# --------------------------------------------------------------------------------------------------
# errors


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        gguf_to_hf_dir(tmp_path / "nope.gguf")


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(ValueError, match="is a directory"):
        gguf_to_hf_dir(tmp_path)


def test_not_a_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"<html>404 Not Found</html>")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        gguf_to_hf_dir(path)
    assert not qg.is_gguf_file(path)


def test_truncated_gguf(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path)
    assert qg.is_gguf_file(path)
    data = path.read_bytes()
    for cut in (64, len(data) // 2, len(data) - 100):
        short = tmp_path / f"short{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="truncated or corrupt"):
            gguf_to_hf_dir(short, progress=False)
    cache = tmp_path / "cache" / "gguf"
    assert not cache.exists() or not any(is_converted(entry) for entry in cache.iterdir())


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"'gpt2'.*not supported.*llama, qwen2, qwen3"):
        gguf_to_hf_dir(path, progress=False)


def test_missing_tensor(tmp_path):
    write_gguf(tmp_path / "m.gguf", drop=("blk.1.ffn_down.weight",))
    with pytest.raises(ValueError, match=r"lacks tensors.*model\.layers\.1\.mlp\.down_proj\.weight"):
        gguf_to_hf_dir(tmp_path / "m.gguf", progress=False)


def test_unknown_tensor(tmp_path):
    write_gguf(tmp_path / "m.gguf", extra=("blk.0.ffn_gate_exps.weight",))
    with pytest.raises(ValueError, match=r"tensors a qwen2 model does not have.*ffn_gate_exps"):
        gguf_to_hf_dir(tmp_path / "m.gguf", progress=False)
