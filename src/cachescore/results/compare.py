"""Compare two encoders: per view × metric the difference B − A with its paired bootstrap CI.

The two encoders' scores of one view are resampled with the same draw (same groups, seed and
replicate count; :mod:`.scores`), so the difference's replicates are paired: for CRoMa this is
croma's ``paired_cluster_bootstrap_delta`` (balanced medians; tested), for RI / MaRI the difference
of the pooled ratios, for APD the per-replicate difference over the probe replicates. The verdict
is plain: the interval excludes 0 → the higher one is more robust; otherwise no detectable
difference. Undefined scores are not compared (the verdict says why).
"""

from __future__ import annotations

import math
from collections.abc import Iterable


from .scores import BOOTSTRAP_DEFAULTS, paired_difference, score_entries

__all__ = ["compare_encoders", "COMPARE_COLUMNS"]

#: Keys of one comparison row.
COMPARE_COLUMNS = ("view", "design", "scope", "metric", "m", "encoder_a", "encoder_b", "value_a", "value_b",
                   "delta", "ci_low", "ci_high", "ci_level", "win_fraction", "verdict")


def _verdict(a: str, b: str, lo: float, hi: float) -> str:
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "no interval: cannot decide"
    if lo > 0:
        return f"{b} more robust"
    if hi < 0:
        return f"{a} more robust"
    return "no detectable difference"


def compare_encoders(store, cache, fingerprints: Iterable[str], encoder_a: str, encoder_b: str, *,
                     view: str | None = None, metric: str | None = None, bootstrap: dict | None = None) -> list[dict]:
    """Rows (:data:`COMPARE_COLUMNS`) for every view × design × scope × metric × m that both
    encoders have among the stored records ``fingerprints`` (optionally one ``view`` / ``metric``).
    ``delta`` = B − A; ``win_fraction`` = share of replicates where B's value is strictly greater.
    Raises ``ValueError`` when the two names are equal or no score of either encoder matches."""
    if encoder_a == encoder_b:
        raise ValueError(f"compare needs two different encoders, got {encoder_a!r} twice")
    bootstrap = dict(BOOTSTRAP_DEFAULTS, **(bootstrap or {}))
    entries = [e for e in score_entries(store, cache, fingerprints, bootstrap=bootstrap)
               if e["encoder"] in (encoder_a, encoder_b) and (view is None or e["view"] == view)
               and (metric is None or e["metric"] == metric)]
    found = {e["encoder"] for e in entries}
    missing = [x for x in (encoder_a, encoder_b) if x not in found]
    if missing:
        raise ValueError(f"no stored score of encoder(s) {', '.join(missing)}"
                         + (f" for view {view!r}" if view else "") + (f", metric {metric!r}" if metric else "")
                         + f" (scored encoders: {', '.join(sorted({e['encoder'] for e in entries})) or 'none'})")
    by_key: dict = {}
    for e in entries:
        by_key.setdefault((e["view"], e["design"], e["scope"], e["metric"], e["m"]), {})[e["encoder"]] = e
    rows = []
    for (v, design, scope, met, m), pair in sorted(by_key.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        if encoder_a not in pair or encoder_b not in pair:
            continue
        ea, eb = pair[encoder_a], pair[encoder_b]
        row = {"view": v, "design": design, "scope": scope, "metric": met, "m": m, "encoder_a": encoder_a,
               "encoder_b": encoder_b, "value_a": ea["value"], "value_b": eb["value"],
               "delta": eb["value"] - ea["value"], "ci_level": float(bootstrap["level"])}
        if not (ea["defined"] and eb["defined"]):
            why = ea["undefined_reason"] or eb["undefined_reason"]
            row.update(ci_low=float("nan"), ci_high=float("nan"), win_fraction=float("nan"),
                       verdict=f"not comparable: {why}")
        else:
            lo, hi, win = paired_difference(ea["_reps"], eb["_reps"], row["delta"], row["ci_level"])
            row.update(ci_low=lo, ci_high=hi, win_fraction=win, verdict=_verdict(encoder_a, encoder_b, lo, hi))
        rows.append(row)
    return rows
