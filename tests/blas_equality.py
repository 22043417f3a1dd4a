"""How equal two neighbour tables computed with different GEMM shapes can be on *this* BLAS.

The engines promise bit-identical results across tilings, thread counts and blocked / whole-scope
paths, and they keep it wherever the loaded BLAS computes an entry of ``A @ B.T`` independently of
the shapes it is called with (OpenBLAS's native kernels here). A BLAS forced onto another kernel
(``OPENBLAS_CORETYPE=Haswell`` on an AVX-512 host, which the environment may set and tests must
not change) gives entries that move by one float32 ulp with the call's M and N, so no tiling can
be bit-identical to another there. :data:`SHAPE_INVARIANT` is measured once per session;
:func:`assert_same_search` asserts bit equality where it holds and otherwise the strongest
property that does: distances within the float32 distance tolerance (spec §12.3) and indices
equal up to swaps of near-tied neighbours.
"""

from __future__ import annotations

import functools

import numpy as np
from threadpoolctl import threadpool_limits

from cachescore.neighbors.ann import distance_tol

__all__ = ["shape_invariant", "assert_same_neighbours", "assert_same_search", "assert_same_distances"]


@functools.lru_cache(maxsize=2)
def shape_invariant(dtype=np.float32) -> bool:
    """Whether this process's BLAS gives every entry of a GEMM in ``dtype`` independently of the
    call's row and column counts and offsets (probed on 260 x 260 products, one thread)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((260, 16)).astype(dtype)
    b = rng.standard_normal((260, 16)).astype(dtype)
    with threadpool_limits(limits=1, user_api="blas"):
        full = a @ b.T
        return all(np.array_equal(a[:m] @ b.T, full[:m]) and np.array_equal(a @ b[:m].T, full[:, :m])
                   and np.array_equal(a[5:5 + m] @ b.T, full[5:5 + m]) for m in (70, 64, 16))


def assert_same_neighbours(idx, dist, ref_idx, ref_dist, tol):
    """Equal tables up to near-tie swaps: distances within ``tol``, and where an index differs the
    reference row holds a near-tie partner of that position (or it is the last). Returns the swap
    count."""
    assert idx.shape == ref_idx.shape and idx.dtype == np.int64 and dist.dtype == np.float64
    fin = np.isfinite(ref_dist)
    np.testing.assert_array_equal(np.isfinite(dist), fin)
    np.testing.assert_allclose(dist[fin], ref_dist[fin], rtol=0, atol=tol)
    np.testing.assert_array_equal(idx[~fin], -1)
    diff = np.argwhere(idx != ref_idx)
    for r, p in diff:
        near = np.abs(ref_dist[r] - ref_dist[r, p]) <= 2 * tol
        near[p] = False
        assert near.any() or p == idx.shape[1] - 1, (r, p, dist[r], ref_dist[r])
    return len(diff)


def assert_same_search(got, want, u) -> None:
    """``(idx, dist)`` tables of two exact searches of ``u``: bit-identical on a shape-invariant
    BLAS, else equal up to the float32 distance tolerance and near-tie swaps."""
    if shape_invariant(np.dtype(u.dtype).type):
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    else:
        assert_same_neighbours(np.asarray(got[0]), np.asarray(got[1]), want[0], want[1],
                               distance_tol(u.dtype, u.shape[1]))


def assert_same_distances(got, want, u, *, float64_reference: bool = False) -> None:
    """Distance tables (e.g. typed SO / OS): bit-identical on a shape-invariant BLAS, else within
    the distance tolerance (+inf where the reference has +inf). ``float64_reference``: ``want`` was
    computed in float64 (a brute-force oracle), which no float32 engine reproduces bit for bit on
    any BLAS: always the tolerance."""
    got, want = np.asarray(got), np.asarray(want)
    if shape_invariant(np.dtype(u.dtype).type) and not float64_reference:
        np.testing.assert_array_equal(got, want)
        return
    fin = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), fin)
    np.testing.assert_allclose(got[fin], want[fin], rtol=0, atol=distance_tol(u.dtype, u.shape[1]))
