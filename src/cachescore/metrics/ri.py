"""RI: the Robustness Index, croma 1.0.1-compatible (spec/metrics.md §1–5).

``RobustnessIndex.compute`` scores every candidate ``k`` on the exact cross-group neighbour
windows, selects the operating ``k`` by kNN balanced accuracy on labels, and pools the SO/OS
evidence of all units (a micro-average). ``compute_with`` is the same call with an injected
neighbour backend (any callable with the contract of
:func:`cachescore.neighbors.exact.cross_group_knn`), used by the distributed pipeline and the ANN
backend; ``compute`` is ``compute_with(cross_group_knn, ...)``.

One neighbour search per scope serves every step of a call (scoring, k-selection, tau, the tau
scale check): each step's window is derived from that table with the reference's cap rule for
that step's own ``kmax`` (see :mod:`cachescore.metrics.windows`).

This module also holds the machinery MaRI shares (:class:`_Evaluation`).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field

import numpy as np

from ..manifest import (
    Scope,
    build_scopes,
    check_features,
    check_finite_rows,
    coerce_manifest,
    dataset_name,
    normalize_design,
    normalize_manifest,
)
from ..neighbors.exact import cross_group_knn
from ..neighbors.normalize import normalize_rows
from ..types import RobustnessResult
from .kselect import (
    balanced_accuracy_by_k,
    normalize_k_values,
    select_k_all,
    select_k_paired,
)
from .tail import compute_tail_metrics
from .windows import (
    TINY,
    ScopeScores,
    ScopeTable,
    build_table,
    ratio_from_log,
    scope_log_totals,
    score_scope,
    typed_distances,
    valid_counts,
)

__all__ = ["RobustnessIndex", "RI"]

logger = logging.getLogger("cachescore")

#: Tail level of RI/MaRI results (fixed, spec §5.3).
RESULT_ALPHA = 0.10
#: Fraction of units with a shortened window above which k-selection logs a warning.
_REDUCED_K_WARN = 0.10


@dataclass
class _Evaluation:
    """Validated inputs of one metric call plus the per-scope neighbour tables it has built.

    Create with :meth:`open` (feature and manifest checks, in the spec's catalogue order), then call
    :meth:`build_scopes` at the point of the catalogue where subsets are validated.
    """

    search: object
    features: np.ndarray
    frame: object
    dataset: str
    design: str
    scopes: tuple[Scope, ...] = ()
    width: int = 1
    tables: dict = field(default_factory=dict)
    _tau: float | None = None

    @classmethod
    def open(cls, search, features, manifest, *, confounder_column, evaluation_design, check_feature_types=True):
        df = coerce_manifest(manifest)
        if check_feature_types:
            features = check_features(features, len(df), require_units=True)
        else:
            features = check_features(features, len(df), require_units=False)
        frame = normalize_manifest(df, confounder_column=confounder_column)
        design = normalize_design(evaluation_design)
        return cls(search=search, features=features, frame=frame, dataset=dataset_name(frame), design=design)

    def build_scopes(self, *, validate_subsets: bool) -> None:
        self.scopes = build_scopes(self.frame, self.design, validate_subsets=validate_subsets)
        if self.design == "paired_2x2" and not self.scopes:
            raise RuntimeError(f"{self.dataset}: no valid manifest-defined 2x2 subsets remain for RI/MaRI")

    @property
    def unit(self) -> str:
        return "sample" if self.design == "all" else "occurrence"

    def table(self, scope: Scope) -> ScopeTable:
        """The scope's neighbour table at ``self.width`` (searched once, on first use)."""
        table = self.tables.get(scope.subset)
        if table is None:
            if scope.n <= 1:
                raise RuntimeError(
                    f"{self.dataset}: scope '{scope.subset}' has {scope.n} row(s): need at least two "
                    "samples to compute neighbours"
                )
            check_finite_rows(self.features, scope.rows)
            whole = scope.n == self.features.shape[0] and np.array_equal(scope.rows, np.arange(scope.n))
            u = normalize_rows(self.features if whole else self.features[scope.rows])
            table = build_table(self.search, u, scope, self.width)
            self.tables[scope.subset] = table
        return table

    # -- k-selection (spec §4) -------------------------------------------------------------
    def _bacc(self, scope: Scope, ks: list[int]) -> dict[int, float]:
        table = self.table(scope)
        kmax = max(ks)
        valid = valid_counts(table, kmax)
        reduced = int(np.count_nonzero(valid < kmax))
        if scope.n and reduced / scope.n > _REDUCED_K_WARN:
            logger.warning(
                "[RI/MaRI] %s k-selection, scope '%s': effective k < %d for %d/%d %ss (%.1f%%) after "
                "excluding same-group neighbours.",
                self.dataset, scope.subset, kmax, reduced, scope.n, self.unit, 100.0 * reduced / scope.n,
            )
        return balanced_accuracy_by_k(scope.labels, table.idx, valid, ks)

    def select_k(self, candidates: list[int]) -> int:
        if self.design == "all":
            scope = self.scopes[0]
            ks = [k for k in candidates if k < scope.n]
            if not ks:
                raise RuntimeError(f"{self.dataset}: all-rows k-selection failed because no valid k candidates remain")
            return select_k_all(ks, self._bacc(scope, ks))
        per_scope = []
        for scope in self.scopes:
            ks = [k for k in candidates if k < scope.n]
            if ks:
                per_scope.append(self._bacc(scope, ks))
        if not per_scope:
            raise RuntimeError(f"{self.dataset}: subset k-selection failed on all subsets")
        return select_k_paired(per_scope)

    # -- scoring (spec §5, §6) ----------------------------------------------------------------
    def score(self, ks: list[int], kmax: int, tau: float | None) -> list[dict[int, ScopeScores]]:
        """Per-scope scores for each ``k`` in ``ks``, windows as fetched at ``kmax``."""
        out = []
        for scope in self.scopes:
            table = self.table(scope)
            out.append(score_scope(table, valid_counts(table, kmax), ks, tau))
        return out

    def pooled(self, per_scope: list[dict[int, ScopeScores]], k: int, kmax: int, tau: float | None) -> float:
        """Pooled value at ``k``: the scope's own under ``all``; evidence micro-average under paired."""
        if self.design == "all":
            return float(per_scope[0][k].pooled)
        total_so = 0.0
        total_os = 0.0
        for s in per_scope:
            total_so += float(s[k].so.sum())
            total_os += float(s[k].os.sum())
        if total_so + total_os >= TINY:
            return total_so / (total_so + total_os)
        if tau is None:  # RI evidence is integral: below tiny means none at all
            return 0.5
        log_so = np.longdouble(-np.inf)
        log_os = np.longdouble(-np.inf)
        for scope, scores in zip(self.scopes, per_scope):
            stored = scores[k]
            if stored.log_so is not None:  # score_scope already reduced this scope (same order)
                l_so, l_os = stored.log_so, stored.log_os
            else:
                table = self.table(scope)
                l_so, l_os = scope_log_totals(table, valid_counts(table, kmax), k, tau)
            log_so = np.logaddexp(log_so, l_so)
            log_os = np.logaddexp(log_os, l_os)
        return float(ratio_from_log(log_so, log_os))

    def result(self, per_scope, k: int, kmax: int, tau: float | None) -> RobustnessResult:
        """Assemble the :class:`RobustnessResult` at ``k`` (spec §5.3, §10.1)."""
        parts = [s[k] for s in per_scope]
        values = np.concatenate([p.values for p in parts]).astype(np.float64)
        defined = np.concatenate([p.defined for p in parts]).astype(bool)
        types = np.concatenate([p.types for p in parts]).astype(np.int64)
        subsets = np.concatenate([np.full(sc.n, sc.subset, dtype=object) for sc in self.scopes]).astype(str)
        sources = np.concatenate([sc.rows for sc in self.scopes]).astype(np.int64)
        pair_values = np.asarray([p.pooled for p in parts], dtype=np.float64)
        units = values.size
        sample_values = values[defined].astype(np.float64)
        tail = compute_tail_metrics(sample_values, alpha=RESULT_ALPHA)
        return RobustnessResult(
            dataset=self.dataset,
            k=int(k),
            value=float(self.pooled(per_scope, k, kmax, tau)),
            std=float(pair_values.std(ddof=0)),
            n_pairs=int(pair_values.size),
            pair_values=pair_values,
            sample_values=sample_values,
            sample_values_aligned=values,
            occurrence_defined_mask=defined,
            sample_undefined_types=types,
            occurrence_subsets=subsets,
            occurrence_source_indices=sources,
            support=float(np.mean(defined)),
            ss_dominated_undefined_frac=float(np.count_nonzero(types == 1) / units) if units else 0.0,
            oo_dominated_undefined_frac=float(np.count_nonzero(types == 2) / units) if units else 0.0,
            mixed_undefined_frac=float(np.count_nonzero(types == 3) / units) if units else 0.0,
            evaluation_design=self.design,
            evaluation_unit=self.unit,
            alpha=RESULT_ALPHA,
            median_value=float(np.median(sample_values)) if sample_values.size else float("nan"),
            q_alpha=tail.q_alpha,
            ltm_alpha=tail.ltm_alpha,
            tau=float("nan") if tau is None else float(tau),
            occurrence_so=np.concatenate([p.so for p in parts]).astype(np.float64),
            occurrence_os=np.concatenate([p.os for p in parts]).astype(np.float64),
        )

    def warn_support(self, result: RobustnessResult) -> None:
        """The reference's two support warnings (spec §5.5), with its exact wording."""
        label = "subset occurrences" if self.unit == "occurrence" else "samples"
        if result.support < 1.0:
            warnings.warn(
                f"{self.dataset}: RI/MaRI support is {result.support * 100.0:.1f}% across {label}.",
                RuntimeWarning,
                stacklevel=4,
            )
        oo = result.oo_dominated_undefined_frac
        if oo > max(result.ss_dominated_undefined_frac, result.mixed_undefined_frac, 0.0):
            warnings.warn(
                f"{self.dataset}: undefined RI/MaRI {label} are predominantly OO-dominated ({oo * 100.0:.1f}%).",
                RuntimeWarning,
                stacklevel=4,
            )

    def typed_distances(self, k: int) -> np.ndarray:
        """Typed-neighbour distances at ``k`` over every scope, subsets in sorted order (§6.3)."""
        chunks = [typed_distances(self.table(s), valid_counts(self.table(s), k), k) for s in self.scopes if s.n > 1]
        return np.concatenate(chunks) if chunks else np.empty(0, dtype=np.float64)


class RobustnessIndex:
    """RI = pooled SO / (SO + OS) neighbour counts in each unit's top-k cross-group window.

    A namespace of classmethods (never instantiated), with croma 1.0.1's signatures. ``features``
    is a numpy or row-chunked dask array (N, D) aligned with the manifest rows; ``manifest`` is a
    DataFrame or a path to a ``.parquet``/``.csv`` file.
    """

    @classmethod
    def compute(cls, features, manifest, *, confounder_column, k_candidates, evaluation_design="all") -> RobustnessResult:
        """RI at the operating ``k`` selected by kNN balanced accuracy (spec §5.4).

        Raises (in the spec's catalogue order, §1.8): ``TypeError`` (manifest/features types),
        ``ValueError`` (shape, row count, empty manifest, manifest columns/group_id, design,
        paired subsets, non-positive or empty ``k_candidates``), ``RuntimeError`` (a scope of < 2
        rows, no candidate below the scope size, no unit with a cross-group neighbour),
        ``ValueError`` (NaN/inf features). Warns ``RuntimeWarning`` when support < 1 or when
        undefined units are mostly OO-dominated.
        """
        return cls.compute_with(
            cross_group_knn, features, manifest,
            confounder_column=confounder_column, k_candidates=k_candidates, evaluation_design=evaluation_design,
        )

    @classmethod
    def compute_with(cls, search, features, manifest, *, confounder_column, k_candidates, evaluation_design="all") -> RobustnessResult:
        """:meth:`compute` with the neighbour backend ``search`` (``cross_group_knn`` contract)."""
        ev = _Evaluation.open(search, features, manifest, confounder_column=confounder_column, evaluation_design=evaluation_design)
        ev.build_scopes(validate_subsets=True)
        candidates = normalize_k_values(k_candidates)
        kmax = max(candidates)
        ev.width = kmax
        per_scope = ev.score(candidates, kmax, None)
        k = ev.select_k(candidates)
        result = ev.result(per_scope, k, kmax, None)
        ev.warn_support(result)
        return result

    @classmethod
    def compute_curve(cls, features, manifest, *, confounder_column, k_values, evaluation_design="all") -> dict[int, float]:
        """``{k: pooled RI}`` for every normalised ``k`` in the caller's order, ``k >= n`` included.

        No k-selection and no warnings. Raises as :meth:`compute` up to the neighbour search.
        """
        return cls.compute_curve_with(
            cross_group_knn, features, manifest,
            confounder_column=confounder_column, k_values=k_values, evaluation_design=evaluation_design,
        )

    @classmethod
    def compute_curve_with(cls, search, features, manifest, *, confounder_column, k_values, evaluation_design="all") -> dict[int, float]:
        """:meth:`compute_curve` with the neighbour backend ``search``."""
        ev = _Evaluation.open(search, features, manifest, confounder_column=confounder_column, evaluation_design=evaluation_design)
        ev.build_scopes(validate_subsets=True)
        ks = normalize_k_values(k_values)
        kmax = max(ks)
        ev.width = kmax
        per_scope = ev.score(ks, kmax, None)
        return {k: float(ev.pooled(per_scope, k, kmax, None)) for k in ks}


RI = RobustnessIndex
