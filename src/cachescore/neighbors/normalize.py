"""Row normalisation exactly as the reference applies it before a cosine search (spec §1.7).

Two steps, both in the dtype the reference uses:

1. ``x / (||x||_2 + 1e-12)`` in the input's own floating dtype (integers become float64);
2. scikit-learn's ``normalize``: divide by ``sqrt(einsum(x*x))``, leaving zero rows at zero.

The product of two normalised rows is then computed in float32 for float32 input and in float64
for everything else (float16 is upcast after step 1). Zero rows stay zero, so they sit at cosine
distance exactly 1 from every row.
"""

from __future__ import annotations

import numpy as np

__all__ = ["compute_dtype", "normalize_rows", "cosine_distance_block"]


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype dot products run in for features of ``dtype``: float32 stays, all else float64."""
    return np.dtype(np.float32) if np.dtype(dtype) == np.float32 else np.dtype(np.float64)


def normalize_rows(x: np.ndarray) -> np.ndarray:
    """Return the doubly L2-normalised copy of ``x`` (n, d) in :func:`compute_dtype` precision.

    Raises nothing itself; finiteness is checked by the caller (``check_finite_rows``).
    """
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float64)
    first = x / (np.linalg.norm(x, axis=1, keepdims=True) + 1e-12)
    first = np.asarray(first, dtype=compute_dtype(x.dtype))
    norms = np.sqrt(np.einsum("ij,ij->i", first, first))
    norms[norms == 0.0] = 1.0
    return first / norms[:, None]


def cosine_distance_block(queries: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``clip(1 - queries @ index.T, 0, 2)`` for already-normalised rows, as one BLAS GEMM.

    Shapes: ``queries`` (b, d), ``index`` (c, d) → (b, c), in the rows' dtype.
    """
    block = queries @ index.T
    np.subtract(1, block, out=block)
    np.clip(block, 0, 2, out=block)
    return block
