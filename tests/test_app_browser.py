"""The page in a real browser: Debian's chromium, headless, through Playwright (never `playwright install`).

One walk through what a visitor does: an empty prompt gets a message; a prompt goes to fp16, kivi-k2v2 and kitty,
the three answers stream at the same time, the boost-mask plot appears; the History tab lists the run and opens
it; its permalink reopens it. Screenshots are kept in artifacts/ (gitignored) for a person to look at.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
from test_app_api import serve_app

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
METHODS = ["fp16", "kivi-k2v2", "kitty"]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium "
                                                    "(apt-get install chromium); CI installs it"),
]


@pytest.fixture(scope="module")
def server(default_model, tmp_path_factory):
    with serve_app(default_model, tmp_path_factory.mktemp("browser") / "runs.sqlite3") as (url, services):
        yield url


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM),
            args=["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                  "--disable-dev-shm-usage"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser, server):
    context = browser.new_context(viewport={"width": 1600, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.goto(server)
    page.wait_for_selector("#prompt textarea")
    yield page
    context.close()


def pane_texts(page) -> dict[str, str]:
    """The latest bot message of each method's pane ('' while there is none)."""
    return page.evaluate("""(methods) => Object.fromEntries(methods.map(m => {
        const bots = document.querySelectorAll(`#chat-${m} [data-testid="bot"]`);
        return [m, bots.length ? bots[bots.length - 1].innerText.trim() : ""];
    }))""", METHODS)


def test_compare_stream_history_and_permalink(page, server):
    ARTIFACTS.mkdir(exist_ok=True)

    # An empty prompt gets a message in the page
    page.click("#send")
    page.wait_for_selector("#compare-status .kitty-error")
    assert "The prompt is empty" in page.inner_text("#compare-status")

    # The long example is about 400 tokens: every cache forms key pages, so Kitty has boost masks to show
    page.get_by_text("Summarize this story opening").click()
    page.wait_for_function("document.querySelector('#prompt textarea').value.length > 1000")
    page.fill("#max-new-tokens input", "16")
    checked = page.eval_on_selector_all("#methods input:checked",
                                        "inputs => inputs.map(i => i.closest('label').innerText.trim())")
    assert sorted(checked) == sorted(METHODS)
    page.click("#send")

    # All three answers stream at the same time: seen partial, together, while the run is still going
    seen_together, deadline = False, time.monotonic() + 240
    while time.monotonic() < deadline:
        texts = pane_texts(page)
        running = page.query_selector("#compare-status .kitty-running") is not None
        if running and all(t and t != "…" for t in texts.values()):
            seen_together = True
        if page.query_selector("#compare-status .kitty-ok, #compare-status .kitty-warning"):
            break
        time.sleep(0.2)
    assert seen_together, "the three panes never showed text at the same time during the run"
    status = page.inner_text("#compare-status")
    assert "3 of 3 methods finished" in status and "Saved as run" in status
    slug = status.split("Saved as run ")[1].split(".")[0]
    texts = pane_texts(page)
    assert all(texts[m] for m in METHODS), texts
    for method in METHODS:
        assert "done" in page.inner_text(f"#metrics-{method}")
        assert "tok/s" in page.inner_text(f"#metrics-{method}")
    assert "reference" in page.inner_text("#metrics-fp16")
    assert "of tokens" in page.inner_text("#metrics-kitty")

    # The boost-mask heatmap of kitty (real pages, not the "no page yet" placeholder)
    page.wait_for_function("""() => {
        const title = document.querySelector('#boost-mask-plot .gtitle');
        return title && title.textContent.includes('channels boosted per page');
    }""")
    assert page.query_selector("#boost-mask-plot .heatmaplayer, #boost-mask-plot .hm") is not None
    assert "8 of 64 channels boosted" in page.inner_text("#boost-mask-plot")
    page.wait_for_selector("#magnitude-plot .js-plotly-plot")
    page.screenshot(path=str(ARTIFACTS / "compare.png"), full_page=True)

    # History lists the run; a click opens it with its answers and metrics
    page.get_by_role("tab", name="History").click()
    cell = page.locator("#history-table span").get_by_text(slug, exact=True)
    cell.wait_for()
    cell.click()
    page.wait_for_function(f"document.querySelector('#run-header')?.innerText.includes('Run {slug}')")
    answers = page.inner_text("#run-answers")
    assert all(m in answers for m in METHODS)
    assert texts["kitty"].splitlines()[0][:20] in answers
    assert "kivi-k2v2" in page.inner_text("#run-metrics")
    page.wait_for_function("""() => {
        const title = document.querySelector('#history-boost-plot .gtitle');
        return title && title.textContent.includes('channels boosted per page');
    }""")
    page.screenshot(path=str(ARTIFACTS / "history.png"), full_page=True)

    # The permalink reopens the run on a fresh page load
    page.goto(f"{server}?run={slug}")
    page.wait_for_function(f"document.querySelector('#run-header')?.innerText.includes('Run {slug}')")
    assert page.get_by_role("tab", name="History").get_attribute("aria-selected") == "true"
