"""Grouped holdout and centre holdout constructors with split reports (spec evaluation.md C.4, A.2).

:func:`grouped_split` holds out whole protected groups (slide < case < patient) so that every
class lands on both sides. Candidates come from scikit-learn's ``StratifiedGroupKFold`` (every
fold of every fold count in ``sorted({k*} | {2..min(5, G)})``, ``k* = max(2, min(round(1 /
holdout), G, 20))``) and ``GroupShuffleSplit`` (``min(256, max(32, 4 G))`` draws); only
candidates with every class on both sides are kept; the chosen one minimises
``|test_groups / G - holdout|`` then ``|test_rows - holdout * n|`` (first on ties). The realised
holdout may therefore be larger than requested; the report shows both. There is never a random
row-level fallback: row-level (``"tile"``) splitting happens only when asked for by name, and its
report labels it ungrouped with a warning.

:func:`centre_holdout` holds out whole centres (an explicit list, or every
``LeaveOneGroupOut`` / ``LeavePGroupsOut`` draw over the centre ids) for unseen-confounder test
sets, refusing a side that lacks a class or a protected group spanning both sides.

Index arrays come back sorted (int64). Nothing here draws randomness except through the given
``seed`` (scikit-learn ``random_state``), so a seed reproduces the split.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from sklearn.model_selection import (
    GroupShuffleSplit,
    LeaveOneGroupOut,
    LeavePGroupsOut,
    StratifiedGroupKFold,
    StratifiedKFold,
    train_test_split,
)

__all__ = [
    "GROUP_LEVELS",
    "CentreHoldoutReport",
    "HoldoutReport",
    "centre_holdout",
    "grouped_split",
    "nested_group_folds",
    "normalize_group_level",
]

#: Protected identity levels, least to most independent. ``tile`` means ungrouped.
GROUP_LEVELS = ("tile", "slide", "case", "patient")

_UNGROUPED_WARNING = (
    "tile-level (ungrouped) split: tiles of one slide/patient may sit on both sides, and shared "
    "acquisition context can inflate held-out scores"
)


def normalize_group_level(level: Any) -> str:
    """Return ``level`` if it is exactly one of :data:`GROUP_LEVELS` (case-sensitive), else refuse."""
    if isinstance(level, str) and level in GROUP_LEVELS:
        return level
    raise ValueError(
        f"unknown group level {level!r}; valid levels are exactly {list(GROUP_LEVELS)} (lower case); "
        "'tile' means an ungrouped split"
    )


def _check_ids(values, name: str, n: int | None = None) -> np.ndarray:
    arr = np.asarray(values, dtype=object)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if n is not None and arr.shape[0] != n:
        raise ValueError(f"{name} holds {arr.shape[0]} values but labels hold {n}")
    ser = pd.Series(arr, copy=False)
    bad = ser.isna().to_numpy() | ser.astype("string").str.strip().eq("").fillna(True).to_numpy(dtype=bool)
    if bad.any():
        rows = np.flatnonzero(bad)
        raise ValueError(f"column '{name}' is missing or blank at row {int(rows[0])} "
                         f"({rows.size} row(s) in all, first {rows[:20].tolist()})")
    return arr


@dataclass(frozen=True, kw_only=True)
class HoldoutReport:
    """What a grouped (or explicitly ungrouped) holdout realised (spec C.4; spacr SplitReport).

    ``row_fraction = test_rows / (train_rows + test_rows)``; ``group_fraction = test_groups /
    total_groups``; ``grew`` is True when the realised group fraction exceeds the request (the
    holdout grew to keep every class on both sides).
    """

    group_level: str
    grouped: bool
    requested_fraction: float
    row_fraction: float
    group_fraction: float
    train_rows: int
    test_rows: int
    train_groups: int
    test_groups: int
    total_groups: int
    grew: bool
    seed: int
    rule: str
    warnings: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict:
        d = asdict(self)
        d["warnings"] = list(self.warnings)
        return d

    def summary(self) -> str:
        unit = "tile" if not self.grouped else self.group_level
        return (f"held out {self.test_groups}/{self.total_groups} {unit}(s) "
                f"({100 * self.group_fraction:.1f}%), {self.test_rows}/{self.train_rows + self.test_rows} rows "
                f"({100 * self.row_fraction:.1f}%); requested {100 * self.requested_fraction:.1f}%; {self.rule}")


def _candidates(codes, y, holdout, seed, n_groups):
    k_star = max(2, min(round(1 / holdout), n_groups, 20))
    fold_counts = sorted({k_star} | set(range(2, min(5, n_groups) + 1)))
    dummy = np.zeros((codes.size, 1))
    with warnings.catch_warnings():
        # "least populated class has only k members": a candidate source, not a problem
        warnings.simplefilter("ignore", UserWarning)
        for k in fold_counts:
            try:
                folds = list(StratifiedGroupKFold(k, shuffle=True, random_state=seed).split(dummy, y, codes))
            except ValueError:
                continue
            yield from folds
        n_draws = min(256, max(32, 4 * n_groups))
        try:
            yield from GroupShuffleSplit(n_splits=n_draws, test_size=holdout, random_state=seed).split(
                dummy, y, codes)
        except ValueError:
            return


def grouped_split(groups, labels, holdout: float, seed: int = 0, *, group_level: str = "slide"):
    """Hold out whole groups so that train and test both hold every class.

    Parameters
    ----------
    groups : ids (n,) of the protected level (no missing / blank id).
    labels : class per row (n,).
    holdout : requested test fraction, strictly between 0 and 1 (of groups; rows break ties).
    seed : int, scikit-learn ``random_state`` of the candidate generators.
    group_level : one of :data:`GROUP_LEVELS`; ``"tile"`` with distinct ids is an ungrouped
        stratified row split (reported as such, with a warning); ``"tile"`` with repeated ids
        keeps the rows of one tile together.

    Returns
    -------
    (train_idx, test_idx, HoldoutReport), index arrays sorted int64.

    Raises
    ------
    ValueError
        Unknown level; holdout not finite or not in (0, 1); a groups / labels length mismatch
        (both counts named); fewer than 2 rows; a missing / blank id (row named); fewer than 2
        groups ("memorise"); no candidate puts every class on both sides (groups per class
        named); tile level with a class of fewer than 2 rows.
    RuntimeError
        Internal: a group found on both sides.
    """
    level = normalize_group_level(group_level)
    if isinstance(holdout, bool) or not isinstance(holdout, (int, float, np.integer, np.floating)) \
            or not math.isfinite(float(holdout)) or not 0.0 < float(holdout) < 1.0:
        raise ValueError(f"holdout must be a finite fraction strictly between 0 and 1, got {holdout!r}")
    holdout = float(holdout)
    y = np.asarray(labels)
    if y.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {y.shape}")
    g_raw = np.asarray(groups, dtype=object)
    if g_raw.ndim != 1 or g_raw.shape[0] != y.shape[0]:
        raise ValueError(f"groups hold {g_raw.reshape(-1).shape[0]} values but labels hold {y.shape[0]}; "
                         "give one group id per row")
    n = y.shape[0]
    if n < 2:
        raise ValueError(f"a holdout needs at least 2 rows, got {n}")
    g = _check_ids(g_raw, "groups", n)
    codes, uniq = pd.factorize(pd.Series(g, copy=False), sort=False)
    codes = codes.astype(np.int64)
    n_groups = len(uniq)
    y_codes, classes = pd.factorize(pd.Series(y, copy=False), sort=True)
    n_cls = len(classes)
    notes: list[str] = []

    if level == "tile" and n_groups == n:
        counts = np.bincount(y_codes, minlength=n_cls)
        if n_cls > 1 and counts.min() < 2:
            raise ValueError(f"class counts {dict(zip(map(str, classes), counts.tolist()))}: every class "
                             "needs at least 2 rows for a stratified tile-level split")
        idx = np.arange(n)
        tr, te = train_test_split(idx, test_size=holdout, random_state=seed,
                                  stratify=y_codes if counts.min() >= 2 else None)
        tr, te = np.sort(tr).astype(np.int64), np.sort(te).astype(np.int64)
        notes.append(_UNGROUPED_WARNING)
        return tr, te, HoldoutReport(
            group_level=level, grouped=False, requested_fraction=holdout, row_fraction=te.size / n,
            group_fraction=te.size / n, train_rows=int(tr.size), test_rows=int(te.size),
            train_groups=int(tr.size), test_groups=int(te.size), total_groups=n,
            grew=te.size / n > holdout + 1e-12, seed=int(seed),
            rule="tiles split at random (stratified by class); ungrouped: tiles of one slide may cross",
            warnings=tuple(notes))

    if n_groups < 2:
        raise ValueError(f"only {n_groups} distinct {level} id(s): a grouped holdout needs at least 2, "
                         f"otherwise the model would only memorise this {level}")
    best, best_key = None, None
    for tr, te in _candidates(codes, y_codes, holdout, seed, n_groups):
        if np.bincount(y_codes[tr], minlength=n_cls).min() == 0 or \
                np.bincount(y_codes[te], minlength=n_cls).min() == 0:
            continue
        tg = np.unique(codes[te]).size
        key = (abs(tg / n_groups - holdout), abs(te.size - holdout * n))
        if best_key is None or key < best_key:
            best, best_key = (tr, te), key
    if best is None:
        pairs = np.unique(np.stack([codes, y_codes], axis=1), axis=0)
        per_class = np.bincount(pairs[:, 1], minlength=n_cls)
        raise ValueError(
            f"no grouped {level} split puts every class on both sides; independent {level}s per class: "
            f"{dict(zip(map(str, classes), per_class.tolist()))}. Add {level}s of the sparse classes or "
            "use a finer level; a random row-level fallback would report an optimistic score as grouped"
        )
    tr, te = (np.sort(a).astype(np.int64) for a in best)
    if np.intersect1d(codes[tr], codes[te]).size:
        raise RuntimeError(f"internal error: a {level} appears on both sides of the holdout")
    test_groups = int(np.unique(codes[te]).size)
    gf = test_groups / n_groups
    rule = f"whole {level}s held out (StratifiedGroupKFold / GroupShuffleSplit candidates, every class on both sides)"
    if level == "tile":
        rule += "; repeated rows of one tile stay together"
    rule += "; no group appears on both sides"
    if gf > holdout + 1e-12:
        notes.append(f"holdout grew from {holdout:.3f} to {gf:.3f} of the {level}s to keep every class on both sides")
    return tr, te, HoldoutReport(
        group_level=level, grouped=True, requested_fraction=holdout, row_fraction=te.size / n,
        group_fraction=gf, train_rows=int(tr.size), test_rows=int(te.size),
        train_groups=n_groups - test_groups, test_groups=test_groups, total_groups=n_groups,
        grew=gf > holdout + 1e-12, seed=int(seed), rule=rule, warnings=tuple(notes))


@dataclass(frozen=True, kw_only=True)
class CentreHoldoutReport:
    """One centre holdout: which centres, rows and groups sit on each side."""

    held_out_centres: tuple
    kept_centres: tuple
    kept_rows: int
    held_out_rows: int
    kept_groups: int
    held_out_groups: int
    rule: str

    def to_dict(self) -> dict:
        d = asdict(self)
        d["held_out_centres"] = [str(c) for c in self.held_out_centres]
        d["kept_centres"] = [str(c) for c in self.kept_centres]
        return d


def _one_centre_split(c_codes, c_uniq, y_codes, classes, g_codes, g_uniq, held_mask_c):
    held_rows = held_mask_c[c_codes]
    held_names = tuple(c_uniq[np.flatnonzero(held_mask_c)])
    n_cls = len(classes)
    for side, m in (("held-out", held_rows), ("kept", ~held_rows)):
        present = np.bincount(y_codes[m], minlength=n_cls) > 0
        if not present.all():
            missing = [str(classes[i]) for i in np.flatnonzero(~present)]
            raise ValueError(f"centre holdout {list(map(str, held_names))}: the {side} centres lack "
                             f"class(es) {missing}; every class must be on both sides")
    both = np.intersect1d(g_codes[held_rows], g_codes[~held_rows])
    if both.size:
        raise ValueError(
            f"centre holdout {list(map(str, held_names))}: protected group(s) "
            f"{[str(g_uniq[i]) for i in both[:10]]} ({both.size} in all) span held-out and kept centres"
        )
    kept = np.flatnonzero(~held_rows).astype(np.int64)
    held = np.flatnonzero(held_rows).astype(np.int64)
    return kept, held, CentreHoldoutReport(
        held_out_centres=held_names, kept_centres=tuple(c_uniq[np.flatnonzero(~held_mask_c)]),
        kept_rows=int(kept.size), held_out_rows=int(held.size),
        kept_groups=int(np.unique(g_codes[kept]).size), held_out_groups=int(np.unique(g_codes[held]).size),
        rule="whole centres held out as an unseen-confounder test set; no protected group spans both sides",
    )


def centre_holdout(centres, labels, groups, *, held_out: Sequence | None = None, p: int = 1) -> list:
    """Unseen-centre holdouts: ``[(kept_idx, held_out_idx, CentreHoldoutReport), ...]``.

    Parameters
    ----------
    centres : centre id per row (n,), no missing / blank value.
    labels : class per row (n,).
    groups : protected group id per row (n,) (slide / case / patient).
    held_out : explicit centres to hold out (one split). When None, every
        ``LeaveOneGroupOut`` (``p == 1``) or ``LeavePGroupsOut(p)`` draw over the centres.
    p : centres per draw when enumerating.

    Raises
    ------
    ValueError
        Length mismatch; missing / blank ids; fewer than 2 centres; unknown or all centres held
        out; a side lacking a class; a protected group spanning held-out and kept centres (the
        split and the groups are named).
    """
    y = np.asarray(labels)
    n = y.shape[0]
    c = _check_ids(centres, "centres", n)
    g = _check_ids(groups, "groups", n)
    c_codes, c_uniq = pd.factorize(pd.Series(c, copy=False), sort=True)
    g_codes, g_uniq = pd.factorize(pd.Series(g, copy=False), sort=False)
    y_codes, classes = pd.factorize(pd.Series(y, copy=False), sort=True)
    c_uniq = np.asarray(c_uniq, dtype=object)
    g_uniq = np.asarray(g_uniq, dtype=object)
    if len(c_uniq) < 2:
        raise ValueError(f"a centre holdout needs at least 2 centres, got {len(c_uniq)}")
    masks = []
    if held_out is not None:
        wanted = list(held_out)
        known = {str(x): i for i, x in enumerate(c_uniq)}
        unknown = [w for w in wanted if str(w) not in known]
        if unknown or not wanted:
            raise ValueError(f"held_out centres {unknown or wanted} are not among the centres {list(map(str, c_uniq))}")
        m = np.zeros(len(c_uniq), bool)
        m[[known[str(w)] for w in wanted]] = True
        if m.all():
            raise ValueError("held_out names every centre; at least one centre must be kept")
        masks.append(m)
    else:
        if not 1 <= int(p) < len(c_uniq):
            raise ValueError(f"p must lie in [1, {len(c_uniq) - 1}] for {len(c_uniq)} centres, got {p}")
        splitter = LeaveOneGroupOut() if int(p) == 1 else LeavePGroupsOut(int(p))
        dummy = np.zeros((len(c_uniq), 1))
        for _, te in splitter.split(dummy, groups=np.arange(len(c_uniq))):
            m = np.zeros(len(c_uniq), bool)
            m[te] = True
            masks.append(m)
    return [_one_centre_split(c_codes, c_uniq, y_codes, classes, g_codes, g_uniq, m) for m in masks]


# ---------------------------------------------------------------------------------------------
# nested grouped folds (spec C.4 SHOULD, A.7)


def _fold_count(value, what: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an integer of at least 2, got {value!r}")
    k = int(value)
    if k < 2:
        raise ValueError(f"{what} must be at least 2, got {value!r}")
    return k


def _kfold(y_codes, g_codes, k, seed, where):
    dummy = np.zeros((y_codes.size, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "least populated class" notes
        try:
            if g_codes is None:

                return list(StratifiedKFold(k, shuffle=True, random_state=seed).split(dummy, y_codes))
            return list(StratifiedGroupKFold(k, shuffle=True, random_state=seed).split(dummy, y_codes, g_codes))
        except ValueError as exc:
            n_units = y_codes.size if g_codes is None else np.unique(g_codes).size
            raise ValueError(f"{where}: cannot build {k} folds from {n_units} "
                             f"{'rows' if g_codes is None else 'groups'} ({exc})") from exc


def nested_group_folds(labels, *, outer_splits: int, inner_splits: int, groups=None, seed: int = 0) -> list[dict]:
    """Outer folds, each with inner folds inside its training rows (spec A.7).

    Returns ``[{"outer_fold": 1.., "train", "validation", "inner_seed", "inner": [(train, val),
    ...]}, ...]``; all indices are global, sorted int64. Outer folds come from
    ``StratifiedGroupKFold(outer_splits, shuffle=True, random_state=seed)`` (``StratifiedKFold``
    without groups), inner folds from the same splitter on the outer training rows with
    ``random_state = seed + outer_fold``, so inner layouts differ between outer folds. Groups stay
    whole at both levels. Model selection uses inner validation folds only; each outer validation
    fold is scored once.

    Raises ValueError: a fold count below 2 (counts are cast with ``int``); missing / blank
    group ids; too few rows or groups for the fold count (the level is named).
    """
    outer_k = _fold_count(outer_splits, "outer_splits")
    inner_k = _fold_count(inner_splits, "inner_splits")
    y = np.asarray(labels)
    y_codes = pd.factorize(pd.Series(y, copy=False), sort=True)[0].astype(np.int64)
    g_codes = None
    if groups is not None:
        g = _check_ids(groups, "groups", y.shape[0])
        g_codes = pd.factorize(pd.Series(g, copy=False))[0].astype(np.int64)
    out = []
    for i, (tr, va) in enumerate(_kfold(y_codes, g_codes, outer_k, seed, "outer folds"), start=1):
        inner_seed = int(seed) + i
        inner = _kfold(y_codes[tr], None if g_codes is None else g_codes[tr], inner_k, inner_seed,
                       f"inner folds of outer fold {i}")
        out.append({
            "outer_fold": i, "train": np.sort(tr).astype(np.int64), "validation": np.sort(va).astype(np.int64),
            "inner_seed": inner_seed,
            "inner": [(np.sort(tr[a]).astype(np.int64), np.sort(tr[b]).astype(np.int64)) for a, b in inner],
        })
    return out
