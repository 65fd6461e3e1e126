"""Reading checkpoint tensors: safetensors shards (with a progress bar) and dummy random weights."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm


def safetensors_files(model_dir: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {model_dir}; qwick loads safetensors checkpoints, GGUF files, "
            "or random weights with load_format='dummy'"
        )
    return files


def iterate_safetensors(
    model_dir: str, show_progress: bool = True, skip: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) over every shard; the bar counts tensors, so big shards show progress too.

    `skip(name)` True: that tensor is neither read nor yielded."""
    files = safetensors_files(model_dir)
    handles = [safe_open(f, framework="pt") for f in files]
    names = [[n for n in h.keys() if skip is None or not skip(n)] for h in handles]  # noqa: SIM118
    with tqdm(
        total=sum(map(len, names)),
        desc="Loading weights",
        unit="tensor",
        disable=not show_progress,
        leave=False,
    ) as bar:
        for handle, handle_names in zip(handles, names):
            for name in handle_names:
                yield name, handle.get_tensor(name)
                bar.update(1)


def fill_dummy_weights(model: torch.nn.Module, seed: int = 0, scale: float = 0.02) -> None:
    """Random weights at the model's shapes, for benchmarks where no checkpoint exists.

    Norm weights are set to 1 so activations stay well-scaled and the outputs are not degenerate. A layer
    that stores a quantized checkpoint's codes and scales gets the same random plain weight, quantized by
    its method, so a quantized and an unquantized model with one seed hold (nearly) the same weights.
    """
    from qwick.layers.linear import Linear

    quantized: dict[str, Linear] = {}  # "<layer>.weight" -> layer, for layers stored as codes + scales
    skipped: set[str] = set()  # their scales: written with the codes
    for module_name, module in model.named_modules():
        if isinstance(module, Linear) and hasattr(module.method, "load_dense"):
            if module.weight.dtype.is_floating_point and module.weight.element_size() > 1:
                continue  # a plain weight until loading finishes: filled like any other
            quantized[f"{module_name}.weight"] = module
            for param_name, _ in module.named_parameters():
                if param_name not in ("weight", "bias"):
                    skipped.add(f"{module_name}.{param_name}")
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name in skipped:
            continue
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
            continue
        if param.device not in generators:  # draw where the weights live: fast on a GPU
            generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        gen = generators[param.device]
        values = torch.randn(param.shape, generator=gen, dtype=torch.float32, device=param.device)
        if name in quantized:
            layer = quantized[name]
            layer.method.load_dense(layer, values.mul_(scale))
            continue
        param.data.copy_(values.mul_(scale))
