"""MaRI: the Margin-aware Robustness Index, croma 1.0.1-compatible (spec/metrics.md §6).

Each typed neighbour at distance ``d`` carries weight ``exp(-d / tau)``; a unit's value is its
SO share of typed evidence, pooled over units as a micro-average of evidence. Weights that
underflow below the smallest normal float64 switch to extended-precision log-space sums, so the
ratio survives tiny temperatures.

``tau=None`` (default) resolves the temperature as the median typed-neighbour distance at the
operating ``k`` (:meth:`MarginAwareRobustnessIndex.recommend_tau`), with a 0.2 fallback and a
warning when there is no scale. A pinned ``tau`` is checked against that scale when ``warn_tau``.
The ``*_with`` classmethods take an injected neighbour backend (``cross_group_knn`` contract).
"""

from __future__ import annotations

import warnings

import numpy as np

from ..neighbors.exact import cross_group_knn
from ..types import RobustnessResult
from .kselect import normalize_k_values
from .ri import _Evaluation
from .tau import (
    TAU_FALLBACK,
    assess_tau,
    collapsed_message,
    format_tau_warning,
    no_typed_neighbour_message,
)

__all__ = ["MarginAwareRobustnessIndex", "MaRI", "TAU_FALLBACK"]


def _check_tau(tau) -> None:
    if tau is not None and float(tau) <= 0.0:
        raise ValueError(f"tau must be > 0, got {tau!r}")


def _resolve_tau(ev: _Evaluation, k: int) -> float:
    """Auto-tau at ``k`` with the two fallback warnings (spec §6.3)."""
    typed = ev.typed_distances(k)
    tau = float(np.median(typed)) if typed.size else float("nan")
    if not np.isfinite(tau):
        warnings.warn(no_typed_neighbour_message(k), RuntimeWarning, stacklevel=4)
        return TAU_FALLBACK
    if tau <= 0.0:
        warnings.warn(collapsed_message(k), RuntimeWarning, stacklevel=4)
        return TAU_FALLBACK
    return tau


def _select_phase(search, features, manifest, *, confounder_column, k_values, evaluation_design):
    """The reference's operating-k resolution: full feature checks, subsets not yet validated."""
    ev = _Evaluation.open(search, features, manifest, confounder_column=confounder_column, evaluation_design=evaluation_design)
    candidates = normalize_k_values(k_values)
    ev.build_scopes(validate_subsets=False)
    ev.width = max(candidates)
    return ev, candidates, ev.select_k(candidates)


def _validated(ev: _Evaluation) -> None:
    """Apply the subset validation of the scoring step (raises ``ValueError`` on incomplete subsets)."""
    if ev.design == "paired_2x2":
        ev.build_scopes(validate_subsets=True)


class MarginAwareRobustnessIndex:
    """MaRI: distance-weighted SO share of typed evidence in each unit's top-k window.

    A namespace of classmethods with croma 1.0.1's signatures; inputs as for
    :class:`~cachescore.metrics.ri.RobustnessIndex`.
    """

    @classmethod
    def compute(cls, features, manifest, *, confounder_column, k_candidates, tau=None, evaluation_design="all", warn_tau=True) -> RobustnessResult:
        """MaRI at the operating ``k`` (selected by kNN balanced accuracy, as for RI).

        ``tau=None`` resolves it automatically (fallback 0.2 with a ``RuntimeWarning`` when there is
        no typed neighbour or the median typed distance is 0); a pinned ``tau`` must be > 0
        (``ValueError`` otherwise, checked first) and, with ``warn_tau``, is checked against the
        typed-distance scale (``RuntimeWarning`` when off-scale). Other errors and warnings as
        :meth:`RobustnessIndex.compute <cachescore.metrics.ri.RobustnessIndex.compute>`.
        """
        return cls.compute_with(
            cross_group_knn, features, manifest, confounder_column=confounder_column, k_candidates=k_candidates,
            tau=tau, evaluation_design=evaluation_design, warn_tau=warn_tau,
        )

    @classmethod
    def compute_with(cls, search, features, manifest, *, confounder_column, k_candidates, tau=None, evaluation_design="all", warn_tau=True) -> RobustnessResult:
        """:meth:`compute` with the neighbour backend ``search`` (``cross_group_knn`` contract)."""
        _check_tau(tau)
        ev, candidates, k = _select_phase(
            search, features, manifest, confounder_column=confounder_column, k_values=k_candidates,
            evaluation_design=evaluation_design,
        )
        auto = tau is None
        resolved = _resolve_tau(ev, k) if auto else float(tau)
        _validated(ev)
        kmax = max(candidates)
        per_scope = ev.score([k], kmax, resolved)
        result = ev.result(per_scope, k, kmax, resolved)
        ev.warn_support(result)
        if warn_tau and not auto:
            assessment = assess_tau(resolved, ev.typed_distances(result.k))
            if assessment.regime in ("too_sharp", "too_flat"):
                warnings.warn(format_tau_warning(assessment), RuntimeWarning, stacklevel=3)
        return result

    @classmethod
    def compute_curve(cls, features, manifest, *, confounder_column, k_values, tau=None, evaluation_design="all") -> dict[int, float]:
        """``{k: pooled MaRI}`` for every normalised ``k``, all at one ``tau``.

        ``tau=None`` is resolved once at the operating ``k`` selected over ``k_values`` (so some
        ``k`` must be below the scope size); an explicit ``tau`` runs no selection and no check.
        """
        return cls.compute_curve_with(
            cross_group_knn, features, manifest, confounder_column=confounder_column, k_values=k_values,
            tau=tau, evaluation_design=evaluation_design,
        )

    @classmethod
    def compute_curve_with(cls, search, features, manifest, *, confounder_column, k_values, tau=None, evaluation_design="all") -> dict[int, float]:
        """:meth:`compute_curve` with the neighbour backend ``search``."""
        _check_tau(tau)
        if tau is None:
            ev, ks, k = _select_phase(
                search, features, manifest, confounder_column=confounder_column, k_values=k_values,
                evaluation_design=evaluation_design,
            )
            tau = _resolve_tau(ev, k)
            _validated(ev)
        else:
            ev = _Evaluation.open(search, features, manifest, confounder_column=confounder_column, evaluation_design=evaluation_design)
            ev.build_scopes(validate_subsets=True)
            ks = normalize_k_values(k_values)
            ev.width = max(ks)
        tau = float(tau)
        kmax = max(ks)
        per_scope = ev.score(ks, kmax, tau)
        return {k: float(ev.pooled(per_scope, k, kmax, tau)) for k in ks}

    @classmethod
    def recommend_tau(cls, features, manifest, *, confounder_column, k, evaluation_design="all") -> float:
        """The median typed (SO/OS) neighbour distance at window ``k`` (spec §6.3).

        NaN when no typed neighbour exists, ``k <= 0`` or every scope has ≤ 1 row; 0.0 when at least
        half of the typed distances are 0. Validates the manifest and the design only (paired:
        incomplete subsets are skipped; none left → ``RuntimeError``).
        """
        return cls.recommend_tau_with(
            cross_group_knn, features, manifest, confounder_column=confounder_column, k=k,
            evaluation_design=evaluation_design,
        )

    @classmethod
    def recommend_tau_with(cls, search, features, manifest, *, confounder_column, k, evaluation_design="all") -> float:
        """:meth:`recommend_tau` with the neighbour backend ``search``."""
        ev = _Evaluation.open(
            search, features, manifest, confounder_column=confounder_column,
            evaluation_design=evaluation_design, check_feature_types=False,
        )
        ev.build_scopes(validate_subsets=False)
        k = int(k)
        if k <= 0:
            return float("nan")
        ev.width = k
        typed = ev.typed_distances(k)
        return float(np.median(typed)) if typed.size else float("nan")


MaRI = MarginAwareRobustnessIndex
