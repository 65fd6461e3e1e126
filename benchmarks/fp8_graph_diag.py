"""Which graph path makes fp8-cache graph serving differ from eager: run the fp8 graph test as it is
(`base`), or with one of the fused decode write, the 4-row prefill graphs or the mixed-step split turned off
(`nofuse`, `rows1`, `nosplit`)."""

import sys

import pytest

import qwick.layers.attention.triton_backend as T
import qwick.runner.prefill_graphs as G
from qwick.runner.model_runner import ModelRunner

what = sys.argv[1]
if what == "nofuse":
    T.FUSE_DECODE_WRITE = False
elif what == "rows1":
    G.PREFILL_GRAPH_ROWS = 1
elif what == "nosplit":
    init = ModelRunner.__init__

    def patched(self, *a, **k):
        init(self, *a, **k)
        self.split_mixed_max_tokens = 0

    ModelRunner.__init__ = patched
test = "tests/runner/test_fp8_kv_cache.py::test_fp8_triton_graphs_match_eager_and_reference"
code = pytest.main(["-q", "-s", "-m", "gpu", "-p", "no:cacheprovider", test])
print(f"{what}: exit {int(code)}")
