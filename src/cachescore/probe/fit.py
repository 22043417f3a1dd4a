"""One probe of the sweep: one (replicate, split) -- C grid, first-max selection, scoring (spec §4).

This module is pure NumPy/scikit-learn and knows nothing about Dask. Its unit of work is
:func:`fit_probe`: given the feature matrix, the label vector and the training / validation /
test row indices of one (replicate, split), it fits ``LogisticRegression(C, random_state=0)``
(lbfgs, every other setting at scikit-learn's default) for each C of :data:`C_GRID` on float64
training rows **in the given order**, keeps the first C with the maximal validation balanced
accuracy, and scores the grid model fitted at that C on every test set. Re-using the grid model
instead of refitting gives identical numbers because lbfgs is deterministic (spec §4.4).

ConvergenceWarnings are expected at large C on unscaled features; they are silenced here (the
optimiser's result after ``max_iter`` iterations is used, as the reference does) and counted in
:attr:`ProbeOutcome.n_unconverged` instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # scikit-learn is imported where a probe is fitted (a command that only plans never pays for it)
    from sklearn.linear_model import LogisticRegression

__all__ = ["C_GRID", "ProbeOutcome", "balanced_accuracy", "fit_probe"]

#: The regularisation grid, ``10 ** numpy.linspace(-8, 4, 15)`` (NumPy's linspace: hand-written
#: exponents differ in the last bit).
C_GRID: np.ndarray = 10 ** np.linspace(-8, 4, 15)
C_GRID.setflags(write=False)

#: Key of the in-domain held-out scores.
IN_DOMAIN = "in_domain"


@dataclass(frozen=True, kw_only=True)
class ProbeOutcome:
    """The result of one (replicate, split) probe.

    Attributes
    ----------
    replicate, split : int
        Column and row of the sweep matrix this probe fills.
    seed : int
        The replicate's seed (``replicate_seeds[replicate]``).
    best_C : float
        First C of :data:`C_GRID` with the maximal validation balanced accuracy.
    val_scores : ndarray (15,) float64
        Validation balanced accuracy of each grid C.
    train_rows, val_rows, test_rows : ndarray int64
        Row indices into the sweep's embeddings (training rows in the order the probe saw them).
        ``test_rows`` may be a read-only array shared by the outcomes of one replicate.
    classes : ndarray int64
        The fitted model's ``classes_``.
    scores : dict[str, float]
        Balanced accuracy of the final model: ``"in_domain"`` first, then each extra test set.
    n_unconverged : int
        How many of the 15 grid fits stopped at ``max_iter`` (lbfgs did not converge).
    val_decision : ndarray (n_val, K) float64 or None
        Decision scores of the final model on the validation rows (``keep_predictions`` only).
        Binary problems are expanded to columns ``[0, z]`` so that softmax gives predict_proba.
    test_decision : dict[str, ndarray (n, K)] or None
        Same for every test set (``"in_domain"`` first).
    val_labels : ndarray int or None
    test_labels : dict[str, ndarray] or None
    """

    replicate: int
    split: int
    seed: int
    best_C: float
    val_scores: np.ndarray
    train_rows: np.ndarray
    val_rows: np.ndarray
    test_rows: np.ndarray
    classes: np.ndarray
    scores: dict[str, float]
    n_unconverged: int = 0
    val_decision: np.ndarray | None = None
    test_decision: dict[str, np.ndarray] | None = field(default=None)
    val_labels: np.ndarray | None = None
    test_labels: dict[str, np.ndarray] | None = field(default=None)


def balanced_accuracy(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """scikit-learn's ``balanced_accuracy_score`` (``adjusted=False``) for 1-D integer labels.

    Same operations, so the same float: confusion counts over the sorted union of labels,
    per-class recall ``diag / rowsum`` (int64 counts, float64 division), classes with no true
    row dropped (no warning), ``numpy.mean`` of the rest. Falls back to scikit-learn's function
    (and its errors) for anything that is not a pair of 1-D integer arrays.
    """
    from sklearn.metrics import balanced_accuracy_score  # deferred: scikit-learn only when scoring a probe

    y_true = np.asarray(y_true)
    y_pred = np.asarray(y_pred)
    if (
        y_true.ndim != 1
        or y_pred.ndim != 1
        or y_true.shape != y_pred.shape
        or not np.issubdtype(y_true.dtype, np.integer)
        or not np.issubdtype(y_pred.dtype, np.integer)
        or len(y_true) == 0
    ):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=UserWarning, module="sklearn")
            return balanced_accuracy_score(y_true, y_pred)
    classes, inverse = np.unique(np.concatenate([y_true, y_pred]), return_inverse=True)
    k = len(classes)
    t, p = inverse[: len(y_true)], inverse[len(y_true) :]
    support = np.bincount(t, minlength=k)
    hits = np.bincount(t[t == p], minlength=k)
    present = support > 0
    recall = hits[present] / support[present]
    return float(np.mean(recall))


def _decision(model: LogisticRegression, x: np.ndarray) -> np.ndarray:
    """Decision scores as scikit-learn computes them (``X @ coef.T + intercept``)."""
    return model.decision_function(x)


def _predict(model: LogisticRegression, scores: np.ndarray) -> np.ndarray:
    """scikit-learn's ``predict`` from precomputed decision scores (same rule, same result)."""
    if scores.ndim == 1:
        index = (scores > 0).astype(np.intp)
    else:
        index = np.argmax(scores, axis=1)
    return np.take(model.classes_, index, axis=0)


def _expand(scores: np.ndarray) -> np.ndarray:
    """Binary ``z`` -> ``[0, z]`` columns; multinomial scores unchanged (float64, C order)."""
    if scores.ndim == 1:
        out = np.zeros((len(scores), 2), dtype=np.float64)
        out[:, 1] = scores
        return out
    return np.ascontiguousarray(scores, dtype=np.float64)


def _rows64(features: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``features[rows]`` as a C-contiguous float64 matrix (float32 upcast is exact)."""
    return np.ascontiguousarray(features[rows], dtype=np.float64)


def fit_probe(
    features: np.ndarray,
    labels: np.ndarray,
    *,
    replicate: int,
    split: int,
    seed: int,
    train_rows: np.ndarray,
    val_rows: np.ndarray,
    test_rows: np.ndarray,
    test_sets: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
    keep_predictions: bool = False,
) -> ProbeOutcome:
    """Fit the C grid for one (replicate, split) and score the selected model.

    Parameters
    ----------
    features : ndarray (n_rows, D), float32 or float64
        The sweep's embeddings; rows are upcast to float64 after indexing.
    labels : ndarray (n_rows,), integer
    train_rows, val_rows, test_rows : ndarray int64
        Row indices; training order is the order the probe sees the rows (it matters bitwise).
    test_sets : mapping name -> (X (n, D), y (n,)), optional
        Extra test sets, scored after the in-domain rows with the same final model.
    keep_predictions : bool
        Also return decision scores and labels of the validation and test rows.

    Returns
    -------
    ProbeOutcome

    Raises
    ------
    ValueError
        Whatever scikit-learn raises (e.g. a single training class, NaN in a test set, string
        test labels): the probe has no fallback.
    """
    from sklearn.exceptions import ConvergenceWarning  # deferred: scikit-learn only when fitting
    from sklearn.linear_model import LogisticRegression  # deferred, as above

    train_rows = np.asarray(train_rows, dtype=np.int64)
    val_rows = np.asarray(val_rows, dtype=np.int64)
    test_rows = np.asarray(test_rows, dtype=np.int64)
    x_train, y_train = _rows64(features, train_rows), labels[train_rows]
    x_val, y_val = _rows64(features, val_rows), labels[val_rows]

    val_scores = np.empty(len(C_GRID), dtype=np.float64)
    best_model: LogisticRegression | None = None
    best_score = -np.inf
    best_val_decision: np.ndarray | None = None
    n_unconverged = 0
    for index, c in enumerate(C_GRID):
        model = LogisticRegression(C=c, random_state=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            model.fit(x_train, y_train)
        if np.any(model.n_iter_ >= model.max_iter):
            n_unconverged += 1
        decision = _decision(model, x_val)
        score = balanced_accuracy(y_val, _predict(model, decision))
        val_scores[index] = score
        if score > best_score:  # strict: the first maximum wins
            best_score, best_model, best_val_decision = score, model, decision
    assert best_model is not None and best_val_decision is not None
    best_index = int(np.argmax(val_scores))

    sets: list[tuple[str, np.ndarray, np.ndarray]] = [
        (IN_DOMAIN, _rows64(features, test_rows), labels[test_rows])
    ]
    for name, (tx, ty) in (test_sets or {}).items():
        sets.append((name, tx, ty))
    scores: dict[str, float] = {}
    test_decision: dict[str, np.ndarray] = {}
    test_labels: dict[str, np.ndarray] = {}
    for name, tx, ty in sets:
        decision = _decision(best_model, np.asarray(tx, dtype=np.float64))
        scores[name] = balanced_accuracy(ty, _predict(best_model, decision))
        if keep_predictions:
            test_decision[name] = _expand(decision)
            test_labels[name] = np.asarray(ty)

    return ProbeOutcome(
        replicate=int(replicate),
        split=int(split),
        seed=int(seed),
        best_C=float(C_GRID[best_index]),
        val_scores=val_scores,
        train_rows=train_rows,
        val_rows=val_rows,
        test_rows=test_rows,
        classes=np.asarray(best_model.classes_, dtype=np.int64),
        scores=scores,
        n_unconverged=n_unconverged,
        val_decision=_expand(best_val_decision) if keep_predictions else None,
        test_decision=test_decision if keep_predictions else None,
        val_labels=np.asarray(y_val) if keep_predictions else None,
        test_labels=test_labels if keep_predictions else None,
    )


@dataclass(frozen=True, kw_only=True)
class ProbeTask:
    """The inputs of one (replicate, split) probe, as produced by the driver-side replay (a *probe
    task*: what one Dask task of a sweep fits; not a job file)."""

    replicate: int
    split: int
    seed: int
    train_rows: np.ndarray
    val_rows: np.ndarray
    test_rows: np.ndarray
