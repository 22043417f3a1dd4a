"""Operating-k selection by kNN balanced accuracy (spec/metrics.md §4).

The operating ``k`` is chosen from labels only: for each candidate ``k`` every unit predicts the
most frequent label code among its first ``eff_k_i`` cross-group neighbours (vote ties go to the
smallest code, i.e. the label seen first in scope order); units with ``eff_k_i == 0`` are left
out. Balanced accuracy is the mean, over the classes present in ``y_true``, of per-class recall
(the definition scikit-learn's ``balanced_accuracy_score`` uses; it is computed here directly,
without the warning sklearn emits when a predicted class is absent from ``y_true``).

Votes are vectorised: per label, a cumulative count over the window columns, gathered at
``eff_k_i - 1`` for every candidate at once; rows are processed in blocks.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from .windows import row_block

__all__ = [
    "normalize_k_values",
    "knn_predictions",
    "balanced_accuracy",
    "balanced_accuracy_by_k",
    "select_k_all",
    "select_k_paired",
]



def normalize_k_values(k_values: Iterable) -> list[int]:
    """``int()`` each candidate, reject ``<= 0``, drop duplicates keeping the caller's order (§4.1).

    Raises ``ValueError`` for a non-positive candidate or an empty result.
    """
    out: list[int] = []
    seen: set[int] = set()
    for raw in k_values:
        k = int(raw)
        if k <= 0:
            raise ValueError(f"k_values must be strictly positive, got {raw!r}")
        if k not in seen:
            seen.add(k)
            out.append(k)
    if not out:
        raise ValueError("k_values must contain at least one candidate")
    return out


def knn_predictions(codes: np.ndarray, idx: np.ndarray, valid: np.ndarray, ks: list[int]):
    """Majority-vote predictions for every unit and every ``k`` in ``ks``.

    ``codes``: (N,) int64 target codes (0..L-1) of the scope's rows; ``idx``: (n, W) neighbour
    table of the rows scored (the scope's, or a range of them: the neighbours are scope rows);
    ``valid``: (n,) the step's ``valid_i``. Returns ``pred`` (n, len(ks)) int64 (-1 where unused)
    and ``used`` (n, len(ks)) bool (``eff_k_i > 0``).
    """
    n = idx.shape[0]
    n_codes = int(codes.max()) + 1 if codes.shape[0] else 0
    kv = np.asarray(ks, dtype=np.int64)
    eff = np.minimum(valid[:, None], kv[None, :])
    used = eff > 0
    pred = np.full((n, len(ks)), -1, dtype=np.int64)
    width = idx.shape[1]
    step = row_block(width)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        block_idx = idx[r0:r1]
        inside = np.arange(width)[None, :] < valid[r0:r1, None]
        neigh = np.where(inside & (block_idx >= 0), codes[np.where(block_idx >= 0, block_idx, 0)], -1)
        col = np.maximum(eff[r0:r1] - 1, 0)
        rows = np.arange(r1 - r0)[:, None]
        best = np.full((r1 - r0, len(ks)), -1, dtype=np.int64)
        best_count = np.zeros((r1 - r0, len(ks)), dtype=np.int64)
        for c in range(n_codes):  # ascending code: a later code wins only with a strictly larger count
            counts = np.cumsum(neigh == c, axis=1, dtype=np.int64)[rows, col]
            better = counts > best_count
            best[better] = c
            best_count[better] = counts[better]
        pred[r0:r1] = np.where(used[r0:r1], best, -1)
    return pred, used


def balanced_accuracy(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """Mean per-class recall over the classes present in ``y_true`` (sorted class order)."""
    classes, counts = np.unique(y_true, return_counts=True)
    correct = np.bincount(np.searchsorted(classes, y_true[y_true == y_pred]), minlength=classes.size)
    return float(np.mean(correct / counts))


def balanced_accuracy_by_k(codes: np.ndarray, idx: np.ndarray, valid: np.ndarray, ks: list[int]) -> dict[int, float]:
    """``{k: bacc}`` for the candidates that have at least one used unit (spec §4.2).

    Raises ``RuntimeError`` when no candidate has a used unit (no unit has any cross-group
    neighbour).
    """
    pred, used = knn_predictions(codes, idx, valid, ks)
    out: dict[int, float] = {}
    for j, k in enumerate(ks):
        m = used[:, j]
        if m.any():
            out[int(k)] = balanced_accuracy(codes[m], pred[m, j])
    if not out:
        raise RuntimeError("k-selection failed: no sample has any cross-group neighbor")
    return out


def select_k_all(candidates: list[int], scores: dict[int, float]) -> int:
    """``all`` design: the first candidate, in the caller's order, with the strictly highest bacc."""
    best_k, best = None, -np.inf
    for k in candidates:
        if k in scores and scores[k] > best:
            best_k, best = k, scores[k]
    if best_k is None:
        raise RuntimeError("k-selection failed: no sample has any cross-group neighbor")
    return int(best_k)


def select_k_paired(per_scope: list[dict[int, float]]) -> int:
    """``paired_2x2``: mean bacc per k over the subsets that have it; ascending scan, so the
    smallest k wins a tie (spec §4.3)."""
    keys = sorted({k for s in per_scope for k in s})
    averaged = {k: float(np.mean([s[k] for s in per_scope if k in s])) for k in keys}
    return select_k_all(keys, averaged)
