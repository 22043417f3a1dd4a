"""cachescore.report.build_report: a static HTML report of a results store.

Pins: one leaderboard per (view, design, metric[, m]) ranking encoders by value, descending, with
NaN unranked and last and ties sharing a rank; the newest record of an encoder wins within a group
and older ones are counted; per-unit histograms (inline SVG) for each ranked record; failures with
their errors; provenance of the latest run (by start time) with a relative link to the Dask
performance report; every string from the store is escaped; the file is self-contained (no
external resources, no script) and written atomically; a corrupt per-unit table is reported, not
raised; a missing store raises and is not created.
"""

from __future__ import annotations

import html
import re
from html.parser import HTMLParser

import numpy as np
import pandas as pd
import pytest

from cachescore.report import build_report, histogram_svg
from cachescore.store import ResultsStore, fingerprint

EVIL = "<script>alert('x')</script>&"


def fp_of(*parts) -> str:
    return fingerprint(list(parts))


def record(encoder, value, *, metric="ri", view="centre_all", design="all", m=None, when="2026-01-01T00:00:00+00:00", **kw):
    rec = {"encoder": encoder, "view": view, "tileset": "demo", "design": design, "family": metric, "metric": metric,
           "params": '{"alpha":0.1,"k_candidates":[5,11]}', "value": value, "std": 0.01, "q_alpha": 0.2,
           "ltm_alpha": 0.1, "f0": float("nan"), "support": 1.0, "k": 11, "tau": float("nan"), "m": m,
           "recall": float("nan"), "n_units": 100, "backend": "exact", "seconds": 1.25, "finished_at": when}
    rec.update(kw)
    return rec


def per_unit(rng, n=100, n_nan=0):
    v = rng.uniform(0, 1, n)
    v[:n_nan] = np.nan
    return pd.DataFrame({"unit": np.arange(n), "value": v})


@pytest.fixture
def store(tmp_path):
    rng = np.random.default_rng(0)
    s = ResultsStore(tmp_path / "store")
    # RI leaderboard: ranks 1 enc_b (0.9), 2 EVIL and enc_c tie (0.7), 4 enc_a (0.5), unranked enc_nan
    for enc, value in [("enc_a", 0.5), ("enc_b", 0.9), (EVIL, 0.7), ("enc_c", 0.7), ("enc_nan", float("nan"))]:
        s.write_unit(fp_of("ri", enc), record=record(enc, value), per_unit=per_unit(rng, n_nan=3 if enc == "enc_a" else 0))
    # an older enc_a record with a higher value is superseded by the newer one above
    s.write_unit(fp_of("ri", "enc_a", "old"), record=record("enc_a", 0.99, when="2025-06-01T00:00:00+00:00"))
    # CRoMa: two m values are two leaderboards
    for m, values in [(5, {"enc_a": 0.3, "enc_b": 0.1}), (10, {"enc_a": 0.05, "enc_b": 0.2})]:
        for enc, value in values.items():
            s.write_unit(fp_of("croma", enc, m), record=record(enc, value, metric="croma", m=m, f0=0.25, k=40),
                         per_unit=per_unit(rng))
    # MaRI on another view, whose name needs escaping
    s.write_unit(fp_of("mari", "x"), record=record("enc_a", 0.4, metric="mari", view="v&<1>", tau=0.05), per_unit=per_unit(rng))
    s.record_failure(fp_of("fail", 1), unit={"encoder": "enc_d", "view": "centre_all", "metric": "croma", "run_id": "r2"},
                     error="ValueError: subset <b>'s1'</b> & friends is incomplete")
    # two runs: r2 started later; only r2's performance report exists
    s.write_provenance("r1", {"started_at": "2026-01-01T00:00:00+00:00", "seconds": 3.0, "versions": {"numpy": "0.0"},
                              "units": {"planned": 1}})
    report = s.run_dir("r2") / "dask-performance-report.html"
    report.write_text("<html>perf</html>")
    s.write_provenance("r2", {"started_at": "2026-02-01T00:00:00+00:00", "finished_at": "2026-02-01T00:01:00+00:00",
                              "seconds": 60.0, "job_path": "jobs/<demo>.toml", "code_version": "0.1.0",
                              "versions": {"numpy": "2.4.0", "croma": "1.0.1", "weird": "<x>"},
                              "units": {"planned": 12, "executed": 12, "failed": 1},
                              "hardware": {"platform": "linux", "workers": [{"address": "tcp://a", "nthreads": 2}]},
                              "job": {"name": "demo"}, "performance_report": str(report),
                              "failures": [{"label": "x", "error": "e"}]})
    return s


def section(page: str, sid: str) -> str:
    start = page.index(f'<h2 id="{sid}">')
    nxt = page.find("<h2 ", start + 1)
    return page[start: nxt if nxt > 0 else len(page)]


def leaderboard_rows(page: str, title_part: str) -> list[tuple[str, str, str]]:
    """(rank, encoder, value text) rows of the leaderboard whose title contains ``title_part``."""
    lb = section(page, "leaderboards")
    start = lb.index(title_part)
    end = lb.find("<h3", start)
    chunk = lb[start: end if end > 0 else len(lb)]
    rows = re.findall(r'<tr[^>]*><td class="num">([^<]*)</td><td>(.*?)</td><td class="num">(?:<span[^>]*></span>)?([^<]*)</td>', chunk)
    return [(r, html.unescape(e), v) for r, e, v in rows]


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.attrs = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs.extend(attrs)


def test_leaderboards_rank_escape_and_supersede(store, tmp_path):
    out = build_report(store.path, tmp_path / "out" / "report.html")
    page = out.read_text(encoding="utf-8")
    ri = leaderboard_rows(page, "RI · view centre_all · design all")
    assert ri == [("1", "enc_b", "0.9000"), ("2", EVIL, "0.7000"), ("2", "enc_c", "0.7000"),
                  ("4", "enc_a", "0.5000"), ("—", "enc_nan", "—")]
    assert "1 older record(s) of these encoders superseded" in section(page, "leaderboards")
    assert "0.9900" not in section(page, "leaderboards")  # the superseded enc_a value is not ranked
    assert [e for _, e, _ in leaderboard_rows(page, "CRoMa · view centre_all · design all · m=5")] == ["enc_a", "enc_b"]
    assert [e for _, e, _ in leaderboard_rows(page, "CRoMa · view centre_all · design all · m=10")] == ["enc_b", "enc_a"]
    assert leaderboard_rows(page, "MaRI · view v&amp;&lt;1&gt; · design all") == [("1", "enc_a", "0.4000")]
    titles = re.findall(r'<h3 id="lb\d+">([^<]*)</h3>', page)
    assert titles == ["RI · view centre_all · design all", "CRoMa · view centre_all · design all · m=5",
                      "CRoMa · view centre_all · design all · m=10", "MaRI · view v&amp;&lt;1&gt; · design all"]
    # columns present where the records carry them, absent where every value is missing
    lb = section(page, "leaderboards")
    ri_block = lb[lb.index("RI · view centre_all"): lb.index("<h3", lb.index("RI · view centre_all"))]
    assert "LTM<sub>α</sub>" in ri_block and "<th>F0</th>" not in ri_block and "<th>recall</th>" not in ri_block
    assert "α = 0.1" in ri_block
    croma_block = lb[lb.index("m=5"):]
    assert "<th>F0</th>" in croma_block and "0.2500" in croma_block
    # escaping: no raw markup from the store anywhere, escaped forms present
    for raw in (EVIL, "<b>'s1'</b>", "v&<1>", "jobs/<demo>.toml", "<x>"):
        assert raw not in page
    assert html.escape(EVIL, quote=True) in page and "&lt;b&gt;&#x27;s1&#x27;&lt;/b&gt; &amp; friends" in page
    # self-contained: no script, no external resources
    parser = _Collect()
    parser.feed(page)
    assert "script" not in parser.tags and "img" not in parser.tags and "link" not in parser.tags
    assert not [v for k, v in parser.attrs if k in ("src",) or (k == "href" and v and v.startswith("http"))]


def test_distributions_failures_and_provenance(store, tmp_path):
    out = build_report(store.path, tmp_path / "report.html")
    page = out.read_text(encoding="utf-8")
    dist = section(page, "distributions")
    assert dist.count("<svg") == 5 + 2 + 2 + 1  # one panel per ranked record
    assert "97 finite of 100 units; 3 undefined" in dist and "100 finite of 100 units" in dist
    ri = dist[dist.index("RI · view centre_all"):]
    ri = ri[: ri.index("<h3")]
    assert ri.index("enc_b") < ri.index("enc_c") < ri.index("enc_a") < ri.index("enc_nan")  # ranking order
    fails = section(page, "failures")
    assert "1 failed unit(s)" in fails and "enc_d" in fails and "CRoMa" in fails and "r2" in fails
    assert "ValueError: subset &lt;b&gt;" in fails
    prov = section(page, "provenance")
    assert "<td>r2</td>" in prov and "2026-02-01T00:00:00+00:00" in prov and "60.0 s" in prov
    assert '<a href="store/runs/r2/dask-performance-report.html">dask-performance-report.html</a>' in prov
    assert "<td>croma</td><td>1.0.1</td>" in prov and "&lt;x&gt;" in prov
    assert "1 workers, 2 threads" in prov and "planned 12, executed 12, failed 1" in prov
    assert "All runs" in prov and prov.index("<td>r2</td>", prov.index("All runs")) < prov.index("<td>r1</td>")
    assert "Unit timings" in prov and "1.25" in prov
    runs = prov[prov.index("All runs"):]
    assert runs.count("dask-performance-report.html</a>") == 1 and "not saved for this run" in runs  # r1 has none
    # the linked performance report resolves from the report's folder
    href = re.search(r'<a href="([^"]+)">dask-performance-report', prov).group(1)
    assert (out.parent / href).read_text() == "<html>perf</html>"


def test_atomic_rewrite_and_errors(store, tmp_path):
    out = tmp_path / "r.html"
    out.write_text("old")
    build_report(store.path, out)
    first = out.read_text(encoding="utf-8")
    assert first.startswith("<!DOCTYPE html>") and first.rstrip().endswith("</html>")
    assert not list(tmp_path.glob(".*partial")), "no partial left behind"
    with pytest.raises(FileNotFoundError, match=r"no results store at .*nowhere \(no store\.json\)"):
        build_report(tmp_path / "nowhere", tmp_path / "x.html")
    assert not (tmp_path / "nowhere").exists() and not (tmp_path / "x.html").exists()
    with pytest.raises(ValueError, match="bins must be a positive int"):
        build_report(store.path, out, bins=0)


def test_corrupt_per_unit_is_reported_not_raised(store, tmp_path):
    fp = fp_of("ri", "enc_b")
    pu = store._unit_json(fp).parent
    env = (store._unit_json(fp)).read_text()
    name = re.search(r'"file": "([^"]+)"', env).group(1)
    data = bytearray((pu / name).read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different checksum
    (pu / name).write_bytes(bytes(data))
    page = build_report(store.path, tmp_path / "r.html").read_text(encoding="utf-8")
    # a damaged record is not a stored result (ADR-0014): named at the top, left out of the tables
    assert "1 damaged record(s) left out of this report" in page and fp[:16] in page
    assert "does not match its sha256 checksum" in page
    assert "enc_b" not in [row[1] for row in leaderboard_rows(page, "RI · view centre_all")]


def test_empty_store_and_cache_section(tmp_path):
    from cachescore.cache import import_cache

    store = ResultsStore(tmp_path / "s")
    page = build_report(store.path, tmp_path / "r.html").read_text(encoding="utf-8")
    assert "No scores in the store yet." in page and "No failed units." in page and "No run provenance" in page
    rng = np.random.default_rng(1)
    m = pd.DataFrame({"sample_id": [f"t{i}" for i in range(12)], "image_path": ["p"] * 12,
                      "group_id": [f"s{i % 3}" for i in range(12)], "label": ["a", "b"] * 6, "centre": ["x"] * 12})
    for enc in ("enc_a", "enc_b"):
        np.save(tmp_path / f"{enc}.npy", rng.standard_normal((12, 4)).astype("float32"))
    import_cache(tmp_path / "cache", tileset="t", manifest=m,
                 encoders={e: tmp_path / f"{e}.npy" for e in ("enc_a", "enc_b")},
                 views={"centre_all": {"confounder_column": "centre", "design": "all"}})
    store.write_unit(fp_of("a"), record=record("enc_a", 0.5))
    page = build_report(store.path, tmp_path / "r.html", cache=tmp_path / "cache").read_text(encoding="utf-8")
    cache = section(page, "cache")
    assert "<td>enc_a</td><td>t</td>" in cache and "<td>centre</td><td>all</td>" in cache
    cov = cache[cache.index("Coverage"):]
    assert re.search(r"<td>enc_a</td><td class=\"num\"><span class='ok'>1</span>", cov)
    assert re.search(r"<td>enc_b</td><td class=\"num\"><span class='bad'>none</span>", cov)
    page = build_report(store.path, tmp_path / "r.html", cache=tmp_path / "nocache").read_text(encoding="utf-8")
    assert "could not be read" in section(page, "cache")


def test_histogram_svg_counts_and_marks():
    edges = np.linspace(0, 1, 5)
    svg = histogram_svg(np.array([0.1, 0.1, 0.6, np.nan, np.inf]), edges, marks={"value": 0.5, "out": 2.0, "none": None})
    assert svg.count("<rect") == 1 + 2  # background + two non-empty bins
    assert "[0, 0.25): 2" in svg and "[0.5, 0.75): 1" in svg and "max bin 2" in svg
    assert svg.count("<line") == 1 and "value = 0.5" in svg
