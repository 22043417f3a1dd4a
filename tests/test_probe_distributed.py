"""Pins the Dask fan-out of the probe sweep (spec downstream §8, DESIGN §5).

- One task per (replicate, split); the same matrices and outcomes for ``client=None``, an
  in-process cluster with 1 or 2 single-threaded workers, and (marked ``cluster``) a real
  ``dask scheduler`` + 2 ``dask worker`` subprocesses; also when jobs complete in any order.
- The embeddings are scattered once (never embedded per task) and every probe runs with BLAS
  pinned to one thread.
- A task's failure (a scikit-learn error on a NaN test set) surfaces as the same ValueError.
"""

from __future__ import annotations

import warnings

import croma.downstream as cd
import numpy as np
import pytest
from distributed import Client, LocalCluster
from sklearn.exceptions import ConvergenceWarning
from threadpoolctl import threadpool_info, threadpool_limits

import cachescore.probe.distributed as dist
from cachescore.downstream import IN_DOMAIN, pathorob_schedule, probe_sweep, probe_sweep_over_test_sets
from cachescore.probe.sweep import sweep_outcomes
from cluster_utils import dask_subprocess_cluster  # noqa: F401  (fixture)


def cohort(n_conf=2, n_cls=2, slides=17, rps=2, dim=6, seed=0):
    rng = np.random.default_rng(seed)
    xs, cs, ys = [], [], []
    for i in range(n_conf):
        for j in range(n_cls):
            n = slides * rps
            centre = np.zeros(dim)
            centre[0], centre[1] = 1.5 * j, 1.5 * i
            xs.append(centre + np.repeat(rng.normal(0, 0.4, (slides, dim)), rps, 0) + rng.normal(0, 0.3, (n, dim)))
            cs.append(np.full(n, i))
            ys.append(np.full(n, j))
    return np.concatenate(xs), np.concatenate(cs), np.concatenate(ys)


X, C, Y = cohort()
OOD_X, _, OOD_Y = cohort(n_conf=1, slides=5, seed=1)
KW = dict(
    schedule=pathorob_schedule("camelyon", rows_per_slide=2, n_splits=3),
    rows_per_slide=2,
    iterations=3,
    seed=1000,
    test_sets={"ood": (OOD_X + 2.0, OOD_Y)},
)


@pytest.fixture(scope="module")
def reference():
    return sweep_outcomes(X, C, Y, keep_predictions=True, **KW)


def same_outcomes(a, b):
    assert len(a) == len(b)
    for p, q in zip(a, b):
        assert (p.replicate, p.split, p.seed, p.best_C) == (q.replicate, q.split, q.seed, q.best_C)
        assert p.scores == q.scores
        for name in ("val_scores", "train_rows", "val_rows", "test_rows", "classes", "val_decision"):
            assert np.array_equal(getattr(p, name), getattr(q, name)), name
        for name in p.test_decision:
            assert np.array_equal(p.test_decision[name], q.test_decision[name])


def test_in_process_reference_matches_croma(reference):
    with warnings.catch_warnings(), threadpool_limits(limits=1):
        warnings.simplefilter("ignore", ConvergenceWarning)
        theirs = cd.probe_sweep_over_test_sets(X, C, Y, **KW)
    for name in (IN_DOMAIN, "ood"):
        assert np.array_equal(reference.matrices[name], theirs[name])


class CountingClient:
    """Delegates to a real Client and records scatter / submit calls (data-holding submits apart)."""

    def __init__(self, client):
        self._client = client
        self.scattered: list = []
        self.held: list = []
        self.submitted = 0

    def scatter(self, data, **kwargs):
        self.scattered.append((data, kwargs))
        return self._client.scatter(data, **kwargs)

    def submit(self, fn, *args, **kwargs):
        if str(kwargs.get("key", "")).startswith("probe-data-"):
            self.held.append(args[0])
        else:
            self.submitted += 1
        return self._client.submit(fn, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._client, name)


@pytest.mark.parametrize("n_workers", [1, 2, 8])
def test_in_process_cluster_gives_identical_outcomes(reference, n_workers):
    with LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=False,
                      dashboard_address=None) as cluster, Client(cluster) as client:  # fmt: skip
        counting = CountingClient(client)
        run = sweep_outcomes(X, C, Y, keep_predictions=True, client=counting, **KW)
        # the data is scattered once, without broadcast (Dask moves it where tasks need it): X,
        # labels and the test set's two arrays, never inside the task graph
        assert len(counting.scattered) == 1 and not counting.held
        data, kwargs = counting.scattered[0]
        assert data[0] is X and len(data) == 4 and not kwargs.get("broadcast")
        assert counting.submitted == 3 * 3  # one task per (replicate, split)
        matrix = probe_sweep(X, C, Y, client=client, **{k: v for k, v in KW.items() if k != "test_sets"})
    for name in (IN_DOMAIN, "ood"):
        assert np.array_equal(run.matrices[name], reference.matrices[name])
    assert np.array_equal(matrix, reference.matrices[IN_DOMAIN])
    assert run.replicate_seeds == reference.replicate_seeds
    same_outcomes(run.outcomes, reference.outcomes)


def test_dask_array_embeddings_give_the_same_matrix(reference):
    import dask.array as da

    kwargs = {k: v for k, v in KW.items() if k != "test_sets"}
    matrix = probe_sweep(da.from_array(X, chunks=(25, X.shape[1])), C, Y, **kwargs)
    assert np.array_equal(matrix, reference.matrices[IN_DOMAIN])


def test_completion_order_does_not_matter(reference):
    from cachescore.probe.sweep import _cell_grid, _replay, _validated_plans  # driver-side replay

    plans = _validated_plans(KW["schedule"], _cell_grid(C, Y), 2, None)
    jobs = _replay(_cell_grid(C, Y), plans, reference.replicate_seeds, 2, None)
    shuffled = [jobs[k] for k in np.random.default_rng(0).permutation(len(jobs))]
    tests = {"ood": (np.asarray(OOD_X + 2.0), OOD_Y)}
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=None) as cluster, Client(cluster) as client:  # fmt: skip
        outcomes = dist.run_probe_jobs(shuffled, X, Y, tests, client=client, keep_predictions=True)
    assert [(o.replicate, o.split) for o in outcomes] == [(j.replicate, j.split) for j in shuffled]
    same_outcomes(sorted(outcomes, key=lambda o: (o.replicate, o.split)), reference.outcomes)


def test_every_probe_runs_with_single_threaded_blas(monkeypatch):
    seen = []
    real = dist.fit_probe

    def spy(*args, **kwargs):
        seen.append([info["num_threads"] for info in threadpool_info() if info["user_api"] == "blas"])
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, "fit_probe", spy)
    probe_sweep(X, C, Y, **{**{k: v for k, v in KW.items() if k != "test_sets"}, "iterations": 1})
    assert len(seen) == 3 and all(threads and set(threads) == {1} for threads in seen)


def test_a_failing_task_raises_the_same_error_through_the_client():
    bad = OOD_X.copy()
    bad[0, 0] = np.nan
    kwargs = {**KW, "iterations": 1, "test_sets": {"ood": (bad, OOD_Y)}}
    with pytest.raises(ValueError, match="NaN"):
        probe_sweep_over_test_sets(X, C, Y, **kwargs)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=None) as cluster, Client(cluster) as client:  # fmt: skip
        with pytest.raises(ValueError, match="NaN"):
            probe_sweep_over_test_sets(X, C, Y, client=client, **kwargs)


@pytest.mark.cluster
def test_real_scheduler_and_worker_processes_give_the_same_matrices(reference, dask_subprocess_cluster):
    with Client(dask_subprocess_cluster.address) as client:
        assert len(client.scheduler_info()["workers"]) == 2
        matrices = probe_sweep_over_test_sets(X, C, Y, client=client, **KW)
        # both workers are single-threaded processes
        assert all(n == 1 for n in client.nthreads().values())
    for name in (IN_DOMAIN, "ood"):
        assert np.array_equal(matrices[name], reference.matrices[name])
