"""Recall measurement shared by every approximate engine: tie-robust hit counts, the calibration
of a probe fraction from exact answers, the query sample, the tolerance, and the error raised when a
target is not met.

Tie-robust recall: per query row, the found distances ``<= r + tol`` count as hits (capped at the
number of true neighbours), ``r`` being the row's last finite exact distance and ``tol``
(:func:`distance_tol`) the rounding slack between two kernels computing one distance.
"""

from __future__ import annotations

import numpy as np

from ..errors import UnscorableError

__all__ = ["RecallTargetError", "distance_tol", "recall_counts", "calibrate_fraction", "sample_queries",
           "check_positive_int", "seed_of"]


class RecallTargetError(UnscorableError):
    """The measured recall stayed below the target after every widening round."""

    @classmethod
    def after_rounds(cls, search: str, recall: float, target: float, n_audit: int, rounds: int, detail: str,
                     remedy: str = "max_rounds") -> "RecallTargetError":
        """The error every widening search raises, one wording: ``search`` names it, ``detail``
        its size and last setting, ``remedy`` the option that widens further."""
        return cls(f"{search} reached recall {recall:.4f} < target {target} on {n_audit} sampled rows after "
                   f"{rounds} widening round(s) ({detail}); raise {remedy} or use backend='exact'")


def distance_tol(dtype, d: int) -> float:
    """Absolute slack between two computations of one pair distance: ``sqrt(d) · eps(dtype)``.

    Two kernels (a GEMM in the exact engines, a batched dot product here) sum the ``d`` products in
    different orders; each result carries a rounding error of order ``sqrt(d) · eps/2`` for unit
    rows. Measured max |GEMM - exact| on clustered float32 rows: 4.2e-7 (d=96), 7.7e-7 (d=384),
    5.2e-7 (d=768), so spec §12.3's "~4e-7" holds only for small d; this bound is 2-4× the
    measured maxima (1.2e-6, 2.3e-6, 3.3e-6 for float32; 1.8e-15-6e-15 for float64).
    """
    return float(np.sqrt(max(int(d), 1)) * np.finfo(np.dtype(dtype)).eps)


def check_positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    return int(v)


def seed_of(random_state) -> int | None:
    """An int seed for pynndescent and the audit sample from an int, a Generator or None."""
    if random_state is None:
        return None
    if isinstance(random_state, np.random.Generator):
        return int(random_state.integers(0, 2**31 - 1))
    if isinstance(random_state, np.random.RandomState):
        return int(random_state.randint(0, 2**31 - 1))
    return int(random_state)


def sample_queries(n, n_queries, random_state) -> np.ndarray:
    n_queries = check_positive_int("n_queries", n_queries)
    rng = np.random.default_rng(seed_of(random_state))
    return np.sort(rng.choice(n, size=min(n, n_queries), replace=False)).astype(np.int64)


def recall_counts(found_dist, true_dist, tol):
    """(hits, total) of the tie-robust recall: per row, found distances ``<= r + tol`` (capped
    at the number of true neighbours) where r is the row's last finite true distance."""
    true_valid = np.isfinite(true_dist)
    n_true = true_valid.sum(axis=1)
    r = np.where(n_true > 0, np.where(true_valid, true_dist, -np.inf).max(axis=1), -np.inf)
    hits = np.minimum((found_dist <= r[:, None] + tol).sum(axis=1), n_true)
    return int(hits.sum()), int(n_true.sum())


def calibrate_fraction(levels, true_idx, true_dist, tol, target, fractions):
    """Smallest probe fraction whose recall on calibration rows reaches ``target`` (1.0 if none).

    ``true_idx`` / ``true_dist`` (q, k): the exact answers of the calibration rows (one pair per
    type); ``levels`` (q, k) int the probe level of each true neighbour (see
    :func:`_probe_levels`). A search at fraction ``f_i`` finds every true neighbour of level
    ``<= i`` (it searches the probed rows exactly), so its tie-robust hits are
    ``min(n_true, #level <= i)``; rows tied with the k-th beyond the table are not counted, which
    can only under-state the recall.
    """
    for i, f in enumerate(fractions):
        hits = total = 0
        for lev, ti, td in zip(levels, true_idx, true_dist):
            valid = (ti >= 0) & np.isfinite(td)
            n_true = valid.sum(axis=1)
            hits += int(np.minimum(n_true, ((lev <= i) & valid).sum(axis=1)).sum())
            total += int(n_true.sum())
        if total == 0 or hits / total >= target:
            return f
    del tol
    return 1.0

