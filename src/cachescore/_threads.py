"""Thread pinning: BLAS / OpenMP run one thread inside a task (Dask's threads give the parallelism).

:func:`single_thread_blas` pins every thread pool (BLAS and OpenMP) for a task's block of work;
:func:`shared_blas_pin` pins BLAS for kernels that run their own Python threads and may overlap
in one process (reference-counted, so overlapping callers never restore each other's limits);
:data:`THREAD_ENV` is the environment a worker process is started with so that libraries that
read it at import (OpenBLAS, MKL, OpenMP, numba) start single-threaded too.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from threadpoolctl import ThreadpoolController, threadpool_limits

__all__ = ["single_thread_blas", "shared_blas_pin", "THREAD_ENV"]

#: Environment for worker processes: one BLAS / OpenMP / numba thread each.
THREAD_ENV = {
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "NUMBA_NUM_THREADS": "1",
}


def single_thread_blas():
    """A context manager (``threadpoolctl.threadpool_limits(1)``) limiting BLAS/OpenMP to one thread."""
    return threadpool_limits(limits=1)


_PIN_LOCK = threading.Lock()
_PIN = {"depth": 0, "limits": None, "controller": None}


@contextmanager
def shared_blas_pin() -> Iterator[None]:
    """BLAS limited to one thread while any caller (in any thread) is inside this context.

    threadpoolctl's limits are process-wide: concurrent kernels (e.g. several tasks of an
    in-process Dask cluster) share one pin, taken by the first to enter and restored to the
    original limits by the last to leave, so no kernel ever runs under a restored multithreaded
    BLAS and the process never stays pinned afterwards."""
    with _PIN_LOCK:
        if _PIN["depth"] == 0:
            if _PIN["controller"] is None:  # scanning the loaded libraries costs ~1 ms: once
                _PIN["controller"] = ThreadpoolController()
            _PIN["limits"] = _PIN["controller"].limit(limits=1, user_api="blas")
        _PIN["depth"] += 1
    try:
        yield
    finally:
        with _PIN_LOCK:
            _PIN["depth"] -= 1
            if _PIN["depth"] == 0:
                _PIN["limits"].restore_original_limits()
                _PIN["limits"] = None
