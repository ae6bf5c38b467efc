"""``GET /chat`` in a real headless browser (Chromium through Playwright): type a message,
watch the streamed answer appear, send a second turn that carries the first.

Needs the ``playwright`` package and a Chromium binary (``MESHTRAIN_CHROMIUM``, else
``chromium`` or ``chromium-browser`` on PATH, e.g. Debian's ``apt-get install chromium``);
without them the browser test is skipped with the reason. The page's answers are checked
against ``model.generate`` (greedy: the page's default temperature is 0), and every
request the page makes must go to the server that sent it (anything else is blocked and
fails the test): the page needs no external network.

``MESHTRAIN_CHAT_SCREENSHOT=path.png`` saves a screenshot after the second answer (how
docs/images/chat-page.png was made).
"""

from __future__ import annotations

import os
import shutil
import time

import httpx
import pytest

from tests.serve.conftest import live_server
from tests.serve.test_chat import default_format_ids, reference

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
N_NEW = 24


def _chromium() -> str | None:
    explicit = os.environ.get("MESHTRAIN_CHROMIUM")
    if explicit:
        return explicit
    return shutil.which("chromium") or shutil.which("chromium-browser")


def test_page_is_static_and_self_contained(served_chat, served_classifier):
    with live_server(served_chat, model_name="tiny <b>", max_new_tokens=48) as url:
        r = httpx.get(f"{url}/chat", timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert "tiny &lt;b&gt;" in page and "tiny <b>" not in page  # the name is escaped
    assert 'max="48"' in page and "/v1/chat/completions" in page
    for outside in ("http://", "https://", "//cdn", "<link", "src="):
        assert outside not in page, outside  # no script, style or font from elsewhere
    with live_server(served_classifier) as url:
        r = httpx.get(f"{url}/chat", timeout=60)
    assert r.status_code == 404 and "POST /classify" in r.json()["error"]


def test_chat_page_in_a_browser(chat_dir, served_chat, tmp_path):
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="the browser test needs the playwright package"
    )
    chromium = _chromium()
    if chromium is None:
        pytest.skip("no Chromium binary (set MESHTRAIN_CHROMIUM or install Debian's chromium)")
    first, second = "你好", "hello how are you"
    want1 = reference(chat_dir, default_format_ids(chat_dir, first, []), N_NEW)
    outside: list[str] = []
    posted: list[dict] = []
    # 20 ms per decoding step: the pieces of an answer reach the page at different times
    # (a fast server's events can otherwise arrive in one network read and show at once)
    slow = served_chat.model.register_forward_pre_hook(lambda *_: time.sleep(0.02))
    with (
        live_server(served_chat, max_new_tokens=N_NEW) as url,
        sync_api.sync_playwright() as p,
    ):
        browser = p.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=chromium, headless=True, args=FLAGS
        )
        try:
            page = browser.new_page()

            def guard(route):
                if route.request.url.startswith(url):
                    route.continue_()
                else:  # the page must not reach anything but its server
                    outside.append(route.request.url)
                    route.abort()

            page.route("**/*", guard)
            page.on(
                "request",
                lambda r: posted.append(r.post_data_json) if r.method == "POST" else None,
            )
            page.goto(f"{url}/chat")
            # record every text the answer bubble shows while it streams
            page.evaluate(
                """() => { window.__seen = [];
                new MutationObserver(() => {
                  const a = document.querySelectorAll('.msg.assistant');
                  if (a.length) window.__seen.push(a[a.length - 1].firstChild?.textContent || '');
                }).observe(document.getElementById('messages'),
                           {subtree: true, childList: true, characterData: true}); }"""
            )
            page.fill("#input", first)
            page.press("#input", "Enter")
            done = page.locator(".msg.assistant[data-done='1']")
            done.first.wait_for(timeout=60_000)
            answer1 = page.locator(".msg.assistant").first.evaluate("e => e.firstChild.textContent")
            seen = page.evaluate("window.__seen")
            stats1 = page.inner_text("#stats")

            page.fill("#input", second)
            page.click("#send")
            page.locator(".msg.assistant[data-done='1']").nth(1).wait_for(timeout=60_000)
            answer2 = (
                page.locator(".msg.assistant").nth(1).evaluate("e => e.firstChild.textContent")
            )
            if shot := os.environ.get("MESHTRAIN_CHAT_SCREENSHOT"):
                page.set_viewport_size({"width": 1100, "height": 620})
                page.screenshot(path=shot)
        finally:
            browser.close()
            slow.remove()
    assert outside == []
    assert answer1 == want1
    # streamed: the answer was shown in more than one piece before it was complete
    partial = {s for s in seen if s and s != want1}
    assert partial and all(want1.startswith(s) for s in partial), seen
    assert "tokens/s" in stats1 and "first token" in stats1
    # the second turn sent the first one back and was answered on the whole conversation
    assert posted[1]["messages"] == [
        {"role": "user", "content": first},
        {"role": "assistant", "content": want1},
        {"role": "user", "content": second},
    ]
    assert posted[1]["stream"] is True and posted[1]["temperature"] == 0
    want2 = reference(chat_dir, default_format_ids(chat_dir, second, [[first, want1]]), N_NEW)
    assert answer2 == want2
