"""The chat page end to end: headless Chromium (Debian's `chromium`, driven by Playwright, background
networking off) against a real `qwick serve` on the demo model.

Answers from the model are short (a few dozen tokens) so that the module runs in a couple of minutes on two
cores. Where a test needs an exact answer (script in the output, Markdown tables, the conversation tools) the
page's request is answered by a canned SSE stream through `page.route`; everything else talks to the server.
Screenshots of the main states go to `.test-output/chat-page/` (git-ignored).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server.harness import ServerThread, engine_idle, wait_until

pytestmark = [pytest.mark.demo, pytest.mark.slow]

SHOTS = Path(__file__).resolve().parents[2] / ".test-output" / "chat-page"
CHROMIUM_ARGS = [
    "--no-sandbox",  # tests run as root
    "--disable-gpu",
    "--disable-quic",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-domain-reliability",
    "--no-first-run",
    "--disable-features=Translate,OptimizationHints,MediaRouter,AutofillServerCommunication",
]
ANSWER_TIMEOUT_MS = 180_000  # two shared cores: an answer of a few dozen tokens, with room for a busy machine
CJK = re.compile(r"[\u4e00-\u9fff]")


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


def importlib_available(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


@pytest.fixture(scope="module")
def server(demo_model_dir) -> Iterator[ServerThread]:
    from qwick.server import chat_ui

    with ServerThread([], startup_timeout=600) as s:
        # `qwick serve` built the page (npm ci && npm run build) while the model loaded.
        assert chat_ui.is_fresh(), f"the chat page was not built: {chat_ui._last_error}"
        # One request first, so the page's first answer (and its screenshot) shows a warm engine.
        s.client().chat.completions.create(
            model=s.client().models.list().data[0].id,
            messages=[{"role": "user", "content": "Write a Python function add(a, b)."}],
            max_tokens=24,
            temperature=0,
        )
        yield s


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    path = chromium_path()
    if path is None or not importlib_available("playwright"):
        message = "the chat page tests need Debian's chromium (apt-get install -y chromium) and playwright"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        yield b
        b.close()


class Chat:
    """One browser context (its own IndexedDB and localStorage) on the page, with the steps tests use."""

    def __init__(self, browser: Any, server: ServerThread, settings: dict | None, **context: Any) -> None:
        context.setdefault("viewport", {"width": 1280, "height": 800})
        context.setdefault("color_scheme", "light")
        self.server = server
        self.context = browser.new_context(base_url=server.url, **context)
        if settings is not None:
            # First visit only: later reloads keep whatever the page saved.
            self.context.add_init_script(
                "if (!localStorage.getItem('qwick.settings')) "
                f"localStorage.setItem('qwick.settings', {json.dumps(json.dumps(settings))});"
            )
        self.errors: list[str] = []
        self.allowed_console: list[str] = ["Failed to load resource"]  # an HTTP error status a test asked for
        self.page = self.context.new_page()
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("console", self._console)
        self.open()

    def _console(self, message: Any) -> None:
        # A CSP violation or a script error is a failure, unless the test expects it.
        if message.type == "error" and not any(a in message.text for a in self.allowed_console):
            self.errors.append(message.text)

    def open(self) -> None:
        self.page.goto("/")
        self.page.wait_for_selector("body[data-ready=true]")

    def reload(self) -> None:
        self.page.reload()
        self.page.wait_for_selector("body[data-ready=true]")

    def send(self, text: str) -> None:
        """Type and send a message; returns once its request is out (the new answer is on screen)."""
        self.page.fill("#input", text)
        with self.page.expect_request("**/v1/chat/completions"):
            self.page.press("#input", "Enter")

    def answer(self, index: int = -1) -> Any:
        answers = self.page.locator("#messages .msg-assistant")
        return answers.last if index == -1 else answers.nth(index)

    def wait_done(self, index: int = -1, states: tuple[str, ...] = ("done",)) -> Any:
        answer = self.answer(index)
        selector = ", ".join(f"#messages .msg-assistant[data-state={s}]" for s in states)
        self.page.wait_for_function(
            f"() => {{ const a = [...document.querySelectorAll('#messages .msg-assistant')].at({index});"
            f" return a && a.matches({json.dumps(selector)}); }}",
            timeout=ANSWER_TIMEOUT_MS,
        )
        return answer

    def shot(self, name: str, element: Any = None) -> Path:
        """Save a screenshot of the page (or of one element) under .test-output/chat-page/."""
        SHOTS.mkdir(parents=True, exist_ok=True)
        path = SHOTS / f"{name}.png"
        (element or self.page).screenshot(path=str(path))
        return path

    def close(self) -> None:
        self.context.close()
        assert not self.errors, self.errors


@pytest.fixture
def chat(browser, server) -> Iterator[Callable[..., Chat]]:
    opened: list[Chat] = []

    def make(settings: dict | None = None, **context: Any) -> Chat:
        c = Chat(browser, server, settings, **context)
        opened.append(c)
        return c

    yield make
    for c in opened:
        c.close()


def have_texts(locator: Any, texts: list[str], any_order: bool = False) -> None:
    """Wait (a few seconds at most) until the elements' texts are `texts`."""
    from playwright.sync_api import expect

    if any_order:
        expect(locator).to_have_count(len(texts))
        assert sorted(locator.all_inner_texts()) == sorted(texts)
    else:
        expect(locator).to_have_text(texts)


GREEDY = {"temperature": 0, "topP": 1, "showMetrics": True}


# ---- against the model -----------------------------------------------------------------------------------


def test_streamed_answer_with_highlighted_code_speed_and_metrics(chat, server):
    c = chat({**GREEDY, "maxTokens": 48})
    c.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page = c.page
    page.wait_for_function("() => document.querySelector('.metrics-status').textContent.includes('running')")
    c.send("Write a Python function add(a, b) that returns a + b. Reply with only a code block.")
    # Streamed: the answer is seen growing before it is done.
    lengths: set[int] = set()
    deadline = time.monotonic() + ANSWER_TIMEOUT_MS / 1000
    while time.monotonic() < deadline:
        state = c.answer().get_attribute("data-state")
        if state != "streaming":
            break
        text = c.answer().locator(".content").inner_text()
        if text.strip() and text != "…":
            lengths.add(len(text))
        time.sleep(0.1)
    answer = c.wait_done()
    assert len(lengths) >= 2, f"no partial answer seen while streaming: {lengths}"
    # Rendered Markdown: a highlighted Python block with a copy button.
    code = answer.locator(".code-block pre code.hljs")
    assert code.count() >= 1
    assert answer.locator(".code-block .code-lang").first.inner_text() == "python"
    assert answer.locator(".code-block code .hljs-keyword").count() >= 1  # def / return
    source = code.first.inner_text()
    assert "def add" in source
    answer.locator(".copy-code").first.click()
    have_texts(answer.locator(".copy-code").first, ["Copied"])
    assert page.evaluate("navigator.clipboard.readText()").strip() == source.strip()
    # Speed from the server's timing breakdown.
    stats = answer.locator(".stats")
    assert float(stats.get_attribute("data-ttft-ms")) > 0
    assert float(stats.get_attribute("data-tps")) > 0
    assert re.search(r"TTFT [\d.]+ m?s · [\d.]+ tok/s · \d+ tokens", stats.inner_text()), stats.inner_text()
    # The speed panel plots the server's /metrics: this request's TTFT and the tokens it generated.
    page.wait_for_function(
        "() => Number(document.querySelector('.chart-ttft svg').dataset.points) >= 1"
        " && Number(document.querySelector('.chart-tps svg').dataset.points) >= 1",
        timeout=30_000,
    )
    assert re.search(r"requests [1-9]", page.locator(".metrics-status").inner_text())
    assert page.locator(".chart-ttft .chart-value").inner_text().endswith(" ms")
    assert page.locator(".chart-tps .chart-value").inner_text().endswith(" tok/s")
    assert page.locator(".chart-tps .line").get_attribute("d").startswith("M")  # throughput over time
    page.mouse.move(0, 0)
    c.shot("light")
    c.shot("code-block", answer.locator(".code-block").first)


def test_chinese_multi_turn_and_reload(chat, server):
    c = chat({**GREEDY, "maxTokens": 24})
    page = c.page
    question = "用一句话解释什么是快速排序。"
    page.locator("#input").click()
    page.keyboard.insert_text(question)  # as an input method commits text
    # Enter that confirms an input-method candidate must not send.
    page.evaluate(
        "document.querySelector('#input').dispatchEvent(new KeyboardEvent('keydown',"
        " {key: 'Enter', keyCode: 229, isComposing: true, bubbles: true, cancelable: true}))"
    )
    assert page.locator("#messages .msg-user").count() == 0
    with page.expect_request("**/v1/chat/completions") as first:
        page.press("#input", "Enter")
    assert first.value.post_data_json["messages"] == [{"role": "user", "content": question}]
    answer = c.wait_done()
    text = answer.locator(".content").inner_text()
    assert CJK.search(text), text
    assert "\ufffd" not in text
    assert page.locator("#messages .msg-user .bubble").inner_text() == question
    # Multi-turn: the second request carries the first exchange.
    with page.expect_request("**/v1/chat/completions") as second:
        c.send("再简短一点。")
    c.wait_done()
    sent = second.value.post_data_json["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    assert sent[0]["content"] == question and CJK.search(sent[1]["content"])
    assert page.locator(".conv.active .conv-open").inner_text() == question
    before = page.locator("#messages").inner_text()
    # Reload: the conversation comes back from IndexedDB.
    c.reload()
    assert page.locator("#messages .msg").count() == 4
    assert page.locator("#messages").inner_text() == before
    assert page.locator(".conv.active .conv-open").inner_text() == question
    assert page.locator("#messages .msg-assistant[data-state=done]").count() == 2
    c.shot("chinese")


def test_stop_aborts_and_frees_the_request(chat, server):
    c = chat({"temperature": 0.8, "topP": 0.95, "maxTokens": 2000, "showMetrics": False})
    page = c.page
    c.send("Write a very long story about a dragon who learns to program. Make it at least 2000 words.")
    page.wait_for_selector("#stop:not([hidden])")
    answer = c.answer()
    page.wait_for_function(
        "() => { const t = [...document.querySelectorAll('.msg-assistant .content')].at(-1).innerText;"
        " return t.length > 20 && t !== '…'; }",
        timeout=ANSWER_TIMEOUT_MS,
    )
    assert server.engine.get_stats().num_running == 1
    page.keyboard.press("Escape")
    c.wait_done(states=("stopped",))
    assert page.locator("#stop").is_hidden() and page.locator("#send").is_visible()
    assert "stopped" in answer.locator(".stats").inner_text()
    assert wait_until(lambda: engine_idle(server.engine), timeout=30), server.engine.get_stats()
    assert server.metric("qwick:num_requests_running") == 0
    text = answer.locator(".content").inner_text()
    time.sleep(1.0)
    assert answer.locator(".content").inner_text() == text  # nothing arrives after the stop
    # The stopped answer is kept, and can be regenerated (then stopped with the button).
    answer.locator(".regenerate").click()
    page.wait_for_selector("#messages .msg-assistant[data-state=streaming]")
    page.click("#stop")
    c.wait_done(states=("stopped",))
    assert page.locator("#messages .msg-assistant").count() == 1
    assert wait_until(lambda: engine_idle(server.engine), timeout=30), server.engine.get_stats()


def response_format_supported(server: ServerThread) -> str | None:
    """None when the server takes response_format json_object, else its refusal."""
    with server.http() as h:
        r = h.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "{}"}],
                "max_tokens": 1,
                "response_format": {"type": "json_object"},
            },
        )
    return None if r.status_code == 200 else r.json()["error"]["message"]


def test_json_mode_returns_parseable_json(chat, server):
    c = chat({**GREEDY, "maxTokens": 64, "showMetrics": False})
    page = c.page
    # JSON mode is switched on in the settings dialog, as a user does.
    page.click("#open-settings")
    with server.http() as h:
        served = h.get("/v1/models").json()["data"][0]["id"]
    assert page.locator("#set-model").input_value() == served  # the models come from /v1/models
    assert page.locator("#schema-box").is_hidden()
    page.check("#set-json")
    assert page.locator("#schema-box").is_visible()
    page.click("#save-settings")
    assert page.locator("#settings").is_hidden()
    refusal = response_format_supported(server)
    with page.expect_request("**/v1/chat/completions") as req:
        c.send("Give a JSON object describing a cat, with the keys name and age.")
    assert req.value.post_data_json["response_format"] == {"type": "json_object"}
    answer = c.wait_done(states=("done", "error"))
    if refusal is not None:
        assert refusal in answer.locator(".error").inner_text()
        pytest.xfail(f"the server does not support response_format yet: {refusal}")
    answer.locator(".raw-toggle").click()
    raw = answer.locator("pre.raw-text").inner_text()
    assert isinstance(json.loads(raw), dict), raw
    # With a schema: json_schema, and the answer follows it.
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    page.click("#open-settings")
    page.fill("#set-schema", json.dumps(schema))
    page.click("#save-settings")
    with page.expect_request("**/v1/chat/completions") as req:
        c.send("Describe another cat.")
    fmt = req.value.post_data_json["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["schema"] == schema
    answer = c.wait_done()
    answer.locator(".raw-toggle").click()
    value = json.loads(answer.locator("pre.raw-text").inner_text())
    assert isinstance(value["name"], str) and isinstance(value["age"], int)


def test_invalid_schema_is_refused_in_settings(chat):
    c = chat({"showMetrics": False})
    page = c.page
    page.click("#open-settings")
    page.check("#set-json")
    page.fill("#set-schema", "{not json")
    page.click("#save-settings")
    assert page.locator("#settings").is_visible()  # stays open, the box says why
    assert "not valid JSON" in page.eval_on_selector("#set-schema", "e => e.validationMessage")
    page.fill("#set-schema", "")
    page.click("#save-settings")
    assert page.locator("#settings").is_hidden()


def test_themes_and_phone_width(chat, server):
    c = chat({**GREEDY, "maxTokens": 40})
    page = c.page
    c.send("Write a Python function is_even(n). Reply with only a code block.")
    c.wait_done()
    background = "getComputedStyle(document.body).backgroundColor"
    light = page.evaluate(background)
    assert page.evaluate("document.documentElement.dataset.theme") is None  # follows the system: light
    page.click("#toggle-theme")
    assert page.evaluate("document.documentElement.dataset.theme") == "dark"
    dark = page.evaluate(background)
    assert light == "rgb(255, 255, 255)" and dark != light
    page.mouse.move(0, 0)
    c.shot("dark")
    c.reload()  # the choice is kept, and applied before the page paints
    assert page.evaluate("document.documentElement.dataset.theme") == "dark"
    page.click("#toggle-theme")
    assert page.evaluate(background) == light
    # A dark system preference is followed until the user picks a theme.
    d = chat({"showMetrics": False}, color_scheme="dark")
    assert d.page.evaluate(background) == dark

    # Phone width: the sidebar is a drawer behind the menu button.
    phone = chat({**GREEDY, "maxTokens": 40}, viewport={"width": 390, "height": 844}, is_mobile=True)
    p = phone.page
    assert p.locator("#menu").is_visible()
    assert p.locator("#sidebar").bounding_box()["x"] < 0
    phone.send("Write a Python one-liner that reverses a string.")
    phone.wait_done()
    width = p.evaluate("document.documentElement.scrollWidth")
    assert width <= 390, f"the page scrolls sideways at phone width ({width}px)"
    phone.shot("phone")
    p.click("#menu")
    p.wait_for_function("() => document.querySelector('#sidebar').getBoundingClientRect().x >= 0")
    phone.shot("phone-sidebar")
    p.click("#scrim", position={"x": 370, "y": 400})
    p.wait_for_function("() => document.querySelector('#sidebar').getBoundingClientRect().right <= 0")


# ---- canned answers (exact model output) ---------------------------------------------------------------


def sse_body(pieces: list[str | dict], timing: dict | None = None) -> str:
    """A streamed chat completion: each piece is a content delta (str) or a whole delta (dict)."""

    def chunk(delta: dict, **extra: Any) -> str:
        body = {"id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 0, "model": "demo",
                "choices": [{"index": 0, "delta": delta, "finish_reason": None}], **extra}  # fmt: skip
        return f"data: {json.dumps(body)}\n\n"

    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk(p if isinstance(p, dict) else {"content": p}) for p in pieces]
    usage = {"prompt_tokens": 5, "completion_tokens": len(pieces), "total_tokens": 5 + len(pieces)}
    last = {"id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 0, "model": "demo",
            "choices": [], "usage": usage, "qwick": timing}  # fmt: skip
    out.append(f"data: {json.dumps(last)}\n\n")
    out.append("data: [DONE]\n\n")
    return "".join(out)


TIMING = {"queue_ms": 1.0, "prefill_ms": 11.0, "decode_ms": 200.0, "e2e_ms": 212.0, "ttft_ms": 12.0,
          "tpot_ms": 20.0, "preprocess_ms": 1.0, "prompt_tokens": 5, "completion_tokens": 11,
          "cached_tokens": 0}  # fmt: skip

HOSTILE = [
    "<think>The user wants a table.</think>\n\n",
    "Here you go:\n\n",
    "<script>window.__pwned = 'script'</script>\n\n",
    '<img src="x" onerror="window.__pwned = \'img\'">\n\n',
    "[click me](javascript:window.__pwned='link') ",
    '<iframe srcdoc="<script>parent.__pwned=1</script>"></iframe>',
    '<a href="#" onclick="window.__pwned=\'click\'">also me</a>\n\n',
    "| algorithm | average |\n|---|---|\n| quicksort | O(n log n) |\n| bubble sort | O(n^2) |\n\n",
    "- one\n- two\n\n",
    "```js\nconst x = 1;\n```\n",
]


class Canned:
    """Answer the page's chat requests with fixed SSE streams, and keep what it sent."""

    def __init__(self, page: Any, pieces: list[str | dict], timing: dict | None = TIMING) -> None:
        self.pieces = pieces
        self.timing = timing
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        page.route("**/v1/chat/completions", self.handle)

    def handle(self, route: Any) -> None:
        self.requests.append(route.request.post_data_json)
        self.headers.append(route.request.headers)
        route.fulfill(status=200, content_type="text/event-stream", body=sse_body(self.pieces, self.timing))


def test_model_output_cannot_run_script(chat):
    c = chat({"showMetrics": False})
    page = c.page
    # DOMPurify parses the answer in an inert DOMParser document; Chromium still checks that document's
    # onerror= against the page's CSP and logs it as blocked. Nothing runs (checked below).
    c.allowed_console.append("Executing inline event handler violates")
    Canned(page, HOSTILE)
    c.send("Show me a table.")
    answer = c.wait_done()
    content = answer.locator(".content")
    # Rendered: the table, the list, the highlighted code; the reasoning collapsed.
    assert content.locator("table th").all_inner_texts() == ["algorithm", "average"]
    assert content.locator("table td").count() == 4
    assert content.locator("ul li").all_inner_texts() == ["one", "two"]
    assert content.locator(".code-block code .hljs-keyword").count() >= 1
    reasoning = answer.locator("details.reasoning")
    assert reasoning.is_visible() and reasoning.get_attribute("open") is None
    assert reasoning.locator("summary").inner_text() == "Reasoning"
    assert "think" not in content.inner_text()
    # Nothing ran, and nothing that could run is in the page.
    content.locator("a", has_text="click me").click()
    page.wait_for_timeout(300)
    assert page.evaluate("window.__pwned") is None
    assert content.locator("script, iframe, [onerror], [onclick]").count() == 0
    assert content.locator("a[href^='javascript']").count() == 0
    assert content.locator("img").count() <= 1
    # The raw-text view shows exactly what the model wrote, as text.
    answer.locator(".raw-toggle").click()
    raw = answer.locator("pre.raw-text").inner_text()
    assert "<script>window.__pwned = 'script'</script>" in raw and "<think>" in raw
    assert page.evaluate("window.__pwned") is None
    answer.locator(".raw-toggle").click()
    assert content.locator("table").count() == 1
    assert answer.locator(".stats").inner_text() == "TTFT 12 ms · 50.0 tok/s · 11 tokens"
    page.mouse.move(0, 0)
    c.shot("markdown")


def test_reasoning_content_is_shown_collapsed(chat):
    c = chat({"showMetrics": False})
    page = c.page
    canned = Canned(page, [{"reasoning_content": "The user greets; "}, {"reasoning_content": "greet back."},
                           {"content": "Hello **there**"}])  # fmt: skip
    c.send("hi")
    answer = c.wait_done()
    reasoning = answer.locator("details.reasoning")
    assert (
        reasoning.get_attribute("open") is None and reasoning.locator("summary").inner_text() == "Reasoning"
    )
    assert not reasoning.locator(".md").is_visible()
    reasoning.locator("summary").click()
    assert reasoning.locator(".md").inner_text() == "The user greets; greet back."
    assert answer.locator(".content strong").inner_text() == "there"
    c.send("again")  # the next request carries the answer, not the reasoning
    c.wait_done()
    assert canned.requests[1]["messages"][1] == {"role": "assistant", "content": "Hello **there**"}


def test_conversations_sidebar_edit_regenerate_export_import(chat, tmp_path):
    c = chat({"showMetrics": False, "systemPrompt": "Be brief.", "apiKey": "sk-from-settings"})
    page = c.page
    canned = Canned(page, ["Hello", " there", "!"])
    c.send("first chat")
    c.wait_done()
    assert canned.requests[0]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert canned.headers[0]["authorization"] == "Bearer sk-from-settings"
    assert canned.requests[0]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    # Regenerate: the same request again, one answer kept.
    with page.expect_request("**/v1/chat/completions"):
        c.answer().locator(".regenerate").click()
    c.wait_done()
    assert len(canned.requests) == 2 and canned.requests[1]["messages"] == canned.requests[0]["messages"]
    assert page.locator("#messages .msg-assistant").count() == 1
    # Edit the user message: the answer after it is replaced.
    page.locator("#messages .msg-user").hover()
    page.locator("#messages .msg-user .edit").click()
    page.fill(".edit-box", "first chat, edited")
    with page.expect_request("**/v1/chat/completions"):
        page.click(".save-edit")
    c.wait_done()
    assert canned.requests[2]["messages"][-1] == {"role": "user", "content": "first chat, edited"}
    assert page.locator("#messages .msg").count() == 2
    # A second conversation, then rename, search and delete in the sidebar.
    page.click("#new-chat")
    c.send("second chat about 快速排序")
    c.wait_done()
    titles = page.locator(".conv .conv-open")
    have_texts(titles, ["second chat about 快速排序", "first chat"])
    page.locator(".conv").nth(1).hover()
    page.locator(".conv").nth(1).locator(".conv-rename").click()
    page.fill(".conv-title-input", "renamed chat")
    page.press(".conv-title-input", "Enter")
    have_texts(titles, ["second chat about 快速排序", "renamed chat"])
    page.fill("#search", "edited")  # matches a message, not a title
    have_texts(titles, ["renamed chat"])
    page.fill("#search", "快速")
    have_texts(titles, ["second chat about 快速排序"])
    page.fill("#search", "")
    titles.nth(1).click()
    assert page.locator("#messages .msg-user .bubble").inner_text() == "first chat, edited"
    # Export everything, delete a conversation, import the export back.
    with page.expect_download() as dl:
        page.click("#export")
    exported = tmp_path / "export.json"
    dl.value.save_as(exported)
    doc = json.loads(exported.read_text())
    assert doc["format"] == "qwick-chat" and len(doc["conversations"]) == 2
    page.once("dialog", lambda d: d.accept())
    page.locator(".conv.active .conv-delete").click()
    have_texts(titles, ["second chat about 快速排序"])
    page.set_input_files("#import-file", str(exported))
    page.wait_for_function("() => document.querySelectorAll('.conv').length === 3")
    assert "Imported 2 conversations" in page.locator("#banner").inner_text()
    have_texts(
        titles, ["second chat about 快速排序", "second chat about 快速排序", "renamed chat"], any_order=True
    )
    c.reload()
    assert page.locator(".conv").count() == 3


def test_server_error_is_shown(chat):
    c = chat({"showMetrics": False})
    page = c.page
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(
            status=400,
            content_type="application/json",
            body=json.dumps(
                {
                    "error": {
                        "message": "Something was wrong with the request.",
                        "type": "invalid_request_error",
                        "param": None,
                        "code": None,
                    }
                }
            ),
        ),  # fmt: skip
    )
    c.send("hi")
    answer = c.wait_done(states=("error",))
    assert answer.locator(".error").inner_text() == "Something was wrong with the request."
