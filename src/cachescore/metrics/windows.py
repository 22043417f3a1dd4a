"""Neighbour windows, the reference's fetch cap, effective k and per-unit evidence (spec §3, §5, §6).

One neighbour table per scope serves every step of a metric call (scoring, k-selection, tau, the
tau scale check). Each step has its own ``kmax`` (spec §3.5), and the reference's window for that
step differs from a prefix of the exact cross-group list only under the *cap*:

* uncapped (``kmax + max(64, G) < n - 1``): the window is the first ``kmax`` rows of ``X_i``;
* capped: the reference fetches ``n - 1`` rows counting ``i`` itself, so the single farthest row
  ``f_i`` of the whole scope is invisible. Since ``f_i``, when it is cross-group, is the *last*
  entry of ``i``'s sorted cross-group list, the window is still a prefix, only one entry shorter
  when it would reach that last entry (``kmax >= |X_i|``).

So a step's window is fully described by ``valid_i`` = the number of usable prefix entries::

    valid_i = min(kmax, |X_i| - [capped and f_i in X_i])

and ``eff_k_i = min(k, valid_i)`` for a window size ``k <= kmax`` (spec §3.6). The farthest-row
flag is only needed for rows with ``|X_i| <= kmax`` of a capped step, and is computed for those
rows only (one extra pass over the scope; capped scopes are small by definition).

Per-unit quantities are row-parallel (spec §12.2) and are computed in row blocks from the
``(n, W)`` table with cumulative sums over the type matrix; nothing here loops over units.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..manifest import Scope
from ..neighbors.base import call_search
from ..neighbors.exact import farthest_rows
from ..neighbors.fetch import MIN_NEIGHBOR_BUFFER, is_capped

__all__ = [
    "MIN_NEIGHBOR_BUFFER",
    "TINY",
    "ScopeTable",
    "is_capped",
    "build_table",
    "valid_counts",
    "type_matrix",
    "ScopeScores",
    "unit_scores",
    "pooled_ratio",
    "score_scope",
    "typed_distances",
    "ratio_from_log",
]

#: Smallest normal float64; below it MaRI switches from linear to log-space ratios (spec §6.1).
TINY = float(np.finfo(np.float64).tiny)
#: Entries (rows x window width) per block for per-unit computations: ~32 MiB per int64 array.
BLOCK_ENTRIES = 1 << 22


def row_block(width: int) -> int:
    """Rows per block so that a (rows, ``width``) block holds about :data:`BLOCK_ENTRIES` entries."""
    return max(1, BLOCK_ENTRIES // max(1, int(width)))

# Neighbour type codes in the type matrix.
SO, OS, SS, OO, PAD = 0, 1, 2, 3, -1


@dataclass
class ScopeTable:
    """The exact cross-group neighbour table of one scope, plus what the cap rule needs.

    ``idx``/``dist``: (n, W) from the search backend, ``(distance, index)`` order, padded with
    -1/+inf. ``cross_count[i] = |X_i|`` (rows outside ``i``'s group). ``u`` is kept so the
    farthest-row flags can be computed on demand for capped steps.
    """

    scope: Scope
    u: np.ndarray
    idx: np.ndarray
    dist: np.ndarray
    cross_count: np.ndarray
    _far_cross: np.ndarray | None = field(default=None, repr=False)
    _far_known: np.ndarray | None = field(default=None, repr=False)

    @property
    def n(self) -> int:
        return self.scope.n

    @property
    def width(self) -> int:
        return int(self.idx.shape[1])

    def far_is_cross(self, rows: np.ndarray) -> np.ndarray:
        """Whether the farthest scope row from each of ``rows`` lies outside its group."""
        n = self.n
        if self._far_cross is None:
            self._far_cross = np.zeros(n, dtype=bool)
            self._far_known = np.zeros(n, dtype=bool)
        todo = rows[~self._far_known[rows]]
        if todo.size:
            far = farthest_rows(self.u, todo)
            g = self.scope.groups
            self._far_cross[todo] = g[far] != g[todo]
            self._far_known[todo] = True
        return self._far_cross[rows]


def build_table(search, u: np.ndarray, scope: Scope, kmax: int) -> ScopeTable:
    """Search ``scope`` once at window ``min(kmax, longest cross-group list)`` with ``search``.

    The longest cross-group list has ``n - (smallest group size) <= n - 1`` entries, so no row can
    ever have more usable neighbours than that: a wider table would only hold padding. The width
    is therefore bounded by the scope, whatever ``kmax`` (``k = 10**6`` on a 2,000-row scope costs
    what ``k = n - 1`` costs), and :func:`valid_counts` is unchanged (``valid_i <= |X_i|``; the cap
    rule only ever shortens a window). ``search`` has the contract of
    :func:`cachescore.neighbors.exact.cross_group_knn`. Raises ``RuntimeError`` for a scope of
    fewer than 2 rows (spec §3.1).
    """
    n = scope.n
    if n <= 1:
        raise RuntimeError(
            f"scope '{scope.subset}' has {n} row(s): need at least two samples to compute neighbours"
        )
    sizes = np.bincount(scope.groups)
    longest = n - int(sizes[sizes > 0].min())
    width = max(1, min(int(kmax), longest))
    idx, dist = call_search(search, u, scope.groups, width, scope=scope.subset)
    idx = np.asarray(idx, dtype=np.int64)
    dist = np.asarray(dist, dtype=np.float64)
    if idx.shape != (n, width) or dist.shape != (n, width):
        raise ValueError(
            f"neighbour backend returned shapes {idx.shape}/{dist.shape}, expected ({n}, {width})"
        )
    cross = n - sizes[scope.groups]
    return ScopeTable(scope=scope, u=u, idx=idx, dist=dist, cross_count=cross.astype(np.int64))


def valid_counts(table: ScopeTable, kmax: int) -> np.ndarray:
    """``valid_i`` for a step fetching at ``kmax`` (spec §3.2, §3.5), int64 of shape (n,)."""
    kmax = int(kmax)
    n = table.n
    found = np.count_nonzero(table.idx >= 0, axis=1)
    valid = np.minimum(np.minimum(found, table.cross_count), kmax)
    if is_capped(kmax, n, table.scope.max_group_size):
        reach = np.flatnonzero(table.cross_count <= kmax)
        if reach.size:
            drop = table.far_is_cross(reach)
            rows = reach[drop]
            valid[rows] = np.minimum(valid[rows], table.cross_count[rows] - 1)
    return valid.astype(np.int64)


def type_matrix(labels: np.ndarray, confounders: np.ndarray, idx: np.ndarray, valid: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """(rows, W) int8 neighbour types (SO=0, OS=1, SS=2, OO=3, -1 outside the window).

    ``idx`` are the table rows of the scope rows ``queries``; slots at positions ``>= valid`` are -1.
    """
    safe = np.where(idx >= 0, idx, 0)
    same_l = labels[safe] == labels[queries][:, None]
    same_c = confounders[safe] == confounders[queries][:, None]
    types = np.where(same_l, np.where(same_c, SS, SO), np.where(same_c, OS, OO)).astype(np.int8)
    types[~(np.arange(idx.shape[1])[None, :] < valid[:, None])] = PAD
    return types


def ratio_from_log(log_so, log_os) -> np.ndarray:
    """``exp(L_SO - logaddexp(L_SO, L_OS))`` in extended precision; 0.5 where not finite."""
    log_so = np.asarray(log_so, dtype=np.longdouble)
    log_os = np.asarray(log_os, dtype=np.longdouble)
    denom = np.logaddexp(log_so, log_os)
    ok = np.isfinite(denom)
    out = np.full(denom.shape, 0.5, dtype=np.float64)
    out[ok] = np.exp(log_so[ok] - denom[ok]).astype(np.float64)
    return out


@dataclass
class ScopeScores:
    """Per-unit results of one scope for one window size ``k`` (spec §5.1–5.3, §6.1–6.2).

    ``values``: per-unit RI/MaRI (NaN if undefined); ``defined``; ``types`` (0 defined, 1 SS-,
    2 OO-dominated, 3 mixed/no neighbour); ``so``/``os``: per-unit evidence (counts as float for
    RI, weight sums for MaRI); ``pooled``: the scope's pooled value; ``log_so``/``log_os``: the
    scope's log-evidence totals (longdouble), computed only when a log path needs them.
    """

    k: int
    values: np.ndarray
    defined: np.ndarray
    types: np.ndarray
    so: np.ndarray
    os: np.ndarray
    pooled: float
    log_so: object = None
    log_os: object = None


def _gather(cum: np.ndarray, eff: np.ndarray, zero):
    """cum[i, eff_i - 1], or ``zero`` where eff_i == 0."""
    col = np.maximum(eff - 1, 0)
    out = cum[np.arange(cum.shape[0]), col]
    return np.where(eff > 0, out, zero)


def _log_cumulative(dist: np.ndarray, types: np.ndarray, tau: float, which: int) -> np.ndarray:
    """Running ``logaddexp`` of ``-d/tau`` over the slots of type ``which`` (longdouble)."""
    logw = -np.asarray(dist, dtype=np.longdouble) / np.longdouble(tau)
    logw = np.where(types == which, logw, np.longdouble(-np.inf))
    return np.logaddexp.accumulate(logw, axis=1)


def unit_scores(table: ScopeTable, valid: np.ndarray, ks: list[int], tau: float | None = None, *,
                offset: int = 0) -> dict[int, ScopeScores]:
    """Per-unit RI (``tau is None``) or MaRI (``tau > 0``) of rows ``offset .. offset + len(valid)``
    of a scope for every ``k`` in ``ks``, without the scope's pooled value (``pooled`` is 0.5).

    ``table.idx`` / ``table.dist`` hold those rows only (row ``r`` of the table is scope row
    ``offset + r``); ``table.scope`` holds the whole scope's codes (neighbours are scope rows).
    ``valid`` is the scoring step's ``valid_i`` of those rows (:func:`valid_counts` at
    ``max(ks)``). Every quantity is row-wise, so a row's values do not depend on ``offset`` or on
    how a scope is cut into ranges (the out-of-core reductions, :mod:`cachescore.metrics.large`,
    score a scope range by range on the workers).
    """
    scope = table.scope
    n = int(valid.shape[0])
    nk = len(ks)
    kv = np.asarray(ks, dtype=np.int64)
    so = np.zeros((n, nk))
    os_ = np.zeros((n, nk))
    n_typed = np.zeros((n, nk), dtype=np.int64)
    n_ss = np.zeros((n, nk), dtype=np.int64)
    n_oo = np.zeros((n, nk), dtype=np.int64)
    eff_all = np.minimum(valid[:, None], kv[None, :])
    step = row_block(table.width)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        types = type_matrix(scope.labels, scope.confounders, table.idx[r0:r1], valid[r0:r1],
                            np.arange(offset + r0, offset + r1))
        eff = eff_all[r0:r1]
        if tau is None:
            w_so = np.cumsum(types == SO, axis=1, dtype=np.int64)
            w_os = np.cumsum(types == OS, axis=1, dtype=np.int64)
        else:
            with np.errstate(over="ignore", under="ignore"):
                weights = np.exp(-np.asarray(table.dist[r0:r1]) / float(tau))
            w_so = np.cumsum(np.where(types == SO, weights, 0.0), axis=1)
            w_os = np.cumsum(np.where(types == OS, weights, 0.0), axis=1)
        c_ss = np.cumsum(types == SS, axis=1, dtype=np.int64)
        c_oo = np.cumsum(types == OO, axis=1, dtype=np.int64)
        c_typed = np.cumsum((types == SO) | (types == OS), axis=1, dtype=np.int64)
        for j in range(nk):
            e = eff[:, j]
            so[r0:r1, j] = _gather(w_so, e, 0)
            os_[r0:r1, j] = _gather(w_os, e, 0)
            n_typed[r0:r1, j] = _gather(c_typed, e, 0)
            n_ss[r0:r1, j] = _gather(c_ss, e, 0)
            n_oo[r0:r1, j] = _gather(c_oo, e, 0)

    out: dict[int, ScopeScores] = {}
    for j, k in enumerate(ks):
        defined = n_typed[:, j] > 0
        s, o = so[:, j].copy(), os_[:, j].copy()
        denom = s + o
        values = np.full(n, np.nan)
        linear = defined & (denom >= TINY)
        values[linear] = s[linear] / denom[linear]
        need_log = defined & ~linear
        if tau is not None and need_log.any():
            values[need_log] = ratio_from_log(*_unit_log_evidence(table, valid, k, tau, np.flatnonzero(need_log),
                                                                  offset=offset))
        types_out = np.zeros(n, dtype=np.int64)
        undef = ~defined
        has = eff_all[:, j] > 0
        ss_c, oo_c = n_ss[:, j], n_oo[:, j]
        cause = np.where(ss_c > oo_c, 1, np.where(oo_c > ss_c, 2, 3))
        types_out[undef & has] = cause[undef & has]
        types_out[undef & ~has] = 3
        out[int(k)] = ScopeScores(k=int(k), values=values, defined=defined, types=types_out, so=s, os=o, pooled=0.5)
    return out


def pooled_ratio(total_so: float, total_os: float, any_defined: bool, log_totals) -> tuple[float, object, object]:
    """A scope's pooled value from its evidence totals (numpy's pairwise sums over its units, in
    unit order): ``(pooled, log_so, log_os)``. 0.5 when no unit is defined; below :data:`TINY`,
    ``log_totals()`` gives the log-evidence totals (:func:`scope_log_totals`) and the ratio is
    taken in log space (the log totals are returned, else None)."""
    if not any_defined:
        return 0.5, None, None
    if total_so + total_os >= TINY:
        return total_so / (total_so + total_os), None, None
    log_so, log_os = log_totals()
    return float(ratio_from_log(log_so, log_os)), log_so, log_os


def score_scope(table: ScopeTable, valid: np.ndarray, ks: list[int], tau: float | None = None) -> dict[int, ScopeScores]:
    """Per-unit RI (``tau is None``) or MaRI (``tau > 0``) of one scope for every ``k`` in ``ks``.

    ``valid`` is the scoring step's ``valid_i`` (:func:`valid_counts` at ``max(ks)``).
    Evidence is accumulated left to right in ascending distance (a running sum per row), and
    pooled with numpy's pairwise sum over units in unit order, as the reference does.
    """
    out = unit_scores(table, valid, ks, tau)
    for k, scores in out.items():
        scores.pooled, scores.log_so, scores.log_os = pooled_ratio(
            float(scores.so.sum()), float(scores.os.sum()), bool(scores.defined.any()),
            lambda k=k: scope_log_totals(table, valid, k, tau))
    return out


def _unit_log_evidence(table: ScopeTable, valid: np.ndarray, k: int, tau: float | None, rows: np.ndarray, *,
                       offset: int = 0):
    """Per-unit ``(L_SO, L_OS)`` at window ``k`` for ``rows`` (longdouble, each of shape ``rows.shape``);
    ``rows`` index ``table`` and ``valid``, whose row ``r`` is scope row ``offset + r``.

    Works in row blocks of :func:`row_block` ``(width)`` rows, so the longdouble work arrays stay
    bounded whatever ``len(rows)``; each row's value does not depend on the blocking.
    """
    scope = table.scope
    rows = np.asarray(rows, dtype=np.int64)
    ninf = np.longdouble(-np.inf)
    l_so = np.full(rows.shape[0], ninf, dtype=np.longdouble)
    l_os = np.full(rows.shape[0], ninf, dtype=np.longdouble)
    flat = tau is None  # RI: unit weights (log 1 = 0)
    tau = 1.0 if flat else tau
    step = row_block(table.width)
    for b0 in range(0, rows.shape[0], step):
        sel = rows[b0 : b0 + step]
        types = type_matrix(scope.labels, scope.confounders, table.idx[sel], valid[sel], sel + offset)
        eff = np.minimum(valid[sel], int(k))
        dist = np.zeros(types.shape) if flat else np.asarray(table.dist[sel])
        l_so[b0 : b0 + sel.shape[0]] = _gather(_log_cumulative(dist, types, tau, SO), eff, ninf)
        l_os[b0 : b0 + sel.shape[0]] = _gather(_log_cumulative(dist, types, tau, OS), eff, ninf)
    return l_so, l_os


def scope_log_totals(table: ScopeTable, valid: np.ndarray, k: int, tau: float | None, *, offset: int = 0,
                     initial=None):
    """The scope's log-evidence totals at ``k``: ``logaddexp.reduce`` of per-unit ``L`` in unit order.

    Returns ``(log_so, log_os)`` as longdouble scalars. The per-unit values are computed in row
    blocks and folded block after block with the previous total as the reduction's initial value:
    the same left-to-right sequence of ``logaddexp`` operations as one reduction over all units
    (bit-identical), without (n, W) longdouble arrays. Callers holding a :class:`ScopeScores` whose
    ``log_so``/``log_os`` are set should use those instead (they are these totals).

    ``table`` and ``valid`` may hold rows ``offset .. offset + len(valid)`` of the scope only, and
    ``initial`` ``(log_so, log_os)`` the fold of the rows before them: the fold then continues
    over these rows, so a chain of ranges gives the scope's totals bit for bit.
    """
    n = int(valid.shape[0])
    tot_so, tot_os = (None, None) if initial is None else initial
    step = row_block(table.width)
    for r0 in range(0, n, step):
        l_so, l_os = _unit_log_evidence(table, valid, k, tau, np.arange(r0, min(n, r0 + step)), offset=offset)
        if tot_so is None:
            tot_so, tot_os = np.logaddexp.reduce(l_so), np.logaddexp.reduce(l_os)
        else:
            tot_so = np.logaddexp.reduce(l_so, initial=tot_so)
            tot_os = np.logaddexp.reduce(l_os, initial=tot_os)
    if tot_so is None:
        ninf = np.longdouble(-np.inf)
        return ninf, ninf
    return tot_so, tot_os


def typed_distances(table: ScopeTable, valid: np.ndarray, k: int, *, offset: int = 0) -> np.ndarray:
    """Distances of the SO/OS slots inside each unit's window at ``k``, row-major (spec §6.3);
    ``table``/``valid`` rows are scope rows ``offset ..`` (as :func:`unit_scores`)."""
    k = int(k)
    scope = table.scope
    eff = np.minimum(valid, k)
    parts = []
    w = min(k, table.width)
    step = row_block(w)
    n = int(valid.shape[0])
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        types = type_matrix(scope.labels, scope.confounders, table.idx[r0:r1, :w], eff[r0:r1],
                            np.arange(offset + r0, offset + r1))
        typed = (types == SO) | (types == OS)
        parts.append(np.asarray(table.dist[r0:r1, :w])[typed])
    return np.concatenate(parts) if parts else np.empty(0)
