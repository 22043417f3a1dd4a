"""The HTML report in a real browser: Debian's headless Chromium driven by playwright (the system
browser, ``/usr/bin/chromium``; nothing downloads a browser build; ``.ci/run`` installs it).

Renders the demo store's report, fails on any console error or page error, checks that every
section and every plot is present and non-empty (an ``<svg>`` with drawn paths and a visible box),
and saves a full-page screenshot as a test artefact (``$CACHESCORE_TEST_ARTIFACTS`` or
``test-artifacts/`` at the repository root).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


from cachescore.report import build_report
from cluster_utils import service_missing

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def require_chromium() -> None:
    """Debian's chromium must be installed (``.ci/run`` installs it); elsewhere the test skips."""
    if not Path(CHROMIUM).is_file():
        service_missing(f"{CHROMIUM} not found: install Debian's chromium (apt-get install chromium)")
ARTIFACTS = Path(os.environ.get("CACHESCORE_TEST_ARTIFACTS", Path(__file__).resolve().parents[1] / "test-artifacts"))
#: The flags the workplace's probe uses for headless Chromium on this closed network.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def test_demo_report_renders_in_chromium_with_every_plot(demo, tmp_path):
    from playwright.sync_api import sync_playwright

    require_chromium()
    out = build_report(demo.store, tmp_path / "report.html")
    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS,
                                     env={**os.environ, "HOME": str(tmp_path)})
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
            page.goto(out.as_uri(), wait_until="load")
            assert page.title().startswith("cachescore report")
            for section in ("overview", "forest", "probe", "margins", "leaderboards", "distributions"):
                box = page.locator(f"#{section}").bounding_box()
                assert box and box["height"] > 0, section
            plots = page.evaluate("""() => [...document.querySelectorAll('svg')].map(s => {
                const r = s.getBoundingClientRect();
                return {w: r.width, h: r.height, drawn: s.querySelectorAll('path, rect, line, polyline').length,
                        section: s.closest('[id]') ? s.closest('[id]').id : ''};
            })""")
            forest = [p for p in plots if p["drawn"] > 10 and p["w"] > 200]
            assert len(plots) >= 40 and all(p["w"] > 20 and p["h"] > 20 and p["drawn"] > 0 for p in plots), plots[:5]
            # 10 forest plots (2 views x 3 metrics + 4 probe reductions), 2 probe curves, 8 CRoMa ECDFs
            assert len(forest) >= 20
            overview = page.locator("#overview ~ h3").count()
            assert overview >= 1 and page.locator("text=★").count() >= 10
            assert page.locator("text=no per-unit values stored").count() == 0  # no empty panels
            # issue 24: direction, rank intervals, verdicts against the best and the disagreement note
            # are on the page and visible (the demo's probe metrics favour enc1, RI/MaRI/CRoMa enc0)
            for text in ("Higher is more robust, for every metric", "rank 1 [1–1] of 4", "worse than enc0: Δ",
                         "The metric families disagree"):
                assert page.locator("#overview ~ *").get_by_text(text, exact=False).first.is_visible(), text
            note = page.locator("p.warn", has_text="The metric families disagree").first.inner_text()
            assert "enc0 is best on" in note and "enc1 is best on" in note
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            shot = ARTIFACTS / "demo-report.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 50_000
        finally:
            browser.close()
    assert errors == []


def test_the_dask_performance_report_renders_with_no_network(demo, tmp_path):
    """Issue 25: the per-run Dask performance report loaded bokeh from a CDN and was blank offline;
    it is written with bokeh inlined (``mode="inline"``). Every request that is not the file itself
    is refused here, and the report's plots must still render."""
    from playwright.sync_api import sync_playwright

    require_chromium()
    [report] = sorted(Path(demo.store).glob("runs/*/dask-performance-report.html"))
    html = report.read_text(encoding="utf-8")
    assert "cdn.bokeh.org" not in html and "cdn.pydata.org" not in html
    errors, refused = [], []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS, env={**os.environ, "HOME": str(tmp_path)})
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
                       else (refused.append(route.request.url), route.abort()))
            page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
            page.goto(report.as_uri(), wait_until="load")
            assert page.get_by_text("Dask Performance Report").first.is_visible()
            page.get_by_text("Task Stream", exact=True).first.click()  # a tab with a plot
            canvases = page.locator("canvas")  # bokeh draws in shadow roots; playwright's locators pierce them
            canvases.first.wait_for(state="visible", timeout=30_000)
            boxes = [canvases.nth(i).bounding_box() for i in range(canvases.count())]
            drawn = [b for b in boxes if b and b["width"] > 50 and b["height"] > 50]
            assert len(drawn) >= 1, boxes
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "dask-performance-report.png"))
        finally:
            browser.close()
    assert refused == [] and errors == [], (refused[:5], errors[:5])
