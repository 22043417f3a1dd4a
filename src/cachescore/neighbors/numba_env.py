"""Safe numba set-up for pynndescent, in the driver and inside Dask workers.

pynndescent JIT-compiles its kernels with numba on first use (about 100 s on a cold cache) and
caches the machine code next to its sources, or under ``NUMBA_CACHE_DIR``. Three things go wrong
in worker processes if nobody takes care of them:

* the cache directory is not writable (read-only site-packages, containers) and every worker
  recompiles from scratch on every start;
* numba starts one thread per core in every worker of a multi-threaded Dask worker, so a 16-thread
  worker would run 16 × 16 threads;
* the first task of each process pays the compile time, which skews task durations.

:func:`configure` fixes the first two (it must run before numba is imported to take full effect,
and only ever *adds* settings the user has not made); :func:`warm_up` pays the JIT once per process
on tiny data. :func:`configure_worker` does both and is what a Dask worker plugin or
``client.run`` should call. Nothing here runs at import time.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import threading

import numpy as np

__all__ = ["default_cache_dir", "configure", "warm_up", "configure_worker"]

_WARM_LOCK = threading.Lock()
_WARMED: set[str] = set()


def default_cache_dir() -> str:
    """A per-user writable directory for numba's on-disk cache (``<tmp>/cachescore-numba-<uid>``)."""
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return os.path.join(tempfile.gettempdir(), f"cachescore-numba-{uid}")


def _pynndescent_dir_writable() -> bool:

    spec = importlib.util.find_spec("pynndescent")
    if spec is None or spec.origin is None:
        return False
    return os.access(os.path.dirname(spec.origin), os.W_OK)


def configure(*, num_threads: int | None = None, cache_dir: str | None = None) -> dict[str, str]:
    """Make numba safe to use in this process; return the environment settings that were made.

    Parameters
    ----------
    num_threads : int, optional
        Threads numba may use. ``None`` leaves the user's ``NUMBA_NUM_THREADS`` alone. Inside a
        multi-threaded Dask worker pass 1. If numba is already imported, the running limit is
        lowered with ``numba.set_num_threads`` (it can never be raised past the launch value).
    cache_dir : str, optional
        Directory for numba's cache. By default ``NUMBA_CACHE_DIR`` is left alone when it is set,
        or when pynndescent's own directory is writable; otherwise :func:`default_cache_dir`.

    Raises
    ------
    ValueError
        ``num_threads < 1``.
    OSError
        The cache directory cannot be created.
    """
    changed: dict[str, str] = {}
    if num_threads is not None:
        num_threads = int(num_threads)
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    if cache_dir is None and "NUMBA_CACHE_DIR" not in os.environ and not _pynndescent_dir_writable():
        cache_dir = default_cache_dir()
    if cache_dir is not None:
        os.makedirs(cache_dir, exist_ok=True)
        os.environ["NUMBA_CACHE_DIR"] = changed["NUMBA_CACHE_DIR"] = str(cache_dir)
    if num_threads is not None and "numba" not in sys.modules:
        os.environ["NUMBA_NUM_THREADS"] = changed["NUMBA_NUM_THREADS"] = str(num_threads)
    if "numba" in sys.modules:
        import numba  # deferred: only touched when numba is already loaded (importing it costs seconds)

        if cache_dir is not None:
            numba.config.reload_config()
        if num_threads is not None:
            numba.set_num_threads(min(num_threads, numba.config.NUMBA_NUM_THREADS))
    return changed


def warm_up(metric: str = "cosine") -> None:
    """JIT-compile pynndescent's build and query paths for ``metric`` once in this process.

    Idempotent and thread-safe; later calls return immediately. Uses 300 random rows of width 8,
    single-threaded, so it costs only the compile time (seconds with a warm on-disk cache).
    """
    with _WARM_LOCK:
        if metric in _WARMED:
            return
        from pynndescent import NNDescent  # deferred: the warm-up is the only reason to import it here

        x = np.random.default_rng(0).standard_normal((300, 8)).astype(np.float32)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        index = NNDescent(x, metric=metric, n_neighbors=10, random_state=0, n_jobs=1)
        index.query(x[:8], k=5)
        _ = index.neighbor_graph
        _WARMED.add(metric)


def configure_worker(num_threads: int = 1, metric: str = "cosine") -> dict[str, str]:
    """:func:`configure` with ``num_threads`` (default 1) then :func:`warm_up`; for Dask workers.

    Call it through ``client.run(configure_worker)`` or a ``distributed.WorkerPlugin.setup``; it
    returns the settings made, so the caller can log them.
    """
    changed = configure(num_threads=num_threads)
    warm_up(metric)
    return changed
