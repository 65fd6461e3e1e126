"""GGUF files as Hugging Face model directories.

A GGUF file is converted once into a cached directory that looks like a Hugging Face checkpoint, and
the rest of qwick loads that directory like any other:

    config.json              the HF config: architecture, shapes, rope, bos/eos ids
    generation_config.json   bos/pad, eos = the file's eos plus its other end-of-generation tokens
    model.safetensors        float32, HF parameter names, llama.cpp's Q/K row permutation undone
    tokenizer.json           transformers' own GGUF tokenizer, saved with `save_pretrained`
    tokenizer_config.json    ... with the file's chat template inside (not a separate .jinja file)
    qwick_gguf.json          where the directory came from; written last

The weights stay float32: every GGUF type dequantizes exactly into float32 (that is what
`gguf.quants.dequantize` returns and what transformers loads), while bfloat16 would round them.

The directory is built in a temporary sibling and renamed into place, under a file lock, so a crash
never leaves half a cache and two processes never convert the same file twice. Its name is keyed by
the file's identity (real path, size, mtime) and the converter version, so a changed file or a newer
converter converts again. The cached path imports nothing heavy and costs one `stat`.

Public API: `gguf_to_hf_dir`, `convert_gguf`, `cache_dir_for`, `default_cache_root`, `is_gguf_file`,
`is_converted`, `SUPPORTED_ARCHITECTURES`; for keeping tensors quantized (`quantization="gguf"`,
qwick/quantization/gguf.py): `source_gguf` (the file a directory came from) and `stored_tensors` (its
tensors' raw blocks, under the converted names).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import math
import os
import re
import shutil
import struct
import tempfile
import time
import uuid
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# Bump when the layout or the content of a converted directory changes: old caches are then ignored.
CONVERTER_VERSION = 1

_CHUNK_ELEMS = 1 << 23  # elements per dequantization piece: 32 MiB of float32

# GGUF `general.architecture` -> (HF model_type, HF architectures[0]).
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}

MARKER_FILE = "qwick_gguf.json"
WEIGHTS_FILE = "model.safetensors"
GGUF_MAGIC = b"GGUF"

# llama.cpp stores the q/k projections of these architectures with the rows of each head interleaved
# for its "normal" (GPT-J style) rope; HF checkpoints use rotate-half. qwen2 and qwen3 use llama.cpp's
# NEOX rope, which is rotate-half already, so their converter leaves the rows alone.
_PERMUTED_QK_ARCHS = frozenset({"llama"})

# Besides the file's own eos (and eot/eom ids), tokens that end a turn, as llama.cpp's end-of-generation
# detection treats them. For Qwen instruct files this gives [<|im_end|>, <|endoftext|>], the list the
# original Hugging Face generation_config.json has.
_EOG_TOKEN_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|end|>")

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Tensors that carry no weights of the HF model. `rope_freqs` holds llama3-style rope factors, which
# the metadata does not describe; transformers drops it too.
# Old llama files also carry per-layer `attn_rot_embd` tensors, which hold nothing.
_IGNORED_TENSORS = re.compile(r"rope_freqs\.weight|blk\.\d+\.attn_rot_embd(\.weight)?")

# Big arrays that the config does not need; `tokens` is read separately when it is.
_SKIPPED_FIELDS = frozenset(
    {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"}
)


# --------------------------------------------------------------------------------------------------
# public API


def default_cache_root() -> str:
    """Where qwick keeps converted models: `$QWICK_CACHE`, else `~/.cache/qwick`."""
    root = os.environ.get("QWICK_CACHE")
    if root:
        return os.path.abspath(os.path.expanduser(root))
    return os.path.join(os.path.expanduser("~"), ".cache", "qwick")


def is_gguf_file(path: str | os.PathLike) -> bool:
    """True when `path` is a file that starts with the GGUF magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def is_converted(hf_dir: str | os.PathLike) -> bool:
    """True when `hf_dir` is a complete converted directory (its marker file is written last)."""
    return os.path.isfile(os.path.join(hf_dir, MARKER_FILE))


def cache_dir_for(gguf_path: str | os.PathLike, cache_root: str | None = None) -> str:
    """The cache directory `gguf_to_hf_dir` uses for this file, keyed by real path, size and mtime."""
    real = os.path.realpath(gguf_path)
    st = os.stat(real)
    key = hashlib.sha256(f"{real}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.splitext(os.path.basename(real))[0]) or "model"
    root = cache_root if cache_root is not None else default_cache_root()
    return os.path.join(root, "gguf", f"{stem}-{key}-v{CONVERTER_VERSION}")


def gguf_to_hf_dir(
    gguf_path: str | os.PathLike, cache_root: str | None = None, *, progress: bool = True
) -> str:
    """Return a Hugging Face-style directory for a GGUF file, converting it on first use.

    Later calls (in any process) return the cached directory at the cost of a `stat`. The cache lives
    under `cache_root` (default `default_cache_root()`), in `gguf/<name>-<key>-v<version>/`.

    Raises FileNotFoundError when the file does not exist, and ValueError when it is not a GGUF file,
    is corrupt, or holds an architecture qwick does not support.
    """
    path = _check_gguf_file(gguf_path)
    return convert_gguf(path, cache_dir_for(path, cache_root), progress=progress)


def convert_gguf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    progress: bool = True,
    source_info: dict[str, Any] | None = None,
) -> str:
    """Convert `gguf_path` into the HF directory `out_dir`, unless that is already complete.

    Atomic (temporary sibling directory, then rename) and locked (`<out_dir>.lock`), so concurrent
    callers convert once and a crash leaves no partial directory. `source_info` is merged into the
    marker file (the demo model records the verified sha256 there). Returns `out_dir`.
    """
    out_dir = os.path.abspath(os.fspath(out_dir))
    if is_converted(out_dir):
        return out_dir
    path = _check_gguf_file(gguf_path)
    parent, name = os.path.split(out_dir)
    os.makedirs(parent, exist_ok=True)
    with _file_lock(out_dir + ".lock"):
        if is_converted(out_dir):  # another process finished while we waited
            return out_dir
        # Under the lock nobody else writes this target: leftovers are from crashed runs.
        for stale in glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(name)}.tmp-*")):
            shutil.rmtree(stale, ignore_errors=True)
        if os.path.lexists(out_dir):
            shutil.rmtree(out_dir, ignore_errors=True)
        tmp = os.path.join(parent, f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.makedirs(tmp)
        try:
            _convert_into(path, tmp, progress=progress, source_info=source_info or {})
            os.rename(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _fsync_dir(parent)
    return out_dir


def source_gguf(hf_dir: str | os.PathLike) -> str:
    """The GGUF file a converted directory was made from, checked to be unchanged since.

    Raises ValueError when `hf_dir` is not a converted GGUF directory, or when its file is gone or
    changed (the directory then no longer describes it; load the .gguf file again to reconvert).
    """
    marker_path = os.path.join(os.fspath(hf_dir), MARKER_FILE)
    try:
        with open(marker_path, encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        raise ValueError(
            f"{os.fspath(hf_dir)!r} is not a model converted from a GGUF file (no {MARKER_FILE}); only .gguf "
            "models (and the built-in demo model) have GGUF tensors to keep quantized"
        ) from None
    path = marker.get("gguf_path")
    try:
        st = os.stat(path)
    except (OSError, TypeError):
        raise ValueError(
            f"the GGUF file {path!r} that {os.fspath(hf_dir)!r} was converted from is gone; load the .gguf "
            "file itself"
        ) from None
    if (st.st_size, st.st_mtime_ns) != (marker.get("gguf_size"), marker.get("gguf_mtime_ns")):
        raise ValueError(
            f"the GGUF file {path!r} changed since {os.fspath(hf_dir)!r} was converted from it; load the "
            ".gguf file again (it is converted again)"
        )
    return path


@dataclass(frozen=True)
class StoredTensor:
    """A 2-D tensor of a GGUF file as the file stores it: rows of quantized blocks, not dequantized."""

    hf_name: str  # its Hugging Face parameter name
    qtype: int  # GGML type id (gguf.GGMLQuantizationType value)
    type_name: str  # "Q4_K", "F32", ...
    shape: tuple[int, int]  # (N, K): rows, row length (HF layout)
    permute_heads: int  # > 0: llama.cpp's q/k row permutation over this many heads is still to be undone
    data: Any  # numpy uint8 [N, bytes per row], a read-only view of the file's memory map


def stored_tensors(gguf_path: str | os.PathLike) -> dict[str, StoredTensor]:
    """The 2-D tensors of a GGUF file by HF name, as stored (memory-mapped, nothing dequantized).

    The same tensor plan as the conversion (names, shapes, checks), so the names are those of the
    converted directory's model.safetensors."""
    path = _check_gguf_file(gguf_path)
    reader = _open_reader(path)
    _, _, plan = _build_config(reader, _read_fields(reader), path)
    out: dict[str, StoredTensor] = {}
    for item in plan:
        if len(item.shape) != 2:
            continue
        t = reader.tensors[item.reader_index]
        out[item.hf_name] = StoredTensor(
            item.hf_name,
            int(t.tensor_type),
            t.tensor_type.name,
            (int(item.shape[0]), int(item.shape[1])),
            item.permute_heads,
            t.data,
        )
    return out


def unpermute_qk_rows(rows: int, n_heads: int):
    """The row order that undoes llama.cpp's q/k permutation: HF row i is stored row `order[i]`."""
    import numpy as np

    return _unpermute_qk(np.arange(rows), n_heads)


# --------------------------------------------------------------------------------------------------
# checks and metadata


def _check_gguf_file(gguf_path: str | os.PathLike) -> str:
    path = os.fspath(gguf_path)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"GGUF file not found: {path!r}. Check the path (qwick takes a .gguf file or a Hugging Face "
            "model directory)."
        )
    if os.path.isdir(path):
        raise ValueError(
            f"{path!r} is a directory, not a GGUF file. Pass the .gguf file inside it, or load the "
            "directory as a Hugging Face model directory."
        )
    with open(path, "rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise ValueError(
            f"{path!r} is not a GGUF file: it starts with {head!r}, not {GGUF_MAGIC!r}. Check that the "
            "path points at the .gguf file and that its download finished."
        )
    return os.path.realpath(path)


def _open_reader(path: str):
    import numpy as np
    from gguf import GGUFReader

    class _Reader(GGUFReader):
        """GGUFReader over a plain ndarray view of its memmap instead of the memmap itself.

        Same bytes, zero-copy, but slicing skips `np.memmap.__array_finalize__`, which makes parsing a
        150k-token vocabulary about 3.5x faster (2.6 s instead of 9.6 s for the demo model).
        """

        @property
        def data(self):
            return self._qwick_data

        @data.setter
        def data(self, value):
            self._qwick_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    try:
        return _Reader(path, "r")
    except Exception as e:  # the reader raises whatever numpy raises on a short or garbled file
        raise ValueError(
            f"{path!r} is not a valid GGUF file ({type(e).__name__}: {e}). It is probably truncated or "
            "corrupt: download it again."
        ) from e


def _read_fields(reader) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key in _SKIPPED_FIELDS:
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # a field this gguf version cannot decode is not one we need
            logger.debug("skipping GGUF field %s", key)
    return meta


def _f32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that is the same float32 (1e-06, not 9.99e-07).

    Identical once the model computes in float32 or lower, and it reads like the original config.
    """
    import numpy as np

    return float(str(np.float32(value)))


@dataclass
class _TensorPlan:
    gguf_name: str
    hf_name: str
    shape: tuple[int, ...]
    reader_index: int
    permute_heads: int = 0  # >0: undo llama.cpp's q/k row permutation with this many heads


def _hf_tensor_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if m and m.group(2) in _LAYER_TENSORS:
        return f"model.layers.{int(m.group(1))}.{_LAYER_TENSORS[m.group(2)]}"
    return None


def _single_int(value: Any, key: str) -> int:
    """Some files store per-layer arrays; qwick's models need one value for every layer."""
    if isinstance(value, list):
        values = set(value)
        if len(values) != 1:
            raise ValueError(
                f"GGUF metadata {key} differs across layers ({sorted(values)}); qwick needs one."
            )
        value = values.pop()
    return int(value)


def _build_config(
    reader, meta: dict[str, Any], path: str
) -> tuple[dict[str, Any], dict[str, Any], list[_TensorPlan]]:
    """HF config, generation config and the tensor plan, all checked before anything is written."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} (in {os.path.basename(path)}) is not supported by qwick. "
            f"Supported architectures: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}."
        )
    model_type, hf_arch = SUPPORTED_ARCHITECTURES[arch]

    def get(key: str, default: Any = ...) -> Any:
        full = f"{arch}.{key}"
        if full in meta:
            return meta[full]
        if default is ...:
            raise ValueError(
                f"{os.path.basename(path)} lacks the GGUF metadata key {full!r}; is the file complete?"
            )
        return default

    shapes = {t.name: tuple(int(x) for x in reversed(t.shape.tolist())) for t in reader.tensors}
    hidden = int(get("embedding_length"))
    n_layers = int(get("block_count"))
    n_heads = _single_int(get("attention.head_count"), f"{arch}.attention.head_count")
    n_kv = _single_int(get("attention.head_count_kv", n_heads), f"{arch}.attention.head_count_kv")
    ffn = _single_int(get("feed_forward_length"), f"{arch}.feed_forward_length")
    if "token_embd.weight" not in shapes or "blk.0.attn_q.weight" not in shapes:
        raise ValueError(f"{os.path.basename(path)} has no token_embd.weight or blk.0.attn_q.weight tensor.")
    vocab = shapes["token_embd.weight"][0]
    n_tokens = meta.get(f"{arch}.vocab_size")
    if n_tokens is not None and int(n_tokens) != vocab:
        logger.warning(
            "GGUF %s.vocab_size=%s but the embedding has %d rows; using the rows.", arch, n_tokens, vocab
        )

    # head_dim: stated (qwen3 files), else implied by the q projection (which is n_heads * head_dim rows).
    q_rows = shapes["blk.0.attn_q.weight"][0]
    head_dim = int(get("attention.key_length", q_rows // n_heads))
    if head_dim * n_heads != q_rows:
        raise ValueError(
            f"inconsistent GGUF: {n_heads} heads of dim {head_dim} but attn_q has {q_rows} rows ({path})."
        )
    if model_type == "qwen2" and head_dim * n_heads != hidden:
        raise ValueError(
            f"qwen2 needs num_heads * head_dim == hidden_size; got {n_heads}*{head_dim} != {hidden}."
        )
    rope_dim = int(get("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(
            f"{os.path.basename(path)} uses partial rotary embeddings (rope.dimension_count={rope_dim}, "
            f"head_dim={head_dim}), which qwick does not support for {arch}."
        )

    tied = "output.weight" not in shapes
    attention_bias = "blk.0.attn_q.bias" in shapes
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(get),
        "tie_word_embeddings": tied,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if model_type == "qwen2":
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=n_layers)
    elif model_type == "qwen3":
        config.update(attention_bias=attention_bias, use_sliding_window=False, sliding_window=None)
    else:
        config.update(attention_bias=attention_bias, mlp_bias=False)
    if "rope_freqs.weight" in shapes:
        logger.warning(
            "%s has a rope_freqs tensor (llama3-style rope scaling) that its metadata does not describe; "
            "it is ignored, as transformers does. Output may differ from llama.cpp at long context.",
            os.path.basename(path),
        )

    tok_ids = {
        k: meta.get(f"tokenizer.ggml.{k}_token_id")
        for k in ("bos", "eos", "padding", "eot", "eom")
        if meta.get(f"tokenizer.ggml.{k}_token_id") is not None
    }
    config["bos_token_id"] = tok_ids.get("bos")
    config["eos_token_id"] = tok_ids.get("eos")
    if "padding" in tok_ids:
        config["pad_token_id"] = tok_ids["padding"]
    generation_config = _generation_config(reader, meta, tok_ids)

    # tensor plan: every tensor maps to an expected HF parameter, and every expected parameter exists
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | (set() if tied else {"lm_head.weight"})
    per_layer = {
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    }
    if model_type == "qwen2":
        per_layer |= {f"self_attn.{p}_proj.bias" for p in "qkv"}
    elif attention_bias:
        per_layer |= {f"self_attn.{p}_proj.bias" for p in "qkvo"}
    if model_type == "qwen3":
        per_layer |= {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}
    expected |= {f"model.layers.{i}.{n}" for i in range(n_layers) for n in per_layer}

    plan: list[_TensorPlan] = []
    unknown: list[str] = []
    permute = arch in _PERMUTED_QK_ARCHS
    for index, t in enumerate(reader.tensors):
        name = t.name
        if _IGNORED_TENSORS.fullmatch(name):
            continue
        hf_name = _hf_tensor_name(name)
        if hf_name is None or hf_name not in expected:
            unknown.append(name)
            continue
        heads = 0
        if permute and (".attn_q." in name or ".attn_k." in name):
            heads = n_heads if ".attn_q." in name else n_kv
        plan.append(_TensorPlan(name, hf_name, shapes[name], index, heads))
    if unknown:
        raise ValueError(
            f"{os.path.basename(path)} has tensors a {arch} model does not have: {unknown[:8]}"
            f"{' ...' if len(unknown) > 8 else ''}. qwick cannot load this file."
        )
    missing = expected - {p.hf_name for p in plan}
    if missing:
        raise ValueError(
            f"{os.path.basename(path)} lacks tensors a {arch} model needs, e.g. {sorted(missing)[:5]}; "
            "the file is incomplete or not a plain decoder model."
        )
    return config, generation_config, plan


def _rope_scaling(get) -> dict[str, Any] | None:
    kind = get("rope.scaling.type", None)
    factor = get("rope.scaling.factor", None)
    if kind is None and get("rope.scale_linear", None) is not None:  # older files
        kind, factor = "linear", get("rope.scale_linear")
    if kind in (None, "none") or factor is None or float(factor) == 1.0:
        return None
    factor = _f32(factor)
    if kind == "linear":
        return {"rope_type": "linear", "type": "linear", "factor": factor}
    if kind == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "type": "yarn", "factor": factor}
        original = get("rope.scaling.original_context_length", None)
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        for key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if (value := get(f"rope.scaling.{key}", None)) is not None:
                scaling[hf_key] = _f32(value)
        return scaling
    raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (qwick handles linear and yarn).")


def _generation_config(reader, meta: dict[str, Any], tok_ids: dict[str, int]) -> dict[str, Any]:
    eos_ids: list[int] = [tok_ids[k] for k in ("eos", "eot", "eom") if k in tok_ids]
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is not None:
        # Only the few special tokens are looked up; decoding the strings we need is cheap.
        tokens = field.contents()
        index = {text: i for i, text in enumerate(tokens) if text in _EOG_TOKEN_TEXTS}
        eos_ids += [index[text] for text in _EOG_TOKEN_TEXTS if text in index]
    eos_ids = list(dict.fromkeys(int(i) for i in eos_ids))
    gen: dict[str, Any] = {}
    if "bos" in tok_ids:
        gen["bos_token_id"] = int(tok_ids["bos"])
    if eos_ids:
        gen["eos_token_id"] = eos_ids if len(eos_ids) > 1 else eos_ids[0]
    if "padding" in tok_ids:
        gen["pad_token_id"] = int(tok_ids["padding"])
    sampling = {
        "general.sampling.temp": "temperature",
        "general.sampling.top_k": "top_k",
        "general.sampling.top_p": "top_p",
        "general.sampling.min_p": "min_p",
        "general.sampling.penalty_repeat": "repetition_penalty",
    }
    for key, hf_key in sampling.items():
        if key in meta:
            gen[hf_key] = int(meta[key]) if hf_key == "top_k" else _f32(meta[key])
    if "temperature" in gen:
        gen["do_sample"] = gen["temperature"] > 0
    return gen


# --------------------------------------------------------------------------------------------------
# conversion


def _convert_into(path: str, out: str, *, progress: bool, source_info: dict[str, Any]) -> None:
    start = time.perf_counter()
    logger.info("Converting %s into %s (once; later loads use the cache).", path, out)
    reader = _open_reader(path)
    meta = _read_fields(reader)
    config, generation_config, plan = _build_config(reader, meta, path)

    _write_json(os.path.join(out, "config.json"), config)
    _write_json(os.path.join(out, "generation_config.json"), generation_config)
    has_tokenizer = _save_tokenizer(path, out, config["model_type"], config["max_position_embeddings"])
    _write_safetensors(os.path.join(out, WEIGHTS_FILE), reader, plan, path, progress=progress)

    st = os.stat(path)
    marker = {
        "converter_version": CONVERTER_VERSION,
        "gguf_path": path,
        "gguf_size": st.st_size,
        "gguf_mtime_ns": st.st_mtime_ns,
        "architecture": meta.get("general.architecture"),
        "name": meta.get("general.name"),
        "file_type": meta.get("general.file_type"),
        "tensor_types": dict(Counter(reader.tensors[p.reader_index].tensor_type.name for p in plan)),
        "dtype": "float32",
        "tokenizer": has_tokenizer,
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "seconds": round(time.perf_counter() - start, 2),
        **source_info,
    }
    for entry in os.listdir(out):
        _fsync_file(os.path.join(out, entry))
    _write_json(os.path.join(out, MARKER_FILE), marker)  # last: its presence means "complete"
    _fsync_dir(out)
    logger.info("Converted %s in %.1f s.", os.path.basename(path), time.perf_counter() - start)


def _save_tokenizer(path: str, out: str, model_type: str, model_max_length: int) -> bool:
    """Save transformers' tokenizer for the file; False (with a warning) when it cannot build one."""
    try:
        from transformers import AutoTokenizer

        # A private directory holding only the file, so no stray tokenizer files next to it are read.
        with tempfile.TemporaryDirectory(prefix="qwick-gguf-tok-") as src:
            name = os.path.basename(path)
            try:
                os.symlink(path, os.path.join(src, name))
            except OSError:
                src, name = os.path.split(path)
            try:
                # Naming the tokenizer type skips transformers re-reading the whole config (~10 s).
                tok = AutoTokenizer.from_pretrained(src, gguf_file=name, tokenizer_type=model_type)
            except ValueError:
                tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
        tok.model_max_length = model_max_length
        tok.save_pretrained(out, save_jinja_files=False)  # chat template inside tokenizer_config.json
        cfg_path = os.path.join(out, "tokenizer_config.json")
        with open(cfg_path, encoding="utf-8") as f:
            tok_cfg = json.load(f)
        for junk in ("is_local", "local_files_only"):  # loading kwargs that leak into the saved file
            tok_cfg.pop(junk, None)
        _write_json(cfg_path, tok_cfg)
        return True
    except Exception as e:
        logger.warning(
            "Could not build a tokenizer from %s (%s: %s); the converted model has none. Pass a Hugging "
            "Face tokenizer explicitly (tokenizer=...).",
            os.path.basename(path),
            type(e).__name__,
            e,
        )
        return False


def _chunks(plan: list[_TensorPlan]) -> Iterator[tuple[_TensorPlan, int, int]]:
    """Row ranges to dequantize: whole small tensors, big ones (embeddings, lm_head) in pieces, so memory
    stays bounded and the pieces fit the caches. Rows are independent in every GGUF type."""
    for item in plan:
        rows = item.shape[0] if len(item.shape) > 1 else 1
        per_row = max(1, math.prod(item.shape) // rows)
        step = rows if item.permute_heads else max(1, _CHUNK_ELEMS // per_row)
        for start in range(0, rows, step):
            yield item, start, min(rows, start + step)


def _dequantized(reader, plan: list[_TensorPlan], path: str) -> Iterator[tuple[_TensorPlan, bool, Any]]:
    """(tensor, is_its_last_piece, float32 HF-layout rows), in file order. Dequantized a few pieces ahead
    in threads: numpy releases the GIL, so the cores work while the main thread writes."""
    import numpy as np
    from gguf.quants import dequantize

    def load(item: _TensorPlan, start: int, stop: int):
        t = reader.tensors[item.reader_index]
        data = t.data if len(item.shape) == 1 else t.data[start:stop]
        try:
            arr = dequantize(data, t.tensor_type)
        except NotImplementedError as e:
            raise ValueError(
                f"{os.path.basename(path)}: tensor {t.name} has type {t.tensor_type.name}, which the "
                f"installed gguf package cannot dequantize ({e}). Try `pip install -U gguf`."
            ) from e
        shape = item.shape if len(item.shape) == 1 else (stop - start, *item.shape[1:])
        arr = np.asarray(arr, dtype=np.float32).reshape(shape)
        if item.permute_heads:
            arr = _unpermute_qk(arr, item.permute_heads)
        return np.ascontiguousarray(arr, dtype="<f4")

    workers = max(1, min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="qwick-gguf") as pool:
        pending: deque = deque()
        for item, start, stop in _chunks(plan):
            last = len(item.shape) == 1 or stop == item.shape[0]
            pending.append((item, last, pool.submit(load, item, start, stop)))
            if len(pending) > 2 * workers:
                done, done_last, fut = pending.popleft()
                yield done, done_last, fut.result()
        while pending:
            done, done_last, fut = pending.popleft()
            yield done, done_last, fut.result()


def _unpermute_qk(arr, n_heads: int):
    """Undo llama.cpp's `LlamaModel.permute` (rows of each head interleaved for GPT-J style rope).

    llama.cpp writes `w.reshape(n, 2, d // n // 2, ...).swapaxes(1, 2)`; the inverse swaps back.
    Works for the weight (2-D) and the bias (1-D) alike.
    """
    rows = arr.shape[0]
    return arr.reshape(n_heads, rows // n_heads // 2, 2, *arr.shape[1:]).swapaxes(1, 2).reshape(arr.shape)


def _write_safetensors(path: str, reader, plan: list[_TensorPlan], src: str, *, progress: bool) -> None:
    """Stream the tensors into a safetensors file: the header is known from the shapes up front, so
    only a few tensors are ever in memory (the file can be several times the GGUF's size)."""
    from tqdm.auto import tqdm

    header: dict[str, Any] = {}
    offset = 0
    for item in plan:
        nbytes = 4 * math.prod(item.shape)
        header[item.hf_name] = {
            "dtype": "F32",
            "shape": list(item.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header["__metadata__"] = {
        "format": "pt",
        "source": "gguf",
        "qwick_converter_version": str(CONVERTER_VERSION),
    }
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned, as safetensors writes it

    bar = tqdm(
        total=len(plan), desc=f"Converting {os.path.basename(src)}", unit="tensor", disable=not progress
    )
    with open(path, "wb") as f, bar:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, last, arr in _dequantized(reader, plan, src):
            f.write(arr.data)
            bar.update(int(last))
        f.flush()
        if f.tell() != 8 + len(blob) + offset:
            raise RuntimeError(
                f"internal error: wrote {f.tell()} bytes to {path}, expected {8 + len(blob) + offset}"
            )


# --------------------------------------------------------------------------------------------------
# files


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _fsync_file(path: str) -> None:
    if os.path.isfile(path):
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):  # not every platform lets a directory be opened
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _file_lock(path: str) -> Iterator[None]:
    """An exclusive advisory lock (released by the OS if the holder dies); a no-op without fcntl."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock; the atomic rename still keeps the cache consistent
        yield
        return
    with open(path, "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("Waiting for another process that is converting into %s ...", path[: -len(".lock")])
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
