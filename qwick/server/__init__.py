"""qwick's OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of the engine-core process.

`qwick serve` starts it; `build_app(engine, args)` builds the ASGI app around a running `AsyncLLM`.
FastAPI, uvicorn and prometheus-client are imported only by the modules of this package that need them,
so `import qwick` (and `import qwick.server`) stays free of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qwick.server.app import build_app

__all__ = ["build_app"]


def __getattr__(name: str):
    if name == "build_app":
        from qwick.server.app import build_app

        return build_app
    raise AttributeError(f"module 'qwick.server' has no attribute {name!r}")
