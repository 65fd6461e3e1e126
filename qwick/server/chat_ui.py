"""The built-in chat page: its build (npm) and its routes (`/` and `/assets/*`).

The page's sources are in `qwick/server/web/` (plain JavaScript modules, bundled by esbuild; dependencies
pinned by `package-lock.json`). `qwick serve` calls `ensure_built()`, which runs `npm ci && npm run build`
there when `web/dist/` is missing or older than the sources (a hash of them is kept in `dist/.source-hash`),
so a fresh clone needs no manual step. Without npm, or when the build fails, the server still starts and `/`
answers with a page that says how to build it. `--no-chat-ui` turns all of this off.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response

from qwick.server.errors import NOT_FOUND, error_body

logger = logging.getLogger("qwick.server")

WEB_DIR = Path(__file__).resolve().parent / "web"
DIST_DIR = WEB_DIR / "dist"
ASSETS_DIR = DIST_DIR / "assets"
_STAMP = ".source-hash"
_LOCK_STAMP = ".qwick-lock-hash"  # in node_modules/: the package-lock.json that `npm ci` installed
_SOURCES = ("package.json", "package-lock.json", "build.mjs", "index.html", "src")
_ASSET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_CONTENT_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".map": "application/json",
    ".json": "application/json",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".woff2": "font/woff2",
    ".txt": "text/plain; charset=utf-8",
}
# The page runs only its own script: even if sanitizing ever missed something in a model's answer, an
# inline <script> or onerror= would not run, and nothing loads from another origin.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
BUILD_COMMAND = f"cd {WEB_DIR} && npm ci && npm run build"

_build_lock = threading.Lock()
_last_error: str | None = None


def source_hash() -> str:
    """A hash of everything the bundle is built from."""
    h = hashlib.sha256()
    for name in _SOURCES:
        path = WEB_DIR / name
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in files:
            h.update(str(f.relative_to(WEB_DIR)).encode() + b"\0")
            h.update(f.read_bytes() if f.exists() else b"<missing>")
            h.update(b"\0")
    return h.hexdigest()


def _file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else ""


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def is_built() -> bool:
    return (DIST_DIR / "index.html").is_file()


def is_fresh() -> bool:
    return is_built() and _read(DIST_DIR / _STAMP) == source_hash()


@contextlib.contextmanager
def _interprocess_lock() -> Iterator[None]:
    """One build at a time, across threads and processes sharing this source tree."""
    with _build_lock:
        try:
            import fcntl
        except ImportError:  # not POSIX: the thread lock alone
            yield
            return
        with open(WEB_DIR / ".build.lock", "w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)


def _run(cmd: list[str], timeout: float) -> None:
    proc = subprocess.run(
        cmd, cwd=WEB_DIR, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"`npm {' '.join(cmd[1:])}` failed (exit {proc.returncode}):\n{tail}")


def ensure_built(timeout: float = 900.0) -> str | None:
    """Build the chat page if it is missing or stale. Returns None when an up-to-date bundle is there, else
    why not (also logged). Never raises: the API works without the page."""
    global _last_error
    try:
        if is_fresh():
            _last_error = None
            return None
        npm = shutil.which("npm")
        if npm is None:
            reason = (
                "npm is not installed, so the chat page cannot be built: install Node.js and npm "
                f"(e.g. `apt-get install -y npm`) and restart, or build it once with `{BUILD_COMMAND}`"
            )
            if is_built():
                logger.warning("chat page: its sources changed since the last build and %s", reason)
                reason = None  # an older page still works
            else:
                logger.warning("chat page: %s", reason)
            _last_error = reason
            return reason
        with _interprocess_lock():
            if is_fresh():  # another process built it while this one waited
                _last_error = None
                return None
            start = time.monotonic()
            logger.info(
                "chat page: building it (npm ci && npm run build in %s); this happens once per change to "
                "its sources",
                WEB_DIR,
            )
            lock_hash = _file_hash(WEB_DIR / "package-lock.json")
            if _read(WEB_DIR / "node_modules" / _LOCK_STAMP) != lock_hash:
                _run([npm, "ci", "--prefer-offline", "--no-audit", "--no-fund"], timeout)
                (WEB_DIR / "node_modules" / _LOCK_STAMP).write_text(lock_hash + "\n")
            want = source_hash()
            _run([npm, "run", "build"], timeout)
            (DIST_DIR / _STAMP).write_text(want + "\n")
            logger.info("chat page: built in %.1f s", time.monotonic() - start)
        _last_error = None
        return None
    except Exception as exc:  # npm missing pieces, no network, a read-only install, a timeout...
        reason = f"the chat page could not be built: {exc}"
        logger.warning("chat page: %s%s", reason, " (serving the previous build)" if is_built() else "")
        _last_error = None if is_built() else reason
        return _last_error


def _not_built_page() -> str:
    from html import escape

    reason = _last_error or "the chat page has not been built yet"
    return (
        "<!doctype html><meta charset=utf-8><title>qwick: chat page not built</title>"
        "<body style='font-family:system-ui,sans-serif;max-width:46rem;margin:3rem auto;padding:0 1rem'>"
        "<h1>The chat page is not built</h1>"
        f"<p>{escape(reason)}.</p>"
        "<p>Build it once (Node.js and npm needed) and reload this page; the API works meanwhile:</p>"
        f"<pre style='background:#f4f4f4;padding:1rem;overflow-x:auto'>{escape(BUILD_COMMAND)}</pre>"
        "<p>The OpenAI-compatible API is at <code>/v1</code>; <code>qwick serve --no-chat-ui</code> turns "
        "this page off.</p>"
    )


def add_routes(app: Any) -> None:
    """`GET /` (the page) and `GET /assets/NAME` (its bundle), served without an API key."""
    security = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def chat_page(request: Request) -> Response:
        index = DIST_DIR / "index.html"
        try:
            body = index.read_bytes()
        except OSError:
            return HTMLResponse(_not_built_page(), status_code=503, headers=security)
        headers = {**security, "Content-Security-Policy": CSP, "Cache-Control": "no-cache"}
        return HTMLResponse(body, headers=headers)

    @app.api_route("/assets/{name}", methods=["GET", "HEAD"], include_in_schema=False)
    async def chat_asset(request: Request, name: str) -> Response:
        path = ASSETS_DIR / name
        if not _ASSET_NAME.match(name) or not path.is_file():
            message = f"Unknown path: {request.method} {request.url.path}"
            return JSONResponse(error_body(message, NOT_FOUND), status_code=404)
        media_type = _CONTENT_TYPES.get(os.path.splitext(name)[1], "application/octet-stream")
        # Names carry a content hash: a new build is a new name, so a name can be cached for good.
        headers = {**security, "Cache-Control": "public, max-age=31536000, immutable"}
        return FileResponse(path, media_type=media_type, headers=headers)
