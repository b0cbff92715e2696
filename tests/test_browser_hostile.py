"""Real-browser test of what one visitor can put on another's page: a session gives a budget written as Markdown and
HTML (a phishing link, a tracking image), and its deep link is opened by another visitor in Debian's headless
chromium. The document line and the refusal toast on that page show the value as text: no link, no image, and no
request to the host the value names."""

from __future__ import annotations

import shutil

import pytest

from tests.served import served
from tests.test_browser import CHROMIUM, CHROMIUM_ARGS, sync_api  # skips this module where that one skips

EVIL = "evil.example"
HOSTILE = (f"**Session expired** [log in](http://{EVIL}/login) ![x](http://{EVIL}/p.png) "
           f"<img src=http://{EVIL}/q.png> <a href=http://{EVIL}/a>here</a> www.{EVIL} me@{EVIL}")
MARKUP_FROM_VALUE = f"""(selector) => Array.from(document.querySelectorAll(selector + ' a, ' + selector + ' img'))
    .filter(e => (e.href || e.src || '').includes('{EVIL}')).length"""


@pytest.fixture(scope="module")
def app_url():
    """The app served on a free loopback port for the duration of this module."""
    with served() as url:
        yield url


def test_a_deep_link_puts_no_link_or_image_on_another_visitors_page(app_url: str) -> None:
    import httpx
    from gradio_client import Client

    from app.presets import EMBEDDED

    attacker = Client(app_url, verbose=False)
    attacker.predict("A short note.", EMBEDDED, HOSTILE, api_name="/describe_document")
    link = httpx.get(f"{app_url}gradio_api/deep_link", params={"session_hash": attacker.session_hash}).json()
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=shutil.which(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page()
        fetched: list[str] = []
        page.on("request", lambda request: fetched.append(request.url) if EVIL in request.url else None)
        page.goto(f"{app_url}?deep_link={link}")
        page.wait_for_function("() => document.querySelector('#doc-info')?.innerText.includes('Session expired')",
                               timeout=120_000)
        line = page.inner_text("#doc-info")
        assert "**Session expired** [log in](http://" in line and f"<img src=http://{EVIL}" not in line, line
        assert page.evaluate(MARKUP_FROM_VALUE, "#doc-info") == 0

        page.click("#run")  # the replayed budget is refused in a toast, the value shown as text there too
        toast = page.locator('[data-testid="toast-body"]').first
        toast.wait_for(timeout=120_000)
        assert "Session expired" in toast.inner_text() and "[log in](http://" in toast.inner_text()
        assert page.evaluate(MARKUP_FROM_VALUE, '[data-testid="toast-body"]') == 0
        assert fetched == []
        browser.close()
