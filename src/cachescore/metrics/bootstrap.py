"""Cluster bootstrap utilities on per-unit values (spec/metrics.md §8.2), croma 1.0.1-compatible.

The resampling unit is the cluster (``group_id``), never the single row: clusters are drawn with
replacement and all of a drawn cluster's rows are pooled. Every routine uses
``np.random.default_rng(seed)`` and draws, replicate after replicate, ``integers(0, K, K)``; all
draws are taken at once as one ``(n_boot, K)`` call, which yields the same stream.

Replicates are evaluated without a Python loop per replicate: a pooled median only depends on how
many times each cluster was drawn, so the values are sorted once and every replicate's median is
read off the cumulative cluster multiplicities (an exact order statistic, so bit-identical to
``np.median`` of the concatenated rows).
"""

from __future__ import annotations

import math

import numpy as np

from ..types import BootstrapCI, RankStability

__all__ = [
    "percentile_ci",
    "cluster_counts",
    "pooled_ratio_replicates",
    "balanced_median_replicates",
    "rank_summary",
    "bootstrap_pooled_ratio",
    "bootstrap_balanced_median",
    "bootstrap_pooled_median",
    "paired_cluster_bootstrap_delta",
    "paired_rank_stability",
    "bootstrap_spearman",
]

#: Upper bound on replicate × value entries held at once by the vectorised medians.
_CHUNK_ENTRIES = 1 << 22

#: Smallest normal float64: a resampled pooled ratio with less evidence than this is undefined.
_TINY = float(np.finfo(np.float64).tiny)


def percentile_ci(boot, point: float, level: float, n_boot: int) -> BootstrapCI:
    """Percentile interval of the finite replicate values (linear interpolation).

    No finite replicate → ``BootstrapCI(point, nan, nan, level, 0)``; otherwise ``n_boot`` echoes the
    requested replicate count, not the finite count.
    """
    boot = np.asarray(boot, dtype=float)
    finite = boot[np.isfinite(boot)]
    if finite.size == 0:
        return BootstrapCI(point, float("nan"), float("nan"), level, 0)
    q_lo = (1.0 - level) / 2.0 * 100.0
    return BootstrapCI(
        point=float(point),
        lo=float(np.percentile(finite, q_lo, method="linear")),
        hi=float(np.percentile(finite, 100.0 - q_lo, method="linear")),
        level=float(level),
        n_boot=int(n_boot),
    )


def _cluster_index(cluster_ids: np.ndarray) -> tuple[np.ndarray, int]:
    """Cluster number of every row (clusters = distinct IDs in stable-sorted order), and K."""
    ids = np.asarray(cluster_ids)
    if ids.shape[0] == 0:
        return np.zeros(0, dtype=np.int64), 0
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    new = np.concatenate([[False], sorted_ids[1:] != sorted_ids[:-1]])
    member = np.empty(ids.shape[0], dtype=np.int64)
    member[order] = np.cumsum(new)
    return member, int(member.max()) + 1


def _draw(rng: np.random.Generator, n_boot: int, k: int) -> np.ndarray:
    """``(n_boot, k)`` picks, identical to ``n_boot`` successive ``rng.integers(0, k, k)`` calls."""
    return rng.integers(0, k, (int(n_boot), k))


def _multiplicities(picks: np.ndarray, k: int) -> np.ndarray:
    """``counts[b, c]`` = how many times cluster ``c`` was drawn in replicate ``b``."""
    b = picks.shape[0]
    flat = (picks + (np.arange(b, dtype=np.int64) * k)[:, None]).ravel()
    return np.bincount(flat, minlength=b * k).reshape(b, k)


def _block_rows(n_values: int, n_clusters: int) -> int:
    """Rows per block of :func:`_weighted_medians`: about ``sqrt(V) / 1.5`` rounded to a power of
    two in [8, 4096] (measured best at 2,000 and 200,000 values: ``benchmarks/bootstrap_speed.py``),
    raised so the (clusters × blocks) matrix stays within ``_CHUNK_ENTRIES`` entries."""
    rows = 2 ** int(round(math.log2(max(1.0, math.sqrt(n_values) / 1.5))))
    rows = min(4096, max(8, rows))
    return max(rows, -(-n_values * max(1, n_clusters) // _CHUNK_ENTRIES))


def _weighted_medians(values: np.ndarray, member: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Median of the multiset {value_j repeated counts[b, member_j] times} for every replicate b.

    ``values`` (V,) finite, ``member`` (V,) cluster numbers, ``counts`` (B, K). NaN where the
    multiset is empty. Equal to ``np.median`` of the concatenated rows, bit for bit.

    No loop over replicates or rows: the values are sorted once and cut into blocks of ``L`` rows
    (:func:`_block_rows`); each replicate's multiplicity per block is one product of its cluster
    counts with the (clusters × blocks) membership counts (exact integers in float64), whose
    cumulative sums locate the block holding each order statistic; inside that block the rows'
    multiplicities are gathered and summed — B × (K × V / L + L) work instead of B × V.
    """
    n_rep = counts.shape[0]
    out = np.full(n_rep, np.nan)
    if values.size == 0 or n_rep == 0:
        return out
    order = np.argsort(values, kind="stable")
    v, mem = values[order], np.asarray(member)[order]
    n, k = v.size, counts.shape[1]
    width = _block_rows(n, k)
    n_blocks = -(-n // width)
    block_of = np.arange(n) // width
    per_block = np.bincount(mem * n_blocks + block_of, minlength=k * n_blocks).reshape(k, n_blocks)
    per_block = per_block.astype(np.float64)
    # replicates per step: the (step, K) float counts and the (step, width) gathers both bounded
    # (the entries are exact integers, so the steps do not change a bit of the result)
    step = max(1, _CHUNK_ENTRIES // max(width, n_blocks, k))
    offsets = np.arange(width)
    for s in range(0, n_rep, step):
        c = counts[s : s + step].astype(np.float64)  # multiplicities: integers, exact in float64
        cum_blocks = np.cumsum(c @ per_block, axis=1)
        total = cum_blocks[:, -1]
        rep = np.arange(c.shape[0])

        def position(rank: np.ndarray) -> np.ndarray:
            # the first sorted position whose cumulative multiplicity exceeds ``rank``
            blk = np.minimum((cum_blocks <= rank[:, None]).sum(axis=1), n_blocks - 1)
            before = np.where(blk > 0, cum_blocks[rep, np.maximum(blk - 1, 0)], 0.0)
            pos = blk[:, None] * width + offsets[None, :]
            w = np.take_along_axis(c, mem[np.minimum(pos, n - 1)], axis=1)
            w[pos >= n] = 0.0
            inside = (np.cumsum(w, axis=1) <= (rank - before)[:, None]).sum(axis=1)
            return np.minimum(blk * width + inside, n - 1)

        i_lo, i_hi = position(np.floor((total - 1) / 2)), position(np.floor(total / 2))
        med = np.where(i_lo == i_hi, v[i_lo], (v[i_lo] + v[i_hi]) / 2)
        med[total == 0] = np.nan
        out[s : s + step] = med
    return out


def _median_of_present(medians: np.ndarray) -> np.ndarray:
    """Row-wise median of the non-NaN entries of ``medians`` (B, S); NaN for an all-NaN row."""
    srt = np.sort(medians, axis=1)  # NaN last
    present = np.isfinite(medians).sum(axis=1)
    lo = np.maximum((present - 1) // 2, 0)
    hi = np.maximum(present // 2, 0)
    a = np.take_along_axis(srt, lo[:, None], axis=1)[:, 0]
    b = np.take_along_axis(srt, hi[:, None], axis=1)[:, 0]
    out = np.where(lo == hi, a, (a + b) / 2)
    out[present == 0] = np.nan
    return out


def bootstrap_pooled_median(values, cluster_ids, *, n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> BootstrapCI:
    """Cluster-bootstrap CI of the pooled median of the finite ``values`` (shape (n,)).

    ``cluster_ids`` (n,) are the resampling units. Non-finite values are dropped from the point and
    from each replicate (an empty replicate is NaN and leaves the CI). Raises ``ValueError`` when the
    lengths differ. No clusters → ``BootstrapCI(point, nan, nan, level, 0)``.
    """
    values = np.asarray(values, dtype=float)
    cluster_ids = np.asarray(cluster_ids)
    if values.shape[0] != cluster_ids.shape[0]:
        raise ValueError(
            f"values and cluster_ids must be the same length (got {values.shape[0]} and {cluster_ids.shape[0]})"
        )
    finite = np.isfinite(values)
    point = float(np.median(values[finite])) if finite.any() else float("nan")
    member, k = _cluster_index(cluster_ids)
    if k == 0:
        return BootstrapCI(point, float("nan"), float("nan"), level, 0)
    picks = _draw(np.random.default_rng(seed), n_boot, k)
    boot = _weighted_medians(values[finite], member[finite], _multiplicities(picks, k))
    return percentile_ci(boot, point, level, int(n_boot))


def paired_cluster_bootstrap_delta(
    canonical,
    alternative,
    group_ids,
    *,
    subset_ids=None,
    n_boot: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> BootstrapCI:
    """Shared-group bootstrap of ``balanced_median(alternative) - balanced_median(canonical)``.

    All inputs are aligned 1-D arrays of one length. The balanced median is the plain median, or,
    with ``subset_ids``, the median over the subsets present of each subset's median (rows of a group
    drawn twice count twice), mirroring CRoMa's paired value. One group draw per replicate serves
    both vectors.

    Raises ``ValueError``: inputs not 1-D or of different lengths; ``subset_ids`` not 1-D or of the
    wrong length; any non-finite value; no group.
    """
    canonical = np.asarray(canonical, dtype=float)
    alternative = np.asarray(alternative, dtype=float)
    group_ids = np.asarray(group_ids)
    subsets = None if subset_ids is None else np.asarray(subset_ids)
    if canonical.ndim != 1 or alternative.ndim != 1 or group_ids.ndim != 1:
        raise ValueError("canonical, alternative, and group_ids must be one-dimensional")
    if not (len(canonical) == len(alternative) == len(group_ids)):
        raise ValueError(
            "canonical, alternative, and group_ids must be the same length "
            f"(got {len(canonical)}, {len(alternative)}, {len(group_ids)})"
        )
    if subsets is not None and (subsets.ndim != 1 or len(subsets) != len(canonical)):
        raise ValueError("subset_ids must be one-dimensional and match the value length")
    if not np.isfinite(canonical).all() or not np.isfinite(alternative).all():
        raise ValueError("paired CRoMa values must all be finite")
    member, k = _cluster_index(group_ids)
    if k == 0:
        raise ValueError("paired bootstrap requires at least one independence group")

    picks = _draw(np.random.default_rng(seed), n_boot, k)
    counts = np.vstack([np.ones((1, k), dtype=np.int64), _multiplicities(picks, k)])  # row 0: point

    def balanced(values: np.ndarray) -> np.ndarray:
        if subsets is None:
            return _weighted_medians(values, member, counts)
        per_subset = [
            _weighted_medians(values[sel], member[sel], counts)
            for sel in (subsets == s for s in np.unique(subsets))
        ]
        return _median_of_present(np.stack(per_subset, axis=1))

    delta = balanced(alternative) - balanced(canonical)
    return percentile_ci(delta[1:], float(delta[0]), level, int(n_boot))


def paired_rank_stability(model_values: dict, cluster_ids, *, n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> RankStability:
    """Ranking stability of models by pooled median under one shared cluster draw per replicate.

    ``model_values`` maps model name → per-row values (all of length n, aligned to
    ``cluster_ids``). Rank 1 is the highest pooled median; replicate ranks treat NaN as ``-inf`` and
    keep dict order among ties. ``pairwise_win[(a, b)]`` is the fraction of replicates where both
    medians are finite and ``a``'s is strictly greater.

    Raises ``ValueError`` for an empty dict or mismatched lengths.
    """
    models = list(model_values)
    if not models:
        raise ValueError("model_values must be non-empty")
    arrays = {name: np.asarray(v, dtype=float) for name, v in model_values.items()}
    n_rows = len(arrays[models[0]])
    for name, a in arrays.items():
        if a.shape[0] != n_rows:
            raise ValueError(f"model '{name}' has {a.shape[0]} values but the first model has {n_rows}")
    cluster_ids = np.asarray(cluster_ids)
    if cluster_ids.shape[0] != n_rows:
        raise ValueError(f"cluster_ids has {cluster_ids.shape[0]} entries but the models have {n_rows} values")

    member, k = _cluster_index(cluster_ids)
    point_value = {
        name: (float(np.median(a[np.isfinite(a)])) if np.isfinite(a).any() else float("nan"))
        for name, a in arrays.items()
    }
    picks = _draw(np.random.default_rng(seed), n_boot, k)
    counts = _multiplicities(picks, k) if k else np.zeros((int(n_boot), 0), dtype=np.int64)
    meds = np.stack(
        [_weighted_medians(arrays[name][np.isfinite(arrays[name])], member[np.isfinite(arrays[name])], counts) for name in models],
        axis=1,
    )  # (n_boot, M)
    ranks = rank_summary(models, point_value, meds, level=level)
    return RankStability(
        models=models,
        point_value=point_value,
        point_rank=ranks["point_rank"],
        mean_rank=ranks["mean_rank"],
        rank_lo=ranks["rank_lo"],
        rank_hi=ranks["rank_hi"],
        value_ci={name: percentile_ci(meds[:, j], point_value[name], level, int(n_boot)) for j, name in enumerate(models)},
        pairwise_win=ranks["pairwise_win"],
        n_boot=int(n_boot),
    )


def bootstrap_spearman(x, y, *, n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> BootstrapCI:
    """Spearman correlation of paired points with a bootstrap CI over the points.

    Pairs with a non-finite side are dropped; fewer than 3 left → all-NaN with ``n_boot = 0``. A
    replicate in which either side has fewer than 2 distinct values is NaN (dropped from the CI).
    Raises ``ValueError`` when the shapes differ.
    """
    from scipy.stats import rankdata, spearmanr  # deferred: scipy.stats costs ~1 s at every command's start

    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    if x.shape != y.shape:
        raise ValueError(f"x and y must be the same shape (got {x.shape} and {y.shape})")
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    n = x.shape[0]
    if n < 3:
        return BootstrapCI(float("nan"), float("nan"), float("nan"), level, 0)
    point = float(spearmanr(x, y).statistic)
    idx = _draw(np.random.default_rng(seed), n_boot, n)
    xb, yb = x[idx], y[idx]
    degenerate = (xb.min(axis=1) == xb.max(axis=1)) | (yb.min(axis=1) == yb.max(axis=1))
    boot = np.full(idx.shape[0], np.nan)
    ok = ~degenerate
    if ok.any():
        rx = rankdata(xb[ok], axis=1)
        ry = rankdata(yb[ok], axis=1)
        rx -= rx.mean(axis=1, keepdims=True)
        ry -= ry.mean(axis=1, keepdims=True)
        cov = np.einsum("ij,ij->i", rx, ry)
        r = cov / np.sqrt(np.einsum("ij,ij->i", rx, rx)) / np.sqrt(np.einsum("ij,ij->i", ry, ry))
        boot[ok] = np.clip(r, -1.0, 1.0)
    return percentile_ci(boot, point, level, int(n_boot))


# --------------------------------------------------------------------------- pooled statistics
# The functions below serve the stored scores (cachescore.results, ADR-0009): one shared draw per
# view (the picks depend only on the seed and the number of clusters), replicate values of every
# encoder from it, then CIs and rank intervals. Same draw rule and percentile CI as above.


def cluster_counts(cluster_ids, *, n_boot: int = 2000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(member, counts)``: every row's cluster number (clusters = distinct IDs, stable-sorted) and
    ``counts[b, c]``, how often replicate ``b`` drew cluster ``c`` (``(n_boot, K)`` int32; the
    croma draw rule: ``rng.integers(0, K, K)`` per replicate from ``default_rng(seed)``)."""
    member, k = _cluster_index(np.asarray(cluster_ids))
    if k == 0:
        return member, np.zeros((int(n_boot), 0), dtype=np.int64)
    return member, _counts(int(n_boot), int(seed), int(k))


#: ``(n_boot, seed, K) -> counts`` drawn in this process (read-only arrays): the draw depends on
#: those three only, and every record of one view shares it.
_COUNTS: dict = {}
_COUNTS_MAX = 16


#: Replicates drawn, counted or multiplied at a time: the (replicates, clusters) temporaries stay
#: a block whatever ``n_boot`` (a multiple of 16: BLAS kernels unroll rows by up to 16, so a block
#: computes each replicate as the whole product does).
_REPLICATE_BLOCK = 256


def _drawn_multiplicities(rng: np.random.Generator, n_boot: int, k: int) -> np.ndarray:
    """``_multiplicities(_draw(rng, n_boot, k), k)`` drawn :data:`_REPLICATE_BLOCK` replicates at a
    time (the same stream, the same counts): the picks and their flat index never exist whole."""
    out = np.empty((int(n_boot), int(k)), dtype=np.int32)  # a multiplicity is at most K < 2**31
    for a in range(0, int(n_boot), _REPLICATE_BLOCK):
        b = min(int(n_boot), a + _REPLICATE_BLOCK)
        out[a:b] = _multiplicities(_draw(rng, b - a, k), k)
    return out


def _counts(n_boot: int, seed: int, k: int) -> np.ndarray:
    key = (n_boot, seed, k)
    counts = _COUNTS.get(key)
    if counts is None:
        counts = _drawn_multiplicities(np.random.default_rng(seed), n_boot, k)
        counts.flags.writeable = False  # shared: a caller writing into it would change every later draw
        if len(_COUNTS) >= _COUNTS_MAX:
            _COUNTS.pop(next(iter(_COUNTS)))
        _COUNTS[key] = counts
    return counts


def pooled_ratio_replicates(so, os, member, counts) -> np.ndarray:
    """Replicate values of the pooled ratio ``sum(so) / (sum(so) + sum(os))`` (RI: neighbour counts,
    MaRI: weight sums; spec §5.3 / §6.2): per-cluster sums times the cluster multiplicities, no loop
    over rows. A replicate with less evidence than the smallest normal float is NaN (undefined).
    ``so``, ``os``, ``member``: (n,); ``counts``: (B, K). Returns (B,) float64."""
    so = np.asarray(so, dtype=np.float64)
    os_ = np.asarray(os, dtype=np.float64)
    k = counts.shape[1]
    s_g = np.bincount(member, weights=so, minlength=k)
    o_g = np.bincount(member, weights=os_, minlength=k)
    s, o = np.empty(counts.shape[0]), np.empty(counts.shape[0])
    for a in range(0, counts.shape[0], _REPLICATE_BLOCK):  # a block of float64 counts at a time
        cf = counts[a : a + _REPLICATE_BLOCK].astype(np.float64)
        s[a : a + cf.shape[0]], o[a : a + cf.shape[0]] = cf @ s_g, cf @ o_g
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(s + o >= _TINY, s / (s + o), np.nan)


def balanced_median_replicates(values, member, counts, subset_ids=None) -> np.ndarray:
    """Replicate values of the (balanced) median of the finite ``values``: the median of the
    drawn rows, or with ``subset_ids`` the median over the subsets present of each subset's median
    (CRoMa's paired value; the rule of :func:`paired_cluster_bootstrap_delta`). (B,) float64."""
    values = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(values)
    if subset_ids is None:
        return _weighted_medians(values[finite], member[finite], counts)
    subsets = np.asarray(subset_ids)
    per_subset = [
        _weighted_medians(values[sel & finite], member[sel & finite], counts)
        for sel in (subsets == s for s in np.unique(subsets))
    ]
    return _median_of_present(np.stack(per_subset, axis=1))


def bootstrap_pooled_ratio(so, os, cluster_ids, *, point: float | None = None, n_boot: int = 2000,
                           level: float = 0.95, seed: int = 0) -> BootstrapCI:
    """Cluster-bootstrap CI of a pooled ratio (RI / MaRI) from its per-unit evidence.

    ``point`` defaults to ``sum(so) / (sum(so) + sum(os))`` (NaN without evidence); pass the stored
    score to keep the metric's own point (its log path, its 0.5 fallback). Raises ``ValueError``
    for mismatched lengths or non-finite / negative evidence."""
    so = np.asarray(so, dtype=np.float64)
    os_ = np.asarray(os, dtype=np.float64)
    ids = np.asarray(cluster_ids)
    if not (so.shape == os_.shape == ids.shape) or so.ndim != 1:
        raise ValueError(f"so, os and cluster_ids must be 1-D of one length (got {so.shape}, {os_.shape}, {ids.shape})")
    if not (np.isfinite(so).all() and np.isfinite(os_).all()) or (so < 0).any() or (os_ < 0).any():
        raise ValueError("per-unit evidence (so, os) must be finite and non-negative")
    if point is None:
        total = float(so.sum() + os_.sum())
        point = float(so.sum() / total) if total >= _TINY else float("nan")
    member, counts = cluster_counts(ids, n_boot=n_boot, seed=seed)
    if counts.shape[1] == 0:
        return BootstrapCI(float(point), float("nan"), float("nan"), level, 0)
    return percentile_ci(pooled_ratio_replicates(so, os_, member, counts), float(point), level, int(n_boot))


def bootstrap_balanced_median(values, cluster_ids, subset_ids=None, *, n_boot: int = 2000, level: float = 0.95,
                              seed: int = 0) -> BootstrapCI:
    """Cluster-bootstrap CI of the (balanced) median of the finite ``values``: without subsets it is
    :func:`bootstrap_pooled_median` (croma's); with ``subset_ids`` the point and every replicate are
    the median of the per-subset medians (CRoMa under ``paired_2x2``). Raises ``ValueError`` for
    mismatched lengths."""
    values = np.asarray(values, dtype=np.float64)
    ids = np.asarray(cluster_ids)
    if values.shape != ids.shape or (subset_ids is not None and np.shape(subset_ids) != values.shape):
        raise ValueError("values, cluster_ids (and subset_ids) must be 1-D of one length")
    if subset_ids is None:
        return bootstrap_pooled_median(values, ids, n_boot=n_boot, level=level, seed=seed)
    member, counts = cluster_counts(ids, n_boot=n_boot, seed=seed)
    ones = np.ones((1, counts.shape[1]), dtype=np.int64)
    point = float(balanced_median_replicates(values, member, ones, subset_ids)[0]) if counts.shape[1] else float("nan")
    if counts.shape[1] == 0:
        return BootstrapCI(point, float("nan"), float("nan"), level, 0)
    return percentile_ci(balanced_median_replicates(values, member, counts, subset_ids), point, level, int(n_boot))


def rank_summary(models, point_values, replicates, *, level: float = 0.95, ties: str = "ordered") -> dict:
    """Ranks of ``models`` from their point values and shared-draw replicates (the conventions of
    :func:`paired_rank_stability`: rank 1 = highest; the point ranking by a stable sort, ties in
    ``models`` order; replicate ranks treat NaN as -inf; ``rank_lo``/``rank_hi`` truncated
    percentiles; ``pairwise_win[(a, b)]`` the fraction of replicates with both finite and a's
    strictly greater). ``replicates``: (B, M) aligned with ``models``; with B = 0 only the point
    ranks are given (the other entries are None / NaN).

    ``ties="span"`` (the tidy tables' ranks): tied values are not ordered by name. A point rank is
    ``1 +`` the number of strictly higher values (tied models share it); in each replicate a model
    occupies the ranks ``1 + #higher .. #higher-or-equal``, so ``rank_lo`` is a percentile of the
    lowest and ``rank_hi`` of the highest rank it could hold, and ``mean_rank`` averages the
    middle of that span. Without ties both conventions give the same numbers."""
    if ties not in ("ordered", "span"):
        raise ValueError(f"ties must be 'ordered' or 'span', got {ties!r}")
    models = list(models)
    reps = np.asarray(replicates, dtype=np.float64).reshape(-1, len(models))
    if ties == "span":
        point_rank = {a: 1 + sum(point_values[b] > point_values[a] for b in models) for a in models}
    else:
        ranked = sorted(models, key=lambda name: point_values[name], reverse=True)
        point_rank = {name: i + 1 for i, name in enumerate(ranked)}
    if reps.shape[0] == 0:
        return {"point_rank": point_rank, "mean_rank": {n: float("nan") for n in models},
                "rank_lo": {n: None for n in models}, "rank_hi": {n: None for n in models},
                "pairwise_win": {(a, b): float("nan") for a in models for b in models if a != b}}
    finite = np.isfinite(reps)
    key = np.where(finite, reps, -np.inf)
    if ties == "span":  # (B, M): how many models are strictly above / at least level with each one
        low = 1 + (key[:, None, :] > key[:, :, None]).sum(axis=2)
        high = (key[:, None, :] >= key[:, :, None]).sum(axis=2)
        ranks = (low + high) / 2.0
    else:
        order = np.argsort(-key, axis=1, kind="stable")
        ranks = np.empty_like(order)
        np.put_along_axis(ranks, order, np.arange(1, len(models) + 1)[None, :], axis=1)
        low = high = ranks
    beats = finite[:, :, None] & finite[:, None, :] & (reps[:, :, None] > reps[:, None, :])
    n_rep = max(1, reps.shape[0])
    win = beats.sum(axis=0) / float(n_rep)
    q_lo = (1.0 - level) / 2.0 * 100.0
    rank_lo = np.percentile(low, q_lo, axis=0)  # per column, as one call per model would give
    rank_hi = np.percentile(high, 100.0 - q_lo, axis=0)
    return {
        "point_rank": point_rank,
        "mean_rank": {name: float(ranks[:, j].mean()) for j, name in enumerate(models)},
        "rank_lo": {name: int(rank_lo[j]) for j, name in enumerate(models)},
        "rank_hi": {name: int(rank_hi[j]) for j, name in enumerate(models)},
        "pairwise_win": {(a, b): float(win[i, j]) for i, a in enumerate(models) for j, b in enumerate(models)
                         if a != b},
    }
