"""The one piece of global state: what the current forward pass needs besides its inputs.

The model runner sets it around each forward; attention layers read their step's metadata from it. Keeping
it here (instead of threading it through every module's signature) lets the model files stay plain
`nn.Module`s that CUDA graphs can capture.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass
class ForwardContext:
    attn_metadata: Any  # the attention backend's metadata for this step


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError("No forward context: the model must be run through the model runner.")
    return _forward_context


@contextmanager
def set_forward_context(attn_metadata: Any) -> Iterator[None]:
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(attn_metadata)
    try:
        yield
    finally:
        _forward_context = previous
