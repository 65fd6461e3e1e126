"""The engine stays importable without the server's dependencies (the GPU machine has none of them)."""

from __future__ import annotations

import subprocess
import sys

SERVER_ONLY = ("msgspec", "zmq", "fastapi", "uvicorn", "prometheus_client")


def test_offline_engine_imports_no_server_dependencies():
    code = (
        "import sys, qwick, qwick.entrypoints.llm, qwick.engine.engine_core, qwick.bench.cli\n"
        f"print([m for m in {SERVER_ONLY!r} if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_engine_imports_no_xgrammar():
    """Structured output imports xgrammar only for a request that asks for it (the GPU machine has none)."""
    code = (
        "import sys, qwick, qwick.entrypoints.llm, qwick.engine.engine_core, qwick.runner.sampler, "
        "qwick.structured_output, qwick.engine.processor\n"
        "print('xgrammar' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout
