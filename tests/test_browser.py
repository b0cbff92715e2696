"""Real-browser test: Playwright drives Debian's headless chromium as a first-time visitor would, on a 1440×900
screen: the first view (Run in sight, what a CPU gives), the settings, a TriForce run read as plain text and then
with its overlays, a stopped run, a comparison of the three methods, a source file uploaded, the How it works tab,
and the README's screenshot."""

from __future__ import annotations

import os
import re
import shutil
import socket
import time
from pathlib import Path

import pytest

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (bash install.sh --test)")
CHROMIUM = os.environ.get("TRIFORCE_CHROMIUM", "/usr/bin/chromium")
if not shutil.which(CHROMIUM):  # install.sh --test installs Debian's chromium only where it runs as root
    pytest.skip(f"no chromium at {CHROMIUM}: installing Debian's chromium needs root (bash install.sh --test as root, "
                "or apt-get install chromium fonts-noto-color-emoji; TRIFORCE_CHROMIUM names another)",
                allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREEN = {"width": 1440, "height": 900}
OTHER_SAMPLE = "Python Socket Programming HOWTO"
VISIBLE = """(selector) => Array.from(document.querySelectorAll(selector))
    .filter(e => e.textContent.trim() && getComputedStyle(e).display !== 'none')"""
SHOWN_DRAFTS = f"() => ({VISIBLE})('#answer del').length"
COLOURED = f"""() => ({VISIBLE})('#answer .answer-text > span')
    .filter(e => getComputedStyle(e).backgroundColor !== 'rgba(0, 0, 0, 0)').length"""
ANSWER_CHARS = "() => document.querySelector('#answer .answer-text').innerText.length"
LINES = """(selector) => Array.from(document.querySelectorAll(selector)).filter(e => e.offsetHeight)
    .map(e => Math.round(e.offsetHeight / parseFloat(getComputedStyle(e).lineHeight)))"""
LABELS = "#settings label > span:first-child, #quick-settings label > span:first-child"
HELP = "#settings .info-text"
# a dropdown's text ends before its arrow: the input's content box stops left of the arrow's box
CLEAR_OF_ARROW = """(id) => { const input = document.querySelector(`#${id} input`);
    const arrow = document.querySelector(`#${id} .icon-wrap`).getBoundingClientRect();
    return input.getBoundingClientRect().right - parseFloat(getComputedStyle(input).paddingRight) <= arrow.left; }"""
# a dropdown shows its whole choice: the text the input holds is no wider than the input
FITS = "(id) => { const input = document.querySelector(`#${id} input`); return input.scrollWidth <= input.clientWidth; }"
PREFILL_SHARE = r"() => (document.querySelector('#status').innerText.match(/Prefill: (\d+)%/) || [])[1]"


def screenshot_path() -> Path:
    """assets/screenshot.png when TRIFORCE_SCREENSHOT=1 (for the README), else the git-ignored tests/artifacts/."""
    if os.environ.get("TRIFORCE_SCREENSHOT") == "1":
        return ROOT / "assets" / "screenshot.png"
    (ROOT / "tests" / "artifacts").mkdir(parents=True, exist_ok=True)
    return ROOT / "tests" / "artifacts" / "screenshot.png"


@pytest.fixture(scope="module")
def app_url():
    """The app served on a free loopback port for the duration of this module."""
    from app.layout import build_demo, launch_options

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    demo = build_demo()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True, **launch_options())
    yield f"http://127.0.0.1:{port}/"
    demo.close()


def pick_sample(page, title: str) -> None:
    """Choose a bundled sample in the dropdown."""
    page.click("#sample input")
    page.click(f'[role="option"][aria-label="{title}"]')


def text(page, selector: str) -> str:
    return page.inner_text(selector)


def test_a_visitors_run_stop_and_comparison(app_url: str) -> None:
    from app.documents import load_samples
    from app.layout import default_sample
    from app.views import PROVENANCE

    first = default_sample(load_samples())
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=shutil.which(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport=SCREEN)
        errors: list[str] = []
        page.on("pageerror", lambda err: errors.append(str(err)))
        page.goto(app_url)
        page.wait_for_selector("#run", timeout=60_000)

        # the first view: Run in sight on a laptop's screen, what a CPU gives said up front, the three levels chosen,
        # the default sample and its first question, no dropdown's text under its arrow
        run_box = page.locator("#run").bounding_box()
        assert run_box and run_box["y"] + run_box["height"] <= SCREEN["height"], run_box
        assert "near plain decoding's speed, a little faster greedy and slower sampled" in text(page, "#cpu-note")
        assert page.locator("#set-method input[value='triforce']").is_checked()
        assert page.input_value("#sample input") == first.title
        assert page.input_value("#instruction textarea") == first.instructions[0]
        assert page.evaluate(CLEAR_OF_ARROW, "preset") and page.evaluate(CLEAR_OF_ARROW, "sample")

        assert page.evaluate(FITS, "sample")
        pick_sample(page, OTHER_SAMPLE)
        page.wait_for_function("() => document.querySelector('#document textarea').value.includes('Socket')")
        assert page.evaluate(FITS, "sample"), "the sample menu cuts its own choice"
        pick_sample(page, first.title)
        page.wait_for_function(f"() => document.querySelector('#instruction textarea').value === "
                               f"{first.instructions[0]!r}")
        # the settings a visitor changes sit above the tabs; the rest, on a tab of their own, read in a line or two
        page.get_by_label("Max new tokens").fill("32")
        page.get_by_label("Greedy", exact=True).check()
        page.wait_for_function("() => document.querySelector('#doc-info').innerText.includes('32 answer tokens')",
                               timeout=60_000)
        page.get_by_role("tab", name="Settings").click()
        page.wait_for_function(f"() => ({LINES})({LABELS!r}).length >= 12")  # the panel drawn
        labels, helps = page.evaluate(LINES, LABELS), page.evaluate(LINES, HELP)
        assert max(labels) <= 2, f"a setting's label wraps onto three lines or more: {labels}"
        assert helps and max(helps) <= 3, f"a setting's help runs over three lines: {helps}"
        page.get_by_role("tab", name="TriForce").click()

        page.click("#run")
        # prefill reports each layer of its forwards, not only 25 % steps
        page.wait_for_function(f"() => ({PREFILL_SHARE})() % 25 > 0", timeout=240_000, polling=50)
        assert page.locator("#status .eta-bar, #status .progress-text").count() == 0  # one status line, ours
        page.wait_for_function("() => document.querySelector('#status').innerText.includes('Finished')",
                               timeout=240_000)
        # plain text by default; the provenance colours and the rejected drafts are overlays the checkboxes add
        answer = text(page, "#answer")
        assert page.evaluate(COLOURED) == 0 and page.evaluate(SHOWN_DRAFTS) == 0 and "im_end" not in answer
        page.locator("#colour-answer input").check()
        page.wait_for_function(f"() => ({COLOURED})() >= 2")
        legend = text(page, "#answer .legend").splitlines()
        assert PROVENANCE["level3"][0] in legend and set(legend) <= {label for label, _ in PROVENANCE.values()}
        chars = page.evaluate(ANSWER_CHARS)
        page.locator("#show-rejected input").check()
        page.wait_for_function(f"() => ({SHOWN_DRAFTS})() > 0")
        assert page.evaluate(ANSWER_CHARS) > chars and "<|" not in text(page, "#answer")
        # a rejected line break is a mark, never a struck-through blank line
        assert not page.evaluate("() => Array.from(document.querySelectorAll('#answer del'))"
                                 ".filter(e => e.textContent.includes('\\n')).length")
        page.wait_for_selector("#heatmap .hm image", state="attached", timeout=30_000)
        assert "Per layer: the answer's one selection" in page.text_content("#heatmap")
        ticks = page.evaluate("() => Array.from(document.querySelectorAll('#heatmap .cbaxis text'))"
                              ".map(e => e.textContent)")
        assert ticks and all(re.fullmatch(r"\d+", tick) for tick in ticks), ticks  # counts: whole numbers only
        assert "kept by" in text(page, "#doc-view") and "im_start" not in text(page, "#doc-view")
        assert page.locator("#timeline .tl-round").count() >= 1
        # one vocabulary: the timeline's legend names level 3's own token as the answer's legend does
        assert PROVENANCE["level3"][0] in text(page, "#timeline")
        assert page.evaluate("() => { const legend = document.querySelector('#timeline .tl-legend');"
                             " return legend.scrollWidth <= legend.clientWidth; }"), "the timeline's legend wraps"
        assert not re.search(r"\b1 (rounds|selections)\b", page.text_content("body"))
        # one budget share of one prompt count on the screen: the document line's and the stats table's
        share = re.search(r"budget 512 tokens = ([\d.]+) % of the ([\d,]+)-token prompt", text(page, "#doc-info"))
        assert share and f"| budget / prompt | {share[1]} % |" in "| " + " | ".join(
            text(page, "#stats").replace("\t", " | ").splitlines()) + " |"
        page.wait_for_function("() => document.querySelector('#costs').textContent.includes('level 3')")
        page.screenshot(path=str(screenshot_path()), full_page=True)

        page.fill("#document textarea", first.read()[:1500])
        page.get_by_label("Max new tokens").fill("400")
        page.click("#run")
        page.wait_for_function("() => document.querySelector('#status').innerText.includes('Decoding')",
                               timeout=240_000)
        page.click("#stop")
        # The Stop handler's status line can lose a race with the cancelled run's last update (seen once in CI-like
        # runs); what must hold is that no more tokens arrive and Run is usable again.
        try:
            page.wait_for_function("() => document.querySelector('#status').innerText.includes('Stopped')",
                                   timeout=15_000)
        except sync_api.TimeoutError:
            page.screenshot(path=str(ROOT / "tests" / "artifacts" / "stop-status.png"), full_page=True)
        time.sleep(0.5)
        stopped_at = page.evaluate(ANSWER_CHARS)
        time.sleep(2.5)
        assert page.evaluate(ANSWER_CHARS) == stopped_at, "generation went on after Stop"
        assert page.is_enabled("#run")
        page.get_by_label("Max new tokens").fill("4")  # the next run works
        page.click("#run")
        page.wait_for_function("() => document.querySelector('#status').innerText.includes('Finished')",
                               timeout=240_000)

        # Compare: autoregressive, TriForce and auto on the same input, each named by what ran
        page.get_by_role("tab", name="Compare").click()
        page.get_by_label("Max new tokens").fill("16")
        page.get_by_label("Greedy", exact=True).check()
        page.click("#compare-run")
        page.wait_for_function("() => document.querySelector('#verdict').innerText.includes('Token-identical')",
                               timeout=240_000)
        verdict = text(page, "#verdict")
        assert "Ran on cpu" in verdict and "Method auto chose" in verdict and "near plain decoding's speed" in verdict
        assert text(page, "#compare-triforce-head") == "TriForce (levels 1 → 2 → 3)"
        assert "ran " in text(page, "#compare-auto-head")
        ar_table = text(page, "#compare-ar-stats")
        assert re.search(r"level-1 acceptance\s+—", ar_table) and re.search(r"budget / prompt\s+—", ar_table)
        assert "0 %" not in ar_table
        page.locator("#colour-compare input").check()
        assert text(page, "#compare-ar .legend") == PROVENANCE["target"][0]  # autoregressive, not level 3's
        page.wait_for_function("() => document.querySelector('#compare-costs').textContent.includes('autoregressive')")
        bars = page.text_content("#compare-bars")
        assert "time to first token" in bars and "TriForce" in bars and re.search(r"auto: (autoregressive|drafting|"
                                                                                   r"\d+/\d+ tokens AR)", bars)

        # an upload replaces the sample: the menu names the file in its place, and questions about a document in general
        page.get_by_role("tab", name="TriForce").click()
        with page.expect_file_chooser() as chooser:
            page.click("#upload")
        chooser.value.set_files(str(ROOT / "core" / "decode" / "sampling.py"))
        page.wait_for_function("() => document.querySelector('#document textarea').value.includes('def nucleus')",
                               timeout=30_000)
        page.wait_for_function("() => document.querySelector('#sample input').value === '📄 sampling.py'")
        # the page names the file and says, once, what the embedded model is worth on a visitor's own document,
        # Run still in sight
        page.wait_for_function("() => document.querySelector('#upload-note').innerText.includes('sampling.py')")
        assert "often wrong about a document of your own" in text(page, "#upload-note")
        run_bottom = page.evaluate("() => document.querySelector('#run').getBoundingClientRect().bottom + scrollY")
        assert run_bottom <= SCREEN["height"], run_bottom  # from the page's top
        assert page.evaluate(FITS, "sample")
        assert page.input_value("#instruction textarea") != first.instructions[0]
        assert first.instructions[0] not in text(page, "#examples")
        assert "Invalid file type" not in page.content()

        # How it works: the models table has no empty header; the Python snippet names where `core` lives
        page.get_by_role("tab", name="How it works").click()
        page.wait_for_function("() => document.querySelector('#engines table') !== null", timeout=60_000)
        assert all(cell.strip() for cell in page.locator("#engines th").all_inner_texts())
        page.wait_for_function("() => document.querySelector('#python-snippet').innerText.includes('sys.path')")
        assert f'sys.path.insert(0, "{ROOT}")' in text(page, "#python-snippet")
        assert not errors, errors
        browser.close()


# Stop says so within a second on a quiet machine: 0.1 to 0.5 s measured in the page, from the click to the words;
# beside the suite's other worker (a model test on the same 2 cores) 3.6 s was seen. The fault this guards against
# never said it (30 s and more), so the bound leaves a loaded machine its slack and still catches it.
STOP_WITHIN_MS = 10_000
LATE_S = 1.0  # a cancelled run's late frame would arrive within this; the status must still say Stopped after it
SAYS = "([selector, words]) => document.querySelector(selector).innerText.includes(words)"
CLICK = "(selector) => { window.clickedAt = performance.now(); document.querySelector(selector).click(); }"
STOPPED_AFTER_MS = """(selector) => document.querySelector(selector).innerText.includes('Stopped')
    && performance.now() - window.clickedAt"""


def stop_during(page, tab: str, phase: str) -> None:
    """Run on `tab` ("" for TriForce, "compare-" for Compare), click its Stop once the status shows `phase`, and
    check the status says Stopped within a second of the click (timed in the page, apart from the test's driving of
    it) and still does after a cancelled run's last frame could have come, the stats no longer live and the cost
    panel no longer waiting for the end."""
    status = "#compare-status" if tab else "#status"
    page.click(f"#{tab}run")
    page.wait_for_function(SAYS, arg=[status, phase], timeout=240_000, polling=20)
    before = text(page, status)
    page.evaluate(CLICK, f"#{tab}stop")
    took = page.wait_for_function(STOPPED_AFTER_MS, arg=status, timeout=30_000, polling=20).json_value()
    where = f"{tab or 'triforce'} Stop during {phase} ({before!r})"
    assert took <= STOP_WITHIN_MS, f"{where} said so after {took:.0f} ms"
    time.sleep(LATE_S)
    assert "Stopped" in text(page, status), f"{where}: {text(page, status)!r}"
    for stats in [f"#compare-{method}-stats" for method in ("ar", "triforce", "auto")] if tab else ["#stats"]:
        assert "live" not in text(page, stats).split("\n")[0], (where, stats, text(page, stats))
    assert "appears when the run has finished" not in page.text_content(f"#{tab}costs")


def test_stop_always_says_stopped_in_both_tabs_during_prefill_and_decoding(app_url: str) -> None:
    from app.documents import load_samples
    from app.layout import default_sample

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=shutil.which(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport=SCREEN)
        page.goto(app_url)
        page.wait_for_selector("#run", timeout=60_000)
        page.get_by_label("Max new tokens").fill("400")
        for phase in ("Prefill", "Decoding"):  # the default sample's prefill is long; a short one's is over at once
            page.get_by_role("tab", name="TriForce").click()
            if phase == "Decoding":
                page.fill("#document textarea", default_sample(load_samples()).read()[:1500])
            for tab, name in (("", "TriForce"), ("compare-", "Compare")):
                page.get_by_role("tab", name=name).click()
                for _ in range(2):
                    stop_during(page, tab, phase)
        browser.close()


# A second visitor's long prompt read beside a lone visitor's run: the run is told why it slows while it lasts and
# goes on decoding, and the second visitor why its prompt is read slowly (their stats after: tests/test_visitors.py).
# The rate itself (at least 0.7 of alone, by design 1 / (1 + PREFILL_SHARE)) is measured by `python -m bench.served
# pace`, apart from the suite: a browser's timing on a shared machine is no measure. Bounded: both runs are stopped once that has been seen.
NEEDLE = "Needle in a haystack (~6K tokens)"
SLOWER = "slower while the CPU also reads another run's"


def test_a_lone_visitors_run_says_why_it_slows_while_a_second_visitors_long_prompt_is_read(app_url: str) -> None:
    from app.documents import load_samples
    from app.layout import default_sample

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=shutil.which(CHROMIUM), args=CHROMIUM_ARGS)
        first, second = browser.new_page(viewport=SCREEN), browser.new_page(viewport=SCREEN)
        for page in (first, second):
            page.goto(app_url)
            page.wait_for_selector("#run", timeout=60_000)
        pick_sample(second, NEEDLE)
        second.wait_for_function("() => document.querySelector('#document textarea').value.length > 20000")
        second.get_by_label("Max new tokens").fill("4")
        # the first visitor's run outlasts the second's prefill start: a short document, a long bound (Stop ends it)
        # and a temperature at which the answer ends there, not at an end-of-text token
        first.fill("#document textarea", default_sample(load_samples()).read()[:1500])
        first.get_by_label("Max new tokens").fill("400")
        first.get_by_role("tab", name="Settings").click()
        first.get_by_role("spinbutton", name="number input for Temperature").fill("2")
        first.get_by_role("tab", name="TriForce").click()
        first.click("#run")
        first.wait_for_function(SAYS, arg=["#status", "Decoding"], timeout=240_000, polling=50)
        second.click("#run")
        second.wait_for_function(SAYS, arg=["#status", "Prefill"], timeout=60_000, polling=50)
        # the second visitor is told why its prompt is read slowly: between the first's steps
        second.wait_for_function(SAYS, arg=["#status", "slower while 1 other run decodes"], timeout=30_000, polling=50)
        first.wait_for_function(SAYS, arg=["#status", SLOWER], timeout=30_000, polling=50)
        status = text(first, "#status")
        chars = first.evaluate(ANSWER_CHARS)
        first.wait_for_function(f"() => ({ANSWER_CHARS})() > {chars}", timeout=30_000)  # slower, never stalled
        for page in (second, first):
            page.click("#stop")
            page.wait_for_function(SAYS, arg=["#status", "Stopped"], timeout=30_000)
        assert re.search(r"\d+-token prompt \(about \d+% of its pace meanwhile\)", status), status
        browser.close()
