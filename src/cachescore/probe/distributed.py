"""Run the sweep's (replicate, split) probes in-process or as Dask futures (spec §8).

With a ``distributed.Client``, the embeddings, the label vector and the extra test sets are
scattered to every worker **once** (``broadcast=True``), and one task per (replicate, split) is
submitted that references them; each task pins BLAS to one thread (threadpoolctl), which is both
the reference setting and ~5x faster than multi-threaded BLAS on these small problems. Tasks
consume no randomness, so the outcomes -- and the matrices assembled from them centrally -- are
identical for any number of workers and any completion order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._taskkeys import task_key
from .._threads import single_thread_blas
from .fit import ProbeOutcome, ProbeTask, fit_probe

__all__ = ["run_probe_job", "run_probe_jobs", "gather_on_scattered"]


def gather_on_scattered(client, arrays, submit) -> list:
    """Scatter ``arrays`` once (no broadcast: Dask moves them where tasks need them), submit the
    tasks with ``submit(array futures) -> [task futures]`` and gather their results in order.

    Scattered data cannot be recomputed: when a worker holding it dies (a cancelled or preempted
    worker job) the tasks fail. Then, once, the data is scattered again and the tasks resubmitted;
    any other failure is raised at once. The data never enters the task graph (the scheduler does
    not hold it). Remaining tasks are cancelled on failure; the scattered data is released.
    """
    for attempt in (0, 1):
        held = client.scatter(list(arrays), hash=False)
        futures: list = []
        try:
            futures = submit(held)
            return list(client.gather(futures))
        except (KeyboardInterrupt, SystemExit):
            client.cancel(futures)
            raise
        except BaseException:  # noqa: BLE001 - CancelledError is a BaseException
            client.cancel(futures)  # a probe failed: stop the rest
            lost = any(f.status != "finished" for f in held)
            if attempt or not lost:
                raise
        finally:
            for f in held:
                f.release()
    raise AssertionError("unreachable")  # pragma: no cover


def run_probe_job(
    job: ProbeTask,
    features: np.ndarray,
    labels: np.ndarray,
    test_names: Sequence[str],
    keep_predictions: bool,
    *test_arrays: np.ndarray,
) -> ProbeOutcome:
    """One (replicate, split) probe with BLAS pinned to one thread.

    ``test_arrays`` is ``(X_0, y_0, X_1, y_1, ...)`` in ``test_names`` order (flat, so that Dask
    resolves each scattered future as a top-level argument).
    """
    test_sets = {
        name: (test_arrays[2 * k], test_arrays[2 * k + 1]) for k, name in enumerate(test_names)
    }
    with single_thread_blas():
        return fit_probe(
            features,
            labels,
            replicate=job.replicate,
            split=job.split,
            seed=job.seed,
            train_rows=job.train_rows,
            val_rows=job.val_rows,
            test_rows=job.test_rows,
            test_sets=test_sets,
            keep_predictions=keep_predictions,
        )


def run_probe_jobs(
    jobs: Sequence[ProbeTask],
    features: np.ndarray,
    labels: np.ndarray,
    test_sets: Mapping[str, tuple[np.ndarray, np.ndarray]],
    *,
    client: Any = None,
    keep_predictions: bool = False,
) -> list[ProbeOutcome]:
    """Fit every job's probe; returns the outcomes in ``jobs`` order.

    ``client=None`` runs a plain in-process loop. Otherwise ``client`` must be a
    ``distributed.Client``: the data is scattered once (:func:`gather_on_scattered`) and one
    task is submitted per job (keys ``probe_replicate[.<encoder>.<view>.probe]-r<replicate>-s<split>-<random>``, see :mod:`cachescore._taskkeys`); a task failure re-raises here.
    """
    names = list(test_sets)
    flat_tests: list[np.ndarray] = [a for name in names for a in test_sets[name]]
    if client is None:
        return [
            run_probe_job(job, features, labels, names, keep_predictions, *flat_tests)
            for job in jobs
        ]
    def submit(held):
        x_future, y_future, *test_futures = held
        return [client.submit(run_probe_job, job, x_future, y_future, names, keep_predictions, *test_futures,
                              key=task_key("probe_replicate", f"r{job.replicate}", f"s{job.split}"), pure=False)
                for job in jobs]

    return gather_on_scattered(client, [features, labels, *flat_tests], submit)
