"""Lower-tail summaries of per-unit values (spec/metrics.md §8.1)."""

from __future__ import annotations

import numpy as np

from ..types import TailMetrics

__all__ = ["compute_tail_metrics", "confounder_dominant_fraction"]


def compute_tail_metrics(values, alpha: float = 0.10) -> TailMetrics:
    """``q_alpha`` (numpy linear percentile) and the lower-tail mean of the finite ``values``.

    Non-finite values are dropped before ranking. With no finite value the result is
    ``(alpha, nan, nan, 0)``. ``alpha`` outside [0, 1] raises numpy's ``ValueError``.
    """
    v = np.asarray(values, dtype=np.float64).ravel()
    finite = v[np.isfinite(v)]
    if finite.size == 0:
        return TailMetrics(alpha=alpha, q_alpha=float("nan"), ltm_alpha=float("nan"), n_tail_samples=0)
    q = float(np.percentile(finite, alpha * 100))
    tail = finite[finite <= q]
    ltm = float(np.mean(tail)) if tail.size else q
    return TailMetrics(alpha=alpha, q_alpha=q, ltm_alpha=ltm, n_tail_samples=int(tail.size))


def confounder_dominant_fraction(values) -> float:
    """F(0): fraction of the finite values that are ``<= 0`` (closed boundary); NaN if none."""
    v = np.asarray(values, dtype=np.float64).ravel()
    finite = v[np.isfinite(v)]
    if finite.size == 0:
        return float("nan")
    return float(np.mean(finite <= 0))
