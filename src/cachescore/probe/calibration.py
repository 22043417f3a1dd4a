"""Probabilities, calibration tables, top-label ECE and temperature scaling for probe outputs.

Spec: ``spec/evaluation.md`` A.5 (definitions), C.5 (fit on validation only), Part D.

Bin convention (stated once, used by both the ECE and the calibration table): ``M`` equal-width
bins with edges ``e_b = linspace(0, 1, M + 1)``; a score ``c`` goes to bin
``searchsorted(e[1:-1], c, side="left")``, i.e. bins are ``(e_b, e_{b+1}]`` with ``0`` in the first
bin and ``1.0`` in the last. This is exactly scikit-learn's ``calibration_curve(strategy=
"uniform")`` rule, so that function is a test oracle for the binary / one-vs-rest case. A value
lying exactly on an inner edge goes to the LOWER bin.

``n_bins`` below 2 is refused (never silently floored).

Temperature scaling divides the probe's decision scores (logits) by ``T`` before the softmax. It
never changes the argmax, so accuracy and balanced accuracy cannot move; only NLL, Brier and ECE
can. ``T`` is fitted by the caller on VALIDATION rows only; this module never sees which rows are
which, it fits on exactly the arrays it is handed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from ..errors import UnscorableError

__all__ = [
    "CALIBRATION_COLUMNS",
    "TEMPERATURE_BOUNDS",
    "apply_temperature",
    "bin_indices",
    "calibration_table",
    "confusion_counts",
    "decision_to_probabilities",
    "expected_calibration_error",
    "fit_temperature",
    "multiclass_brier",
    "negative_log_likelihood",
    "normalize_probabilities",
]

#: Columns of :func:`calibration_table`, in order; an empty table still has all of them.
CALIBRATION_COLUMNS = (
    "class_index",
    "class_name",
    "bin",
    "bin_lower",
    "bin_upper",
    "n",
    "mean_confidence",
    "observed_frequency",
    "calibration_gap",
)

#: Closed interval the fitted temperature is confined to (spec A.5: optimised over ln T).
TEMPERATURE_BOUNDS = (0.05, 20.0)


# ---------------------------------------------------------------------------------------------
# validation helpers


def _check_n_bins(n_bins) -> int:
    if isinstance(n_bins, bool) or not isinstance(n_bins, (int, np.integer)):
        raise ValueError(f"n_bins must be an integer of at least 2, got {n_bins!r}")
    if n_bins < 2:
        raise ValueError(f"n_bins must be at least 2, got {n_bins}")
    return int(n_bins)


def _check_labels(y, n: int, k: int, *, what: str = "labels") -> np.ndarray:
    y = np.asarray(y)
    if y.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {y.shape}")
    if y.shape[0] != n:
        raise ValueError(f"{what} hold {y.shape[0]} entries but the probabilities hold {n} rows")
    if n and not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"{what} must hold integer class indices, got dtype {y.dtype}")
    y = y.astype(np.int64, copy=False)
    bad = np.flatnonzero((y < 0) | (y >= k))
    if bad.size:
        raise ValueError(
            f"{what} at rows {bad[:20].tolist()} ({bad.size} in all) lie outside the {k} "
            f"probability columns (valid class indices are 0..{k - 1})"
        )
    return y


def normalize_probabilities(p, *, n_classes: int | None = None) -> np.ndarray:
    """Validate a probability matrix and return a NEW row-normalised float64 copy.

    Parameters
    ----------
    p : array-like of shape (n,), (n, 1) or (n, K), K >= 2
        A 1-D vector or a single column is read as positive-class probabilities and expanded
        to ``[1 - p, p]``.
    n_classes : int, optional
        If given, the column count must equal it.

    Raises
    ------
    ValueError
        Not 2-D with >= 2 columns after expansion; wrong column count; NaN/inf; a value below 0
        or above 1; a row summing to 0 or less. Each has its own message.
    """
    arr = np.array(p, dtype=np.float64, copy=True)
    if arr.ndim == 1 or (arr.ndim == 2 and arr.shape[1] == 1):
        col = arr.reshape(-1)
        arr = np.column_stack([1.0 - col, col])
    if arr.ndim != 2 or arr.shape[1] < 2:
        raise ValueError(
            f"probabilities must be a 2-D (n, K) matrix with at least 2 columns, got shape {arr.shape}"
        )
    if n_classes is not None and arr.shape[1] != n_classes:
        raise ValueError(
            f"probabilities have {arr.shape[1]} columns but n_classes is {n_classes}"
        )
    if not np.isfinite(arr).all():
        rows = np.flatnonzero(~np.isfinite(arr).all(axis=1))
        raise ValueError(f"probabilities must be finite; rows {rows[:20].tolist()} hold NaN or inf")
    if (arr < 0).any():
        rows = np.flatnonzero((arr < 0).any(axis=1))
        raise ValueError(f"probabilities must not be negative; rows {rows[:20].tolist()} are")
    if (arr > 1).any():
        rows = np.flatnonzero((arr > 1).any(axis=1))
        raise ValueError(f"probabilities must not exceed 1; rows {rows[:20].tolist()} do")
    sums = arr.sum(axis=1)
    if (sums <= 0).any():
        rows = np.flatnonzero(sums <= 0)
        raise ValueError(f"every probability row must have a positive sum; rows {rows[:20].tolist()} sum to 0")
    arr /= sums[:, None]
    return arr


def _check_logits(z) -> np.ndarray:
    z = np.asarray(z, dtype=np.float64)
    if z.ndim != 2 or z.shape[1] < 2:
        raise ValueError(
            f"decision scores must be a 2-D (n, K) matrix with K >= 2 columns, got shape {z.shape}; "
            "expand a binary decision_function z to columns [0, z] first"
        )
    if not np.isfinite(z).all():
        rows = np.flatnonzero(~np.isfinite(z).all(axis=1))
        raise ValueError(f"decision scores must be finite; rows {rows[:20].tolist()} are not")
    return z


def decision_to_probabilities(decision) -> np.ndarray:
    """Softmax of decision scores, row-wise, as float64 (n, K).

    A 1-D ``decision`` (a binary probe's ``decision_function``) is expanded to columns
    ``[0, z]``, which makes the softmax equal to scikit-learn's ``predict_proba`` (the logistic
    sigmoid). Raises ValueError for non-finite scores or a bad shape.
    """
    from scipy.special import softmax  # deferred: scipy only when calibrating

    z = np.asarray(decision, dtype=np.float64)
    if z.ndim == 1:
        z = np.column_stack([np.zeros_like(z), z])
    z = _check_logits(z)
    return softmax(z, axis=1)


# ---------------------------------------------------------------------------------------------
# binning, ECE, tables


def bin_indices(scores, n_bins: int) -> np.ndarray:
    """0-based bin index of each score in [0, 1]: bins ``(e_b, e_{b+1}]``, 0 in bin 0.

    Same rule as scikit-learn ``calibration_curve(strategy="uniform")``.
    """
    n_bins = _check_n_bins(n_bins)
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    return np.searchsorted(edges[1:-1], np.asarray(scores, dtype=np.float64), side="left")


def expected_calibration_error(y, p, *, n_bins: int = 15) -> float:
    """Top-label expected calibration error.

    ``c_i = max_k p_ik``, ``yhat_i = argmax_k p_ik`` (first maximum on ties),
    ``ECE = sum_b |B_b|/n * |mean(1[yhat = y]) - mean(c)|`` over non-empty bins
    (bin rule in the module docstring).

    Parameters
    ----------
    y : int array of shape (n,), class indices in ``[0, K)``
    p : probabilities of shape (n, K) (validated by :func:`normalize_probabilities`)

    Returns NaN for ``n = 0``. Raises ValueError on a length mismatch, a label outside the
    columns, or ``n_bins < 2``.
    """
    n_bins = _check_n_bins(n_bins)
    p = normalize_probabilities(p) if np.asarray(p).size else np.zeros((0, 2))
    y = _check_labels(y, p.shape[0], p.shape[1])
    n = p.shape[0]
    if n == 0:
        return float("nan")
    conf = p.max(axis=1)
    correct = (p.argmax(axis=1) == y).astype(np.float64)
    b = bin_indices(conf, n_bins)
    count = np.bincount(b, minlength=n_bins)
    sum_conf = np.bincount(b, weights=conf, minlength=n_bins)
    sum_acc = np.bincount(b, weights=correct, minlength=n_bins)
    nz = count > 0
    gaps = np.abs(sum_acc[nz] / count[nz] - sum_conf[nz] / count[nz])
    return float(np.sum(count[nz] / n * gaps))


def calibration_table(
    y, p, *, classes: Sequence[str] | None = None, n_bins: int = 15
) -> pd.DataFrame:
    """One-vs-rest reliability table for every class (columns :data:`CALIBRATION_COLUMNS`).

    For class k: score ``s_i = p_ik``, outcome ``o_i = 1[y_i = k]``; one row per NON-EMPTY bin,
    ``bin`` numbered from 1, ``mean_confidence = mean(s)``, ``observed_frequency = mean(o)``,
    ``calibration_gap = observed_frequency - mean_confidence`` (positive = under-confident).
    Empty input gives an empty frame with every column.

    Raises ValueError: length mismatch; a label outside ``[0, K)`` (rows named); a class-name
    list whose length is not K (an empty list falls back to ``class_0..``); ``n_bins < 2``.
    """
    n_bins = _check_n_bins(n_bins)
    arr = np.asarray(p)
    p = normalize_probabilities(arr) if arr.size else np.zeros((0, arr.shape[1] if arr.ndim == 2 else 2))
    n, k = p.shape
    y = _check_labels(y, n, k)
    if classes is None or len(classes) == 0:
        names = [f"class_{i}" for i in range(k)]
    else:
        names = [str(c) for c in classes]
        if len(names) != k:
            raise ValueError(f"{len(names)} class names given for {k} probability columns")
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    if n == 0:
        return _empty_calibration_frame()
    # all classes at once: flat bin id = class * n_bins + bin
    b = bin_indices(p, n_bins)  # (n, k)
    flat = (np.arange(k)[None, :] * n_bins + b).ravel()
    outcome = (y[:, None] == np.arange(k)[None, :]).astype(np.float64).ravel()
    size = k * n_bins
    count = np.bincount(flat, minlength=size)
    s_sum = np.bincount(flat, weights=p.ravel(), minlength=size)
    o_sum = np.bincount(flat, weights=outcome, minlength=size)
    nz = np.flatnonzero(count)
    cls, bins = np.divmod(nz, n_bins)
    mean_conf = s_sum[nz] / count[nz]
    obs = o_sum[nz] / count[nz]
    return pd.DataFrame(
        {
            "class_index": cls.astype(np.int64),
            "class_name": pd.array([names[c] for c in cls], dtype="str") if cls.size else pd.array([], dtype="str"),
            "bin": (bins + 1).astype(np.int64),
            "bin_lower": edges[bins],
            "bin_upper": edges[bins + 1],
            "n": count[nz].astype(np.int64),
            "mean_confidence": mean_conf,
            "observed_frequency": obs,
            "calibration_gap": obs - mean_conf,
        },
        columns=list(CALIBRATION_COLUMNS),
    )


def _empty_calibration_frame() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "class_index": np.zeros(0, np.int64),
            "class_name": pd.array([], dtype="str"),
            "bin": np.zeros(0, np.int64),
            "bin_lower": np.zeros(0),
            "bin_upper": np.zeros(0),
            "n": np.zeros(0, np.int64),
            "mean_confidence": np.zeros(0),
            "observed_frequency": np.zeros(0),
            "calibration_gap": np.zeros(0),
        },
        columns=list(CALIBRATION_COLUMNS),
    )


# ---------------------------------------------------------------------------------------------
# scalar metrics


def negative_log_likelihood(y, p, *, eps: float = 1e-15) -> float:
    """Mean ``-ln p_{i, y_i}`` with p clipped to ``[eps, 1]`` (every class column counts).

    Equals ``sklearn.metrics.log_loss(y, p, labels=range(K))`` for normalised p.
    """
    p = normalize_probabilities(p)
    y = _check_labels(y, p.shape[0], p.shape[1])
    if p.shape[0] == 0:
        return float("nan")
    return float(-np.mean(np.log(np.clip(p[np.arange(p.shape[0]), y], eps, 1.0))))


def multiclass_brier(y, p) -> float:
    """Mean over rows of ``sum_k (p_ik - 1[y_i = k])^2`` (range 0-2, not halved); NaN if empty."""
    p = normalize_probabilities(p)
    y = _check_labels(y, p.shape[0], p.shape[1])
    if p.shape[0] == 0:
        return float("nan")
    onehot = np.zeros_like(p)
    onehot[np.arange(p.shape[0]), y] = 1.0
    return float(np.mean(np.sum((p - onehot) ** 2, axis=1)))


def confusion_counts(y, predicted, n_classes: int, *, normalize: bool = False) -> np.ndarray:
    """(K, K) confusion matrix over classes ``0..K-1`` (rows = true, columns = predicted).

    With ``normalize=True`` each row is divided by its true-class total; a class with no
    support keeps an all-zero row.
    """
    from sklearn.metrics import confusion_matrix  # deferred: scikit-learn only when scoring

    y = np.asarray(y)
    predicted = np.asarray(predicted)
    if y.shape != predicted.shape or y.ndim != 1:
        raise ValueError(f"labels {y.shape} and predictions {predicted.shape} must be 1-D of equal length")
    labels = np.arange(int(n_classes))
    if y.size == 0:
        return np.zeros((labels.size, labels.size), dtype=np.float64 if normalize else np.int64)
    return confusion_matrix(y, predicted, labels=labels, normalize="true" if normalize else None)


# ---------------------------------------------------------------------------------------------
# temperature scaling


def apply_temperature(decision, temperature: float) -> np.ndarray:
    """``softmax(decision / T)`` row-wise, float64 (n, K). ``T`` must be finite and > 0."""
    from scipy.special import softmax  # deferred: scipy only when calibrating

    t = float(temperature)
    if not math.isfinite(t) or t <= 0:
        raise ValueError(f"temperature must be finite and positive, got {temperature!r}")
    z = _check_logits(decision)
    return softmax(z / t, axis=1)


def _nll_at(z: np.ndarray, y: np.ndarray, t: float) -> float:
    from scipy.special import log_softmax  # deferred: scipy only when calibrating

    lp = log_softmax(z / t, axis=1)
    return float(-np.mean(lp[np.arange(z.shape[0]), y]))


def fit_temperature(y, decision) -> float:
    """Fit the softmax temperature minimising the mean NLL of ``y`` under ``softmax(decision/T)``.

    Optimised over ``u = ln T`` with scipy ``minimize_scalar(method="bounded")`` on
    ``[ln 0.05, ln 20]``; returns ``T`` in :data:`TEMPERATURE_BOUNDS`. Fit it on VALIDATION rows
    only; it uses every row it is given and nothing else.

    Parameters
    ----------
    y : int array (n,), column indices in ``[0, K)``
    decision : float array (n, K), finite decision scores (logits)

    Raises
    ------
    ValueError
        Fewer than 2 rows, fewer than 2 distinct labels, shape / label problems.
    RuntimeError
        The optimiser reports failure.
    """
    from scipy.optimize import minimize_scalar  # deferred: scipy only when calibrating

    z = _check_logits(decision)
    y = _check_labels(y, z.shape[0], z.shape[1])
    if z.shape[0] < 2:
        raise ValueError(f"a temperature needs at least 2 rows to fit, got {z.shape[0]}")
    if np.unique(y).size < 2:
        raise ValueError("a temperature needs at least 2 distinct labels to fit, got one class only")
    lo, hi = TEMPERATURE_BOUNDS
    res = minimize_scalar(
        lambda u: _nll_at(z, y, math.exp(u)), bounds=(math.log(lo), math.log(hi)), method="bounded"
    )
    if not res.success:
        raise UnscorableError(f"temperature fit did not converge: {res.message}")
    return float(min(max(math.exp(res.x), lo), hi))
