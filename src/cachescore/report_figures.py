"""The report's figures, drawn with matplotlib and embedded as inline SVG (no CDN, no JavaScript).

matplotlib is the plotting library because it renders static, self-contained SVG offline with a
stable API and no browser-side runtime (Vega-Lite/altair would inline ~1 MB of JavaScript per
report); figures are deterministic (fixed hash salt, no timestamp), so two reports of one store
are byte-identical.

* :func:`forest_svg` — value with its CI per encoder on an axis that starts where the metric's
  range starts (RI/MaRI [0, 1], CRoMa around 0, APD/nIPD with 0 = no degradation);
* :func:`accuracy_curve_svg` — probe accuracy (mean ± replicate sd) per split, per encoder;
* :func:`reliability_svg` — calibration reliability diagram with each encoder's ECE;
* :func:`centre_bars_svg` — probe accuracy per centre per encoder;
* :func:`ecdf_svg` — the ECDF of a CRoMa unit's margins with F0 (share ≤ 0) and the α-tail marked.
"""

from __future__ import annotations

import io
import math

import matplotlib

matplotlib.use("Agg")  # headless: no display, no GUI toolkit
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend
import numpy as np  # noqa: E402

from .metrics import families  # noqa: E402

__all__ = ["forest_svg", "accuracy_curve_svg", "reliability_svg", "centre_bars_svg", "ecdf_svg", "metric_axis"]

plt.rcParams.update({"svg.hashsalt": "cachescore", "svg.fonttype": "none", "font.size": 9,
                     "axes.spines.top": False, "axes.spines.right": False})


def _svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog and doctype: inline in HTML


def metric_axis(metric: str, lows, highs) -> tuple[float, float]:
    """The x range of a metric's forest plot: the family's fixed ``value_range`` where it has one
    (RI / MaRI: [0, 1]); else symmetric around 0 (CRoMa and the probe reductions: their no-effect
    point), wide enough for every interval."""
    family = families.lookup(metric)
    if family is not None and family.value_range is not None:
        return family.value_range
    vals = [abs(float(v)) for v in list(lows) + list(highs) if v is not None and math.isfinite(float(v))]
    span = max(vals) if vals else 0.1
    span = max(0.05, 1.1 * span)
    return -span, span


def forest_svg(encoders, values, lows, highs, *, metric: str, title: str, best=None) -> str:
    """Horizontal value-and-CI plot, one row per encoder label (top = first). NaN intervals draw
    the point only. ``best``: the label(s) of rank 1, starred in their tick label (a marker on the
    point would hide its interval)."""
    n = len(encoders)
    fig, ax = plt.subplots(figsize=(5.6, 0.42 * n + 0.9))
    y = np.arange(n)[::-1]
    v = np.asarray(values, dtype=float)
    lo = np.asarray(lows, dtype=float)
    hi = np.asarray(highs, dtype=float)
    has = np.isfinite(lo) & np.isfinite(hi)
    ax.errorbar(v[has], y[has], xerr=[v[has] - lo[has], hi[has] - v[has]], fmt="o", color="#0969da",
                ecolor="#0969da", capsize=3, ms=5)
    if (~has).any():
        ax.plot(v[~has], y[~has], "o", color="#8c959f", ms=5)
    x0, x1 = metric_axis(metric, np.concatenate([lo[has], v]), np.concatenate([hi[has], v]))
    ax.set_xlim(x0, x1)
    family = families.lookup(metric)  # the no-effect value: RI / MaRI 0.5 (SO = OS), others 0
    ax.axvline(family.neutral if family is not None else 0.0, color="#8c959f", lw=0.8, ls=":")
    starred = {best} if isinstance(best, str) else set(best or ())
    ax.set_yticks(y, [("★ " if str(e) in starred else "") + str(e) for e in encoders])
    ax.set_title(title, fontsize=9, loc="left")
    ax.grid(axis="x", color="#eaeef2", lw=0.6)
    return _svg(fig)


def accuracy_curve_svg(curves: dict, *, title: str, x=None) -> str:
    """``curves``: ``{encoder: (mean per split, sd per split)}``; split 0 = balanced, the last =
    most confounded; ``x``: the schedule's Cramér's V per split (else the split index). Mean
    balanced accuracy with ± 1 sd over the replicates."""
    fig, ax = plt.subplots(figsize=(5.6, 3.0))
    for name, (mean, sd) in curves.items():
        xs = np.arange(len(mean)) if x is None or len(x) != len(mean) else np.asarray(x, dtype=float)
        ax.errorbar(xs, mean, yerr=sd, marker="o", ms=4, capsize=2, lw=1.2, label=str(name))
    ax.set_xlabel("split (0 = balanced → most confounded)" if x is None
                  else "confounding of the training set (Cramér's V, centre × class)")
    ax.set_ylabel("balanced accuracy")
    ax.set_ylim(0.0, 1.02)
    ax.axhline(0.5, color="#8c959f", lw=0.8, ls=":")
    ax.legend(fontsize=8, frameon=False, ncol=2)
    ax.set_title(title, fontsize=9, loc="left")
    ax.grid(axis="y", color="#eaeef2", lw=0.6)
    return _svg(fig)


def reliability_svg(curves: dict, *, title: str) -> str:
    """Reliability diagram: ``curves`` = ``{label: (mean confidence per bin, observed frequency per
    bin, ECE)}``; the diagonal is perfect calibration."""
    fig, ax = plt.subplots(figsize=(3.6, 3.2))
    ax.plot([0, 1], [0, 1], color="#8c959f", lw=0.8, ls=":")
    for name, (conf, freq, ece) in curves.items():
        ax.plot(conf, freq, marker="o", ms=3, lw=1.1, label=f"{name} (ECE {ece:.3f})")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("mean confidence")
    ax.set_ylabel("observed frequency")
    ax.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.02, 1.0))  # beside, not on, the curves
    ax.set_title(title, fontsize=9, loc="left")
    return _svg(fig)


def centre_bars_svg(table, *, title: str, xlabel: str = "centre") -> str:
    """Grouped bars: ``table`` a DataFrame, rows = centres (by name), columns = encoders, mean
    balanced accuracy of the probes on each centre; ``xlabel`` names the confounder."""
    centres, encoders = list(table.index), list(table.columns)
    fig, ax = plt.subplots(figsize=(max(3.6, 0.9 * len(centres) + 1.5), 2.8))
    width = 0.8 / max(1, len(encoders))
    for j, enc in enumerate(encoders):
        ax.bar(np.arange(len(centres)) + j * width, table[enc].to_numpy(float), width, label=str(enc))
    ax.set_xticks(np.arange(len(centres)) + 0.4 - width / 2, [str(c) for c in centres])
    ax.set_ylim(0, 1.02)
    ax.axhline(0.5, color="#8c959f", lw=0.8, ls=":")
    ax.set_ylabel("balanced accuracy")
    ax.set_xlabel(xlabel)
    ax.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    ax.set_title(title, fontsize=9, loc="left")
    return _svg(fig)


def ecdf_svg(values, *, alpha: float, q_alpha: float | None, title: str) -> str:
    """ECDF of the finite ``values`` (CRoMa margins): F0 = share ≤ 0 marked at 0, the α-tail
    (values ≤ q_α) shaded."""
    v = np.sort(np.asarray(values, dtype=float))
    v = v[np.isfinite(v)]
    fig, ax = plt.subplots(figsize=(3.6, 2.4))
    if v.size:
        ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", color="#0969da", lw=1.2)
        f0 = float(np.mean(v <= 0))
        ax.axvline(0.0, color="#cf222e", lw=0.9, ls="--")
        ax.text(0.0, f0, f" F0 = {f0:.3f}", color="#cf222e", fontsize=8, va="bottom")
        if q_alpha is not None and math.isfinite(q_alpha):
            ax.axvspan(v[0], q_alpha, color="#8250df", alpha=0.12, lw=0)
            ax.text(q_alpha, 0.02, f" α-tail (α = {alpha:g})", color="#8250df", fontsize=7)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("margin")
    ax.set_ylabel("ECDF")
    ax.set_title(title, fontsize=9, loc="left")
    return _svg(fig)
