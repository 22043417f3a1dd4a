"""A self-contained static HTML report of a results store.

:func:`build_report` reads a results store (:class:`~cachescore.store.ResultsStore`) and writes one
HTML file with no external resources (inline CSS and SVG drawn by matplotlib, no JavaScript):

* **Overview** (from ``<store>/scores.parquet``): encoder × metric per view, value with its CI and
  flags, the best defined score of each column starred;
* **Scores with uncertainty**: a forest plot per view × metric (axis on the metric's range);
* **Probe sweep** (``<store>/probe.parquet``, the bundles): accuracy against the training set's
  Cramér's V per encoder (in-domain and unseen centres), reliability diagrams with ECE, accuracy
  per centre, and a warning when most probes selected the C grid's smallest value;
* **CRoMa margins**: the ECDF of every unit's margin with F0 and the α-tail;

* **Leaderboards**, one per (view, design, metric[, m]): encoders ranked by ``value`` (descending;
  higher is more robust; NaN ranks last and gets no rank; equal values share a rank), with std,
  the lower tail (q_alpha, LTM_alpha), F0, support, k, tau, m, recall, backend and timing where
  the records carry them. When several records exist for the same encoder in one group (a
  re-score after a change of parameters or inputs), the most recent one is ranked and the others
  are counted as superseded.
* **Distributions**: a histogram (inline SVG) of each ranked record's per-unit values, with bins
  shared across the encoders of a group so that the panels compare; the pooled value and q_alpha
  are marked.
* **Failures**: every failed unit without a later success, with its error.
* **Provenance** of the latest run (by start time): versions, job, cache/store paths, unit counts,
  timings, hardware, a link to the Dask performance report when the file exists, and a list of
  earlier runs.
* **Cache** (only with ``cache=``): encoders × tilesets, views, and which encoder × view pairs
  have scores.

Every string that comes from the store, the cache or provenance is HTML-escaped. The file is
written atomically (a ``.partial`` sibling renamed into place) and replaces an earlier report.
"""

from __future__ import annotations

import html
import json
import math
import os
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pandas as pd

from .cache import Cache, CacheError
from .metrics import families
from .store import CENTRES_FILE, PROBE_FILE, SCORES_FILE, CorruptRecordError, ResultsStore, is_store
from .report_figures import accuracy_curve_svg, centre_bars_svg, ecdf_svg, forest_svg, metric_axis, reliability_svg
from .results.bundles import bundle_facts
from ._atomic import atomic_write_bytes
from ._missing import is_missing

__all__ = ["build_report"]

#: Histogram bins per distribution panel.
HIST_BINS = 24
#: Leaderboard columns after rank/encoder/value, shown only when some record of the group has them:
#: (column in the scores table, header).
LEADERBOARD_COLUMNS = (
    ("std", "std"), ("q_alpha", "q<sub>α</sub>"), ("ltm_alpha", "LTM<sub>α</sub>"), ("f0", "F0"),
    ("support", "support"), ("n_units", "units"), ("k", "k"), ("tau", "τ"), ("m", "m"),
    ("recall", "recall"), ("backend", "backend"), ("seconds", "seconds"),
)

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#1b1f24;max-width:1400px}
h1{font-size:1.6em;margin-bottom:4px}h2{border-bottom:2px solid #d0d7de;padding-bottom:4px;margin-top:36px}
h3{margin:22px 0 6px 0;font-size:1.1em}.muted{color:#57606a;font-size:.9em}
table{border-collapse:collapse;margin:6px 0 12px 0;font-size:.88em}
th,td{border:1px solid #d0d7de;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f6f8fa}td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.nan td{color:#8c959f}.bar{display:inline-block;height:9px;background:#0969da;margin-right:6px;vertical-align:middle}
pre{white-space:pre-wrap;word-break:break-word;margin:0;font-size:.95em}
.panels{display:flex;flex-wrap:wrap;gap:12px}.panel{border:1px solid #d0d7de;padding:6px;border-radius:4px}
.panel .t{font-size:.85em;font-weight:600}.ok{color:#1a7f37}.bad{color:#cf222e}.warn{color:#9a6700}
.best{color:#bf8700}.panel svg{max-width:100%;height:auto}.small{font-size:.8em}
nav a{margin-right:12px}code{font-size:.9em}
"""


# -- small formatting helpers ------------------------------------------------------------------
def _e(value) -> str:
    """``html.escape`` of ``str(value)`` (quotes included); None -> ``""``."""
    return "" if value is None else html.escape(str(value), quote=True)


def _num(value, digits: int = 4) -> str:
    """A table cell's text: floats with ``digits`` decimals, ints as such, missing as an em dash."""
    if is_missing(value):
        return "—"
    if isinstance(value, (bool, np.bool_)):
        return _e(bool(value))
    if isinstance(value, (int, np.integer)):
        return _e(int(value))
    if isinstance(value, (float, np.floating)):
        v = float(value)
        if math.isinf(v):
            return "∞" if v > 0 else "−∞"
        return _e(f"{v:.{digits}f}")
    return _e(value)


def _metric_name(metric) -> str:
    return families.display(metric)


def _params(text) -> dict:
    if is_missing(text):
        return {}
    try:
        out = json.loads(text)
    except (TypeError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def _table(headers: list[str], rows: list[list[str]], *, raw_headers: bool = False, row_classes=None) -> str:
    """An HTML table; ``rows`` hold already-escaped cell HTML (``<td>`` added here)."""
    head = "".join(f"<th>{h if raw_headers else _e(h)}</th>" for h in headers)
    body = []
    for i, cells in enumerate(rows):
        cls = f' class="{row_classes[i]}"' if row_classes and row_classes[i] else ""
        body.append(f"<tr{cls}>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _td(text_html: str, *, num: bool = False) -> str:
    return f'<td class="num">{text_html}</td>' if num else f"<td>{text_html}</td>"


# -- histogram ---------------------------------------------------------------------------------
def histogram_svg(values: np.ndarray, edges: np.ndarray, *, marks: dict | None = None,
                  width: int = 260, height: int = 96) -> str:
    """Inline SVG of a histogram of the finite ``values`` over ``edges`` (increasing, length bins+1).

    ``marks`` maps a label to an x value drawn as a vertical line (skipped when missing or outside
    the edges). Returns an ``<svg>`` element; all text is escaped.
    """
    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values)]
    counts, _ = np.histogram(values, bins=edges)
    pad_l, pad_b, pad_t = 4, 16, 4
    plot_w, plot_h = width - 2 * pad_l, height - pad_b - pad_t
    lo, hi = float(edges[0]), float(edges[-1])
    span = hi - lo if hi > lo else 1.0
    top = max(int(counts.max()) if counts.size else 0, 1)
    x_of = lambda v: pad_l + (float(v) - lo) / span * plot_w
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img">',
             f'<rect x="{pad_l}" y="{pad_t}" width="{plot_w}" height="{plot_h}" fill="#f6f8fa"/>']
    for i, c in enumerate(counts):
        if c == 0:
            continue
        x0, x1 = x_of(edges[i]), x_of(edges[i + 1])
        h = c / top * plot_h
        parts.append(f'<rect x="{x0:.2f}" y="{pad_t + plot_h - h:.2f}" width="{max(x1 - x0 - 0.6, 0.6):.2f}" '
                     f'height="{h:.2f}" fill="#0969da"><title>{_e(f"[{edges[i]:.4g}, {edges[i + 1]:.4g}): {c}")}'
                     f'</title></rect>')
    colours = ("#cf222e", "#8250df", "#1a7f37")
    for j, (label, v) in enumerate((marks or {}).items()):
        if is_missing(v) or not (lo <= float(v) <= hi):
            continue
        x = x_of(v)
        parts.append(f'<line x1="{x:.2f}" x2="{x:.2f}" y1="{pad_t}" y2="{pad_t + plot_h}" stroke="{colours[j % 3]}" '
                     f'stroke-width="1.5" stroke-dasharray="{"4 2" if j else "none"}"><title>{_e(label)} = '
                     f'{_e(f"{float(v):.4g}")}</title></line>')
    parts.append(f'<text x="{pad_l}" y="{height - 3}" font-size="10" fill="#57606a">{_e(f"{lo:.3g}")}</text>')
    parts.append(f'<text x="{width - pad_l}" y="{height - 3}" font-size="10" fill="#57606a" '
                 f'text-anchor="end">{_e(f"{hi:.3g}")}</text>')
    parts.append(f'<text x="{width / 2:.0f}" y="{height - 3}" font-size="10" fill="#57606a" '
                 f'text-anchor="middle">max bin {top}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _shared_edges(arrays: list[np.ndarray], bins: int) -> np.ndarray:
    finite = [a[np.isfinite(a)] for a in arrays]
    finite = [a for a in finite if a.size]
    if not finite:
        return np.linspace(0.0, 1.0, bins + 1)
    lo = min(float(a.min()) for a in finite)
    hi = max(float(a.max()) for a in finite)
    if hi <= lo:
        lo, hi = lo - 0.5, hi + 0.5
    return np.linspace(lo, hi, bins + 1)


# -- data selection ----------------------------------------------------------------------------
def _group_key(row) -> tuple:
    family = families.lookup(row["metric"])
    m = row["m"] if family is not None and family.unit_param and not is_missing(row["m"]) else None
    view, design, metric = ("" if is_missing(row[c]) else str(row[c]) for c in ("view", "design", "metric"))
    order = families.order(metric)
    # probe records: one leaderboard per matrix (``scope``: in_domain or a test set)
    scope = "" if design != "probe" or is_missing(row.get("scope")) else str(row["scope"])
    return view, design, order, metric, -1 if m is None else int(m), scope


def _leaderboards(scores: pd.DataFrame) -> list[dict]:
    """Groups of the scores table: ``{"key", "rows" (latest record per encoder, ranked), "superseded"}``."""
    if scores.empty:
        return []
    frame = scores.reset_index(drop=True)
    frame["_ts"] = frame["finished_at"].fillna(pd.Timestamp(0, tz="UTC"))
    frame["_enc"] = frame["encoder"].fillna("?")
    members: dict[tuple, list[int]] = {}
    for i, (_, r) in enumerate(frame.iterrows()):
        members.setdefault(_group_key(r), []).append(i)
    groups = []
    for key in sorted(members):
        g = frame.iloc[members[key]]
        g = g.sort_values(["_enc", "_ts", "fingerprint"], ascending=[True, False, True])
        latest = g.drop_duplicates("_enc", keep="first")
        values = latest["value"].to_numpy(dtype=float)
        order = np.lexsort((latest["_enc"].to_numpy(dtype=object).astype(str), -np.where(np.isnan(values), -np.inf, values)))
        latest = latest.iloc[order].reset_index(drop=True)
        vals = latest["value"].to_numpy(dtype=float)
        ranks = []
        for v in vals:  # competition ranking: ties share the best rank
            ranks.append(None if np.isnan(v) else int(np.sum(vals[~np.isnan(vals)] > v)) + 1)
        latest["_rank"] = pd.array(ranks, dtype="Int64")
        groups.append({"key": key, "rows": latest, "superseded": len(g) - len(latest)})
    return groups


def _group_title(key: tuple) -> str:
    view, design, _, metric, m, scope = key
    title = f"{_metric_name(metric or None)} · view {view or '?'} · design {design or '?'}"
    return title + (f" · m={m}" if m >= 0 else "") + (f" · matrix {scope}" if scope else "")


# -- sections from the tidy tables (scores.parquet / probe.parquet, ADR-0009) ---------------------
def _tidy(store_path: Path, name: str) -> pd.DataFrame | None:
    path = store_path / name
    if not path.is_file():
        return None
    try:
        return pd.read_parquet(path)
    except (OSError, ValueError) as exc:  # a damaged table: say so in the page
        return pd.DataFrame({"_error": [f"{path}: {exc}"]})


def _label(r) -> str:
    return families.display(r["metric"], r.get("m"), r.get("scope"))


def _cell(r) -> str:
    if not r["defined"]:
        return f"<span class='muted' title='{_e(r['undefined_reason'])}'>undefined</span>"
    ci = "" if is_missing(r["ci_low"]) else f" <span class='muted'>[{_num(r['ci_low'], 3)}, {_num(r['ci_high'], 3)}]</span>"
    flags = []
    if r["low_support"]:
        flags.append(f"<span class='bad' title='support {_num(r['support'], 3)}'>low support</span>")
    if str(r.get("warnings") or "").strip():
        flags.append(f"<span class='warn' title='{_e(r['warnings'])}'>⚠</span>")
    star = "<b class='best' title='rank 1'>★</b> " if r["rank"] == 1 else ""
    return (f"{star}{_num(r['value'], 3)}{ci}{' ' + ' '.join(flags) if flags else ''}"
            f"<div class='muted small'>{_rank_text(r)}</div>{_verdict_html(r)}")


def _rank_text(r) -> str:
    """``rank 2 [2–3] of 4``: the point rank, its bootstrap interval (ties span every position)."""
    if is_missing(r.get("rank")):
        return "not ranked"
    lo, hi = r.get("rank_low"), r.get("rank_high")
    interval = "" if is_missing(lo) or is_missing(hi) else f" [{int(lo)}–{int(hi)}]"
    return f"rank {int(r['rank'])}{interval} of {int(r['n_ranked'])}"


def _verdict_html(r) -> str:
    """The paired verdict against the column's best encoder (scores.parquet ``verdict``)."""
    verdict = str(r.get("verdict") or "")
    if not verdict or verdict == "best":
        return ""
    delta = "" if is_missing(r.get("delta_ci_low")) else (
        f": Δ {_num(r['delta_vs_best'], 3)} [{_num(r['delta_ci_low'], 3)}, {_num(r['delta_ci_high'], 3)}]")
    css = "bad" if verdict.startswith("worse") else "muted"
    return f"<div class='{css} small'>{_e(verdict)}{delta}</div>"


def _disagreement_html(part: pd.DataFrame) -> str:
    """A note when the view's metric columns do not agree on the most robust encoder: each column's
    best, and whether the others are statistically behind it there."""
    if "verdict" not in part.columns:  # a table written before verdicts existed
        return ""
    bests = {}
    for _, r in part[part["verdict"].fillna("") == "best"].iterrows():
        bests[_label(r) + f" · {r['design']}"] = str(r["encoder"])
    if len(set(bests.values())) <= 1:
        return ""
    by_best: dict = {}
    for col, enc in bests.items():
        by_best.setdefault(enc, []).append(col)
    lines = "; ".join(f"{_e(enc)} is best on {_e(', '.join(cols))}" for enc, cols in sorted(by_best.items()))
    return (f"<p class='warn'><b>The metric families disagree</b> on the most robust encoder of this view: {lines}. "
            "Read each column's verdicts (a difference is detectable only where its paired interval excludes 0) "
            "before choosing.</p>")


#: Which end of every score is better, stated wherever scores are shown (issue 24): read from the
#: family table (:func:`cachescore.metrics.families.reading_guide`; a registered family adds itself).
DIRECTION = families.reading_guide()


def _overview_html(scores: pd.DataFrame | None) -> str:
    if scores is None or scores.empty:
        return "<p class='muted'>No <code>scores.parquet</code> yet: run the job (cachescore run JOB).</p>"
    if "_error" in scores.columns:
        return f"<p class='bad'>{_e(scores['_error'].iloc[0])}</p>"
    out = []
    for view, part in scores.groupby("view", sort=True):
        cols = list(dict.fromkeys(_label(r) + f" · {r['design']}" for _, r in part.iterrows()))
        encoders = sorted(part["encoder"].unique())
        cells = {(r["encoder"], _label(r) + f" · {r['design']}"): _cell(r) for _, r in part.iterrows()}
        body = [[_td(_e(e))] + [_td(cells.get((e, c), "—"), num=True) for c in cols] for e in encoders]
        out.append(f"<h3>view {_e(view)}</h3>" + _disagreement_html(part)
                   + _table(["encoder"] + [_e(c) for c in cols], body, raw_headers=True))
    return (f"<p class='direction'>{_e(families.reading_guide())}</p>"
            "<p class='muted'>value [95% cluster-bootstrap CI over group_id; APD: over probe replicates]; "
            "★ best defined score of the column; rank with its bootstrap interval (tied or indistinguishable "
            "encoders share positions); under it the verdict against the column's best: Δ = this − best with "
            "its paired 95% interval (worse when it excludes 0, else no detectable difference); undefined "
            "scores are never ranked (hover for why); ⚠ stored warnings (hover).</p>" + "".join(out))


def _forest_html(scores: pd.DataFrame | None) -> str:
    if scores is None or scores.empty or "_error" in scores.columns:
        return "<p class='muted'>No scores to plot.</p>"
    out = []
    keys = ["view", "design", "scope", "metric", "m"]
    for key, part in scores.groupby(keys, dropna=False, sort=True):
        part = part.sort_values("encoder")  # one encoder order in every panel (ranks are in the labels)
        shown = part[part["defined"]]
        hidden = part[~part["defined"]]
        title = f"{_label(part.iloc[0])} · view {key[0]} · design {key[1]}"
        if shown.empty:
            out.append(f"<div class='panel'><div class='t'>{_e(title)}</div><div class='muted'>no defined score: "
                       f"{_e('; '.join(sorted(set(hidden['undefined_reason']))))}</div></div>")
            continue
        best = shown.loc[shown["rank"] == 1, "encoder"].tolist()
        labels = [f"{r['encoder']} · {_rank_text(r)}" for _, r in shown.iterrows()]
        svg = forest_svg(labels, shown["value"].to_numpy(float), shown["ci_low"].to_numpy(float),
                         shown["ci_high"].to_numpy(float), metric=str(key[3]), title=title,
                         best=[lab for lab, (_, r) in zip(labels, shown.iterrows()) if r["encoder"] in best])
        note = "" if hidden.empty else (f"<div class='muted'>not shown (undefined): "
                                        f"{_e(', '.join(hidden['encoder']))}</div>")
        out.append(f"<div class='panel'>{svg}{note}</div>")
    return ("<p class='muted'>points: stored scores; bars: 95% CIs; ★ rank 1 (in the label, so no bar is hidden); "
            "encoders in the same order in every panel; axis: the metric's range "
            "(RI/MaRI 0–1, dotted line at 0.5; CRoMa and probe drops around 0).</p>"
            f"<div class='panels'>{''.join(out)}</div>")


def _probe_facts(store, scores: pd.DataFrame | None) -> dict:
    """``{(view, encoder): BundleFacts}`` of the probe units behind the score table's probe rows."""
    out: dict = {}
    if scores is None or scores.empty or "_error" in scores.columns:
        return out
    for _, r in scores[scores["design"] == "probe"].iterrows():
        key = (r["view"], r["encoder"])
        if key in out:
            continue
        record = store.record(r["fingerprint"]) or {}
        out[key] = bundle_facts(record.get("bundle"))
    return out


def _calibration_curve(table: pd.DataFrame, role: str):
    """Pooled reliability curve of one role (raw probabilities, every probe, every class):
    n-weighted mean confidence and observed frequency per bin."""
    t = table[(table["role"] == role) & (table["stage"] == "raw") & (table["n"] > 0)]
    if t.empty:
        return None
    g = t.assign(wc=t["mean_confidence"] * t["n"], wf=t["observed_frequency"] * t["n"]).groupby("bin")
    sums = g[["wc", "wf", "n"]].sum()
    return (sums["wc"] / sums["n"]).to_numpy(float), (sums["wf"] / sums["n"]).to_numpy(float)


def _probe_html(store, probe: pd.DataFrame | None, scores: pd.DataFrame | None,
                centres: pd.DataFrame | None) -> str:
    """The probe section: warnings, accuracy curves, calibration and per-centre accuracy."""
    if probe is None or probe.empty or "_error" in probe.columns:
        return "<p class='muted'>No probe sweep in this store.</p>"
    facts = _probe_facts(store, scores)
    warns = [f"<li><b>{_e(enc)}</b> · view {_e(view)}: {_e(f.smallest_c_warning)}</li>"
             for (view, enc), f in sorted(facts.items()) if f.smallest_c_warning]
    out = [f"<div class='bad'><ul>{''.join(warns)}</ul></div>"] if warns else []
    out.append(_accuracy_panels(probe, facts))
    out.append(_calibration_panels(facts))
    out.append(_centre_panels(centres))
    return "".join(out)


def _accuracy_panels(probe: pd.DataFrame, facts: dict) -> str:
    panels = []
    for (view, test_set), part in probe.groupby(["view", "test_set"], sort=True):
        curves = {}
        for enc, e in part.groupby("encoder", sort=True):
            stats = e.groupby("split")["accuracy"].agg(["mean", "std"]).sort_index()
            curves[enc] = (stats["mean"].to_numpy(float), stats["std"].fillna(0).to_numpy(float))
        v = next((f.cramers_v for (fv, _), f in facts.items() if fv == view and f.cramers_v), None)
        panels.append(f"<div class='panel'>{accuracy_curve_svg(curves, title=f'view {view} · test set {test_set}', x=v)}</div>")
    return ("<h3>Accuracy under confounding</h3><p class='muted'>balanced accuracy of the probes per split of "
            "the schedule (mean ± sd over replicates) against the confounding of the training set: a robust "
            "encoder keeps its accuracy as training gets more confounded, in-domain and on unseen centres.</p>"
            f"<div class='panels'>{''.join(panels)}</div>")


def _calibration_curves(facts: dict, view: str, role: str) -> dict:
    """``encoder -> (confidence, frequency, ECE)`` of the probes of ``view`` on ``role``."""
    curves = {}
    for (fv, enc), f in sorted(facts.items()):
        if fv != view or f.calibration is None:
            continue
        curve = _calibration_curve(f.calibration, role)
        if curve is None:
            continue
        m = f.metrics
        ece = float(m.loc[m["role"] == role, "ece_raw"].mean()) if m is not None and "ece_raw" in m else float("nan")
        curves[enc] = (curve[0], curve[1], ece)
    return curves


def _calibration_panels(facts: dict) -> str:
    panels = []
    for view in sorted({v for v, _ in facts}):
        roles = sorted({r for (fv, _), f in facts.items() if fv == view and f.calibration is not None
                        for r in f.calibration["role"].unique() if r != "val"})
        for role in roles:
            curves = _calibration_curves(facts, view, role)
            if curves:
                panels.append(f"<div class='panel'>{reliability_svg(curves, title=f'view {view} · {role}')}</div>")
    if not panels:
        return ""
    return ("<h3>Calibration</h3><p class='muted'>reliability of the probes' raw probabilities (every "
            "probe and class pooled per confidence bin); ECE = mean expected calibration error of the "
            f"probes.</p><div class='panels'>{''.join(panels)}</div>")


def _centre_panels(centres: pd.DataFrame | None) -> str:
    if centres is None or centres.empty or "_error" in centres.columns:
        return ""
    panels = []
    test = centres[centres["role"] != "val"]
    for (view, role), part in test.groupby(["view", "role"], sort=True):
        named = part["confounder_column"].dropna() if "confounder_column" in part.columns else part["view"][:0]
        xlabel = str(named.iloc[0]) if len(named) else "centre"
        table = part.pivot_table(index="centre", columns="encoder", values="balanced_accuracy", aggfunc="mean")
        panels.append(f"<div class='panel'>{centre_bars_svg(table, title=f'view {view} · {role}', xlabel=xlabel)}</div>")
    return ("<h3>Accuracy per centre</h3><p class='muted'>mean balanced accuracy of the probes on each "
            f"centre's rows.</p><div class='panels'>{''.join(panels)}</div>")


def _damaged_html(damaged: list[tuple[str, str]]) -> str:
    """A warning naming the store's damaged records (left out of every table; ADR-0014)."""
    if not damaged:
        return ""
    items = "".join(f"<li><code>{_e(fp[:16])}</code>: {_e(why)}</li>" for fp, why in damaged[:20])
    more = f"<li>… and {len(damaged) - 20} more</li>" if len(damaged) > 20 else ""
    return (f"<div class='panel'><strong>{len(damaged)} damaged record(s) left out of this report</strong> "
            f"(<code>cachescore run JOB</code> recomputes them):<ul>{items}{more}</ul></div>")


def _margins_html(store, scores: pd.DataFrame | None) -> str:
    if scores is None or scores.empty or "_error" in scores.columns:
        return "<p class='muted'>No scores.</p>"
    margin_families = [n for n in families.names() if families.get(n).margins]
    rows = scores[scores["metric"].isin(margin_families) & scores["defined"]]
    if rows.empty:
        return "<p class='muted'>No CRoMa scores.</p>"
    panels = []
    for _, r in rows.sort_values(["view", "design", "m", "rank"]).iterrows():
        try:
            values = store.per_unit(r["fingerprint"])["value"].to_numpy(dtype=float)
        except (CorruptRecordError, KeyError) as exc:
            panels.append(f"<div class='panel'><div class='muted'>{_e(r['encoder'])}: per-unit table unreadable: "
                          f"{_e(exc)}</div></div>")
            continue
        title = f"{r['encoder']} · {r['view']} · m={int(r['m'])}"
        panels.append(f"<div class='panel'>{ecdf_svg(values, alpha=0.10, q_alpha=r['q_alpha'], title=title)}</div>")
    return ("<p class='muted'>ECDF of each unit's CRoMa margin: F0 = share of units with a margin ≤ 0 (red), "
            "the lower α-tail shaded.</p>" f"<div class='panels'>{''.join(panels)}</div>")


# -- sections ----------------------------------------------------------------------------------
def _leaderboard_html(groups: list[dict]) -> str:
    if not groups:
        return "<p class='muted'>No scores in the store yet.</p>"
    out = []
    for gi, g in enumerate(groups):
        rows: pd.DataFrame = g["rows"]
        # std is the spread over a paired design's subsets: always 0 under ``all``, so not shown there
        shown = [(c, h) for c, h in LEADERBOARD_COLUMNS if c in rows.columns and not rows[c].map(is_missing).all()
                 and not (c == "std" and g["key"][1] == "all")]
        alpha = {_params(p).get("alpha") for p in rows["params"]} - {None}
        finite = rows["value"].to_numpy(dtype=float)
        finite = finite[np.isfinite(finite)]
        # bars on the metric's own range (RI/MaRI [0, 1]; others symmetric around 0), not the
        # table's min..max (which always drew the last entry with an empty bar)
        lo, hi = metric_axis(str(g["key"][3]), finite, finite)
        headers = ["rank", "encoder", "value"] + [h for _, h in shown] + ["fingerprint"]
        body, classes = [], []
        for _, r in rows.iterrows():
            v = r["value"]
            frac = 0.0 if is_missing(v) or not np.isfinite(v) else (1.0 if hi <= lo else (float(v) - lo) / (hi - lo))
            bar = f'<span class="bar" style="width:{4 + 80 * frac:.0f}px"></span>' if not is_missing(v) else ""
            cells = [_td(_num(r["_rank"]), num=True), _td(_e(r["encoder"])), _td(bar + _num(v), num=True)]
            cells += [_td(_num(r[c]) if c != "backend" else _e(r[c]), num=c != "backend") for c, _ in shown]
            cells.append(_td(f"<code title='{_e(r['fingerprint'])}'>{_e(str(r['fingerprint'])[:12])}</code>"))
            body.append(cells)
            classes.append("nan" if is_missing(v) else "")
        note = []
        if alpha:
            note.append("α = " + ", ".join(_e(a) for a in sorted(alpha, key=str)))
        if g["superseded"]:
            note.append(f"{g['superseded']} older record(s) of these encoders superseded by newer ones")
        out.append(f'<h3 id="lb{gi}">{_e(_group_title(g["key"]))}</h3>'
                   + (f"<p class='muted'>{'; '.join(note)}</p>" if note else "")
                   + _table(headers, body, raw_headers=True, row_classes=classes))
    return "".join(out)


def _distributions_html(store, groups: list[dict], bins: int) -> str:

    if not groups:
        return "<p class='muted'>No per-unit values.</p>"
    out = []
    for gi, g in enumerate(groups):
        if g["key"][1] == "probe":  # APD / nIPD summarise matrices: their plots are in the probe section
            continue
        rows: pd.DataFrame = g["rows"]
        values, notes = [], []
        for _, r in rows.iterrows():
            try:
                table = store.per_unit(r["fingerprint"])
            except CorruptRecordError as exc:
                values.append(None)
                notes.append(f"per-unit table unreadable: {exc}")
                continue
            except KeyError:
                values.append(None)
                notes.append("record vanished while reading")
                continue
            if "value" not in table.columns:
                values.append(None)
                notes.append("no per-unit values stored")
                continue
            values.append(pd.to_numeric(table["value"], errors="coerce").to_numpy(dtype=float))
            notes.append(None)
        edges = _shared_edges([v for v in values if v is not None], bins)
        panels = []
        for (_, r), v, note in zip(rows.iterrows(), values, notes):
            head = f'<div class="t">{_e(r["encoder"])}</div>'
            if v is None:
                panels.append(f'<div class="panel">{head}<div class="muted">{_e(note)}</div></div>')
                continue
            n_fin = int(np.isfinite(v).sum())
            svg = histogram_svg(v, edges, marks={"value": r["value"], "q_alpha": r.get("q_alpha")})
            panels.append(f'<div class="panel">{head}{svg}<div class="muted">{n_fin} finite of {v.size} units'
                          f"{'' if n_fin == v.size else f'; {v.size - n_fin} undefined'}</div></div>")
        out.append(f'<h3 id="dist{gi}">{_e(_group_title(g["key"]))}</h3>'
                   f"<p class='muted'>red line: pooled value; purple dashed: q<sub>α</sub>; bins shared across "
                   f"encoders</p><div class='panels'>{''.join(panels)}</div>")
    return "".join(out)


def _failures_html(failures: pd.DataFrame) -> str:
    if failures.empty:
        return "<p class='ok'>No failed units.</p>"
    failures = failures.sort_values(["failed_at", "fingerprint"], ascending=[False, True], na_position="last")
    headers = ["encoder", "view", "scope", "metric", "error", "run", "failed at", "fingerprint"]
    body = []
    for _, r in failures.iterrows():
        metric = r["metric"] if not is_missing(r["metric"]) else r["family"]
        body.append([_td(_e(r["encoder"])), _td(_e(r["view"])), _td(_e(r["scope"])), _td(_e(_metric_name(metric))),
                     _td(f"<pre>{_e(r['error'])}</pre>"), _td(_e(r["run_id"])), _td(_e(r["failed_at"])),
                     _td(f"<code title='{_e(r['fingerprint'])}'>{_e(str(r['fingerprint'])[:12])}</code>")])
    return f"<p class='bad'>{len(failures)} failed unit(s) without a later success.</p>" + _table(headers, body)


def _href(target: Path, out_html: Path) -> str:
    """A relative link from the report's folder to ``target`` (absolute ``file://`` URI when on another drive)."""
    try:
        rel = os.path.relpath(Path(target).resolve(), Path(out_html).resolve().parent)
        return quote(Path(rel).as_posix())
    except ValueError:  # pragma: no cover - Windows, different drives
        return Path(target).resolve().as_uri()


_UNIT_COUNTS = ("planned", "executed", "skipped", "succeeded", "failed")


def _units_text(units) -> str:
    """``planned 12, executed 12, …`` in a fixed order (then any other keys, sorted); ``—`` if none."""
    if not isinstance(units, dict) or not units:
        return "—"
    keys = [k for k in _UNIT_COUNTS if k in units] + sorted(k for k in units if k not in _UNIT_COUNTS)
    return _e(", ".join(f"{k} {units[k]}" for k in keys))


def _or_dash(value) -> str:
    return "—" if value is None or value == "" else _e(value)


def _kv_table(items: list[tuple[str, str]]) -> str:
    return _table(["", ""], [[_td(f"<b>{_e(k)}</b>"), _td(v)] for k, v in items])


def _perf_link(store, prov: dict, out_html: Path) -> str:
    """A relative link to the run's Dask performance report, or why there is none."""
    report = prov.get("performance_report")
    if not report:
        return "<span class='muted'>not saved for this run</span>"
    path = Path(str(report))
    if not path.is_absolute():
        path = store.path / path
    if not path.is_file():
        return f"<span class='muted'>{_e(report)} (file not found)</span>"
    return f'<a href="{_e(_href(path, out_html))}">{_e(path.name)}</a>'


def _producing_run(store, scores: pd.DataFrame) -> tuple[str | None, dict | None, list[tuple[str, dict]]]:
    """``(run id, provenance, every run)`` of the run that wrote the store's latest score (a no-op
    re-run since then wrote none); without a readable one, the latest run that executed a unit,
    else the latest run."""
    latest, prov, runs = _latest_run(store)
    by_id = dict(runs)
    if not scores.empty and {"run_id", "finished_at"} <= set(scores.columns):
        done = scores.dropna(subset=["run_id"]).sort_values("finished_at", na_position="first")
        if len(done) and str(done["run_id"].iloc[-1]) in by_id:
            rid = str(done["run_id"].iloc[-1])
            return rid, by_id[rid], runs
    working = [(rid, p) for rid, p in runs if isinstance(p.get("units"), dict) and p["units"].get("executed")]
    return (working[-1][0], working[-1][1], runs) if working else (latest, prov, runs)


def _latest_run(store) -> tuple[str | None, dict | None, list[tuple[str, dict]]]:
    runs = []
    for run_id in store.runs():
        try:
            runs.append((run_id, store.read_provenance(run_id)))
        except (KeyError, OSError, ValueError):
            continue
    runs.sort(key=lambda item: (str(item[1].get("started_at") or ""), item[0]))
    if not runs:
        return None, None, []
    return runs[-1][0], runs[-1][1], runs


def _provenance_html(store, scores: pd.DataFrame, out_html: Path) -> str:
    run_id, prov, runs = _producing_run(store, scores)
    parts = []
    if prov is None:
        parts.append("<p class='muted'>No run provenance recorded in this store.</p>")
    else:
        items = [("run", _e(run_id)), ("started", _or_dash(prov.get("started_at"))),
                 ("finished", _or_dash(prov.get("finished_at"))),
                 ("wall time", _num(prov.get("seconds"), 1) + " s" if not is_missing(prov.get("seconds")) else "—"),
                 ("job file", _or_dash(prov.get("job_path"))), ("cache", _or_dash(prov.get("cache"))),
                 ("store", _or_dash(prov.get("store"))), ("code version", _or_dash(prov.get("code_version"))),
                 ("units", _units_text(prov.get("units"))), ("dashboard", _or_dash(prov.get("dashboard")))]
        items.append(("Dask performance report", _perf_link(store, prov, out_html)))
        parts.append(_kv_table(items))
        versions = prov.get("versions")
        if isinstance(versions, dict) and versions:
            parts.append("<h3>Versions</h3>" + _table(["package", "version"],
                         [[_td(_e(k)), _td(_e(v if v is not None else "not installed"))] for k, v in sorted(versions.items())]))
        hw = prov.get("hardware")
        if isinstance(hw, dict) and hw:
            workers = hw.get("workers") if isinstance(hw.get("workers"), list) else []
            hw_items = [(k, _e(v)) for k, v in hw.items() if k != "workers"]
            if workers:
                threads = sum(int(w.get("nthreads") or 0) for w in workers if isinstance(w, dict))
                hw_items.append(("workers", _e(f"{len(workers)} workers, {threads} threads")))
            parts.append("<h3>Hardware</h3>" + _kv_table(hw_items))
        job = prov.get("job")
        if job:
            parts.append("<h3>Job</h3><details><summary>job document as run</summary><pre>"
                         + _e(json.dumps(job, indent=2, sort_keys=True, default=str)) + "</pre></details>")
        fails = prov.get("failures")
        if isinstance(fails, list) and fails:
            parts.append(f"<p class='bad'>{len(fails)} unit(s) failed in this run (see Failures).</p>")
    if not scores.empty and "seconds" in scores.columns and scores["seconds"].notna().any():
        t = scores.assign(_m=scores["metric"].map(_metric_name), _s=scores["seconds"].astype(float))
        agg = t.groupby("_m")["_s"].agg(["count", "sum", "median", "max"]).reset_index()
        parts.append("<h3>Unit timings (all stored records)</h3>" + _table(
            ["metric", "units", "total s", "median s", "max s"],
            [[_td(_e(r["_m"])), _td(_num(int(r["count"])), num=True), _td(_num(r["sum"], 2), num=True),
              _td(_num(r["median"], 2), num=True), _td(_num(r["max"], 2), num=True)] for _, r in agg.iterrows()]))
    if runs:
        body = []
        for rid, p in reversed(runs):
            body.append([_td(_e(rid)), _td(_or_dash(p.get("started_at"))), _td(_num(p.get("seconds"), 1), num=True),
                         _td(_units_text(p.get("units"))), _td(_perf_link(store, p, out_html))])
        parts.append("<h3>All runs</h3>" + _table(["run", "started", "seconds", "units", "performance report"], body))
    return "".join(parts)


def _cache_html(cache, scores: pd.DataFrame) -> str:

    cache = cache if isinstance(cache, Cache) else Cache(cache)
    try:
        encoders, views = cache.encoders(), cache.views()
        emb_rows = []
        for enc in encoders:
            for ts in cache.embedding_tilesets(enc):
                try:
                    meta = cache.meta(enc, ts)
                    emb_rows.append([_td(_e(enc)), _td(_e(ts)), _td(_num(meta.n_rows), num=True),
                                     _td(_num(meta.dim), num=True), _td(_e(meta.dtype.name)), _td(_num(len(meta.shards)), num=True)])
                except (CacheError, OSError) as exc:
                    emb_rows.append([_td(_e(enc)), _td(_e(ts)), f"<td colspan='4' class='bad'>{_e(exc)}</td>"])
        view_rows = []
        for v in views:
            try:
                spec = cache.view_spec(v)
                view_rows.append([_td(_e(v)), _td(_e(spec.tileset)), _td(_e(spec.confounder_column)), _td(_e(spec.design or "—"))])
            except (CacheError, OSError) as exc:
                view_rows.append([_td(_e(v)), f"<td colspan='3' class='bad'>{_e(exc)}</td>"])
    except (CacheError, OSError) as exc:
        return f"<p class='bad'>Cache {_e(cache.root)} could not be read: {_e(exc)}</p>"
    parts = [f"<p>Cache folder: <code>{_e(cache.root)}</code></p>",
             "<h3>Embeddings</h3>" + (_table(["encoder", "tileset", "rows", "dim", "dtype", "shards"], emb_rows)
                                      if emb_rows else "<p class='muted'>none</p>"),
             "<h3>Views</h3>" + (_table(["view", "tileset", "confounder", "design"], view_rows)
                                 if view_rows else "<p class='muted'>none</p>")]
    if encoders and views:
        have = scores.groupby(["encoder", "view"]).size() if not scores.empty else pd.Series(dtype=int)
        body = []
        for enc in encoders:
            cells = [_td(_e(enc))]
            for v in views:
                n = int(have.get((enc, v), 0))
                cells.append(_td(f"<span class='ok'>{n}</span>" if n else "<span class='bad'>none</span>", num=True))
            body.append(cells)
        parts.append("<h3>Coverage (stored records per encoder × view)</h3>" + _table(["encoder", *views], body))
    return "".join(parts)


# -- entry point -------------------------------------------------------------------------------
def build_report(store_path, out_html, *, cache=None, bins: int = HIST_BINS) -> Path:
    """Write a static, self-contained HTML report of the results store at ``store_path``.

    Parameters
    ----------
    store_path : str or Path
        An existing results store folder (with ``store.json``); it is only read.
    out_html : str or Path
        The HTML file to write (parent folders are created). Written atomically; an existing file
        is replaced.
    cache : str, Path or :class:`~cachescore.cache.Cache`, optional
        Adds a section describing the cache (embeddings, views, coverage of encoder × view).
    bins : int
        Histogram bins per distribution panel.

    Returns the path of the written file. Raises ``FileNotFoundError`` when ``store_path`` is not
    an existing results store, :class:`~cachescore.store.StoreError` when it is not a valid one,
    ``ValueError`` for ``bins < 1``. A record whose per-unit table is corrupt is reported in the
    page, not raised.
    """

    store_path, out_html = Path(store_path), Path(out_html)
    if not is_store(store_path):
        raise FileNotFoundError(f"no results store at {store_path} (no store.json); run `cachescore run JOB` first")
    if not isinstance(bins, (int, np.integer)) or isinstance(bins, bool) or bins < 1:
        raise ValueError(f"bins must be a positive int, got {bins!r}")
    store = ResultsStore.open(store_path)
    scores = store.scores()
    failures = store.failures()
    damaged = store.damaged(sorted(store.stored_fingerprints()))
    groups = _leaderboards(scores)
    generated = datetime.now(timezone.utc).isoformat(timespec="seconds")
    n_enc = scores["encoder"].nunique() if not scores.empty else 0
    n_view = scores["view"].nunique() if not scores.empty else 0
    tidy, probe = _tidy(store_path, SCORES_FILE), _tidy(store_path, PROBE_FILE)
    sections = [("overview", "Overview", _overview_html(tidy)),
                ("forest", "Scores with uncertainty", _forest_html(tidy)),
                ("probe", "Probe sweep", _probe_html(store, probe, tidy, _tidy(store_path, CENTRES_FILE))),
                ("margins", "CRoMa margins", _margins_html(store, tidy)),
                ("leaderboards", "Leaderboards", _leaderboard_html(groups)),
                ("distributions", "Per-unit distributions", _distributions_html(store, groups, int(bins))),
                ("failures", f"Failures ({len(failures)})", _failures_html(failures)),
                ("provenance", "Provenance of the run that produced the latest scores",
                 _provenance_html(store, scores, out_html))]
    if cache is not None:
        sections.append(("cache", "Cache", _cache_html(cache, scores)))
    nav = "".join(f'<a href="#{sid}">{_e(title)}</a>' for sid, title, _ in sections)
    body = "".join(f'<h2 id="{sid}">{_e(title)}</h2>{content}' for sid, title, content in sections)
    page = (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>cachescore report: {_e(store_path.name)}</title><style>{_CSS}</style></head><body>"
            f"<h1>cachescore report</h1><p class='muted'>store <code>{_e(store_path)}</code> · generated {_e(generated)} · "
            f"{len(scores)} records, {n_enc} encoders, {n_view} views, {len(groups)} leaderboards, "
            f"{len(failures)} failures</p>{_damaged_html(damaged)}<nav>{nav}</nav>{body}</body></html>\n")
    out_html.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_html, page.encode("utf-8"), overwrite=True)
    return out_html
