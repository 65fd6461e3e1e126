"""The qwick command line with one decode launch shape for single-row steps of bf16/fp16 caches (from
`benchmarks/short_decode_sweep.py`'s JSON), for A/B runs of batch-1 decode at short contexts:

    python benchmarks/b1_with_decode_cfg.py BEST.json bench latency ...
"""

import json
import os
import sys

sys.path.insert(0, os.getcwd())  # run from the repository root
from qwick.entrypoints.cli import main
from qwick.layers.attention.triton_backend import TritonAttentionBackend

with open(sys.argv[1]) as f:
    one_row = json.load(f)
default_cfg = TritonAttentionBackend._decode_cfg


def decode_cfg(
    self, head_dim: int, itemsize: int, kv_fp8: bool, num_rows: int, preload: bool = False
) -> dict:
    if num_rows == 1 and itemsize == 2 and not kv_fp8 and self.decode_config is None:
        return one_row
    return default_cfg(self, head_dim, itemsize, kv_fp8, num_rows, preload)


TritonAttentionBackend._decode_cfg = decode_cfg
sys.exit(main(sys.argv[2:]))
