"""Out-of-core reductions of the neighbour metrics: RI, MaRI and CRoMa of scopes that no process
holds, computed where the neighbour tables are (issue 26, ADR-0019).

The out-of-core engine (:class:`cachescore.neighbors.large_scope.LargeScopeSearch`) leaves a
scope's neighbour tables in scratch files, in scope order. The functions here score them with
**tasks over row ranges on the workers**; the driving process gathers only what each reduction
needs and never holds an ``(n, k)`` table, the view frame or a per-unit column other than the one
below:

* **k-selection** (RI, MaRI): per candidate ``k`` and label, the used units and the correct
  majority votes (integers; balanced accuracy is computed from them exactly as
  :func:`~.kselect.balanced_accuracy` does);
* **pooled ratio** (RI, MaRI): per-range sums of the SO / OS evidence over the leaves of numpy's
  pairwise summation tree (:func:`pairwise_leaves`), recombined in the tree's order
  (:func:`pairwise_total`): the same float64 operations as ``evidence.sum()`` over the scope, so
  the pooled value is bit-identical; the rare log-space fallback folds range after range;
* **MaRI's auto temperature** (the median of every typed neighbour distance, ``n × k`` values):
  an exact distributed selection (:func:`select_ranks`, a radix search over the float64 bit
  patterns: 16-bit histograms until the wanted bin is small, then its values);
* **per-unit values** stay in the per-unit fragments on the workers. The lower-tail quantile and
  CRoMa's scope medians are exact selections over them (:func:`linear_percentile`,
  :func:`exact_median`); the lower-tail mean needs the tail itself in unit order (numpy's pairwise
  sum over it), so the values at or below the quantile come back (about ``alpha`` of the units:
  0.8 bytes a row at ``alpha = 0.1``); CRoMa's F(0) is a ratio of counts;
* **per-unit table**: each range task writes its rows as a Parquet fragment; one task
  concatenates them (:func:`concat_parquet_task`) and the store takes the file as it is.

Every per-row quantity comes from the in-memory functions (:func:`~.windows.unit_scores`,
:func:`~.kselect.knn_predictions`, :func:`~.windows.typed_distances`, CRoMa's margins) applied to
a range with its ``offset``, so a row's values do not depend on the ranges; the parity tests pin
the results to the in-memory metric API over the same tables bit for bit
(``tests/test_large_reductions.py``).
"""

from __future__ import annotations

import logging
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from distributed import as_completed

from .._atomic import atomic_write
from .._taskkeys import task_key
from .._futures import gather_or_cancel
from ..neighbors.large_scope import ScopeRef
from ..types import TailMetrics, TauAssessment
from .croma import SCHEDULE_NOT_COMPUTED, _margins, _require_support
from .kselect import knn_predictions, normalize_k_values, select_k_all, select_k_paired
from .tail import compute_tail_metrics
from .tau import (
    DEFAULT_TAU_SCALE_FACTOR,
    TAU_FALLBACK,
    collapsed_message,
    format_tau_warning,
    no_typed_neighbour_message,
)
from .windows import ScopeTable, pooled_ratio, ratio_from_log, scope_log_totals, typed_distances, unit_scores

__all__ = ["LEAF_ROWS", "OutOfCore", "LargeResult", "pairwise_leaves", "pairwise_total", "select_ranks",
           "ri_reduce", "mari_reduce", "croma_reduce", "concat_parquet_task", "REDUCERS", "TABLES"]

logger = logging.getLogger("cachescore")

#: Largest leaf of the pairwise-sum tree, and so the most rows one range task scores.
LEAF_ROWS = 1 << 16
#: Values a selection round gathers instead of another histogram round.
GATHER_LIMIT = 1 << 20
#: numpy's pairwise summation: arrays of at most this many items are summed without splitting.
_PW_BLOCK = 128
#: RI/MaRI result tail level (as :data:`cachescore.metrics.ri.RESULT_ALPHA`).
_RESULT_ALPHA = 0.10
#: Share of units with a shortened window above which k-selection logs a warning (as ri.py).
_REDUCED_K_WARN = 0.10


# ----------------------------------------------------------------------------- pairwise sums


def pairwise_leaves(n: int, leaf: int | None = None) -> list[tuple[int, int]]:
    """The ranges ``[lo, hi)`` of at most ``leaf`` items where numpy's pairwise summation of an
    ``n``-item contiguous float64 array stops splitting into halves (it splits ``n`` at
    ``n // 2 - (n // 2) % 8``), in order. ``leaf >= 128`` (default :data:`LEAF_ROWS`)."""
    leaf = LEAF_ROWS if leaf is None else int(leaf)
    if leaf < _PW_BLOCK:
        raise ValueError(f"leaf must be >= {_PW_BLOCK}, got {leaf}")
    out: list[tuple[int, int]] = []

    def split(lo: int, n_: int) -> None:
        if n_ <= leaf:
            out.append((lo, lo + n_))
            return
        half = n_ // 2
        half -= half % 8
        split(lo, half)
        split(lo + half, n_ - half)

    if n > 0:
        split(0, int(n))
    return out


def pairwise_total(n: int, sums: dict, leaf: int | None = None) -> float:
    """``np.add.reduce`` of an ``n``-item contiguous float64 array from its leaf sums
    (``{(lo, hi): np.add.reduce(a[lo:hi])}`` over :func:`pairwise_leaves` ``(n, leaf)``),
    combined in numpy's order: bit-identical to the sum of the whole array. 0.0 for ``n = 0``."""
    leaf = LEAF_ROWS if leaf is None else int(leaf)
    if n <= 0:
        return 0.0

    def combine(lo: int, n_: int):
        if n_ <= leaf:
            return sums[(lo, lo + n_)]
        half = n_ // 2
        half -= half % 8
        return combine(lo, half) + combine(lo + half, n_ - half)

    return float(combine(0, int(n)))


# ----------------------------------------------------------------------------- exact selection


def _sortable(values: np.ndarray) -> np.ndarray:
    """uint64 keys of float64 ``values`` that sort as the values do (negatives flipped)."""
    bits = np.ascontiguousarray(values, dtype=np.float64).view(np.uint64)
    neg = (bits >> np.uint64(63)).astype(bool)
    return np.where(neg, ~bits, bits | np.uint64(1 << 63))


def _unsortable(key: int) -> float:
    k = np.uint64(key)
    bits = (k & ~np.uint64(1 << 63)) if (k >> np.uint64(63)) else ~k
    return float(np.array([bits], dtype=np.uint64).view(np.float64)[0])


def key_requests(keys: np.ndarray, requests: list[tuple]) -> list:
    """Answer selection ``requests`` over ``keys`` (:func:`_sortable` of one range's values):
    ``("hist", prefix, bits)`` -> counts (65536,) of the next 16 bits of the keys whose top
    ``bits`` bits are ``prefix``; ``("gather", prefix, bits)`` -> those keys."""
    out = []
    for kind, prefix, bits in requests:
        sel = keys if bits == 0 else keys[(keys >> np.uint64(64 - bits)) == np.uint64(prefix)]
        if kind == "hist":
            nxt = (sel >> np.uint64(64 - bits - 16)) & np.uint64(0xFFFF)
            out.append(np.bincount(nxt.astype(np.int64), minlength=1 << 16).astype(np.int64))
        else:
            out.append(sel)
    return out


def select_ranks(run, ranks, limit: int | None = None) -> dict[int, float]:
    """The values at 0-based ``ranks`` of the ascending order of a distributed float64 multiset.

    ``run(requests)`` answers :func:`key_requests` over every value (histograms summed, gathered
    keys concatenated). Each round narrows a rank to a 16-bit longer prefix of its value's key; a
    prefix holding at most ``limit`` values is gathered and sorted. Exact: the value returned is
    the one ``np.sort`` puts at that rank. Ranks must be in ``[0, count)``; ``limit`` defaults
    to :data:`GATHER_LIMIT`."""
    limit = GATHER_LIMIT if limit is None else int(limit)
    state = {int(r): (0, 0, int(r)) for r in ranks}  # rank -> (prefix, bits, rank within prefix)
    counts: dict[tuple, int] = {}
    found: dict[int, float] = {}
    while len(found) < len(state):
        todo = {r: s for r, s in state.items() if r not in found}
        reqs: dict[tuple, str] = {}
        for prefix, bits, _ in todo.values():
            n_in = counts.get((prefix, bits))
            reqs[(prefix, bits)] = "gather" if (bits > 0 and n_in is not None and n_in <= limit) or bits >= 48 else "hist"
        keys = list(reqs)
        answers = run([(reqs[k], k[0], k[1]) for k in keys])
        got = dict(zip(keys, answers))
        for r, (prefix, bits, within) in todo.items():
            ans = got[(prefix, bits)]
            if reqs[(prefix, bits)] == "gather":
                found[r] = _unsortable(int(np.sort(ans)[within]))
                continue
            cum = np.cumsum(ans)
            b = int(np.searchsorted(cum, within, side="right"))
            before = int(cum[b - 1]) if b else 0
            nprefix, nbits = (prefix << 16) | b, bits + 16
            counts[(nprefix, nbits)] = int(ans[b])
            state[r] = (nprefix, nbits, within - before)
    return found


def exact_median(run, count: int) -> float:
    """``np.median`` of a distributed multiset of ``count`` float64 values (NaN when empty):
    the middle value, or the mean of the two middle values computed as numpy computes it."""
    if count == 0:
        return float("nan")
    ranks = [count // 2] if count % 2 else [count // 2 - 1, count // 2]
    vals = select_ranks(run, ranks)
    return float(np.mean(np.array([vals[r] for r in ranks], dtype=np.float64)))


def linear_percentile(select, count: int, percent: float) -> float:
    """``np.percentile(values, percent)`` (method "linear") of ``count`` values (NaN when empty)
    from their order statistics: ``select(ranks) -> {rank: value}`` gives the values at 0-based
    ranks of the ascending order. The same float64 operations as numpy's (its virtual index
    ``(count - 1) * q``, the neighbouring ranks, its two-sided interpolation), so the result is
    bit-identical (``tests/test_large_reductions.py`` compares them on random arrays)."""
    if count == 0:
        return float("nan")
    q = float(np.true_divide(percent, 100))
    if not 0.0 <= q <= 1.0:
        raise ValueError("Percentiles must be in the range [0, 100]")
    h = (count - 1) * q
    if h >= count - 1:  # numpy takes the last value, with its index -1 in the weight
        lo = hi = count - 1
        gamma = h + 1.0
    else:
        lo = int(np.floor(h))
        hi = lo + 1
        gamma = h - lo
    got = select(sorted({lo, hi}))
    a, b = got[lo], got[hi]
    diff = b - a
    return float(b - diff * (1.0 - gamma)) if gamma >= 0.5 else float(a + diff * gamma)


# ----------------------------------------------------------------------------- the unit's context


@dataclass
class OutOfCore:
    """What an out-of-core reduction works with: the engine (its client and tables), the
    scopes in the metric's scope order, the view's dataset name and design, and the folder the
    per-unit table is assembled in."""

    engine: object  # LargeScopeSearch
    scopes: list  # [ScopeRef], scope order
    dataset: str
    design: str
    folder: Path
    _tables: dict = field(default_factory=dict, repr=False)

    def tables(self, ref: ScopeRef, kinds: tuple, k: int) -> dict:
        """The scope's table files of ``kinds`` at ``k`` (:meth:`LargeScopeSearch.table_files`),
        asked of the engine once per unit (its details list one search per table, as the metric
        API's calls do)."""
        key = (ref.name, tuple(kinds), int(k))
        if key not in self._tables:
            self._tables[key] = self.engine.table_files(ref.name, tuple(kinds), int(k))
        return self._tables[key]

    @property
    def client(self):
        return self.engine.client

    @property
    def unit(self) -> str:
        return "sample" if self.design == "all" else "occurrence"

    def offsets(self) -> list[int]:
        """Unit index of each scope's first row (scopes are concatenated in order)."""
        return np.concatenate([[0], np.cumsum([r.n for r in self.scopes])]).astype(int).tolist()[:-1]

    def map(self, fn, ref: ScopeRef, *args, phase_detail: str = "rows") -> list:
        """Run ``fn(ref, lo, hi, *args)`` on the workers for every leaf range of ``ref``; results
        in range order (a failed task cancels the rest and raises)."""
        futures = [self.client.submit(fn, ref, lo, hi, *args, pure=False,
                                      key=task_key("reduce", f"{phase_detail}{i:05d}"))
                   for i, (lo, hi) in enumerate(pairwise_leaves(ref.n))]
        return gather_or_cancel(self.client, futures)


@dataclass
class LargeResult:
    """An out-of-core unit's result: the record fields every family shares (``value``, ``std``,
    ``q_alpha``, ``ltm_alpha``, ``n_pairs``, ``n_units``, ``n_defined``), the family's own fields
    (as :attr:`cachescore.metrics.families.Family.record` gives them) and the per-unit table as a
    Parquet file (its columns as :func:`cachescore.pipeline.unit.result_record` writes them)."""

    value: float
    std: float
    q_alpha: float
    ltm_alpha: float
    n_pairs: int
    n_units: int
    n_defined: int
    fields: dict = field(default_factory=dict)
    per_unit: str | None = None


# ----------------------------------------------------------------------------- worker side

_CODES_LOCK = threading.Lock()
_CODES: dict = {}


def _codes(ref: ScopeRef):
    """(labels, confounders, groups, group sizes) of the whole scope, int64; one scope kept per
    worker process (range tasks of one scope follow each other)."""
    key = (ref.rows_path, ref.n)
    with _CODES_LOCK:
        hit = _CODES.get(key)
        if hit is None:
            index = ref.files().index(0, ref.n)
            hit = (np.ascontiguousarray(index[:, 2]), np.ascontiguousarray(index[:, 3]),
                   np.ascontiguousarray(index[:, 1]))
            del index
            hit = hit + (np.bincount(hit[2]),)
            _CODES.clear()
            _CODES[key] = hit
        return hit


class _Codes:
    """The :class:`~cachescore.manifest.Scope` attributes :mod:`.windows` reads (whole scope)."""

    def __init__(self, ref: ScopeRef):
        self.labels, self.confounders, self.groups, self.sizes = _codes(ref)
        self.subset = ref.name
        self.n = ref.n
        self.max_group_size = ref.max_group


def _rows(path: str, lo: int, hi: int, cols: int | None = None) -> np.ndarray:
    mm = np.load(path, mmap_mode="r")
    try:
        return np.array(mm[lo:hi] if cols is None else mm[lo:hi, :cols])
    finally:
        del mm


def _range_table(ref: ScopeRef, tables: dict, lo: int, hi: int, kmax: int, with_dist: bool = True):
    """``(table, valid)`` of scope rows ``lo:hi``: their cross-group rows of the scope's table
    (:class:`~.windows.ScopeTable` holding those rows) and ``valid_i`` at ``kmax`` (the engine
    refuses capped scopes, so ``valid_i = min(found, |X_i|, kmax)``)."""
    codes = _Codes(ref)
    idx = _rows(tables["cross_idx"], lo, hi)
    dist = _rows(tables["cross_dist"], lo, hi) if with_dist else None
    cross = (ref.n - codes.sizes[codes.groups[lo:hi]]).astype(np.int64)
    table = ScopeTable(scope=codes, u=None, idx=idx, dist=dist, cross_count=cross)
    valid = np.minimum(np.minimum(np.count_nonzero(idx >= 0, axis=1), cross), int(kmax)).astype(np.int64)
    return table, valid


def _select_task(ref: ScopeRef, lo: int, hi: int, tables: dict, ks: list, kmax: int):
    """k-selection counts of rows ``lo:hi``: ``(correct (len(ks), L), used (len(ks), L), rows
    with valid < kmax)`` per label code ``L``."""
    table, valid = _range_table(ref, tables, lo, hi, kmax, with_dist=False)
    labels = table.scope.labels
    pred, used = knn_predictions(labels, table.idx, valid, ks)
    y = labels[lo:hi]
    n_lab = max(ref.n_labels, int(labels.max()) + 1 if labels.size else 1)
    correct = np.zeros((len(ks), n_lab), dtype=np.int64)
    total = np.zeros((len(ks), n_lab), dtype=np.int64)
    for j in range(len(ks)):
        m = used[:, j]
        ym = y[m]
        total[j] = np.bincount(ym, minlength=n_lab)
        correct[j] = np.bincount(ym[ym == pred[m, j]], minlength=n_lab)
    return correct, total, int(np.count_nonzero(valid < kmax))


def _typed_task(ref: ScopeRef, lo: int, hi: int, tables: dict, k: int, requests: list):
    """Selection answers (:func:`key_requests`) over the typed distances of rows ``lo:hi`` at
    window ``k`` (valid at ``k``, as MaRI's temperature step fetches)."""
    table, valid = _range_table(ref, tables, lo, hi, k)
    d = typed_distances(table, valid, k, offset=lo)
    d = d[np.isfinite(d)]
    return key_requests(_sortable(d), requests), int(d.size)


def _identity_columns(ref: ScopeRef, lo: int, hi: int, unit0: int) -> dict:
    """The per-unit table's first columns for scope rows ``lo:hi`` (the scope's units start at
    unit ``unit0``): ``unit``, ``source_index`` (view row), ``subset``, as ``result_record`` writes them."""
    sources = _rows(ref.sources_path, lo, hi) if ref.sources_path else np.arange(lo, hi, dtype=np.int64)
    return {"unit": np.arange(unit0 + lo, unit0 + hi, dtype=np.int64), "source_index": sources.astype(np.int64),
            "subset": np.full(hi - lo, ref.name if ref.name is not None else "dataset", dtype=object).astype(str)}


def _fragment(path: str, frame: pd.DataFrame) -> None:
    table = pa.Table.from_pandas(frame, preserve_index=False)
    atomic_write(Path(path), lambda fh: pq.write_table(table, fh))


def _ratio_task(ref: ScopeRef, lo: int, hi: int, tables: dict, k: int, kmax: int, tau, unit0: int, out: str):
    """Score rows ``lo:hi`` at ``k`` (evidence windows valid at ``kmax``; ``tau`` None for RI):
    writes their per-unit fragment to ``out`` (the values stay there) and returns ``(so sum, os
    sum, counts)`` with ``counts = (defined, types 1, 2, 3)`` and the sums over this leaf
    (``np.add.reduce``)."""
    table, valid = _range_table(ref, tables, lo, hi, kmax, with_dist=tau is not None)
    s = unit_scores(table, valid, [k], tau, offset=lo)[int(k)]
    frame = pd.DataFrame({
        **_identity_columns(ref, lo, hi, unit0),
        "value": s.values.astype(np.float64),
        "defined": s.defined.astype(bool),
        "undefined_type": s.types.astype(np.int64).astype(str),
        "so": s.so.astype(np.float64),
        "os": s.os.astype(np.float64),
    })
    _fragment(out, frame)
    counts = (int(s.defined.sum()), *(int(np.count_nonzero(s.types == t)) for t in (1, 2, 3)))
    return np.add.reduce(s.so), np.add.reduce(s.os), counts


def _log_task(ref: ScopeRef, lo: int, hi: int, tables: dict, k: int, kmax: int, tau, initial):
    """The log-evidence fold of rows ``lo:hi`` continued from ``initial`` (:func:`scope_log_totals`)."""
    table, valid = _range_table(ref, tables, lo, hi, kmax, with_dist=tau is not None)
    return scope_log_totals(table, valid, k, tau, offset=lo, initial=initial)


def _croma_task(ref: ScopeRef, lo: int, hi: int, tables: dict, m: int, unit0: int, out: str):
    """CRoMa margins of rows ``lo:hi``: writes their per-unit fragment (the values stay there) and
    returns ``(unresolved count, zero-denominator count)``."""
    so = _rows(tables["so_dist"], lo, hi, m)
    os_ = _rows(tables["os_dist"], lo, hi, m)
    values, unresolved, zero = _margins(so, os_)
    frame = pd.DataFrame({
        **_identity_columns(ref, lo, hi, unit0),
        "value": values.astype(np.float64),
    })
    _fragment(out, frame)
    return int(unresolved.sum()), int(zero.sum())


def concat_parquet_task(parts: list, out: str) -> int:
    """Concatenate the Parquet ``parts`` (one schema) into ``out`` row group by row group (one
    part in memory at a time), atomically; returns the rows written."""
    rows = 0

    def write(fh):
        nonlocal rows
        writer = None
        for p in parts:
            t = pq.read_table(p)
            if writer is None:
                writer = pq.ParquetWriter(fh, t.schema)
            writer.write_table(t)
            rows += t.num_rows
        if writer is not None:
            writer.close()

    atomic_write(Path(out), write)
    return rows


def _fragment_values(path: str) -> np.ndarray:
    """The ``value`` column of a per-unit fragment, float64 in unit order (a null is NaN)."""
    col = pq.read_table(path, columns=["value"]).column("value")
    return col.to_numpy().astype(np.float64, copy=False)


def _value_counts_task(path: str) -> tuple[int, int, int]:
    """``(finite, finite and <= 0, NaN)`` counts of a fragment's values."""
    v = _fragment_values(path)
    finite = np.isfinite(v)
    return int(np.count_nonzero(finite)), int(np.count_nonzero(v[finite] <= 0)), int(np.count_nonzero(np.isnan(v)))


def _value_keys_task(path: str, requests: list, finite_only: bool) -> list:
    """:func:`key_requests` over a fragment's values (the finite ones, or all but NaN)."""
    v = _fragment_values(path)
    return key_requests(_sortable(v[np.isfinite(v)] if finite_only else v[~np.isnan(v)]), requests)


def _lower_tail_task(path: str, q: float) -> np.ndarray:
    """A fragment's finite values ``<= q``, in unit order."""
    v = _fragment_values(path)
    return v[np.isfinite(v) & (v <= q)]


# ----------------------------------------------------------------------------- client side


def _scope_guard(ctx: OutOfCore) -> None:
    for ref in ctx.scopes:
        if ref.n <= 1:
            raise RuntimeError(f"{ctx.dataset}: scope '{ref.name}' has {ref.n} row(s): need at least two samples "
                               "to compute neighbours")


def _width(ref: ScopeRef, kmax: int) -> int:
    """The table width the in-memory metrics search at (:func:`~.windows.build_table`)."""
    return max(1, min(int(kmax), ref.n - ref.min_group))


def _tables(ctx: OutOfCore, ref: ScopeRef, kmax: int) -> dict:
    return ctx.tables(ref, ("cross",), _width(ref, kmax))


def _select_k(ctx: OutOfCore, candidates: list[int], width_k: int) -> int:
    """The operating k (spec §4), from per-range vote counts."""

    def bacc(ref: ScopeRef, ks: list[int]) -> dict[int, float]:
        kmax = max(ks)
        parts = ctx.map(_select_task, ref, _tables(ctx, ref, width_k), ks, kmax, phase_detail="select")
        correct = sum(p[0] for p in parts)
        total = sum(p[1] for p in parts)
        reduced = sum(p[2] for p in parts)
        if ref.n and reduced / ref.n > _REDUCED_K_WARN:
            logger.warning("[RI/MaRI] %s k-selection, scope '%s': effective k < %d for %d/%d %ss (%.1f%%) after "
                           "excluding same-group neighbours.", ctx.dataset, ref.name, kmax, reduced, ref.n, ctx.unit,
                           100.0 * reduced / ref.n)
        out = {}
        for j, k in enumerate(ks):
            present = total[j] > 0
            if present.any():
                out[int(k)] = float(np.mean(correct[j][present] / total[j][present]))
        if not out:
            raise RuntimeError("k-selection failed: no sample has any cross-group neighbor")
        return out

    if ctx.design == "all":
        ref = ctx.scopes[0]
        ks = [k for k in candidates if k < ref.n]
        if not ks:
            raise RuntimeError(f"{ctx.dataset}: all-rows k-selection failed because no valid k candidates remain")
        return select_k_all(ks, bacc(ref, ks))
    per_scope = []
    for ref in ctx.scopes:
        ks = [k for k in candidates if k < ref.n]
        if ks:
            per_scope.append(bacc(ref, ks))
    if not per_scope:
        raise RuntimeError(f"{ctx.dataset}: subset k-selection failed on all subsets")
    return select_k_paired(per_scope)


def _typed_median(ctx: OutOfCore, k: int, width_k: int) -> tuple[float, int]:
    """``(median, count)`` of the typed distances at ``k`` over every scope (exact)."""
    jobs = [(ref, _tables(ctx, ref, width_k)) for ref in ctx.scopes if ref.n > 1]

    def run(requests):
        totals = _KeyTotals(requests)
        _fold(ctx, [(_typed_task, (ref, lo, hi, tables, int(k), requests))
                    for ref, tables in jobs for lo, hi in pairwise_leaves(ref.n)],
              lambda i, got: totals.add(i, got[0]), "tau")
        return totals.result()

    count = int(run([("hist", 0, 0)])[0].sum()) if jobs else 0
    return exact_median(run, count), count


def _ratio(ctx: OutOfCore, params: dict, tau_param, mari: bool) -> LargeResult:
    _scope_guard(ctx)
    candidates = normalize_k_values(params["k_candidates"])
    kmax = max(candidates)
    k = _select_k(ctx, candidates, kmax)
    tau = None
    if mari:
        if tau_param is None:
            med, _ = _typed_median(ctx, k, kmax)
            if not np.isfinite(med):
                warnings.warn(no_typed_neighbour_message(k), RuntimeWarning, stacklevel=2)
                tau = TAU_FALLBACK
            elif med <= 0.0:
                warnings.warn(collapsed_message(k), RuntimeWarning, stacklevel=2)
                tau = TAU_FALLBACK
            else:
                tau = med
        else:
            tau = float(tau_param)
    ctx.folder.mkdir(parents=True, exist_ok=True)
    tables = [_tables(ctx, ref, kmax) for ref in ctx.scopes]  # searched before scoring
    return _ratio_score(ctx, params, tau_param, mari, k, kmax, tau, tables)


def _ratio_score(ctx: OutOfCore, params: dict, tau_param, mari: bool, k: int, kmax: int, tau,
                 scope_tables: list) -> LargeResult:
    """The scoring step of :func:`_ratio` at the operating ``k`` and temperature ``tau``, over
    each scope's tables (``scope_tables``, scope order); the per-unit values stay in the fragments."""
    pooled, parts, log_pairs = [], [], []
    n_def = n_units = 0
    type_counts = np.zeros(3, dtype=np.int64)
    for ref, unit0, tables in zip(ctx.scopes, ctx.offsets(), scope_tables):
        outs = _fragments(ctx, ref, unit0)
        got = _map_out(ctx, _ratio_task, ref, outs, tables, int(k), int(kmax), tau, unit0)
        leaves = pairwise_leaves(ref.n)
        so = pairwise_total(ref.n, {lv: g[0] for lv, g in zip(leaves, got)})
        os_ = pairwise_total(ref.n, {lv: g[1] for lv, g in zip(leaves, got)})
        counts = np.sum([g[2] for g in got], axis=0)
        n_def += int(counts[0])
        type_counts += counts[1:]
        n_units += ref.n
        del got

        def log_totals(ref=ref, tables=tables):
            total = None
            for lo, hi in pairwise_leaves(ref.n):  # a chain: each range continues the fold
                total = ctx.client.submit(_log_task, ref, lo, hi, tables, int(k), int(kmax), tau, total,
                                          pure=False, key=task_key("reduce", "log")).result()
            return total

        value, l_so, l_os = pooled_ratio(so, os_, counts[0] > 0, log_totals)
        pooled.append(value)
        log_pairs.append((so, os_, l_so, l_os, log_totals))
        parts.extend(outs)
    value = pooled[0] if ctx.design == "all" else _paired_pooled(log_pairs, tau)
    tail, _ = _fragments_tail(ctx, parts, _RESULT_ALPHA)
    per_unit = str(ctx.folder / "per_unit.parquet")
    ctx.client.submit(concat_parquet_task, parts, per_unit, pure=False, key=task_key("reduce", "table")).result()
    pair_values = np.asarray(pooled, dtype=np.float64)
    support = float(n_def / n_units) if n_units else float("nan")
    _warn_support(ctx, support, type_counts, n_units)
    fields = {"support": support, "n_defined": int(n_def), "k": int(k)}
    if mari:
        fields["tau"] = float(tau)
        if bool(params.get("warn_tau", True)) and tau_param is not None:
            _assess_pinned_tau(ctx, float(tau), int(k), kmax)
    return LargeResult(value=float(value), std=float(pair_values.std(ddof=0)), q_alpha=tail.q_alpha,
                       ltm_alpha=tail.ltm_alpha, n_pairs=int(pair_values.size), n_units=int(n_units),
                       n_defined=int(n_def), fields=fields, per_unit=per_unit)


def _fold(ctx: OutOfCore, calls: list, fold, phase_detail: str) -> None:
    """Run ``fn(*args)`` on the workers for each ``(fn, args)`` of ``calls`` and ``fold(i, result)``
    as each finishes (the driver holds one result at a time, not all of them); a failed task
    cancels the rest and raises."""
    futures = [ctx.client.submit(fn, *args, pure=False, key=task_key("reduce", f"{phase_detail}{i:05d}"))
               for i, (fn, args) in enumerate(calls)]
    index = {f.key: i for i, f in enumerate(futures)}
    try:
        for future, result in as_completed(futures, loop=ctx.client.loop, with_results=True):
            fold(index[future.key], result)
            future.release()
    except BaseException:
        ctx.client.cancel(futures)
        raise


class _KeyTotals:
    """The answers to :func:`key_requests` summed over tasks as they arrive: histograms added,
    gathered keys kept (their order does not matter: :func:`select_ranks` sorts them)."""

    def __init__(self, requests: list):
        self.requests = requests
        self.totals: list = [np.zeros(1 << 16, dtype=np.int64) if r[0] == "hist" else [] for r in requests]

    def add(self, _, answers: list) -> None:
        for r, total, a in zip(self.requests, self.totals, answers):
            if r[0] == "hist":
                total += a
            else:
                total.append(a)

    def result(self) -> list:
        return [t if r[0] == "hist" else (np.concatenate(t) if t else np.empty(0, np.uint64))
                for r, t in zip(self.requests, self.totals)]


def _value_run(ctx: OutOfCore, paths: list, finite_only: bool):
    """``run(requests)`` for :func:`select_ranks` over the values of the fragments ``paths``."""

    def run(requests):
        totals = _KeyTotals(requests)
        _fold(ctx, [(_value_keys_task, (p, requests, finite_only)) for p in paths], totals.add, "keys")
        return totals.result()

    return run


def _fragments_tail(ctx: OutOfCore, paths: list, alpha: float) -> tuple[TailMetrics, np.ndarray]:
    """:func:`~.tail.compute_tail_metrics` of the finite values in the fragments ``paths`` (unit
    order), bit for bit, with the per-fragment counts ``(finite, finite <= 0, NaN)`` (fragment
    order) it took on the way: the quantile is selected exactly among the finite values
    (:func:`linear_percentile`); only the values at or below it come back, for their mean in
    unit order."""
    counts = np.zeros((len(paths), 3), dtype=np.int64)

    def put(i, c):
        counts[i] = c

    _fold(ctx, [(_value_counts_task, (p,)) for p in paths], put, "count")
    n_finite = int(counts[:, 0].sum())
    if n_finite == 0:
        return compute_tail_metrics(np.empty(0), alpha=alpha), counts
    run = _value_run(ctx, paths, finite_only=True)
    q = linear_percentile(lambda ranks: select_ranks(run, ranks, limit=LEAF_ROWS), n_finite, alpha * 100)
    pieces: list = [None] * len(paths)

    def keep(i, values):
        pieces[i] = values

    _fold(ctx, [(_lower_tail_task, (p, q)) for p in paths], keep, "tail")
    tail = np.concatenate(pieces)
    ltm = float(np.mean(tail)) if tail.size else q
    return TailMetrics(alpha=alpha, q_alpha=q, ltm_alpha=ltm, n_tail_samples=int(tail.size)), counts


def _fragments_median(ctx: OutOfCore, paths: list, count: int, nan: int) -> float:
    """``np.median`` of the ``count`` values in the fragments ``paths`` (``nan`` of them NaN: then
    NaN, as numpy's), by exact selection."""
    if nan:
        return float("nan")
    return exact_median(_value_run(ctx, paths, finite_only=False), count)


def _paired_pooled(scopes: list, tau) -> float:
    """The paired design's pooled value (:meth:`cachescore.metrics.ri._Evaluation.pooled`)."""
    total_so = total_os = 0.0
    for so, os_, *_ in scopes:
        total_so += float(so)
        total_os += float(os_)
    if total_so + total_os >= float(np.finfo(np.float64).tiny):
        return total_so / (total_so + total_os)
    if tau is None:
        return 0.5
    log_so = np.longdouble(-np.inf)
    log_os = np.longdouble(-np.inf)
    for _, _, l_so, l_os, log_totals in scopes:
        if l_so is None:
            l_so, l_os = log_totals()
        log_so = np.logaddexp(log_so, l_so)
        log_os = np.logaddexp(log_os, l_os)
    return float(ratio_from_log(log_so, log_os))


def _warn_support(ctx: OutOfCore, support: float, types: np.ndarray, units: int) -> None:
    """The two support warnings of :meth:`cachescore.metrics.ri._Evaluation.warn_support`."""
    label = "subset occurrences" if ctx.unit == "occurrence" else "samples"
    if support < 1.0:
        warnings.warn(f"{ctx.dataset}: RI/MaRI support is {support * 100.0:.1f}% across {label}.", RuntimeWarning,
                      stacklevel=3)
    ss, oo, mixed = ((float(t) / units) if units else 0.0 for t in types)
    if oo > max(ss, mixed, 0.0):
        warnings.warn(f"{ctx.dataset}: undefined RI/MaRI {label} are predominantly OO-dominated ({oo * 100.0:.1f}%).",
                      RuntimeWarning, stacklevel=3)


def _assess_pinned_tau(ctx: OutOfCore, tau: float, k: int, kmax: int) -> None:
    """croma's off-scale check of a pinned tau (:func:`~.tau.assess_tau`), from the exact median."""
    med, count = _typed_median(ctx, k, kmax)
    if count == 0:
        return
    factor = DEFAULT_TAU_SCALE_FACTOR
    low, high = med / factor, med * factor
    regime = "too_sharp" if tau < low else "too_flat" if tau > high else "principled"
    if regime in ("too_sharp", "too_flat"):
        warnings.warn(format_tau_warning(TauAssessment(tau, count, med, med, low, high, factor, regime)),
                      RuntimeWarning, stacklevel=3)


def ri_reduce(params: dict, ctx: OutOfCore) -> LargeResult:
    """RI of an out-of-core unit (:meth:`cachescore.metrics.ri.RI.compute` on the engine's tables)."""
    return _ratio(ctx, params, None, mari=False)


def mari_reduce(params: dict, ctx: OutOfCore) -> LargeResult:
    """MaRI of an out-of-core unit (:meth:`cachescore.metrics.mari.MaRI.compute`; ``tau`` "auto"
    or a number, ``warn_tau`` as the job says)."""
    t = params.get("tau", "auto")
    tau = None if t in (None, "auto") else float(t)
    if tau is not None and tau <= 0.0:
        raise ValueError(f"tau must be > 0, got {t!r}")
    return _ratio(ctx, params, tau, mari=True)


def croma_reduce(params: dict, ctx: OutOfCore) -> LargeResult:
    """CRoMa of an out-of-core unit (:meth:`cachescore.metrics.croma.CRoMa.compute` with
    ``schedule_diagnostics=False``: ``k`` is :data:`~.croma.SCHEDULE_NOT_COMPUTED`)."""
    m = int(params["m"])
    if m < 1:
        raise ValueError("m must be >= 1")
    ctx.folder.mkdir(parents=True, exist_ok=True)
    scope_tables = []
    for ref in ctx.scopes:  # searched before scoring (a scope below 2 rows fails first)
        if ref.n < 2:
            _require_support(np.ones(ref.n, bool), np.zeros(ref.n, bool), dataset=ctx.dataset, design=ctx.design,
                             subset=ref.name, unit=ctx.unit, m=m, n=ref.n, k_final=SCHEDULE_NOT_COMPUTED)
        scope_tables.append(ctx.tables(ref, ("so", "os"), m))
    return _croma_score(ctx, params, m, scope_tables)


def _croma_score(ctx: OutOfCore, params: dict, m: int, scope_tables: list) -> LargeResult:
    """:func:`croma_reduce`'s scoring over each scope's typed tables; the per-unit values stay in
    the fragments (scope medians and the tail by exact selection, F(0) from counts)."""
    scope_parts = []
    for ref, unit0, tables in zip(ctx.scopes, ctx.offsets(), scope_tables):
        outs = _fragments(ctx, ref, unit0)
        got = _map_out(ctx, _croma_task, ref, outs, tables, m, unit0)
        unresolved = np.int64(sum(g[0] for g in got))
        zero = np.int64(sum(g[1] for g in got))
        _require_support(unresolved, zero, dataset=ctx.dataset, design=ctx.design, subset=ref.name, unit=ctx.unit,
                         m=m, n=ref.n, k_final=SCHEDULE_NOT_COMPUTED)
        scope_parts.append(outs)
    parts = [p for outs in scope_parts for p in outs]
    tail, counts = _fragments_tail(ctx, parts, float(params.get("alpha", _RESULT_ALPHA)))
    medians, at = [], 0
    for ref, outs in zip(ctx.scopes, scope_parts):
        nan = int(counts[at : at + len(outs), 2].sum())
        medians.append(_fragments_median(ctx, outs, ref.n, nan))
        at += len(outs)
    pair_values = np.asarray(medians, dtype=float)
    finite = pair_values[np.isfinite(pair_values)]
    value = float(np.median(finite)) if finite.size else float("nan")
    std = float(finite.std(ddof=0)) if finite.size > 1 else 0.0
    n_finite, n_nonpositive = int(counts[:, 0].sum()), int(counts[:, 1].sum())
    f0 = float(np.float64(n_nonpositive) / n_finite) if n_finite else float("nan")  # np.mean of the booleans
    n_units = int(sum(ref.n for ref in ctx.scopes))
    per_unit = str(ctx.folder / "per_unit.parquet")
    ctx.client.submit(concat_parquet_task, parts, per_unit, pure=False, key=task_key("reduce", "table")).result()
    fields = {"f0": float(f0), "support": 1.0, "k": int(SCHEDULE_NOT_COMPUTED), "m": m, "n_defined": n_units}
    return LargeResult(value=value, std=std, q_alpha=tail.q_alpha, ltm_alpha=tail.ltm_alpha,
                       n_pairs=int(pair_values.size), n_units=n_units, n_defined=n_units, fields=fields,
                       per_unit=per_unit)


def _fragments(ctx: OutOfCore, ref: ScopeRef, unit0: int) -> list[str]:
    """One per-unit fragment path per leaf range of ``ref`` (named by its first unit)."""
    return [str(ctx.folder / f"part-{unit0 + lo:012d}.parquet") for lo, _ in pairwise_leaves(ref.n)]


def _map_out(ctx: OutOfCore, fn, ref: ScopeRef, outs: list, *args) -> list:
    """``fn(ref, lo, hi, *args, out)`` for every leaf range of ``ref`` (``outs``: one fragment
    path per range), gathered in range order."""
    futures = [ctx.client.submit(fn, ref, lo, hi, *args, out, pure=False, key=task_key("reduce", f"rows{i:05d}"))
               for i, ((lo, hi), out) in enumerate(zip(pairwise_leaves(ref.n), outs))]
    return gather_or_cancel(ctx.client, futures)


#: The out-of-core computations by name (what :attr:`cachescore.metrics.families.Family.reduce`
#: calls, importing this module only when a large unit is scored).
REDUCERS = {"ri_reduce": ri_reduce, "mari_reduce": mari_reduce, "croma_reduce": croma_reduce}


def ratio_tables(params: dict, ref: ScopeRef) -> list:
    """The table RI and MaRI ask of ``ref``: cross-group at the width of their largest candidate k."""
    if ref.n <= 1:
        return []
    return [(("cross",), _width(ref, max(normalize_k_values(params["k_candidates"]))))]


def croma_tables(params: dict, ref: ScopeRef) -> list:
    """The tables CRoMa asks of ``ref``: SO and OS at ``m``."""
    return [(("so", "os"), int(params["m"]))] if ref.n >= 2 and int(params["m"]) >= 1 else []


#: What each reducer asks of a scope (:attr:`cachescore.metrics.families.Family.tables`).
TABLES = {"ri_reduce": ratio_tables, "mari_reduce": ratio_tables, "croma_reduce": croma_tables}
