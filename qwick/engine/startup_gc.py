"""Keep what a serving process built at startup out of Python's garbage collector.

A full (generation-2) collection walks every tracked container object. After startup a serving process holds
~250k of them (model modules, tokenizer, transformers' and FastAPI's import-time objects), and one pass over
them took 120-195 ms on the project's 2-core VM (195.5 ms in `qwick serve`'s API process, 1.3 ms once
frozen: BENCHMARKS.md): a pause of every stream at once, whenever one happens to run.
`gc.freeze()` moves them to the permanent generation, which no collection scans; what serving allocates is
still collected as usual. vLLM does the same after its startup.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_startup_objects(process: str) -> int:
    """Collect once, then freeze every surviving object; returns how many were frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.debug("%s: %d startup objects frozen out of the garbage collector's passes", process, frozen)
    return frozen
