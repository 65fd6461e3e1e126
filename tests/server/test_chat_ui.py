"""The chat page's serving side: `/` and `/assets/*` (types, caching, CSP, no API key), `--no-chat-ui`, the
404 envelope for unknown paths, and the build step's bookkeeping (fresh / stale / no npm)."""

from __future__ import annotations

import re

import httpx
import pytest

from qwick.server import chat_ui
from tests.server.harness import TINY_ENGINE_ARGS, ServerThread, tiny_model_dir

ENGINE = [*TINY_ENGINE_ARGS, "--num-gpu-blocks-override", "64"]
KEY = "sk-page-test"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerThread([model_dir, *ENGINE, "--api-key", KEY]) as s:
        yield s


def test_page_and_assets_served_without_key(server):
    if not chat_ui.is_built():
        pytest.skip(f"the chat page could not be built here: {chat_ui._last_error}")
    with server.http() as h:
        assert h.get("/v1/models").status_code == 401  # the API still wants its key
        page = h.get("/")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp
        assert page.headers["x-content-type-options"] == "nosniff"
        assert not re.search(r'(?:src|href)="(?:https?:)?//', page.text)  # nothing loads from elsewhere
        assets = re.findall(r'(?:src|href)="(assets/[^"]+)"', page.text)
        kinds = {a.rsplit(".", 1)[1] for a in assets}
        assert kinds == {"js", "css"}, assets
        for asset in assets:
            r = h.get("/" + asset)
            assert r.status_code == 200, asset
            want = "text/javascript" if asset.endswith(".js") else "text/css"
            assert r.headers["content-type"].startswith(want)
            assert "immutable" in r.headers["cache-control"]
        assert h.head("/").status_code == 200


@pytest.mark.parametrize("path", ["/assets/nope.js", "/assets/..%2Fpackage.json", "/v1/nothing", "/nothing"])
def test_unknown_paths_keep_the_json_404(server, path):
    r = httpx.get(server.url + path, timeout=30)
    assert r.status_code == 404
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["type"] == "not_found_error"


def test_no_chat_ui_flag(model_dir):
    with ServerThread([model_dir, *ENGINE, "--no-chat-ui"]) as s:
        r = httpx.get(s.url + "/", timeout=30)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert httpx.get(s.url + "/health", timeout=30).status_code == 200


@pytest.fixture
def web_copy(tmp_path, monkeypatch):
    """chat_ui pointed at an unbuilt copy of the page's sources."""
    web = tmp_path / "web"
    (web / "src").mkdir(parents=True)
    for name in ("package.json", "package-lock.json", "build.mjs", "index.html"):
        (web / name).write_bytes((chat_ui.WEB_DIR / name).read_bytes())
    for f in (chat_ui.WEB_DIR / "src").iterdir():
        (web / "src" / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(chat_ui, "WEB_DIR", web)
    monkeypatch.setattr(chat_ui, "DIST_DIR", web / "dist")
    monkeypatch.setattr(chat_ui, "ASSETS_DIR", web / "dist" / "assets")
    return web


def test_without_npm_the_server_explains(web_copy, monkeypatch):
    monkeypatch.setattr(chat_ui.shutil, "which", lambda name: None)
    reason = chat_ui.ensure_built()
    assert reason is not None and "npm is not installed" in reason
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()
    chat_ui.add_routes(app)
    r = TestClient(app).get("/")
    assert r.status_code == 503 and r.headers["content-type"].startswith("text/html")
    assert "npm ci &amp;&amp; npm run build" in r.text and "npm is not installed" in r.text


def test_stale_and_fresh(web_copy, monkeypatch):
    calls: list[list[str]] = []

    def fake_run(cmd, timeout):
        calls.append(cmd[1:])
        if cmd[1:] == ["run", "build"]:
            (web_copy / "dist").mkdir(exist_ok=True)
            (web_copy / "dist" / "index.html").write_text("<!doctype html>")
        else:
            (web_copy / "node_modules").mkdir(exist_ok=True)

    monkeypatch.setattr(chat_ui.shutil, "which", lambda name: "/usr/bin/npm")
    monkeypatch.setattr(chat_ui, "_run", fake_run)
    assert not chat_ui.is_fresh()
    assert chat_ui.ensure_built() is None
    assert calls == [["ci", "--prefer-offline", "--no-audit", "--no-fund"], ["run", "build"]]
    assert chat_ui.is_fresh()
    assert chat_ui.ensure_built() is None and len(calls) == 2  # fresh: nothing runs
    (web_copy / "src" / "main.js").write_text("// changed\n")
    assert not chat_ui.is_fresh()
    assert chat_ui.ensure_built() is None
    assert calls[2:] == [["run", "build"]]  # same lockfile: no reinstall
