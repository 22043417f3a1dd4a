"""CRoMa, the cross-confounder robustness margin, with croma 1.0.1's contract (spec/metrics.md §7).

Per unit ``i`` of a scope, with ``dSO``/``dOS`` the means of the ``m`` smallest SO/OS distances to
rows of other groups::

    CRoMa_i = (dOS - dSO) / (dOS + dSO)

The reference finds the typed neighbours by growing a kNN window (start ``start_k``, factor
``k_growth_factor``). That schedule never changes a margin (§7.4), so the margins here come from an
exact per-cell typed search (:func:`cachescore.neighbors.typed.typed_knn`, or any callable with its
contract passed to :meth:`CrossConfounderRobustnessMargin.compute_with`). Only the diagnostics
``k_start``/``k_final``/``retries`` depend on the schedule; they are reproduced arithmetically
from one counting pass (§7.10) instead of by growing a window; ``compute_with(...,
schedule_diagnostics=False)`` skips that pass (an O(n²·d) GEMM pass, impossible for huge ANN
scopes) and reports them as :data:`SCHEDULE_NOT_COMPUTED` (-1). Both passes are injectable
(``typed_search``, ``count_search``), e.g. with the Dask-distributed twins of
:mod:`cachescore.neighbors.blocked`.

Total support is a contract: any unit without ``m`` SO and ``m`` OS neighbours, or with a zero
denominator, raises ``RuntimeError`` and no result is returned (§7.5).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import numpy as np

from ..manifest import (
    Scope,
    check_features,
    check_finite_rows,
    coerce_manifest,
    normalize_design,
    prepare,
)
from ..neighbors.base import call_search
from ..neighbors.normalize import normalize_rows
from ..neighbors.typed import (
    count_within,
    search_threads,
    typed_knn,
    typed_knn_and_counts,
)
from ..types import CRoMaResult
from .tail import compute_tail_metrics, confounder_dominant_fraction

__all__ = ["CROMA_HEADLINE_M", "CROMA_ALPHA", "CROMA_START_K", "CROMA_K_GROWTH", "SCHEDULE_NOT_COMPUTED", "CrossConfounderRobustnessMargin", "CRoMa", "croma_schedule", "TypedSearch"]

#: Default (headline) number of typed neighbours averaged per type.
CROMA_HEADLINE_M = 5
#: croma 1.0.1's defaults of the lower-tail level and of the window schedule (declared once: the
#: metric API's signatures and the job keys of ``[metrics.croma]`` both read them).
CROMA_ALPHA = 0.10
CROMA_START_K = 200
CROMA_K_GROWTH = 2.0

#: ``typed_search(u, labels, confounders, groups, m) -> (so_dist, os_dist)``, each (n, m) float64
#: ascending and ``+inf`` padded; see :func:`cachescore.neighbors.typed.typed_knn`.
TypedSearch = Callable[..., tuple[np.ndarray, np.ndarray]]

#: Value reported for ``k_start``, ``k_final`` and ``retries`` when ``compute_with`` is called with
#: ``schedule_diagnostics=False``: "not computed" (no real schedule can produce a negative window).
SCHEDULE_NOT_COMPUTED = -1

#: Slack, in units of the compute dtype's machine epsilon, added to each unit's typed radius in the
#: counting pass. Distances of one pair computed by two GEMMs of different shapes may differ in the
#: last few bits; without the slack the unit's own m-th typed neighbour could drop out of its count.
_COUNT_SLACK_EPS = 4.0


def croma_schedule(n: int, start_k: int, k_growth_factor: float, max_need: float) -> tuple[int, int, int]:
    """``(k_start, k_final, retries)`` of croma's window schedule for one scope (spec §7.2).

    ``max_need`` is the largest window any unit needs to see its ``m_max``-th SO and OS neighbour
    (``inf`` when some unit can never be resolved). The windows are ``k_0 = max(1, min(start_k,
    n-1))`` and ``k_{r+1} = min(n-1, max(k_r + 1, ceil(k_r * factor)))``. After each round the
    reference stops if the window is at the cap ``n-1``; otherwise it grows the window (one retry)
    and only then notices that no unit is left unresolved. So when every unit resolves in round
    ``r`` below the cap, the reported ``k_final`` is ``k_{r+1}`` and ``retries`` is ``r + 1``
    (e.g. the isotropic 1000-row fixture resolves at 200 and reports ``200 -> 400``, 1 retry).
    ``n <= 1`` gives ``(0, 0, 0)``.
    """
    n = int(n)
    if n <= 1:
        return 0, 0, 0
    k = int(max(1, min(int(start_k), n - 1)))
    k_start, retries = k, 0
    while True:
        resolved = k >= max_need
        if k >= n - 1:
            break
        k = int(min(n - 1, max(k + 1, math.ceil(float(k) * float(k_growth_factor)))))
        retries += 1
        if resolved:
            break
    return k_start, k, retries


def _schedule_or_radius(dtype, scope: Scope, so, os_, *, start_k, k_growth_factor):
    """``(schedule, None)`` when the scope's schedule is decided without counting, else
    ``(None, radius)``: the per-unit radius (with slack) to count cross-group rows within."""
    n = scope.n
    if n <= 1:
        return (0, 0, 0), None
    if int(max(1, min(int(start_k), n - 1))) >= n - 1:
        return croma_schedule(n, start_k, k_growth_factor, 0), None  # one round, at the cap
    radius = np.maximum(so[:, -1], os_[:, -1])
    if not np.isfinite(radius).all():
        return croma_schedule(n, start_k, k_growth_factor, math.inf), None
    # Cheap bracket: every unit needs at least its 2*m_max typed rows and at most its whole
    # cross-group pool. When both bounds give the same schedule, no counting pass is needed.
    m_max = so.shape[1]
    upper = n - int(np.unique(scope.groups, return_counts=True)[1].min())
    lower = min(2 * m_max, upper)
    if croma_schedule(n, start_k, k_growth_factor, lower) == croma_schedule(n, start_k, k_growth_factor, upper):
        return croma_schedule(n, start_k, k_growth_factor, upper), None
    return None, radius + _COUNT_SLACK_EPS * float(np.finfo(dtype).eps)


def _scope_schedule(
    u, scope: Scope, so: np.ndarray, os_: np.ndarray, *, start_k, k_growth_factor, count=True, count_search=count_within
) -> tuple[int, int, int] | None:
    """The scope's ``(k_start, k_final, retries)``; ``None`` when only a counting pass could tell
    and ``count`` is False. An unresolved unit sends the schedule to the cap: no counting."""
    decided, radius = _schedule_or_radius(u.dtype, scope, so, os_, start_k=start_k, k_growth_factor=k_growth_factor)
    if decided is not None:
        return decided
    if not count:
        return None
    need = count_search(u, scope.groups, radius)
    return croma_schedule(scope.n, start_k, k_growth_factor, int(need.max()))


def _fused_search(u, scope: Scope, m_max, *, start_k, k_growth_factor, threads=None):
    """The default exact backend with the counting pass sharing the typed search's GEMMs
    (:func:`cachescore.neighbors.typed.typed_knn_and_counts`): ``(so, os, schedule)``."""
    decided = {}

    def radius_for(so, os_):
        decided["schedule"], radius = _schedule_or_radius(
            u.dtype, scope, so, os_, start_k=start_k, k_growth_factor=k_growth_factor
        )
        return radius

    so, os_, need = typed_knn_and_counts(
        u, scope.labels, scope.confounders, scope.groups, m_max, radius_for, threads=threads
    )
    if need is not None:
        return so, os_, croma_schedule(scope.n, start_k, k_growth_factor, int(need.max()))
    return so, os_, decided["schedule"]


def _margins(so: np.ndarray, os_: np.ndarray):
    """Per-unit margins for one m, plus the disjoint unresolved / zero-denominator masks."""
    unresolved = np.isinf(so).any(axis=1) | np.isinf(os_).any(axis=1)
    mean_so = np.mean(so, axis=1)
    mean_os = np.mean(os_, axis=1)
    denom = mean_os + mean_so
    with np.errstate(divide="ignore", invalid="ignore"):
        values = (mean_os - mean_so) / denom
    zero = ~unresolved & (denom == 0.0)
    values[unresolved | zero] = np.nan
    return values, unresolved, zero


def _require_support(unresolved, zero, *, dataset, design, subset, unit, m, n, k_final) -> None:
    causes = []
    n_unresolved = int(unresolved.sum())
    if n_unresolved:
        causes.append(
            f"{n_unresolved}/{n} {unit}(s) could not find {m} SO and {m} OS neighbour(s) after adaptive "
            f"neighbour search reached k={k_final}"
        )
    n_zero = int(zero.sum())
    if n_zero:
        causes.append(
            f"{n_zero}/{n} {unit}(s) have a zero margin denominator (d_OS + d_SO = 0) despite complete "
            "typed-neighbour support, as produced by a collapsed embedding or duplicated rows"
        )
    if causes:
        raise RuntimeError(
            f"[CRoMa] dataset '{dataset}' ({design}), subset '{subset}', m={m}: {'; '.join(causes)}; "
            f"CRoMa requires every requested {unit} to be scoreable, so no pooled or tail statistics "
            "were computed"
        )


def _parse_m(m) -> tuple[list[int], bool]:
    if isinstance(m, (list, tuple)):
        if len(m) == 0:
            raise ValueError("m must include at least one integer")
        ordered = [int(v) for v in m]
        single = False
    else:
        ordered = [int(m)]
        single = True
    if min(ordered) < 1:
        raise ValueError("m must be >= 1")
    return ordered, single


class CrossConfounderRobustnessMargin:
    """Namespace of classmethods; never instantiated (croma-compatible)."""

    @classmethod
    def compute(
        cls,
        features,
        manifest,
        *,
        confounder_column,
        evaluation_design="all",
        m=CROMA_HEADLINE_M,
        alpha=CROMA_ALPHA,
        start_k=CROMA_START_K,
        k_growth_factor=CROMA_K_GROWTH,
    ):
        """CRoMa of ``features`` (N, D) (numpy or row-chunked dask) over ``manifest`` (N rows).

        Returns a :class:`~cachescore.types.CRoMaResult`, or ``dict[int, CRoMaResult]`` keyed by the
        distinct ``int(m)`` in first-appearance order when ``m`` is a list or tuple.

        Raises, in this order (spec §1.8): ``ValueError`` for a bad ``evaluation_design``, ``m``
        (empty, or any value < 1), ``start_k < 1`` or ``k_growth_factor <= 1``; ``TypeError`` /
        ``ValueError`` for manifest/features type, ndim or row count; ``ValueError`` for manifest
        normalisation and paired-subset errors; per scope (subsets in sorted order) ``ValueError``
        for NaN/inf features, then ``RuntimeError`` when total support fails for some m (ascending);
        finally numpy's ``ValueError`` for ``alpha`` outside [0, 1].

        An empty manifest under ``all`` returns a NaN result (numpy warns about the empty median).
        """
        return cls.compute_with(
            typed_knn,
            features,
            manifest,
            confounder_column=confounder_column,
            evaluation_design=evaluation_design,
            m=m,
            alpha=alpha,
            start_k=start_k,
            k_growth_factor=k_growth_factor,
        )

    @classmethod
    def compute_with(
        cls,
        typed_search: TypedSearch,
        features,
        manifest,
        *,
        confounder_column,
        evaluation_design="all",
        m=CROMA_HEADLINE_M,
        alpha=CROMA_ALPHA,
        start_k=CROMA_START_K,
        k_growth_factor=CROMA_K_GROWTH,
        schedule_diagnostics=True,
        count_search=None,
        threads=None,
    ):
        """:meth:`compute` with an injected typed-neighbour backend.

        ``typed_search(u, labels, confounders, groups, m)`` must honour the contract of
        :func:`cachescore.neighbors.typed.typed_knn`: ``u`` (n, d) normalised rows, int codes of
        shape (n,), returns ``(so_dist, os_dist)`` float64 (n, m) ascending, ``+inf`` padded. It is
        called once per scope with ``n >= 2``, with ``m = max(m)``.

        ``schedule_diagnostics`` (default True): compute ``k_start``/``k_final``/``retries``
        exactly, which costs one blocked O(n²·d) counting pass per scope with ``start_k < n-1``
        whose units are all resolved. With False that pass is skipped (for scopes too large for it,
        e.g. ANN scopes) and all three fields are :data:`SCHEDULE_NOT_COMPUTED` (-1, "not
        computed") in every returned result; margins and statistics are unchanged, and the
        total-support error message still reports croma's ``k`` (an unresolved scope's schedule
        runs to the cap, which needs no counting).

        ``count_search(u, groups, radius) -> counts`` replaces the counting pass's kernel
        (default :func:`cachescore.neighbors.typed.count_within`, whose contract it must honour),
        e.g. ``cachescore.neighbors.blocked.make_search(client, "count")``. With the default
        backends (``typed_search is typed_knn``, no ``count_search``) both passes run fused
        (:func:`~cachescore.neighbors.typed.typed_knn_and_counts`): the typed cell pairs' GEMMs
        serve the count too.

        ``threads``: Python threads of the default exact kernels (``typed_knn`` when it is the
        backend, the default counting pass, the fused pair; default
        :func:`cachescore.neighbors.typed.search_threads`: the CPU affinity, 1 inside a Dask
        worker task). BLAS is pinned to one thread during those kernels; results are
        bit-identical for every value. Injected backends are called unchanged. ``ValueError``
        when ``threads < 1``.
        """
        design = normalize_design(evaluation_design)
        ordered_m, single = _parse_m(m)
        if threads is not None:
            search_threads(threads)  # validate before any work
        if int(start_k) < 1:
            raise ValueError("start_k must be >= 1")
        if float(k_growth_factor) <= 1.0:
            raise ValueError("k_growth_factor must be > 1")
        frame = coerce_manifest(manifest)
        features = check_features(features, len(frame), require_units=False)
        prepared = prepare(frame, confounder_column=confounder_column, evaluation_design=design)
        if design == "paired_2x2" and not prepared.scopes:
            raise ValueError(f"manifest for dataset '{prepared.dataset}' does not define any subsets")

        unique_m = sorted(set(ordered_m))
        m_max = unique_m[-1]
        unit = prepared.unit
        values_by_m: dict[int, list[np.ndarray]] = {mm: [] for mm in unique_m}
        medians_by_m: dict[int, list[float]] = {mm: [] for mm in unique_m}
        diagnostics = []
        for scope in prepared.scopes:
            n = scope.n
            so, os_, diag = _scope_neighbours(
                features, scope, m_max, typed_search=typed_search, count_search=count_search,
                schedule_diagnostics=schedule_diagnostics, start_k=start_k, k_growth_factor=k_growth_factor,
                threads=threads,
            )
            diagnostics.append(diag)
            for mm in unique_m:
                values, unresolved, zero = _margins(so[:, :mm], os_[:, :mm])
                _require_support(
                    unresolved,
                    zero,
                    dataset=prepared.dataset,
                    design=design,
                    subset=scope.subset,
                    unit=unit,
                    m=mm,
                    n=n,
                    k_final=diag[1] if diag is not None else SCHEDULE_NOT_COMPUTED,
                )
                values_by_m[mm].append(values)
                medians_by_m[mm].append(float(np.median(values)))

        k_start, k_final, retries = _schedule_summary(diagnostics, schedule_diagnostics)
        if prepared.scopes:
            subsets = np.concatenate([np.full(s.n, s.subset, dtype=object) for s in prepared.scopes]).astype(str)
        else:
            subsets = np.empty(0, dtype=str)
        common = dict(
            evaluation_design=design,
            evaluation_unit=unit,
            occurrence_subsets=subsets,
            occurrence_source_indices=prepared.source_indices.astype(int),
            k_start=int(k_start),
            k_final=int(k_final),
            retries=int(retries),
        )
        results = {
            mm: _croma_result(prepared.dataset, mm, medians_by_m[mm], values_by_m[mm], alpha=alpha, **common)
            for mm in unique_m
        }
        if single:
            return results[ordered_m[0]]
        return {mm: results[mm] for mm in ordered_m}


def _scope_neighbours(features, scope, m_max, *, typed_search, count_search, schedule_diagnostics, start_k,
                      k_growth_factor, threads):
    """``(so, os_, diag)`` of one scope: its typed distances (float64, (n, m_max), +inf padded)
    and its schedule diagnostics ``(k_start, k_final, retries)``. Default backends with
    diagnostics run fused; a scope of fewer than two rows has no neighbours (all +inf)."""
    n = scope.n
    if n < 2:
        return np.full((n, m_max), np.inf), np.full((n, m_max), np.inf), (0, 0, 0)
    check_finite_rows(features, scope.rows)
    u = normalize_rows(features[scope.rows])
    fused = typed_search is typed_knn and count_search is None and schedule_diagnostics
    if fused:
        so, os_, diag = _fused_search(u, scope, m_max, start_k=start_k, k_growth_factor=k_growth_factor, threads=threads)
    elif typed_search is typed_knn:
        so, os_ = typed_knn(u, scope.labels, scope.confounders, scope.groups, m_max, threads=threads)
    else:
        so, os_ = call_search(typed_search, u, scope.labels, scope.confounders, scope.groups, m_max, scope=scope.subset)
    so = np.ascontiguousarray(so, dtype=np.float64)
    os_ = np.ascontiguousarray(os_, dtype=np.float64)
    if so.shape != (n, m_max) or os_.shape != (n, m_max):
        raise ValueError(f"typed_search returned shapes {so.shape} and {os_.shape}; expected ({n}, {m_max}) each")
    if not fused:
        diag = _scope_schedule(
            u,
            scope,
            so,
            os_,
            start_k=start_k,
            k_growth_factor=k_growth_factor,
            count=schedule_diagnostics,
            count_search=partial(count_within, threads=threads) if count_search is None else count_search,
        )
    return so, os_, diag


def _schedule_summary(diagnostics, computed: bool) -> tuple[int, int, int]:
    """``(k_start, k_final, retries)`` over the scopes, or :data:`SCHEDULE_NOT_COMPUTED` thrice."""
    if not computed:
        return SCHEDULE_NOT_COMPUTED, SCHEDULE_NOT_COMPUTED, SCHEDULE_NOT_COMPUTED
    return (min((d[0] for d in diagnostics), default=0), max((d[1] for d in diagnostics), default=0),
            max((d[2] for d in diagnostics), default=0))


def _croma_result(dataset, mm, medians, values, *, alpha, **common) -> CRoMaResult:
    """The :class:`CRoMaResult` of margin size ``mm`` from its per-scope medians and unit values."""
    pair_values = np.asarray(medians, dtype=float)
    finite = pair_values[np.isfinite(pair_values)]
    value = float(np.median(finite)) if finite.size else float("nan")
    std = float(finite.std(ddof=0)) if finite.size > 1 else 0.0
    unit_values = np.concatenate(values).astype(float) if values else np.empty(0, dtype=float)
    tail = compute_tail_metrics(unit_values, alpha=alpha)
    return CRoMaResult(
        dataset,
        mm,
        value,
        std,
        len(pair_values),
        pair_values,
        unit_values,
        unit_values,
        **common,
        alpha=tail.alpha,
        q_alpha=tail.q_alpha,
        ltm_alpha=tail.ltm_alpha,
        f0=confounder_dominant_fraction(unit_values),
    )


#: Public alias (croma-compatible).
CRoMa = CrossConfounderRobustnessMargin
