"""Evaluate a probe sweep: plan audit first, then per-(replicate, split) metrics, calibration, APD.

Spec: ``spec/evaluation.md`` C.3 (audit before any fit), C.4 (split report), C.5 (metrics,
calibration, prediction table), C.6 (distribution), ``spec/downstream.md`` §3-5.

:func:`evaluate_sweep` does, in this order:

1. builds the split plan on the client (:func:`cachescore.probe.plan.build_probe_plan`: the
   sweep's own validation and arrangement replay, no fit) and hashes it;
2. audits the plan (:func:`cachescore.probe.audit.audit_sweep`: tile / group / ood_centre /
   test_set_drift / replicate_seeds / conflicting_labels) and the embedding contents
   (:func:`cachescore.probe.audit.audit_content`: byte-identical rows in two roles). With
   ``fail_on_leakage=True`` (default) a failing audit raises
   :class:`~cachescore.probe.audit.LeakageError` and NO probe task is submitted;
3. fits and evaluates every (replicate, split): in-process, or -- with ``client`` -- as one Dask
   task per (replicate, split) that fits the probe AND evaluates it on the worker, returning
   small tables (metrics, confusion, calibration, per-centre metrics, predictions) and the
   outcome without its decision scores;
4. assembles the matrices, APD / nIPD, split reports and tables centrally, in (replicate, split)
   order, so the result is identical for any number of workers.

Roles: ``val``; ``in_domain`` (kind ``test_id``: the sweep's held-out tail); each extra test set
(kind ``test_ood``). The ``role`` column holds the matrix key, ``role_kind`` the kind.

Metrics per (replicate, split, role), from the probe's decision scores turned into probabilities
by softmax (a binary probe's score ``z`` as columns ``[0, z]``, i.e. ``predict_proba``):
balanced accuracy (checked to equal the sweep matrix entry bit for bit), accuracy, macro F1
(over the labels present in ``y`` or the predictions, zero division -> 0), NLL with every class
column, multiclass Brier (0-2, not halved), top-label ECE, mean confidence; confusion counts and
row-normalised fractions; the same scalar metrics per centre.

Temperature scaling is OFF by default (spec C.5). With ``temperature_scaling=True`` the
temperature is fitted on the VALIDATION rows of the same (replicate, split) only and applied to
every role; raw and calibrated values are reported side by side. It never changes the argmax, so
accuracy, balanced accuracy and macro F1 cannot move. When it is off, or cannot be fitted (fewer
than 2 validation rows, a single validation class), the calibrated columns equal the raw ones,
``temperature = 1.0`` and ``temperature_fitted = False`` (with a collected warning when a
requested fit failed).

Probabilities live in the TASK's class space ``0..n_classes-1`` (``n_classes`` = one more than
the largest label anywhere): a class the probe never saw gets probability 0.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import pandas as pd

from .._taskkeys import task_key
from .._threads import single_thread_blas
from . import calibration as cal
from .audit import (
    LeakageError,
    _as_parts,
    _error_message,
    audit_content,
    audit_sweep,
    combine_leakage,
)
from .distributed import gather_on_scattered, run_probe_job
from .fit import C_GRID, IN_DOMAIN, balanced_accuracy
from .plan import ProbePlan, _prepare
from .plan import plan_sha256 as _hash
from .reductions import apd as _apd
from .reductions import cramers_v as _cramers_v
from .reductions import nipd as _nipd

__all__ = [
    "METRIC_COLUMNS",
    "OutcomeEvaluation",
    "SweepEvaluation",
    "SweepIdentities",
    "SweepParams",
    "evaluate_outcome",
    "evaluate_run",
    "evaluate_sweep",
    "safe_class_columns",
    "sweep_arguments",
]

#: Scalar metrics computed for every (replicate, split, role) and every centre inside it.
SCALAR_METRICS = (
    "n",
    "balanced_accuracy",
    "accuracy",
    "f1_macro",
    "nll_raw",
    "nll_calibrated",
    "brier_raw",
    "brier_calibrated",
    "ece_raw",
    "ece_calibrated",
    "mean_confidence_raw",
    "mean_confidence_calibrated",
)

#: Columns of :attr:`SweepEvaluation.metrics`, in order.
METRIC_COLUMNS = (
    "replicate",
    "split",
    "seed",
    "role",
    "role_kind",
    "best_C",
    "calibration_method",
    "temperature",
    "temperature_fitted",
    *SCALAR_METRICS,
)

#: Columns of :attr:`SweepEvaluation.per_centre` (the centre first), in order.
PER_CENTRE_COLUMNS = ("centre", "replicate", "split", "role", "role_kind", *SCALAR_METRICS)

#: Columns of :attr:`SweepEvaluation.confusion` (long form, one row per non-zero cell);
#: ``fraction`` = count / true-class total of that role.
CONFUSION_COLUMNS = ("replicate", "split", "role", "true", "pred", "count", "fraction")

#: Leading columns of :attr:`SweepEvaluation.calibration`; then ``calibration.CALIBRATION_COLUMNS``.
CALIBRATION_KEY_COLUMNS = ("replicate", "split", "role", "stage")

#: Columns of :attr:`SweepEvaluation.probe_selection`.
SELECTION_COLUMNS = ("replicate", "split", "C_index", "C", "val_balanced_accuracy", "selected")

#: Leading columns of :attr:`SweepEvaluation.predictions`; then the identity columns
#: (``tile_key`` or ``tile_key_<i>``, ``<level>_id`` per protected level, ``centre``), then
#: ``raw_prob_<class>`` and ``prob_<class>`` per class.
PREDICTION_KEY_COLUMNS = ("replicate", "split", "role", "role_kind", "row", "true", "predicted",
                          "correct", "confidence")

#: Centre name given to rows whose centre is not known (an extra test set without confounders).
UNKNOWN_CENTRE = "unknown"


def role_kind(role: str) -> str:
    """``val`` -> ``val``; ``in_domain`` -> ``test_id``; any extra test set -> ``test_ood``."""

    return "val" if role == "val" else ("test_id" if role == IN_DOMAIN else "test_ood")


# ---------------------------------------------------------------------------------------------
# the evaluation record


@dataclass(frozen=True, kw_only=True, eq=False)
class SweepEvaluation:
    """Everything an evaluated sweep produced; written and read by :mod:`cachescore.probe.bundle`.

    Attributes
    ----------
    matrices : dict[str, ndarray (n_splits, iterations) float64]
        The sweep's balanced-accuracy matrices, ``"in_domain"`` first.
    replicate_seeds : tuple[int, ...]
    cramers_v : ndarray (n_splits,) float64 or None
        Cramér's V of each split's scheduled training composition (None when undefined).
    chance : float
        ``1 / n_cls``, the nIPD chance level (``n_cls`` = classes of the in-domain cell grid).
    n_classes : int
        Width of the probability space (largest label in the sweep or any test set, plus one).
    class_names : tuple[str, ...]
        One unique name per class index (default ``"0", "1", ...``).
    apd, nipd : dict[str, float | None]
        Per matrix; None (with a warning) when the reduction is undefined for that matrix.
    metrics : DataFrame (:data:`METRIC_COLUMNS`), one row per (replicate, split, role).
    per_centre : DataFrame (:data:`PER_CENTRE_COLUMNS`), one row per (.., role, centre).
    confusion : DataFrame (:data:`CONFUSION_COLUMNS`), long form, non-zero counts only.
    calibration : DataFrame, ``replicate, split, role, stage`` (``raw``, plus ``temperature``
        when scaling is on) then ``calibration.CALIBRATION_COLUMNS``.
    probe_selection : DataFrame (:data:`SELECTION_COLUMNS`), validation score of every C.
    predictions : DataFrame, one row per held-out row per (replicate, split, role).
    split_reports : list[dict], one per (replicate, split) (spec C.4), JSON-safe.
    plan_sha256 : str or None
        Hash of the audited split plan (None for a run evaluated after the fact).
    audit : dict, the plan leakage-audit report.
    content_audit : dict or None, this encoder's content audit (None when it did not run).
    parameters : dict, JSON-safe sweep parameters (schedule, seeds, n_bins, settings, ...).
    warnings : tuple[str, ...]
    """

    matrices: dict[str, np.ndarray]
    replicate_seeds: tuple[int, ...]
    cramers_v: np.ndarray | None
    chance: float
    n_classes: int
    class_names: tuple[str, ...]
    apd: dict[str, float | None]
    nipd: dict[str, float | None]
    metrics: pd.DataFrame
    per_centre: pd.DataFrame
    confusion: pd.DataFrame
    calibration: pd.DataFrame
    probe_selection: pd.DataFrame
    predictions: pd.DataFrame
    split_reports: list
    plan_sha256: str | None
    audit: dict
    content_audit: dict | None
    parameters: dict
    warnings: tuple[str, ...] = field(default=())

    @property
    def leakage(self) -> dict:
        """The combined leakage record (plan + content); ``passed`` is never vacuously True."""
        return combine_leakage(self.audit, self.content_audit)

    def equals(self, other: SweepEvaluation) -> bool:
        """Exact equality of every field (arrays and frames compared value for value)."""
        if not isinstance(other, SweepEvaluation):
            return False
        if list(self.matrices) != list(other.matrices):
            return False
        if not all(np.array_equal(self.matrices[k], other.matrices[k]) for k in self.matrices):
            return False
        if (self.cramers_v is None) != (other.cramers_v is None):
            return False
        if self.cramers_v is not None and not np.array_equal(self.cramers_v, other.cramers_v):
            return False
        for name in FRAME_FIELDS:
            a, b = getattr(self, name), getattr(other, name)
            if not (list(a.columns) == list(b.columns) and a.shape == b.shape and a.equals(b)):
                return False

        def canon(x):
            return json.dumps(x, sort_keys=True, allow_nan=True)

        return (
            tuple(self.replicate_seeds) == tuple(other.replicate_seeds)
            and self.chance == other.chance
            and self.n_classes == other.n_classes
            and tuple(self.class_names) == tuple(other.class_names)
            and self.plan_sha256 == other.plan_sha256
            and canon(self.apd) == canon(other.apd)
            and canon(self.nipd) == canon(other.nipd)
            and canon(self.audit) == canon(other.audit)
            and canon(self.content_audit) == canon(other.content_audit)
            and canon(self.split_reports) == canon(other.split_reports)
            and canon(self.parameters) == canon(other.parameters)
            and tuple(self.warnings) == tuple(other.warnings)
        )


#: DataFrame fields of :class:`SweepEvaluation` (bundle file stems).
FRAME_FIELDS = ("metrics", "per_centre", "confusion", "calibration", "probe_selection", "predictions")


# ---------------------------------------------------------------------------------------------
# class names


def safe_class_columns(names: Sequence[Any]) -> list[str]:
    """Column-safe, unique versions of class names (spacr's rule, spec A.6).

    Each run of characters outside ``[A-Za-z0-9_.-]`` becomes ``_``, leading / trailing ``_``
    are stripped, an empty result becomes ``class_<i>``, and collisions get ``_2``, ``_3``, ...
    (``"A B", "A/B", ""`` -> ``A_B, A_B_2, class_2``). Duplicate class NAMES are refused.
    """
    raw = [str(n) for n in names]
    dup = pd.Series(raw)[pd.Series(raw).duplicated()].tolist()
    if dup:
        raise ValueError(f"class names must be unique; {sorted(set(dup))} repeat")
    out: list[str] = []
    seen: set[str] = set()
    for i, n in enumerate(raw):
        base = re.sub(r"[^A-Za-z0-9_.\-]+", "_", n).strip("_") or f"class_{i}"
        cand, k = base, 2
        while cand in seen:
            cand, k = f"{base}_{k}", k + 1
        seen.add(cand)
        out.append(cand)
    return out


# ---------------------------------------------------------------------------------------------
# scalar metrics


def _f1_macro(cm: np.ndarray) -> float:
    """Macro F1 over the labels present in y or the predictions (zero division -> 0)."""
    tp = np.diag(cm).astype(np.float64)
    support = cm.sum(axis=1)
    predicted = cm.sum(axis=0)
    present = (support + predicted) > 0
    if not present.any():
        return float("nan")
    denom = support + predicted  # 2 tp / (2 tp + fp + fn)
    f1 = np.divide(2.0 * tp, denom, out=np.zeros_like(tp), where=denom > 0)
    return float(np.mean(f1[present]))


def _scalar_metrics(y, pred, p_raw, p_cal, n_classes: int, n_bins: int) -> tuple[dict, np.ndarray]:

    n = int(y.size)
    cm = cal.confusion_counts(y, pred, n_classes)
    if n == 0:
        nan = float("nan")
        return {"n": 0, **{k: nan for k in SCALAR_METRICS[1:]}}, cm
    return {
        "n": n,
        "balanced_accuracy": float(balanced_accuracy(y, pred)),
        "accuracy": float(np.mean(pred == y)),
        "f1_macro": _f1_macro(cm),
        "nll_raw": cal.negative_log_likelihood(y, p_raw),
        "nll_calibrated": cal.negative_log_likelihood(y, p_cal),
        "brier_raw": cal.multiclass_brier(y, p_raw),
        "brier_calibrated": cal.multiclass_brier(y, p_cal),
        "ece_raw": cal.expected_calibration_error(y, p_raw, n_bins=n_bins),
        "ece_calibrated": cal.expected_calibration_error(y, p_cal, n_bins=n_bins),
        "mean_confidence_raw": float(p_raw.max(axis=1).mean()),
        "mean_confidence_calibrated": float(p_cal.max(axis=1).mean()),
    }, cm


def _expand_to_task(prob: np.ndarray, classes: np.ndarray, n_classes: int) -> np.ndarray:
    out = np.zeros((prob.shape[0], n_classes), dtype=np.float64)
    out[:, classes] = prob
    return out


# ---------------------------------------------------------------------------------------------
# one (replicate, split)


@dataclass(frozen=True, kw_only=True, eq=False)
class OutcomeEvaluation:
    """Small tables of one evaluated (replicate, split); what a worker task returns.

    ``metrics`` and ``per_centre`` are lists of dicts (per-centre rows carry ``centre_code``,
    -1 = unknown); ``predictions`` has :data:`PREDICTION_KEY_COLUMNS` plus ``centre_code`` and
    ``raw_prob_<k>`` / ``prob_<k>`` by class INDEX (renamed centrally).
    """

    metrics: list
    per_centre: list
    confusion: pd.DataFrame
    calibration: pd.DataFrame
    predictions: pd.DataFrame
    warnings: list


def evaluate_outcome(
    outcome: Any,
    *,
    n_classes: int,
    n_bins: int = 15,
    temperature_scaling: bool = False,
    row_centres: np.ndarray | None = None,
    test_centres: Mapping[str, np.ndarray] | None = None,
) -> OutcomeEvaluation:
    """Metrics of one kept-predictions ``ProbeOutcome``.

    Parameters
    ----------
    outcome : ``ProbeOutcome`` with ``val_decision`` / ``test_decision`` (keep_predictions).
    n_classes : width of the task's class space.
    n_bins : calibration bins (>= 2).
    temperature_scaling : fit T on this outcome's validation rows and apply it to every role.
    row_centres : int codes (n_rows,) of the in-domain rows' centres (-1 = unknown), optional.
    test_centres : ``{test set: int codes (n,)}``, optional (missing -> unknown).

    Raises
    ------
    ValueError
        The outcome carries no predictions.
    RuntimeError
        A role's balanced accuracy from the kept scores differs from the sweep's score.
    """
    if outcome.val_decision is None or outcome.test_decision is None:
        raise ValueError(
            f"replicate {outcome.replicate}, split {outcome.split}: outcome carries no decision "
            "scores; run the sweep with keep_predictions=True"
        )

    classes = np.asarray(outcome.classes, dtype=np.int64)
    r, s = int(outcome.replicate), int(outcome.split)
    notes: list[str] = []

    val_y = np.asarray(outcome.val_labels)
    temperature, fitted = 1.0, False
    if temperature_scaling:
        col = np.clip(np.searchsorted(classes, val_y), 0, classes.size - 1)
        known = classes[col] == val_y
        try:
            if not known.all():
                raise ValueError(
                    f"{int((~known).sum())} validation label(s) are classes the probe never saw")
            temperature = cal.fit_temperature(col, outcome.val_decision)
            fitted = True
        except (ValueError, RuntimeError) as exc:
            notes.append(f"replicate {r}, split {s}: temperature not fitted ({exc}); raw "
                         "probabilities kept, T = 1.0")

    roles: list[tuple[str, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]] = [
        ("val", outcome.val_decision, val_y, np.asarray(outcome.val_rows, np.int64),
         None if row_centres is None else row_centres[outcome.val_rows]),
    ]
    for name, dec in outcome.test_decision.items():
        ty = np.asarray(outcome.test_labels[name])
        if name == IN_DOMAIN:
            rows = np.asarray(outcome.test_rows, np.int64)
            cent = None if row_centres is None else row_centres[rows]
        else:
            rows = np.arange(ty.shape[0], dtype=np.int64)
            cent = (test_centres or {}).get(name)
        roles.append((name, dec, ty, rows, cent))

    metric_rows, centre_rows, conf_parts, cal_parts, pred_parts = [], [], [], [], []
    for role, dec, y, rows, cent in roles:
        kind = role_kind(role)
        dec = np.asarray(dec, dtype=np.float64)
        y = y.astype(np.int64, copy=False)
        n = y.size
        if dec.shape[0] != n or rows.shape[0] != n:
            raise ValueError(
                f"replicate {r}, split {s}, {role}: {dec.shape[0]} decision rows, {n} labels and "
                f"{rows.shape[0]} row indices must agree"
            )
        pred = classes[np.argmax(dec, axis=1)] if n else np.zeros(0, np.int64)
        p_raw = _expand_to_task(cal.decision_to_probabilities(dec), classes, n_classes) if n else \
            np.zeros((0, n_classes))
        p_cal = (_expand_to_task(cal.apply_temperature(dec, temperature), classes, n_classes)
                 if fitted and n else p_raw)
        values, cm = _scalar_metrics(y, pred, p_raw, p_cal, n_classes, n_bins)
        if role != "val":
            expected = outcome.scores[role]
            if not (values["balanced_accuracy"] == expected):
                raise RuntimeError(
                    f"replicate {r}, split {s}, {role}: balanced accuracy "
                    f"{values['balanced_accuracy']!r} from the kept decision scores differs from "
                    f"the sweep's {expected!r}"
                )
        metric_rows.append({
            "replicate": r, "split": s, "seed": int(outcome.seed), "role": role, "role_kind": kind,
            "best_C": float(outcome.best_C),
            "calibration_method": "temperature" if temperature_scaling else "none",
            "temperature": float(temperature), "temperature_fitted": bool(fitted), **values,
        })
        cent = np.full(n, -1, np.int64) if cent is None else np.asarray(cent, np.int64)
        for code in np.unique(cent):
            m = cent == code
            cv, _ = _scalar_metrics(y[m], pred[m], p_raw[m], p_cal[m], n_classes, n_bins)
            centre_rows.append({"centre_code": int(code), "replicate": r, "split": s, "role": role,
                                "role_kind": kind, **cv})
        t_idx, p_idx = np.nonzero(cm)
        support = cm.sum(axis=1)
        conf_parts.append(pd.DataFrame({
            "replicate": np.full(t_idx.size, r, np.int64), "split": np.full(t_idx.size, s, np.int64),
            "role": pd.array([role] * t_idx.size, dtype="str"),
            "true": t_idx.astype(np.int64), "pred": p_idx.astype(np.int64),
            "count": cm[t_idx, p_idx].astype(np.int64),
            "fraction": cm[t_idx, p_idx] / support[t_idx],
        }))
        stages = [("raw", p_raw)] + ([("temperature", p_cal)] if temperature_scaling else [])
        for stage, p in stages:
            tab = cal.calibration_table(y, p, n_bins=n_bins)
            key = pd.DataFrame({
                "replicate": np.full(len(tab), r, np.int64), "split": np.full(len(tab), s, np.int64),
                "role": pd.array([role] * len(tab), dtype="str"),
                "stage": pd.array([stage] * len(tab), dtype="str"),
            })
            cal_parts.append(pd.concat([key, tab.reset_index(drop=True)], axis=1))
        cols = {
            "replicate": np.full(n, r, np.int64), "split": np.full(n, s, np.int64),
            "role": pd.array([role] * n, dtype="str"), "role_kind": pd.array([kind] * n, dtype="str"),
            "row": rows.astype(np.int64), "true": y, "predicted": pred.astype(np.int64),
            "correct": pred == y, "confidence": p_cal.max(axis=1) if n else np.zeros(0),
            "centre_code": cent,
        }
        for k in range(n_classes):
            cols[f"raw_prob_{k}"] = p_raw[:, k]
        for k in range(n_classes):
            cols[f"prob_{k}"] = p_cal[:, k]
        pred_parts.append(pd.DataFrame(cols))
    return OutcomeEvaluation(
        metrics=metric_rows, per_centre=centre_rows,
        confusion=pd.concat(conf_parts, ignore_index=True),
        calibration=pd.concat(cal_parts, ignore_index=True),
        predictions=pd.concat(pred_parts, ignore_index=True), warnings=notes,
    )


def _strip(outcome):
    """The outcome without its (large) decision scores and labels."""
    return replace(outcome, val_decision=None, test_decision=None, val_labels=None, test_labels=None)


def _fit_and_evaluate(job, features, labels, row_centres, names, eval_kw, *flat):
    """One Dask task: fit the (replicate, split) probe and evaluate it here, on the worker.

    ``flat`` = ``(X_0, y_0, ..., X_{m-1}, y_{m-1}, centres_0, ..., centres_{m-1})`` in ``names``
    order (a centre array may be None). BLAS is pinned to one thread for the whole task.
    """

    m = len(names)
    tests = flat[: 2 * m]
    centres = {name: flat[2 * m + k] for k, name in enumerate(names) if flat[2 * m + k] is not None}
    with single_thread_blas():
        outcome = run_probe_job(job, features, labels, names, True, *tests)
        ev = evaluate_outcome(outcome, row_centres=row_centres, test_centres=centres, **eval_kw)
    return _strip(outcome), ev


# ---------------------------------------------------------------------------------------------
# identities, centres, split reports


def _centre_codes(confounders, test_set_confounders, test_sizes):
    """Joint integer codes of every centre value; ``(row_codes, {test set: codes}, names)``."""
    parts = [np.asarray(confounders, dtype=object)]
    names_ts = []
    for ts, n in test_sizes.items():
        v = (test_set_confounders or {}).get(ts)
        if v is not None:
            v = np.asarray(v, dtype=object)
            if v.shape != (n,):
                raise ValueError(f"test set '{ts}': confounders must have one entry per row ({n}), "
                                 f"got shape {v.shape}")
            parts.append(v)
            names_ts.append(ts)
    codes, uniques = pd.factorize(pd.Series(np.concatenate(parts)), sort=False)
    codes = codes.astype(np.int64)
    n0 = parts[0].shape[0]
    out, o = {}, n0
    for ts, p in zip(names_ts, parts[1:]):
        out[ts] = codes[o:o + p.shape[0]]
        o += p.shape[0]
    names = [str(u.item() if isinstance(u, np.generic) else u) for u in uniques]
    return codes[:n0], out, names


def _identity_columns(frame: pd.DataFrame, groups, tile_ids, test_set_groups,
                      centre_names: list[str]) -> pd.DataFrame:
    """Add tile key, protected-group ids and centre name to a predictions frame (vectorised)."""

    n = len(frame)
    in_dom = frame["role_kind"].isin(["val", "test_id"]).to_numpy()
    rows = frame["row"].to_numpy()
    roles = frame["role"].to_numpy(dtype=object)
    extra = {}

    def as_str(values) -> np.ndarray:
        # ids -> str once per distinct value (factorised), then gathered by code: no per-row loop
        codes, uniq = pd.factorize(pd.Series(np.asarray(values, dtype=object), copy=False), sort=False)
        names = np.asarray([str(u.item() if isinstance(u, np.generic) else u) for u in uniq] + [None],
                           dtype=object)
        return names[np.where(codes < 0, len(uniq), codes)]

    def fill(col_name, in_values, test_getter):
        out = np.full(n, None, dtype=object)
        out[in_dom] = as_str(in_values)[rows[in_dom]]
        for ts in pd.unique(roles[~in_dom]):
            m = roles == ts
            vals = test_getter(ts)
            if vals is not None:
                out[m] = as_str(vals)[rows[m]]
        extra[col_name] = pd.array(out, dtype="str")

    parts = _as_parts(tile_ids)
    for i, part in enumerate(parts):
        cname = "tile_key" if len(parts) == 1 else f"tile_key_{i}"

        def get_tile(ts, i=i):
            tg = (test_set_groups or {}).get(ts) or {}
            if "tile" not in tg:
                return None
            return _as_parts(tg["tile"])[i]
        fill(cname, part, get_tile)
    for level, ids in groups.items():
        fill(f"{level}_id", ids, lambda ts, level=level: ((test_set_groups or {}).get(ts) or {}).get(level))
    codes = frame["centre_code"].to_numpy()
    names = np.asarray(centre_names + [UNKNOWN_CENTRE], dtype=object)
    extra["centre"] = pd.array(names[np.where(codes < 0, len(centre_names), codes)], dtype="str") \
        if n else pd.array([], dtype="str")
    keys = frame[list(PREDICTION_KEY_COLUMNS)]
    probs = frame[[c for c in frame.columns if c.startswith(("raw_prob_", "prob_"))]]
    return pd.concat([keys, pd.DataFrame(extra, index=frame.index), probs], axis=1)


def _cramers_v_table(t: np.ndarray) -> float | None:
    t = np.asarray(t, dtype=np.float64)
    n = t.sum()
    rows, cols = t.sum(axis=1), t.sum(axis=0)
    if n <= 0 or min(t.shape) < 2 or (rows == 0).any() or (cols == 0).any():
        return None
    e = np.outer(rows, cols) / n
    chi2 = float(np.sum((t - e) ** 2 / e))
    return math.sqrt(chi2 / (n * (min(t.shape) - 1)))


def split_reports(plan, *, confounders, labels, groups: Mapping[str, Any], schedule,
                  rows_per_slide: int, validation_fraction=None, requested_v=None,
                  test_set_groups=None, test_set_labels=None) -> list[dict]:
    """One split report per (replicate, split) of ``plan`` (spec C.4).

    Each report: replicate, split, seed; ``requested_bias`` (Cramér's V of the scheduled
    training slide counts, or None) and ``realised_bias`` (Cramér's V of the realised train
    tile counts, centre x class; None when undefined) plus ``realised_bias_groups`` (the same on
    distinct-group counts of the first protected level); ``rows`` and ``groups`` (per level)
    per role, ``test_ood`` sets included; ``train_contingency`` = ``{"centres", "classes",
    "tiles": [[...]], "groups": {level: [[...]]}}``; and the provenance ``rule``.
    Counts add up: the role row counts are the plan's index counts.
    """
    conf = np.asarray(confounders, dtype=np.int64)
    lab = np.asarray(labels, dtype=np.int64)
    n_conf, n_cls = int(conf.max()) + 1, int(lab.max()) + 1
    cell = conf * n_cls + lab
    gcodes = {lvl: pd.factorize(pd.Series(np.asarray(v, dtype=object)))[0].astype(np.int64)
              for lvl, v in groups.items()}
    first_level = next(iter(groups))
    rule = (
        "PathoROB confounder-biased sweep: every (centre, class) cell's slides (rows_per_slide="
        f"{int(rows_per_slide)} consecutive rows) are reordered per replicate by its seed "
        "(arrangement carries over between replicates); train = the first 'take' rows of each "
        "scheduled cell, val = the next "
        + ("take/max_train_slides" if validation_fraction is None else
           f"round({float(validation_fraction)} * take)")
        + " rows, test_id = every cell's rows from the first held-out slide on (identical at every "
        "split of a replicate); each test_ood set is scored whole; whole slides only, so no "
        "slide straddles roles when rows_per_slide matches the slide size"
    )
    reports = []
    for job in plan.jobs:
        r, s = int(job.replicate), int(job.split)
        roles = {"train": np.asarray(job.train_rows, np.int64), "val": np.asarray(job.val_rows, np.int64),
                 "test_id": np.asarray(job.test_rows, np.int64)}
        tiles = np.bincount(cell[roles["train"]], minlength=n_conf * n_cls).reshape(n_conf, n_cls)
        group_tabs = {}
        for lvl, gc in gcodes.items():
            pairs = np.unique(np.stack([gc[roles["train"]], cell[roles["train"]]], axis=1), axis=0) \
                if roles["train"].size else np.zeros((0, 2), np.int64)
            group_tabs[lvl] = np.bincount(pairs[:, 1], minlength=n_conf * n_cls).reshape(n_conf, n_cls)
        rows_per_role = {k: int(v.size) for k, v in roles.items()}
        groups_per_role = {k: {lvl: int(np.unique(gc[v]).size) for lvl, gc in gcodes.items()}
                           for k, v in roles.items()}
        for ts, size in plan.test_set_sizes.items():
            rows_per_role[ts] = int(size)
            tg = (test_set_groups or {}).get(ts) or {}
            groups_per_role[ts] = {lvl: (int(pd.unique(pd.Series(np.asarray(tg[lvl], dtype=object))).size)
                                         if lvl in tg else None) for lvl in gcodes}
        req = None if requested_v is None else requested_v[s]
        reports.append({
            "replicate": r, "split": s, "seed": int(job.seed),
            "requested_bias": None if req is None or not math.isfinite(req) else float(req),
            "realised_bias": _cramers_v_table(tiles),
            "realised_bias_groups": _cramers_v_table(group_tabs[first_level]),
            "bias_measure": "Cramér's V of the centre x class training table",
            "rows": rows_per_role,
            "groups": groups_per_role,
            "train_contingency": {
                "centres": list(range(n_conf)), "classes": list(range(n_cls)),
                "tiles": tiles.tolist(), "groups": {lvl: t.tolist() for lvl, t in group_tabs.items()},
            },
            "grouped": True,
            "rule": rule,
        })
    return reports


# ---------------------------------------------------------------------------------------------
# whole sweep


def _jsonable_schedule(schedule) -> list:
    return [[[[int(i), int(j), int(t)] for i, j, t in split_map], int(mts)] for split_map, mts in schedule]


def _safe_reduction(fn: Callable[[], float], what: str, notes: list[str]) -> float | None:
    try:
        return float(fn())
    except ValueError as exc:
        notes.append(f"{what} undefined: {exc}")
        return None


def _n_classes(labels, test_sets) -> int:
    max_label = int(np.max(labels)) if np.size(labels) else -1
    for _, (_, ty) in (test_sets or {}).items():
        ty = np.asarray(ty)
        if ty.size:
            max_label = max(max_label, int(ty.max()))
    return max_label + 1


def _run_tasks(jobs, features, labels, row_centres, named_tests, test_centres, eval_kw, client):
    names = list(named_tests)
    flat = [a for name in names for a in named_tests[name]]
    flat += [test_centres.get(name) for name in names]
    if client is None:
        return [_fit_and_evaluate(job, features, labels, row_centres, names, eval_kw, *flat)
                for job in jobs]
    arrays = [features, labels, row_centres, *[a for a in flat if a is not None]]

    def submit(held):
        x_f, y_f, c_f, *rest = held
        it = iter(rest)
        flat_f = [None if a is None else next(it) for a in flat]
        return [client.submit(_fit_and_evaluate, job, x_f, y_f, c_f, names, eval_kw, *flat_f,
                              key=task_key("probe_evaluate", f"r{job.replicate}", f"s{job.split}"), pure=False)
                for job in jobs]

    return gather_on_scattered(client, arrays, submit)


@dataclass(frozen=True, kw_only=True)
class SweepParams:
    """What a sweep evaluation is asked to do: everything but the data (``spec/downstream.md`` §3,
    ``spec/evaluation.md``). Frozen; ``schedule`` is required.

    ``schedule``, ``rows_per_slide``, ``iterations``, ``seed``, ``validation_fraction``,
    ``arrange_slides``: as the sweep (the matrices equal croma's). ``n_bins``: calibration bins
    (>= 2). ``temperature_scaling``: fit T on validation rows (spec C.5). ``fail_on_leakage``:
    raise ``LeakageError`` before any probe task when an audit fails (False: record and run).
    ``content_audit``: ``"critical"`` or ``"warning"`` (an explicit, recorded relaxation).
    ``class_names``: one unique name per class index (default the indices as text).
    ``protected_level``: the level of the identities' ``groups`` the split protects (default: the
    coarsest of patient > case > slide given; coarser overlaps are warnings, spec C.3 rule 5).
    """

    schedule: Sequence
    rows_per_slide: int = 1
    iterations: int = 20
    seed: int = 1000
    validation_fraction: float | None = None
    arrange_slides: Callable | None = None
    n_bins: int = 15
    temperature_scaling: bool = False
    fail_on_leakage: bool = True
    content_audit: str = "critical"
    class_names: Sequence[Any] | None = None
    protected_level: str | None = None

    def plan_kwargs(self) -> dict:
        """The keywords that fix the split plan (and its sha256): :func:`cachescore.probe.plan._prepare`'s."""
        return {"schedule": self.schedule, "rows_per_slide": self.rows_per_slide, "iterations": self.iterations,
                "seed": self.seed, "validation_fraction": self.validation_fraction,
                "arrange_slides": self.arrange_slides}


@dataclass(frozen=True, kw_only=True)
class SweepIdentities:
    """Who every row is, for the leakage audits and the per-group reports.

    ``groups``: ``{level: ids (n_rows,)}`` protected group ids per embedding row (e.g. slide,
    patient); level names are free but ``row``/``tile`` and audit check names are reserved.
    ``tile_ids``: ids (n_rows,) or a tuple of arrays (a composite tile key, e.g. (slide, tile)).
    ``test_set_groups``: ``{test set: {level: ids}}``, every level of ``groups`` for each test set
    given (optionally ``"tile"``). ``test_set_confounders``: ``{test set: centres}`` in the
    confounders' value space; a centre seen in train / val / in-domain test is a leak
    (``ood_centre``), and the per-centre key of the reports.
    """

    groups: Mapping[str, np.ndarray]
    tile_ids: Any
    test_set_groups: Mapping[str, Mapping[str, np.ndarray]] | None = None
    test_set_confounders: Mapping[str, np.ndarray] | None = None


_PARAM_KEYS = tuple(f.name for f in fields(SweepParams))
_IDENTITY_KEYS = tuple(f.name for f in fields(SweepIdentities))


def sweep_arguments(**flat) -> dict:
    """``{"params": SweepParams, "identities": SweepIdentities, "test_sets": ...}`` from the flat
    keywords of both objects plus ``test_sets`` (a convenience for callers holding a flat mapping,
    e.g. a job's ``[probe]`` table). Raises ``TypeError`` naming unknown keywords."""
    unknown = sorted(set(flat) - set(_PARAM_KEYS) - set(_IDENTITY_KEYS) - {"test_sets"})
    if unknown:
        raise TypeError(f"unknown sweep argument(s) {unknown}; known: {sorted(_PARAM_KEYS + _IDENTITY_KEYS)} "
                        "and test_sets")
    return {"params": SweepParams(**{k: flat[k] for k in _PARAM_KEYS if k in flat}),
            "identities": SweepIdentities(**{k: flat[k] for k in _IDENTITY_KEYS if k in flat}),
            "test_sets": flat.get("test_sets")}


def _audit_plan(plan, p: SweepParams, ids: SweepIdentities, lab, conf) -> dict:
    """The split plan's leakage audit (identities only, no embedding content)."""
    return audit_sweep(
        plan.jobs, n_rows=plan.n_rows, groups=ids.groups, tile_ids=ids.tile_ids, labels=lab,
        confounders=conf, test_set_sizes=plan.test_set_sizes, test_set_groups=ids.test_set_groups,
        test_set_confounders=ids.test_set_confounders, raise_on_leakage=False, protected_level=p.protected_level,
    )


def check_sweep_plan(
    confounders,
    labels,
    *,
    params: SweepParams,
    identities: SweepIdentities,
    test_sets: Mapping[str, tuple[Any, Any]] | None = None,
) -> tuple[ProbePlan, dict]:
    """What :func:`evaluate_sweep` checks before any probe exists, without embeddings or fitting
    (``cachescore validate`` and ``run``'s pre-flight): the sweep's validation catalogue on the
    split plan (cells, slides per cell, test rows, ...) and the identity leakage audit (raising like
    ``evaluate_sweep`` with ``fail_on_leakage``). ``test_sets`` values are ``(any array with one row
    per test row, labels)``. Returns ``(plan, plan_audit)``. Raises ``ValueError`` /
    :class:`LeakageError`. The content audit (duplicate embeddings) needs the embeddings and runs
    only in :func:`evaluate_sweep`."""
    p = params
    cal._check_n_bins(p.n_bins)
    n = len(np.asarray(labels))
    placeholder = np.zeros((n, 1), dtype=np.float32)
    tests = {k: (np.zeros((len(np.asarray(y)), 1), dtype=np.float32), y) for k, (_, y) in (test_sets or {}).items()}
    plan, _, lab, named_tests = _prepare(placeholder, confounders, labels, test_sets=tests or None, **p.plan_kwargs())
    n_classes = _n_classes(lab, named_tests)
    if p.class_names is not None and len(p.class_names) != n_classes:
        raise ValueError(f"{len(p.class_names)} class names given for {n_classes} classes")
    plan_audit = _audit_plan(plan, p, identities, lab, np.asarray(confounders))
    if p.fail_on_leakage and plan_audit["passed"] is not True:
        raise LeakageError(_error_message(plan_audit["breaches"]), plan_audit["breaches"], plan_audit)
    return plan, plan_audit


def evaluate_sweep(
    embeddings,
    confounders,
    labels,
    *,
    params: SweepParams,
    identities: SweepIdentities,
    test_sets: Mapping[str, tuple[Any, Any]] | None = None,
    client=None,
    prepared=None,
) -> SweepEvaluation:
    """Build and audit the split plan, then fit and evaluate every probe.

    Parameters
    ----------
    embeddings, confounders, labels
        The in-domain rows (``spec/downstream.md`` §3): ``(n_rows, d)`` floats, ``(n_rows,)``
        confounder and class indices.
    params : SweepParams
        The sweep's parameters (schedule, replicates, calibration, audit severities).
    identities : SweepIdentities
        Group and tile ids of every row (and of the test sets) for the audits.
    test_sets : ``{name: (embeddings, labels)}``, extra test sets scored by every probe.
    client : distributed.Client, optional
        One task per (replicate, split) that fits AND evaluates on the worker.
    prepared : the ``(plan, features, labels, test sets)`` tuple of
        :func:`cachescore.probe.plan._prepare` when the caller already built the plan (used by
        :func:`cachescore.probe.bundle.run_encoder_evaluation` to hash before deciding to run).

    Returns
    -------
    SweepEvaluation (``plan_sha256`` set; ``audit`` and ``content_audit`` recorded).

    Raises
    ------
    LeakageError
        A row in two roles (always), or any critical audit finding with ``fail_on_leakage``;
        raised before any probe is fitted.
    ValueError
        Invalid inputs (sweep catalogue, identities, n_bins, class names).
    """

    p, ids = params, identities
    schedule, rows_per_slide, validation_fraction = p.schedule, p.rows_per_slide, p.validation_fraction
    groups, tile_ids = ids.groups, ids.tile_ids
    test_set_groups, test_set_confounders = ids.test_set_groups, ids.test_set_confounders
    n_bins = cal._check_n_bins(p.n_bins)
    if prepared is None:
        prepared = _prepare(embeddings, confounders, labels, test_sets=test_sets, **p.plan_kwargs())
    plan, features, lab, named_tests = prepared
    conf = np.asarray(confounders)
    n_classes = _n_classes(lab, named_tests)
    names = tuple(str(k) for k in range(n_classes)) if p.class_names is None else tuple(map(str, p.class_names))
    if len(names) != n_classes:
        raise ValueError(f"{len(names)} class names given for {n_classes} classes")
    prob_cols = safe_class_columns(names)

    # -- audits on the client, before any task exists
    plan_audit = _audit_plan(plan, p, ids, lab, conf)
    content = audit_content(features, plan.jobs, test_sets={k: v[0] for k, v in named_tests.items()},
                            severity=p.content_audit)
    leak = combine_leakage(plan_audit, content)
    if p.fail_on_leakage and leak["passed"] is not True:
        breaches = plan_audit["breaches"] + content["breaches"]
        raise LeakageError(_error_message(breaches), breaches, leak)

    row_centres, test_centres, centre_names = _centre_codes(conf, test_set_confounders, plan.test_set_sizes)
    eval_kw = {"n_classes": n_classes, "n_bins": n_bins, "temperature_scaling": bool(p.temperature_scaling)}
    results = _run_tasks(plan.jobs, features, lab, row_centres, named_tests, test_centres, eval_kw, client)


    notes: list[str] = list(plan_audit["warnings"]) + list(content["warnings"])
    requested_v = None
    n_conf = int(conf.max()) + 1 if conf.size else 0
    try:
        requested_v = _cramers_v(list(schedule), rows_per_slide=rows_per_slide,
                                 shape=(n_conf, int(lab.max()) + 1))
    except ValueError as exc:
        notes.append(f"Cramér's V undefined: {exc}")
    reports = split_reports(plan, confounders=conf, labels=lab, groups=groups, schedule=schedule,
                            rows_per_slide=rows_per_slide, validation_fraction=validation_fraction,
                            requested_v=requested_v, test_set_groups=test_set_groups)
    return _assemble(
        results, plan_sha256=plan.sha256, replicate_seeds=plan.replicate_seeds,
        matrix_names=["in_domain", *named_tests], n_splits=plan.n_splits, lab=lab,
        n_classes=n_classes, class_names=names, prob_cols=prob_cols, centre_names=centre_names,
        groups=groups, tile_ids=tile_ids, test_set_groups=test_set_groups, vv=requested_v,
        audit=plan_audit, content=content, split_reports_=reports, notes=notes,
        params={
            "schedule": _jsonable_schedule(schedule), "rows_per_slide": int(rows_per_slide),
            "n_bins": int(n_bins), "test_sets": list(named_tests), "group_levels": list(groups),
            "protected_level": plan_audit["protected_level"], "iterations": int(p.iterations), "seed": int(p.seed),
            "validation_fraction": None if validation_fraction is None else float(validation_fraction),
            "arrange_slides": None if p.arrange_slides is None else getattr(
                p.arrange_slides, "__qualname__", type(p.arrange_slides).__name__),
            "temperature_scaling": bool(p.temperature_scaling), "fail_on_leakage": bool(p.fail_on_leakage),
            "content_audit": p.content_audit,
        },
    )


def _assemble(results, *, plan_sha256, replicate_seeds, matrix_names, n_splits, lab, n_classes,
              class_names, prob_cols, centre_names, groups, tile_ids, test_set_groups, vv, audit,
              content, split_reports_, notes, params) -> SweepEvaluation:

    results = sorted(results, key=lambda t: (t[0].replicate, t[0].split))
    iterations = len(replicate_seeds)
    matrices = {k: np.full((n_splits, iterations), math.nan) for k in matrix_names}
    metric_rows, centre_rows, conf_parts, cal_parts, pred_parts, sel_parts = [], [], [], [], [], []
    for oc, ev in results:
        for name in matrix_names:
            matrices[name][oc.split, oc.replicate] = oc.scores[name]
        metric_rows.extend(ev.metrics)
        centre_rows.extend(ev.per_centre)
        conf_parts.append(ev.confusion)
        cal_parts.append(ev.calibration)
        pred_parts.append(ev.predictions)
        notes.extend(ev.warnings)
        vs = np.asarray(oc.val_scores, dtype=np.float64)
        sel_parts.append(pd.DataFrame({
            "replicate": np.full(vs.size, int(oc.replicate), np.int64),
            "split": np.full(vs.size, int(oc.split), np.int64),
            "C_index": np.arange(vs.size, dtype=np.int64),
            "C": np.asarray(C_GRID, dtype=np.float64)[: vs.size],
            "val_balanced_accuracy": vs,
            "selected": np.arange(vs.size) == int(np.argmax(vs)),
        }))

    chance = 1.0 / (int(lab.max()) + 1)
    apd_d = {k: _safe_reduction(lambda m=m: _apd(m), f"APD of '{k}'", notes) for k, m in matrices.items()}
    nipd_d = {
        k: (_safe_reduction(lambda m=m: _nipd(m, vv, chance), f"nIPD of '{k}'", notes) if vv is not None else None)
        for k, m in matrices.items()
    }
    metrics = pd.DataFrame(metric_rows, columns=list(METRIC_COLUMNS))
    for c in ("role", "role_kind", "calibration_method"):
        metrics[c] = metrics[c].astype("str")
    cnames = np.asarray(centre_names + [UNKNOWN_CENTRE], dtype=object)
    pc = pd.DataFrame(centre_rows)
    codes = pc.pop("centre_code").to_numpy()
    pc.insert(0, "centre", cnames[np.where(codes < 0, len(centre_names), codes)])
    pc = pc[list(PER_CENTRE_COLUMNS)]
    for c in ("centre", "role", "role_kind"):
        pc[c] = pc[c].astype("str")
    preds = pd.concat(pred_parts, ignore_index=True)
    preds = _identity_columns(preds, groups, tile_ids, test_set_groups, centre_names)
    preds = preds.rename(columns={**{f"raw_prob_{k}": f"raw_prob_{c}" for k, c in enumerate(prob_cols)},
                                  **{f"prob_{k}": f"prob_{c}" for k, c in enumerate(prob_cols)}})
    params = {**params, "class_names": list(class_names), "probability_columns": prob_cols}
    return SweepEvaluation(
        matrices={k: np.ascontiguousarray(v) for k, v in matrices.items()},
        replicate_seeds=tuple(int(x) for x in replicate_seeds),
        cramers_v=vv, chance=chance, n_classes=n_classes, class_names=tuple(class_names),
        apd=apd_d, nipd=nipd_d, metrics=metrics, per_centre=pc,
        confusion=pd.concat(conf_parts, ignore_index=True),
        calibration=pd.concat(cal_parts, ignore_index=True),
        probe_selection=pd.concat(sel_parts, ignore_index=True),
        predictions=preds, split_reports=split_reports_, plan_sha256=plan_sha256,
        audit=audit, content_audit=content, parameters=params, warnings=tuple(notes),
    )


def evaluate_run(
    run: Any,
    *,
    n_rows: int,
    confounders,
    labels,
    params: SweepParams,
    identities: SweepIdentities,
    test_sets: Mapping[str, tuple[Any, Any]] | None = None,
    embeddings=None,
    parameters: Mapping[str, Any] | None = None,
) -> SweepEvaluation:
    """Audit and evaluate an already-computed ``SweepRun`` (kept predictions required).

    For outcomes built or altered by hand (the probes were fitted BEFORE this audit, so prefer
    :func:`evaluate_sweep`). Any critical finding raises LeakageError. ``plan_sha256`` is None;
    the content audit runs only when ``embeddings`` is given (otherwise the leakage record says
    ``not_audited``). ``params`` and ``identities`` as :func:`evaluate_sweep` (of ``params`` the
    plan keys ``iterations``, ``seed``, ``validation_fraction``, ``arrange_slides`` and
    ``fail_on_leakage`` do not apply: the run exists, and any finding raises); ``parameters`` are
    extra entries recorded in the evaluation's ``params``.
    """

    p, ids = params, identities
    schedule, rows_per_slide, temperature_scaling = p.schedule, p.rows_per_slide, p.temperature_scaling
    groups, tile_ids = ids.groups, ids.tile_ids
    test_set_groups, test_set_confounders = ids.test_set_groups, ids.test_set_confounders
    n_bins = cal._check_n_bins(p.n_bins)
    labels = np.asarray(labels)
    conf = np.asarray(confounders)
    test_sets = dict(test_sets or {})
    sizes = {k: int(np.shape(v[0])[0]) for k, v in test_sets.items()}
    outcomes = sorted(run.outcomes, key=lambda o: (o.replicate, o.split))
    audit = audit_sweep(
        outcomes, n_rows=n_rows, groups=groups, tile_ids=tile_ids, labels=labels, confounders=conf,
        test_set_sizes=sizes, test_set_groups=test_set_groups,
        test_set_confounders=test_set_confounders, raise_on_leakage=True, protected_level=p.protected_level,
    )
    content = None
    if embeddings is not None:
        content = audit_content(embeddings, outcomes, test_sets={k: v[0] for k, v in test_sets.items()},
                                severity=p.content_audit)
        if not content["passed"]:
            raise LeakageError(_error_message(content["breaches"]), content["breaches"], content)
    n_classes = _n_classes(labels, test_sets)
    names = tuple(str(k) for k in range(n_classes)) if p.class_names is None else tuple(map(str, p.class_names))
    if len(names) != n_classes:
        raise ValueError(f"{len(names)} class names given for {n_classes} classes")
    prob_cols = safe_class_columns(names)
    row_centres, test_centres, centre_names = _centre_codes(conf, test_set_confounders, sizes)
    results = [
        (_strip(oc), evaluate_outcome(oc, n_classes=n_classes, n_bins=n_bins,
                                      temperature_scaling=temperature_scaling,
                                      row_centres=row_centres, test_centres=test_centres))
        for oc in outcomes
    ]
    # the per-outcome balanced accuracies must be the matrix entries
    for oc in outcomes:
        for name, value in oc.scores.items():
            if not run.matrices[name][oc.split, oc.replicate] == value:
                raise RuntimeError(
                    f"matrix '{name}'[{oc.split}, {oc.replicate}] = "
                    f"{run.matrices[name][oc.split, oc.replicate]!r} differs from the outcome's score {value!r}"
                )

    notes: list[str] = list(audit["warnings"]) + (list(content["warnings"]) if content else [])
    vv = None
    try:
        vv = _cramers_v(list(schedule), rows_per_slide=rows_per_slide,
                        shape=(int(conf.max()) + 1, int(labels.max()) + 1))
    except ValueError as exc:
        notes.append(f"Cramér's V undefined: {exc}")
    seeds = [int(s) for s in run.replicate_seeds]
    n_splits = next(iter(run.matrices.values())).shape[0]

    jobs = tuple(outcomes)
    pseudo_plan = ProbePlan(jobs=jobs, replicate_seeds=tuple(seeds), n_rows=int(n_rows), n_splits=n_splits,
                            test_set_sizes=sizes,
                            sha256=_hash(jobs, n_rows=n_rows, replicate_seeds=seeds, test_set_sizes=sizes))
    reports = split_reports(pseudo_plan, confounders=conf, labels=labels, groups=groups, schedule=schedule,
                            rows_per_slide=rows_per_slide, requested_v=vv, test_set_groups=test_set_groups)
    return _assemble(
        results, plan_sha256=None, replicate_seeds=seeds, matrix_names=list(run.matrices),
        n_splits=n_splits, lab=labels, n_classes=n_classes, class_names=names, prob_cols=prob_cols,
        centre_names=centre_names, groups=groups, tile_ids=tile_ids, test_set_groups=test_set_groups,
        vv=vv, audit=audit, content=content, split_reports_=reports, notes=notes,
        params={
            "schedule": _jsonable_schedule(schedule), "rows_per_slide": int(rows_per_slide),
            "n_bins": int(n_bins), "test_sets": list(test_sets), "group_levels": list(groups),
            "protected_level": audit["protected_level"],
            "temperature_scaling": bool(temperature_scaling), "evaluated_after_fit": True,
            **dict(parameters or {}),
        },
    )
