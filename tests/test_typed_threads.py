"""Threaded execution of the typed search and the counting pass (``cachescore.neighbors.typed``).

Pins:
* ``typed_knn``, ``count_within`` and ``typed_knn_and_counts`` return bit-identical arrays for any
  ``threads`` (tasks are fixed by the layout, BLAS is pinned to one thread for the call, partials
  are merged by order-independent reductions), on many random scopes with groups spanning cells,
  both dtypes, several tile sizes, kept and not-kept typed tiles;
* the threaded result also equals an independent brute-force typed search / count;
* BLAS runs single-threaded during the call and the caller's BLAS limits are restored afterwards;
* ``search_threads``: CPU affinity by default, 1 inside a Dask worker task, ``ValueError`` below 1;
  small scopes (``PARALLEL_MIN_WORK``) and single tasks run on the calling thread.
"""

from __future__ import annotations

import os
import sys
import types

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

import threading

from cachescore.neighbors import typed as typed_mod
from cachescore.neighbors.normalize import cosine_distance_block, normalize_rows
from cachescore.neighbors.typed import count_within, search_threads, typed_knn, typed_knn_and_counts
from blas_equality import assert_same_distances


@pytest.fixture(autouse=True)
def _always_parallel(monkeypatch):
    """The scopes here are small; without this they would run on the calling thread
    (``PARALLEL_MIN_WORK``) and the threaded path would go untested."""
    monkeypatch.setattr(typed_mod, "PARALLEL_MIN_WORK", 0)


def _blas_threads():
    return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]


def _scope(seed, dtype):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 420))
    labels = rng.integers(0, int(rng.integers(1, 4)), n)
    confs = rng.integers(0, int(rng.integers(1, 5)), n)
    groups = rng.integers(0, max(1, n // int(rng.integers(1, 8))), n)  # groups span cells
    u = normalize_rows(rng.standard_normal((n, int(rng.integers(2, 40)))).astype(dtype))
    radius = rng.uniform(0, 2.5, n)
    radius[: min(n, 2)] = [np.inf, 0.0][: min(n, 2)]
    return u, labels, confs, groups, radius, int(rng.integers(1, 7))


def _brute_typed(u, labels, confs, groups, m):
    """Independent reference: the full distance matrix, masked per type, sorted."""
    d = cosine_distance_block(u, u).astype(np.float64)
    cross = groups[:, None] != groups[None, :]
    same_l = labels[:, None] == labels[None, :]
    same_c = confs[:, None] == confs[None, :]
    out = []
    for mask in (cross & same_l & ~same_c, cross & ~same_l & same_c):
        s = np.sort(np.where(mask, d, np.inf), axis=1)[:, :m]
        out.append(np.pad(s, ((0, 0), (0, m - s.shape[1])), constant_values=np.inf))
    return out


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_results_are_bit_identical_for_any_thread_count(seed, dtype):
    u, labels, confs, groups, radius, m = _scope(seed, dtype)
    for block in (None, 5, 64):
        base = typed_knn(u, labels, confs, groups, m, block_rows=block, threads=1)
        base_count = count_within(u, groups, radius, block_rows=block, threads=1)
        for threads in (2, 3):
            got = typed_knn(u, labels, confs, groups, m, block_rows=block, threads=threads)
            np.testing.assert_array_equal(got[0], base[0])
            np.testing.assert_array_equal(got[1], base[1])
            np.testing.assert_array_equal(count_within(u, groups, radius, block_rows=block, threads=threads), base_count)
        for tile_bytes in (None, 0):  # typed tiles kept for the count, or the separate pass
            fused = [
                typed_knn_and_counts(
                    u, labels, confs, groups, m, lambda so, os_: radius, block_rows=block, tile_bytes=tile_bytes,
                    threads=threads,
                )
                for threads in (1, 2, 3)
            ]
            for so, os_, counts in fused:
                np.testing.assert_array_equal(so, base[0])
                np.testing.assert_array_equal(os_, base[1])
                np.testing.assert_array_equal(counts, fused[0][2])


@pytest.mark.parametrize("seed", range(4))
def test_threaded_results_equal_brute_force(seed):
    u, labels, confs, groups, radius, m = _scope(100 + seed, np.float64)
    want = _brute_typed(u, labels, confs, groups, m)
    so, os_, counts = typed_knn_and_counts(u, labels, confs, groups, m, lambda so, os_: radius, block_rows=16, threads=2)
    # other GEMM shapes than the full matrix: a distance may move by an ulp or two of float64
    for g, w in ((so, want[0]), (os_, want[1])):
        np.testing.assert_array_equal(np.isinf(g), np.isinf(w))
        np.testing.assert_allclose(g[np.isfinite(w)], w[np.isfinite(w)], rtol=0, atol=4 * np.finfo(np.float64).eps)
    # counts: tie-free by construction (random radii never sit within an ulp of a distance)
    d = cosine_distance_block(u, u)
    want_count = ((d <= radius[:, None]) & (groups[:, None] != groups[None, :])).sum(axis=1)
    np.testing.assert_array_equal(counts, want_count)


def test_blas_is_pinned_during_the_call_and_restored_after():
    u, labels, confs, groups, radius, m = _scope(7, np.float32)
    seen = []

    def radius_for(so, os_):
        seen.append(_blas_threads())
        return radius

    with threadpool_limits(limits=2, user_api="blas"):
        before = _blas_threads()
        typed_knn_and_counts(u, labels, confs, groups, m, radius_for, threads=2)
        assert _blas_threads() == before
    assert seen and seen[0] and set(seen[0]) == {1}


def test_search_threads_defaults_validation_and_dask_worker(monkeypatch):
    assert search_threads() == len(os.sched_getaffinity(0))
    assert search_threads(3) == 3
    with pytest.raises(ValueError, match="threads must be >= 1"):
        search_threads(0)
    u, labels, confs, groups, _, m = _scope(3, np.float64)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        typed_knn(u, labels, confs, groups, m, threads=0)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        count_within(u, groups, np.ones(len(groups)), threads=-1)

    fake = types.ModuleType("distributed")
    fake.get_worker = lambda: object()  # inside a worker task: the worker's threads fill the machine
    monkeypatch.setitem(sys.modules, "distributed", fake)
    assert search_threads() == 1
    assert search_threads(2) == 2  # an explicit count wins

    def outside():
        raise ValueError("No worker found")

    fake.get_worker = outside
    assert search_threads() == len(os.sched_getaffinity(0))


@pytest.mark.cluster
# distributed's client side may leave an unbound socket (laddr 0.0.0.0:0) to the garbage collector
# (as in tests/test_blocked_search.py); this test creates no socket itself
@pytest.mark.filterwarnings("ignore:unclosed <socket.socket:ResourceWarning")
def test_search_threads_is_one_in_a_real_dask_worker():
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(
        n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None
    ) as cluster, distributed.Client(cluster) as client:
        assert client.submit(search_threads, pure=False).result() == 1


def test_croma_compute_with_threads_gives_identical_results():
    import pandas as pd

    from cachescore.metrics.croma import CRoMa

    rng = np.random.default_rng(11)
    n = 300
    cells = rng.integers(0, 4, n)
    df = pd.DataFrame(
        {
            "sample_id": [f"s{i}" for i in range(n)],
            "image_path": [f"/t/{i}.png" for i in range(n)],
            "label": [f"L{c // 2}" for c in cells],
            "site": [f"C{c % 2}" for c in cells],
            "group_id": [f"g{v}" for v in rng.integers(0, 60, n)],
            "dataset": "toy",
        }
    )
    x = rng.standard_normal((n, 12)).astype(np.float32)
    kw = dict(confounder_column="site", m=[1, 3], start_k=4)
    runs = [CRoMa.compute_with(typed_knn, x, df, threads=t, **kw) for t in (1, 2, 3)]
    runs.append(CRoMa.compute(x, df, **kw))
    for res in runs[1:]:
        for mm in (1, 3):
            np.testing.assert_array_equal(res[mm].sample_values, runs[0][mm].sample_values)
            assert (res[mm].k_start, res[mm].k_final, res[mm].retries) == (
                runs[0][mm].k_start, runs[0][mm].k_final, runs[0][mm].retries,
            )
    with pytest.raises(ValueError, match="threads must be >= 1"):
        CRoMa.compute_with(typed_knn, x, df, threads=0, **kw)


def test_concurrent_callers_share_one_blas_pin_and_restore_it():
    """Two kernels running at once in one process (as tasks of an in-process Dask cluster would)
    give the single-call results and leave the caller's BLAS limits as they were."""
    from concurrent.futures import ThreadPoolExecutor

    cases = [_scope(20 + k, np.float32) for k in range(4)]
    want = [typed_knn(u, lab, con, grp, m, threads=1) for u, lab, con, grp, _, m in cases]
    with threadpool_limits(limits=2, user_api="blas"):
        before = _blas_threads()
        with ThreadPoolExecutor(4) as ex:
            got = list(ex.map(lambda c: typed_knn(c[0], c[1], c[2], c[3], c[5], threads=2), cases * 3))
        assert _blas_threads() == before
    for g, w, c in zip(got, want * 3, cases * 3):
        assert_same_distances(g[0], w[0], c[0])  # bit-identical on a shape-invariant BLAS (blas_equality.py)
        assert_same_distances(g[1], w[1], c[0])


def test_small_work_and_single_tasks_run_on_the_calling_thread(monkeypatch):
    main = threading.get_ident()
    with typed_mod._parallel(2) as run:
        assert set(run(lambda _: threading.get_ident(), range(6))) - {main}  # the pool is used
        assert run(lambda _: threading.get_ident(), [0]) == [main]
    monkeypatch.setattr(typed_mod, "PARALLEL_MIN_WORK", 1000)
    with typed_mod._parallel(2, work=999) as run:
        assert run(lambda _: threading.get_ident(), range(6)) == [main] * 6
    with typed_mod._parallel(2, work=1000) as run:
        assert run(lambda x: x * x, range(6)) == [0, 1, 4, 9, 16, 25]  # task order kept
