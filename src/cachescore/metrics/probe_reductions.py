"""The probe reductions of an accuracy matrix: APD and nIPD (spec §2.5, §5; downstream.md).

Pure NumPy over an ``(n_splits, n_iterations)`` matrix, in the exact operation order the spec
fixes, so the same matrix gives bit-identical floats to croma 1.0.1. They live in ``metrics``
(not ``probe``) because the metric-family table (:mod:`.families`) computes the probe families'
per-replicate intervals with them; :mod:`cachescore.probe.reductions` re-exports them beside the
Cramér's V grid, and the probe code version covers this module (``fingerprint.CODE_SOURCES``).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["apd", "nipd"]


def _accuracy_matrix(accuracies: ArrayLike) -> np.ndarray:
    """Coerce to a float64 matrix (keeping the caller's memory layout) and check its shape."""
    acc = np.asarray(accuracies, dtype=np.float64)
    if acc.ndim != 2:
        raise ValueError(
            f"accuracies must be a 2-D (n_splits, n_iterations) matrix, got {acc.ndim}-D"
        )
    if acc.shape[0] < 2:
        raise ValueError(
            "accuracies must hold the balanced baseline in row 0 and at least one confounded "
            f"split after it, got {acc.shape[0]} row(s)"
        )
    if acc.shape[1] < 1:
        raise ValueError("accuracies must hold at least one replicate per split, got 0")
    if not np.isfinite(acc).all():
        raise ValueError("accuracies must be finite (no NaN or inf scores)")
    return acc


def apd(accuracies: ArrayLike) -> float:
    """PathoROB's Average Performance Drop of an ``(n_splits, n_iterations)`` accuracy matrix.

    ``d_r = mean_{s>=1}(acc[s, r] / acc[0, r]) - 1`` per replicate, then the NumPy mean of ``d``.
    Returns a Python float; 0 = no degradation, negative = accuracy lost under confounding.

    Raises
    ------
    ValueError
        Not 2-D; fewer than 2 rows; no column; non-finite entry; any baseline ``acc[0, r] <= 0``.
    """
    acc = _accuracy_matrix(accuracies)
    if not (acc[0] > 0.0).all():
        raise ValueError(
            "every replicate's baseline accuracy must be positive for a ratio to exist, "
            f"got a minimum baseline of {acc[0].min()}"
        )
    per_replicate = (acc[1:] / acc[0]).mean(axis=0) - 1
    return float(np.mean(per_replicate))


def nipd(accuracies: ArrayLike, cramers_v: ArrayLike, chance: float) -> float:
    """Normalised integrated performance degradation over a Cramér's V grid.

    ``m = acc.mean(axis=1)``; ``g = (m - m[0]) / (m[0] - chance)``; trapezoid of ``g`` over
    ``cramers_v`` (one value per row, finite, strictly increasing, from ~0 to ~1). Pass a
    C-contiguous matrix to match croma bit for bit (NumPy's row mean depends on layout).

    Raises
    ------
    ValueError
        Matrix checks as :func:`apd`; ``cramers_v`` not 1-D with one value per row; not finite,
        not strictly increasing or not spanning [0, 1]; ``chance`` outside [0, 1); mean baseline
        not above chance.
    """
    acc = _accuracy_matrix(accuracies)
    v = np.asarray(cramers_v, dtype=np.float64)
    if v.ndim != 1 or len(v) != len(acc):
        raise ValueError(
            "cramers_v must be a 1-D vector with one Cramér's-V value per accuracy row, "
            f"got shape {v.shape} for {len(acc)} rows"
        )
    spans = bool(np.isclose(v[0], 0.0) and np.isclose(v[-1], 1.0)) if len(v) else False
    if not np.isfinite(v).all() or not np.all(np.diff(v) > 0.0) or not spans:
        raise ValueError(
            f"cramers_v must be finite, strictly increasing, and span [0, 1], got {v.tolist()}"
        )
    if not 0.0 <= chance < 1.0:
        raise ValueError(f"chance must lie in [0, 1), got {chance}")
    m = acc.mean(axis=1)
    skill = m[0] - chance
    if skill <= 0.0:
        raise ValueError(
            "the balanced baseline must score above chance for normalized degradation to exist, "
            f"got a mean baseline of {m[0]} against chance {chance}"
        )
    g = (m - m[0]) / skill
    return float(np.sum(np.diff(v) * (g[:-1] + g[1:]) / 2.0))
