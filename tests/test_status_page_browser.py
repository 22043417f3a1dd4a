"""The live status page (``<dashboard>/cachescore``) in Debian's headless Chromium (playwright with
the system browser, as tests/test_report_browser.py).

A real ``dask scheduler`` (with its HTTP server) and no worker: ``cachescore run --scheduler``
plans and waits, the page shows every unit ``pending`` with the encoders' names; a ``dask
worker`` joins and the same page, without a reload, shows the units ``done`` and the run
``finished``. No console or page error is allowed.
"""

from __future__ import annotations

import os

import pytest

from cluster_utils import subprocess_cluster
from test_report_browser import ARTIFACTS, CHROMIUM, FLAGS, require_chromium
from test_runtime_faults import N_UNITS, cache, cli, finish, wait_for, write_job  # noqa: F401 (fixture)

pytestmark = pytest.mark.cluster


def test_status_page_updates_live_in_chromium(tmp_path, cache):  # noqa: F811 - the fixture
    from playwright.sync_api import sync_playwright

    require_chromium()
    errors: list[str] = []
    with subprocess_cluster(n_workers=0, http=True) as cluster:
        job = write_job(tmp_path, cache, tmp_path / "store")
        log = tmp_path / "run.log"
        proc = cli("run", job, "--scheduler", cluster.address, log=log)
        try:
            wait_for(lambda: "this run:" in log.read_text(), 120, "the printed status page URL", proc, log)
            url = cluster.http + "/cachescore"
            assert f"dashboard: {cluster.http}/status  (this run: {url})" in log.read_text()
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS,
                                             env={**os.environ, "HOME": str(tmp_path)})
                try:
                    page = browser.new_page(viewport={"width": 1200, "height": 900})
                    page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}")
                            if m.type == "error" else None)
                    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
                    page.goto(url, wait_until="load")
                    page.wait_for_function(f"document.querySelectorAll('#units tbody tr td.pending').length == "
                                           f"{N_UNITS}", timeout=30_000)
                    encoders = page.eval_on_selector_all("#units tbody tr td:first-child",
                                                         "cells => [...new Set(cells.map(c => c.textContent))]")
                    assert sorted(encoders) == ["enc0", "enc1", "enc2", "enc3"]
                    assert page.locator("#state").inner_text() == "running"
                    cluster.add_worker()
                    page.wait_for_function("document.getElementById('state').textContent == 'finished'",
                                           timeout=180_000)
                    page.wait_for_function(f"document.querySelectorAll('#units tbody tr td.done').length == "
                                           f"{N_UNITS}", timeout=10_000)
                    values = page.eval_on_selector_all("#units tbody tr td:nth-child(7)",
                                                       "cells => cells.map(c => c.textContent)")
                    assert sum(1 for v in values if v) >= N_UNITS - 4  # metric units show their value
                    ARTIFACTS.mkdir(parents=True, exist_ok=True)
                    page.screenshot(path=str(ARTIFACTS / "status-page.png"), full_page=True)
                finally:
                    browser.close()
            assert finish(proc, 120) == 0, log.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
    assert errors == []
