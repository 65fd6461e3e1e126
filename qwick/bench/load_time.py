"""Start-up time, measured in fresh processes: cold (empty cache: GGUF assembled and converted) and warm."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

_QWICK = """
import time, sys
t = time.perf_counter()
from qwick import LLM
LLM({model!r}, dtype={dtype!r})
print("SECONDS", time.perf_counter() - t)
"""

_TRANSFORMERS_GGUF = """
import time, os
t = time.perf_counter()
from transformers import AutoModelForCausalLM, AutoTokenizer
d, f = os.path.split({gguf!r})
AutoTokenizer.from_pretrained(d, gguf_file=f)
AutoModelForCausalLM.from_pretrained(d, gguf_file=f)
print("SECONDS", time.perf_counter() - t)
"""


def _timed(code: str, env: dict[str, str]) -> float:
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    for line in out.stdout.splitlines():
        if line.startswith("SECONDS"):
            return float(line.split()[1])
    raise RuntimeError(f"load-time probe failed:\n{out.stderr[-2000:]}")


def measure(model: str | None, dtype: str = "auto", compare_gguf: str | None = None) -> dict:
    """Seconds from `import qwick` to a ready `LLM`: cold (fresh cache dir) and warm (same dir again)."""
    with tempfile.TemporaryDirectory(prefix="qwick-cache-") as cache:
        env = {**os.environ, "QWICK_CACHE": cache, "TQDM_DISABLE": "1"}
        code = _QWICK.format(model=model, dtype=dtype)
        result = {"cold_s": _timed(code, env), "warm_s": _timed(code, env)}
    if compare_gguf:
        result["transformers_gguf_s"] = _timed(_TRANSFORMERS_GGUF.format(gguf=compare_gguf), dict(os.environ))
    return result
