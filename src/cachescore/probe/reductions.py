"""Reductions of a probe-sweep accuracy matrix: APD, nIPD, and the Cramér's V grid (spec §2.5, §5).

All three are computed with NumPy in the exact operation order the spec fixes, so that the same
matrix gives bit-identical floats to croma 1.0.1 (``apd`` and ``nipd`` are defined in
:mod:`cachescore.metrics.probe_reductions`, where the metric-family table reaches them):

- ``apd``: divide rows 1.. by row 0, mean over axis 0, subtract 1 (per replicate), then
  ``numpy.mean`` over replicates.
- ``nipd``: row means of the (C-contiguous as given) matrix, normalise by baseline skill above
  chance, trapezoid over the Cramér's V grid summed with ``numpy.sum``.
- ``cramers_v``: Pearson chi-square of the training *slide*-count contingency table of each split.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

from ..metrics.probe_reductions import apd, nipd
from .schedule import SplitPlan

__all__ = ["apd", "nipd", "cramers_v", "sweep_nipd"]


def cramers_v(
    schedule: Sequence[SplitPlan],
    *,
    rows_per_slide: int = 1,
    shape: tuple[int, int] | None = None,
) -> np.ndarray:
    """Cramér's V of each split's training composition, the nIPD x-coordinates (spec §2.5).

    The contingency table of split ``s`` is ``T[i, j] = take(i, j, s) / rows_per_slide`` (slide
    counts: a schedule built at ``rows_per_slide`` r must be passed with the same r, because
    row counts give values that differ in the last bit). Then ``E = rowsum ⊗ colsum / n``,
    ``chi2 = Σ (T - E)² / E``, ``V = sqrt(chi2 / (n · (min(shape) - 1)))`` in float64.

    Parameters
    ----------
    schedule : sequence of SplitPlan
    rows_per_slide : int
        Rows per slide the schedule was built with (default 1: slide counts).
    shape : (n_confounders, n_classes), optional
        Grid size; default: one more than the largest indices named in the schedule.

    Returns
    -------
    ndarray of shape (n_splits,), float64

    Raises
    ------
    ValueError
        Empty schedule; ``rows_per_slide < 1``; a take not a multiple of ``rows_per_slide`` or
        negative; an index outside ``shape``; a grid with fewer than 2 rows or columns; a split
        with no training slides or with an empty row/column total (V undefined).
    """
    if rows_per_slide < 1:
        raise ValueError(f"rows_per_slide must be at least 1, got {rows_per_slide}")
    plans = [([(int(i), int(j), int(t)) for i, j, t in split_map], mts) for split_map, mts in schedule]
    if not plans:
        raise ValueError("schedule must hold at least one split")
    if shape is None:
        entries = [e for split_map, _ in plans for e in split_map]
        if not entries:
            raise ValueError("schedule names no cell; pass shape=(n_confounders, n_classes)")
        shape = (max(e[0] for e in entries) + 1, max(e[1] for e in entries) + 1)
    n_conf, n_cls = int(shape[0]), int(shape[1])
    if min(n_conf, n_cls) < 2:
        raise ValueError(f"Cramér's V needs at least a 2x2 grid, got {n_conf}x{n_cls}")
    out = np.empty(len(plans), dtype=np.float64)
    for s, (split_map, _) in enumerate(plans):
        table = np.zeros((n_conf, n_cls), dtype=np.float64)
        for i, j, take in split_map:
            if not (0 <= i < n_conf and 0 <= j < n_cls):
                raise ValueError(f"split {s}: cell ({i}, {j}) lies outside the {n_conf}x{n_cls} grid")
            if take < 0 or take % rows_per_slide:
                raise ValueError(
                    f"split {s}: cell ({i}, {j}) takes {take} rows, not a non-negative multiple "
                    f"of rows_per_slide={rows_per_slide}"
                )
            table[i, j] += take // rows_per_slide
        n = table.sum()
        rows, cols = table.sum(axis=1), table.sum(axis=0)
        if n <= 0 or (rows <= 0).any() or (cols <= 0).any():
            raise ValueError(
                f"split {s}: Cramér's V is undefined for a training table with an empty "
                f"row or column (row totals {rows.tolist()}, column totals {cols.tolist()})"
            )
        expected = np.outer(rows, cols) / n
        chi2 = np.sum((table - expected) ** 2 / expected)
        out[s] = np.sqrt(chi2 / (n * (min(n_conf, n_cls) - 1)))
    return out


def sweep_nipd(
    matrix: ArrayLike,
    schedule: Sequence[SplitPlan],
    n_classes: int,
    *,
    rows_per_slide: int = 1,
) -> float:
    """nIPD of a sweep's matrix at its schedule's Cramér's V, with chance ``1 / n_classes``.

    Convenience for ``nipd(matrix, cramers_v(schedule, rows_per_slide=...), 1 / n_classes)``;
    the matrix is made C-contiguous first (the layout the sweep returns, spec §5.2).
    The grid is sized ``(n_confounders from the schedule, n_classes)``.
    """
    if n_classes < 2:
        raise ValueError(f"n_classes must be at least 2, got {n_classes}")
    plans = list(schedule)
    n_conf = max((int(i) for split_map, _ in plans for i, _, _ in split_map), default=-1) + 1
    v = cramers_v(plans, rows_per_slide=rows_per_slide, shape=(n_conf, n_classes))
    return nipd(np.ascontiguousarray(matrix, dtype=np.float64), v, 1 / n_classes)
