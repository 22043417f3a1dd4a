"""Finiteness scan shared by the metric API, the cache writer, reader and health check."""

from __future__ import annotations

import numpy as np

__all__ = ["nonfinite_rows", "require_finite"]


def nonfinite_rows(array, *, step_bytes: int = 64 << 20) -> np.ndarray:
    """Positions (int64, ascending) of the rows of 2-D ``array`` holding NaN or ±inf.

    Works block by block (``step_bytes`` per block), so a memory-mapped shard is never read whole.
    Each block is first summed in float64 (cheap); the element-wise scan runs only for a block
    whose sum is not finite. Non-float arrays have no non-finite rows.
    """
    if array.size == 0 or not np.issubdtype(array.dtype, np.floating):
        return np.empty(0, dtype=np.int64)
    step = max(1, step_bytes // max(1, array.shape[1] * array.dtype.itemsize))
    bad = []
    for lo in range(0, array.shape[0], step):
        block = np.asarray(array[lo : lo + step])
        with np.errstate(over="ignore", invalid="ignore"):
            total = block.sum(dtype=np.float64)
        if np.isfinite(total):
            continue
        rows = np.flatnonzero(~np.isfinite(block).all(axis=1))
        if rows.size:  # an empty result means the sum overflowed on finite values
            bad.append(rows + lo)
    return np.concatenate(bad).astype(np.int64) if bad else np.empty(0, dtype=np.int64)


def require_finite(array, what: str = "u") -> None:
    """Raise ``ValueError`` naming ``what`` and the first rows holding NaN or ±inf (a neighbour
    engine's refusal: no distance to a NaN row is meaningful). One float64 sum per 64 MiB block
    on finite data (:func:`nonfinite_rows`)."""
    bad = nonfinite_rows(array)
    if bad.size:
        shown = ", ".join(str(int(r)) for r in bad[:10]) + (f", ... ({bad.size} rows)" if bad.size > 10 else "")
        raise ValueError(f"{what}: NaN or infinite values at rows [{shown}]; a neighbour search needs finite rows")
