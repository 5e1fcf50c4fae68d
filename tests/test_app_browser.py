"""The page in a real browser: Debian's chromium, headless, through Playwright (never `playwright install`), at
1440 x 900 (a common laptop), in light and dark mode, and at 1280 px and on a 390 px phone.

One walk through what a visitor does: an empty prompt gets a message; the long example (a pass key buried in a
story, 11 key pages) goes to fp16, kivi-k2v2 and kitty side by side in one row, blind; the answers stream at the
same time, are scored against FP16 by teacher forcing, and a vote reveals the methods and is stored; the plots
are readable (one title each, nothing clipped, legends clear of the axes) in both themes; the History tab lists
the run with its leaderboard and opens it; its permalink reopens it. Screenshots are kept in artifacts/
(gitignored) for a person to look at; the assertions run on the same pages.
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from conftest import REPORT
from test_app_api import serve_app

from app.examples import KEY

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
METHODS = ["fp16", "kivi-k2v2", "kitty"]
LAPTOP = {"width": 1440, "height": 900}

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium "
                                                    "(apt-get install chromium); CI installs it"),
]


@pytest.fixture(scope="module")
def app_server(default_model, tmp_path_factory):
    with serve_app(default_model, tmp_path_factory.mktemp("browser") / "runs.sqlite3") as (url, services):
        yield url, services


@pytest.fixture(scope="module")
def server(app_server):
    return app_server[0]


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


def open_page(browser, url: str, viewport=LAPTOP, ready: str = "#prompt textarea"):
    context = browser.new_context(viewport=viewport)
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.goto(url)
    page.wait_for_selector(ready)
    return page


@pytest.fixture
def page(browser, server):
    page = open_page(browser, server)
    yield page
    page.context.close()


def pane_texts(page) -> dict[str, str]:
    """The latest bot message of each method's pane ('' while there is none)."""
    return page.evaluate("""(methods) => Object.fromEntries(methods.map(m => {
        const bots = document.querySelectorAll(`#chat-${m} [data-testid="bot"]`);
        return [m, bots.length ? bots[bots.length - 1].innerText.trim() : ""];
    }))""", METHODS)


def boxes(page, selectors: list[str]) -> list[dict]:
    """Where elements are on the whole page (not the viewport, which autofocus may have scrolled)."""
    return page.evaluate("""(sels) => sels.map(s => {
        const r = document.querySelector(s).getBoundingClientRect(), x = window.scrollX, y = window.scrollY;
        return {top: r.top + y, bottom: r.bottom + y, left: r.left + x, right: r.right + x, width: r.width};
    })""", selectors)


def overlap(a: dict, b: dict) -> bool:
    return not (a["right"] <= b["left"] or b["right"] <= a["left"] or a["bottom"] <= b["top"]
                or b["bottom"] <= a["top"])


# Every visible Plotly figure: its title inside the figure (not cut at any side) and clear of the plot areas and the
# legend; the legend clear of the plot areas and the axis titles; bar labels clear of the panels' titles. Returns
# what is wrong, as text, and how many figures were looked at.
PLOT_PROBLEMS = """() => {
    const box = e => e.getBoundingClientRect();
    const shown = e => { const r = box(e); return r.width > 0 && r.height > 0; };
    const hit = (a, b) => !(a.right <= b.left + 1 || b.right <= a.left + 1 || a.bottom <= b.top + 1 ||
                            b.bottom <= a.top + 1);
    const problems = []; let seen = 0;
    for (const plot of document.querySelectorAll('.js-plotly-plot')) {
        if (!shown(plot)) continue;
        seen += 1;
        const name = plot.closest('[id]')?.id || 'a plot';
        const frame = box(plot);
        const areas = [...plot.querySelectorAll('.draglayer .nsewdrag')].map(box);
        const titles = [...plot.querySelectorAll('.gtitle, .gtitle-subtitle')].filter(shown).map(box);
        const axes = [...plot.querySelectorAll('.xtitle, .ytitle')].filter(shown).map(box);
        const legend = plot.querySelector('.legend') && box(plot.querySelector('.legend .bg'));
        const notes = [...plot.querySelectorAll('.annotation')].map(box);
        const bars = [...plot.querySelectorAll('.bartext')].map(box);
        if (plot.querySelectorAll('.gtitle').length !== 1) problems.push(`${name}: not one title`);
        for (const t of titles) {
            if (t.left < frame.left - 1 || t.right > frame.right + 1 || t.top < frame.top - 1 ||
                t.bottom > frame.bottom + 1) problems.push(`${name}: title cut`);
            const under = areas.find(a => hit(a, t));
            if (under) problems.push(`${name}: title (bottom ${Math.round(t.bottom)}) over the plot (top ` +
                                     `${Math.round(under.top)})`);
            if (legend && hit(legend, t)) problems.push(`${name}: title over the legend`);
        }
        if (legend) {
            if (areas.some(a => hit(a, legend))) problems.push(`${name}: legend over the plot`);
            if (axes.some(a => hit(a, legend))) problems.push(`${name}: legend over an axis title`);
            if (legend.right > frame.right + 1 || legend.bottom > frame.bottom + 1)
                problems.push(`${name}: legend cut`);
        }
        for (const b of bars) if (notes.some(n => hit(n, b))) problems.push(`${name}: a bar label over a panel title`);
        for (const n of notes) if (titles.some(t => hit(t, n))) problems.push(`${name}: a panel title under the title`);
    }
    return [problems, seen];
}"""


def assert_plots_readable(page, at_least: int) -> None:
    problems, seen = page.evaluate(PLOT_PROBLEMS)
    assert seen >= at_least and problems == [], problems


def assert_no_gradio_label_on_plots(page) -> None:
    """One title per plot: the figure's own, no Gradio label above it."""
    labelled = page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')].filter(p => p.offsetParent)
        .filter(p => p.closest('.block')?.querySelector('[data-testid="block-label"]')?.offsetParent)
        .map(p => p.closest('[id]')?.id + ': ' + p.closest('.block').querySelector('[data-testid="block-label"]')
                  .innerText)""")
    assert labelled == []


def luminance(css: str) -> float:
    r, g, b = (int(v) / 255 for v in re.findall(r"\d+", css)[:3])
    linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in (r, g, b)]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def contrast(page, selector: str) -> float:
    """Contrast ratio of a status message's text against its box (WCAG: 4.5 or more reads well)."""
    fg, bg = page.evaluate("""(sel) => { const e = document.querySelector(sel);
        return [getComputedStyle(e).color, getComputedStyle(e.closest('.kitty-status')).backgroundColor]; }""",
                           selector)
    high, low = sorted((luminance(fg), luminance(bg)), reverse=True)
    return (high + 0.05) / (low + 0.05)


def assert_dark_plots(page, selector: str) -> None:
    """Dark mode: transparent figure backgrounds on a dark page, light text."""
    fill, background, page_bg = page.evaluate("""(sel) => { const p = document.querySelector(sel);
        return [getComputedStyle(p.querySelector('.gtitle')).fill, getComputedStyle(p.querySelector('.main-svg'))
                .backgroundColor, getComputedStyle(document.querySelector('.gradio-container')).backgroundColor]; }""",
                                              selector)
    assert background == "rgba(0, 0, 0, 0)" and luminance(fill) > 0.6 and luminance(page_bg) < 0.05, \
        (fill, background, page_bg)


def test_compare_arena_long_example_blind_vote_history_and_permalink(page, app_server, browser):
    server, services = app_server
    ARTIFACTS.mkdir(exist_ok=True)

    # An empty prompt gets a message in the page
    page.click("#send")
    page.wait_for_selector("#compare-status .kitty-error")
    assert "The prompt is empty" in page.inner_text("#compare-status")

    # At 1440 px the three default methods share one row, side by side
    panes = boxes(page, [f"#pane-{m}" for m in METHODS])
    assert len({round(b["top"]) for b in panes}) == 1 and panes[-1]["right"] <= LAPTOP["width"]
    assert not any(overlap(a, b) for i, a in enumerate(panes) for b in panes[i + 1:])

    # The long example: a pass key buried in a story, asked about; blind
    page.locator("#examples button").first.click()
    page.wait_for_function("document.querySelector('#document textarea')?.value.length > 5000")
    assert "pass key" in page.input_value("#prompt textarea")
    page.fill("#max-new-tokens input", "12")
    page.check("#blind input")
    page.click("#send")

    # All three answers stream at the same time: seen partial, together, while the run is still going
    seen_together, started, deadline = False, time.monotonic(), time.monotonic() + 480
    while time.monotonic() < deadline:
        texts = pane_texts(page)
        running = page.query_selector("#compare-status .kitty-running") is not None
        if running and all(t and t != "…" for t in texts.values()):
            seen_together = True
        if page.query_selector("#compare-status .kitty-ok, #compare-status .kitty-warning"):
            break
        time.sleep(0.2)
    took = time.monotonic() - started
    assert seen_together, "the three panes never showed text at the same time during the run"
    status = page.inner_text("#compare-status")
    assert "3 of 3 answers complete" in status and "Saved as run" in status
    slug = status.split("Saved as run ")[1].split(".")[0]

    # Blind: letters instead of methods, no metrics, no plots, until the vote
    heads = {m: page.inner_text(f"#head-{m}") for m in METHODS}
    assert sorted(h.splitlines()[0].strip() for h in heads.values()) == ["Answer A", "Answer B", "Answer C"]
    assert not any(m in h for m in METHODS for h in heads.values())
    assert all("hidden until you vote" in page.inner_text(f"#metrics-{m}") for m in METHODS)
    assert not page.is_visible("#boost-mask-plot")
    page.get_by_label("B", exact=True).check()
    page.click("#vote")
    page.wait_for_selector("#vote-status .kitty-ok")
    chosen = re.search(r"B = ([\w*-]+)", page.inner_text("#vote-status")).group(1)
    votes = services.runlog.database().votes(slug)
    assert [(v.choice, v.blind) for v in votes] == [(chosen, True)]

    # Revealed: each answer scored against FP16 by teacher forcing; the long prompt formed 2-bit pages
    page.wait_for_function("document.querySelector('#head-kitty').innerText.includes('kitty')")
    texts = pane_texts(page)
    assert KEY in texts["fp16"] and KEY in texts["kitty"], texts
    assert "reference" in page.inner_text("#metrics-fp16")
    for method in ("kivi-k2v2", "kitty"):
        card = page.inner_text(f"#metrics-{method}")
        assert "top-1 agreement (teacher-forced)" in card and "KL from FP16 (teacher-forced)" in card
        assert "free-running token match" in card
        assert int(re.search(r"([\d,]+) key · ", card).group(1).replace(",", "")) >= 10 * 30   # >= 10 pages a layer
    stored = {r.method: r for r in services.runlog.get(slug).results}
    assert stored["kitty"].kl_from_fp16 < stored["kivi-k2v2"].kl_from_fp16
    REPORT.append(f"long example in the browser ({took:.0f} s, 12 new tokens): " + "; ".join(
        f"{m}: {texts[m]!r}, top-1 {stored[m].top1_agreement}, KL {stored[m].kl_from_fp16}" for m in METHODS))
    if stored["kivi-k2v2"].first_difference is not None:      # its first different token is highlighted
        assert page.query_selector("#chat-kivi-k2v2 mark.kitty-diverge") is not None

    # The plots, now shown: real pages in the boost mask, the projection with lines and measured dots
    page.wait_for_function("""() => document.querySelector('#boost-mask-plot .gtitle-subtitle')?.textContent
        .includes('channels boosted per page')""")
    assert "8 of 64 channels boosted" in page.inner_text("#boost-mask-plot")
    page.wait_for_selector("#magnitude-plot .js-plotly-plot")
    assert page.locator("#kv-projection-plot .scatterlayer .trace").count() >= 2 * len(METHODS)   # lines + dots
    assert "at 32K tokens (projected)" in page.inner_text("#metrics-kitty")
    assert "100% of FP16" in page.inner_text("#metrics-fp16")

    # Readable at 1440 px, light and dark: one title each, nothing cut, legends clear of the axes
    time.sleep(1)                                 # the last redraw settles
    assert_no_gradio_label_on_plots(page)
    assert_plots_readable(page, at_least=5)
    page.screenshot(path=str(ARTIFACTS / "compare-light.png"), full_page=True)
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=str(ARTIFACTS / "compare-viewport.png"))      # what a laptop shows first (the README's)
    page.evaluate("document.body.classList.add('dark')")       # what ?__theme=dark does
    assert_dark_plots(page, "#boost-mask-plot")
    assert contrast(page, "#compare-status .kitty-message") >= 4.5
    assert_plots_readable(page, at_least=5)
    page.screenshot(path=str(ARTIFACTS / "compare-dark.png"), full_page=True)
    page.evaluate("document.body.classList.remove('dark')")

    # History lists the run (and its vote in the leaderboard); a click opens it with its answers and metrics
    page.get_by_role("tab", name="History").click()
    assert page.is_visible("#history-guide") and not page.is_visible("#history-boost-plot")
    cell = page.locator("#history-table span").get_by_text(slug, exact=True)
    cell.wait_for()
    assert chosen in page.inner_text("#leaderboard")
    cell.click()
    page.wait_for_function(f"document.querySelector('#run-header')?.innerText.includes('Run {slug}')")
    assert not page.is_visible("#history-guide") and "1 vote(s)" in page.inner_text("#run-header")
    answers = page.inner_text("#run-answers")
    assert all(m in answers for m in METHODS) and KEY in answers
    assert "kivi-k2v2" in page.inner_text("#run-metrics") and "reference" in page.inner_text("#run-metrics")
    page.wait_for_function("""() => document.querySelector('#history-boost-plot .gtitle-subtitle')?.textContent
        .includes('channels boosted per page')""")
    page.screenshot(path=str(ARTIFACTS / "history.png"), full_page=True)

    # The permalink reopens the run on a fresh page load, in dark mode: the success message reads well
    dark = open_page(browser, f"{server}?__theme=dark&run={slug}", ready="#run-header h3")
    assert dark.evaluate("document.body.classList.contains('dark')")
    assert dark.get_by_role("tab", name="History").get_attribute("aria-selected") == "true"
    assert contrast(dark, "#run-status .kitty-message") >= 4.5
    dark.wait_for_selector("#history-boost-plot .gtitle")
    time.sleep(1)
    assert_dark_plots(dark, "#history-boost-plot")
    assert_no_gradio_label_on_plots(dark)
    assert_plots_readable(dark, at_least=4)
    dark.screenshot(path=str(ARTIFACTS / "history-dark.png"), full_page=True)
    dark.context.close()

    # New chat: empty panes, and no plot of the last run
    page.get_by_role("tab", name="Compare").click()
    page.click("#new-chat")
    page.wait_for_function("document.querySelector('#boost-mask-plot')?.innerText.includes('Run a comparison')")
    assert pane_texts(page) == {m: "" for m in METHODS} and not page.is_visible("#vote-box")


def test_layout_at_1280_px_and_on_a_phone(browser, server):
    """Four methods still share one row at 1280 px (a fifth scrolls sideways); on a 390 px phone the panes come
    first, one per screen and swiped, with the message box right below them and the settings after it."""
    page = open_page(browser, server, viewport={"width": 1280, "height": 800})
    page.get_by_label("kitty-pro", exact=True).check()
    page.wait_for_selector("#pane-kitty-pro", state="visible")
    four = boxes(page, [f"#pane-{m}" for m in [*METHODS, "kitty-pro"]])
    assert len({round(b["top"]) for b in four}) == 1 and four[-1]["right"] <= 1280
    assert min(b["width"] for b in four) >= 200
    page.get_by_label("kivi-k4v4", exact=True).check()
    page.wait_for_selector("#pane-kivi-k4v4", state="visible")
    assert page.evaluate("(e => e.scrollWidth > e.clientWidth)(document.querySelector('#panes'))")
    # Focus two: only those two panes, wider
    page.click("#focus input")
    for method in ("fp16", "kitty"):
        page.get_by_role("option", name=method, exact=True).click()
    page.wait_for_selector("#pane-kivi-k2v2", state="hidden")
    pair = boxes(page, ["#pane-fp16", "#pane-kitty"])
    assert pair[0]["top"] == pair[1]["top"] and min(b["width"] for b in pair) > 400
    page.context.close()

    phone = open_page(browser, server, viewport={"width": 390, "height": 844})
    pane, prompt, controls = boxes(phone, ["#pane-fp16", "#prompt textarea", ".kitty-controls"])
    assert pane["width"] <= 390 and prompt["top"] < controls["top"] and prompt["top"] < 2 * 844
    assert phone.evaluate("(e => e.scrollWidth > e.clientWidth)(document.querySelector('#panes'))")
    phone.evaluate("window.scrollTo(0, 0)")
    phone.screenshot(path=str(ARTIFACTS / "phone.png"), full_page=True)
    phone.context.close()


def test_a_bad_permalink_keeps_its_message_and_history_shows_guidance(browser, server):
    page = open_page(browser, f"{server}?run=nosuchrun1", ready="#run-status .kitty-error")
    time.sleep(1.5)                              # the history list loads meanwhile: it must not replace the message
    assert "No run 'nosuchrun1'" in page.inner_text("#run-status")
    assert "run(s)" in page.inner_text("#history-status")
    assert page.is_visible("#history-guide") and not page.is_visible("#history-boost-plot")
    page.context.close()


def test_teaching_tab_shows_the_precomputed_results_without_running_anything(page):
    """The collapse is on screen at once: pass-key at several thousand tokens, one real page's channels and
    what 2 bits do to them, the suite over the whole text; labelled as precomputed with its command."""
    page.get_by_role("tab", name="Teaching").click()
    page.wait_for_selector("#precomputed-passkey-plot .js-plotly-plot")
    note = page.inner_text("#precomputed-note")
    assert "Precomputed on" in note and "python -m backend.teaching" in note
    table = page.inner_text("#precomputed-passkey-table")
    assert "kitty" in table and "kivi-k2v2" in table and "tokens" in table
    assert "the keys found were: fp16" in page.inner_text("#precomputed-passkey-text")
    for plot in ("#page-channels-plot", "#quantization-plot", "#precomputed-suite-plot"):
        page.wait_for_selector(f"{plot} .js-plotly-plot")
    assert "kitty-pro" in page.inner_text("#precomputed-suite-table")
    assert page.inner_text("#suite-progress").strip() == ""                 # nothing was run live
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "teaching.png"), full_page=True)


def test_teaching_results_are_remembered_after_a_reload_and_tables_fit(page, monkeypatch):
    """A finished suite is shown again on the next page load, and its table (like the precomputed one) fits its
    column. The suite itself is replaced by a quick stand-in: the page, not the suite, is under test here."""
    from backend import teaching
    rows = [["fp16", 1, 0, 11.2, "1/1", 16, 1], ["kivi-k2v2", 0.81, 0.41, 13.9, "0/1", 2.25, 0.71]]
    monkeypatch.setattr(teaching, "run_suite", lambda *args, **kwargs: teaching.Table(teaching.SUITE_COLUMNS, rows))
    page.get_by_role("tab", name="Teaching").click()
    page.click("#run-suite")
    page.wait_for_function("document.querySelector('#suite-table')?.innerText.includes('kivi-k2v2')")
    page.reload()
    page.wait_for_selector("#prompt textarea")
    page.get_by_role("tab", name="Teaching").click()
    page.wait_for_function("document.querySelector('#suite-table')?.innerText.includes('kivi-k2v2')")
    assert "The last run, kept" in page.inner_text("#suite-progress")
    page.wait_for_selector("#suite-plot .js-plotly-plot")
    for table in [t for t in ("#suite-table", "#precomputed-suite-table") if page.query_selector(t)]:
        block, inner = boxes(page, [table, f"{table} table"])
        assert inner["right"] <= block["right"] + 1 and inner["left"] >= block["left"] - 1, (table, block, inner)
        cut = page.evaluate("""(sel) => [...document.querySelectorAll(sel + ' th')].filter(th =>
            th.scrollWidth > th.clientWidth + 1).map(th => th.innerText)""", table)
        assert cut == [], cut
    assert_no_gradio_label_on_plots(page)
    assert_plots_readable(page, at_least=1)
    page.screenshot(path=str(ARTIFACTS / "teaching-remembered.png"), full_page=True)
