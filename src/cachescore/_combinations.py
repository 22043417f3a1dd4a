"""Distinct combinations of a few code columns, with how often each occurs and where it first occurs.

Planning checks a view through the combinations of its label, confounder, group and subset
values (scope sizes, the values a scope holds, CRoMa's candidate counts), never through its
rows: :func:`count` reduces rows (a whole small view, or one batch of a large one) to their
combinations, :func:`merge` adds up batches, :func:`by_sorted_names` renumbers a column's codes
so that code order is the order of its values as sorted text. Memory grows with the number of
combinations, not rows.
"""

from __future__ import annotations

import numpy as np

__all__ = ["Combinations", "by_sorted_names", "count", "merge"]

#: ``(codes (K, m) int64, rows (K,) int64, first (K,) int64)``: the distinct rows of an (n, m)
#: code matrix in lexicographic order, each one's number of occurrences and its first row.
Combinations = tuple


def count(codes: np.ndarray, offset: int = 0) -> Combinations:
    """The combinations of the rows of ``codes`` (n, m) int; ``first`` counts from ``offset``
    (the position of ``codes``' first row in the whole table)."""
    codes = np.asarray(codes, dtype=np.int64).reshape(len(codes), -1)
    uniq, first, inv = _unique_rows(codes)
    rows = np.bincount(inv, minlength=len(uniq)).astype(np.int64)
    return uniq, rows, first.astype(np.int64) + int(offset)


def merge(parts: list[Combinations], m: int) -> Combinations:
    """One :data:`Combinations` of several (batches of one table): counts added, first rows the
    earliest."""
    if not parts:
        return np.zeros((0, m), np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    codes = np.concatenate([p[0] for p in parts])
    rows = np.concatenate([p[1] for p in parts])
    first = np.concatenate([p[2] for p in parts])
    uniq, _, inv = _unique_rows(codes)
    total = np.bincount(inv, weights=rows, minlength=len(uniq)).astype(np.int64)
    earliest = np.full(len(uniq), np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(earliest, inv, first)
    return uniq, total, earliest


def _unique_rows(codes: np.ndarray):
    """``(distinct rows in lexicographic order, index of each one's first occurrence, inverse)``
    of an (n, m) int64 matrix of non-negative codes: one int64 key per row when the codes' ranges
    multiply below 2**62 (a 1-D sort), else numpy's row-wise unique."""
    if not len(codes):
        return codes, np.zeros(0, np.int64), np.zeros(0, np.int64)
    radix = codes.max(axis=0) + 1
    if float(np.prod(radix.astype(np.float64))) >= 2.0**62:
        uniq, first, inv = np.unique(codes, axis=0, return_index=True, return_inverse=True)
        return uniq, first, inv.ravel()
    key = np.zeros(len(codes), dtype=np.int64)
    for j in range(codes.shape[1]):
        key *= radix[j]
        key += codes[:, j]
    _, first, inv = np.unique(key, return_index=True, return_inverse=True)
    return codes[first], first, inv.ravel()  # keys ascend as the rows do lexicographically


def by_sorted_names(names) -> tuple[list[str], np.ndarray]:
    """``(sorted names, rank)`` for a column whose code ``i`` stands for ``names[i]`` (text):
    ``rank[i]`` is that value's position among the sorted names (a stable sort of the text)."""
    text = np.asarray(list(names), dtype=object).astype(str)
    order = np.argsort(text, kind="stable")
    rank = np.empty(order.size, dtype=np.int64)
    rank[order] = np.arange(order.size, dtype=np.int64)
    return [str(v) for v in text[order]], rank
