"""Reusable real-process Dask cluster for tests (``dask scheduler`` + ``dask worker`` subprocesses).

Usage in a test module::

    from cluster_utils import dask_subprocess_cluster  # noqa: F401  (a pytest fixture)

    @pytest.mark.cluster
    def test_something(dask_subprocess_cluster):
        with distributed.Client(dask_subprocess_cluster.address) as client:
            ...

or, outside pytest, ``with subprocess_cluster(n_workers=2) as cluster: ...``.

Everything listens on 127.0.0.1 on free ports, without dashboards; workers run single-threaded
with BLAS pinned to one thread. Processes are always terminated (then killed) on exit, even when
start-up fails half-way, and their output is kept in a temporary directory for failure messages.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

__all__ = ["SubprocessCluster", "dask_subprocess_cluster", "free_port", "subprocess_cluster"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class SubprocessCluster:
    address: str
    n_workers: int
    processes: list[subprocess.Popen] = field(default_factory=list)
    log_dir: Path | None = None
    #: ``http://127.0.0.1:<port>`` of the scheduler's HTTP server (dashboard, /metrics), if started with one.
    http: str | None = None
    #: Starts one more worker process (set by :func:`subprocess_cluster`); returns its Popen.
    add_worker: object = None

    @property
    def scheduler(self) -> subprocess.Popen:
        return self.processes[0]

    @property
    def workers(self) -> list[subprocess.Popen]:
        return self.processes[1:]

    def logs(self) -> str:
        if self.log_dir is None:
            return ""
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(self.log_dir.glob("*.log"))
        )


def _dask_cli() -> list[str]:
    exe = shutil.which("dask")
    return [exe] if exe else [sys.executable, "-m", "dask"]


def _wait_for_port(port: int, deadline: float, procs: list[subprocess.Popen]) -> None:
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a dask process exited during start-up")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(0.2)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"dask scheduler did not listen on 127.0.0.1:{port} in time")



def _start(cluster, port, n_workers, nthreads, memory_limit, timeout, env, handles, *, http_port=None,
           nanny=True) -> None:
    log_dir = cluster.log_dir
    address = cluster.address

    def spawn(name: str, args: list[str]) -> subprocess.Popen:
        handle = open(log_dir / f"{name}.log", "wb")
        handles.append(handle)
        proc = subprocess.Popen(args, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=log_dir)
        cluster.processes.append(proc)
        return proc

    def add_worker() -> subprocess.Popen:
        k = len(cluster.processes) - 1
        return spawn(f"worker-{k}", [*_dask_cli(), "worker", address, "--host", "127.0.0.1",
                                     "--nthreads", str(nthreads), "--no-dashboard", "--name", f"w{k}",
                                     "--memory-limit", memory_limit, *([] if nanny else ["--no-nanny"])])  # fmt: skip

    cluster.add_worker = add_worker
    dashboard = ["--dashboard-address", f"127.0.0.1:{http_port}"] if http_port else ["--no-dashboard"]
    spawn("scheduler", [*_dask_cli(), "scheduler", "--host", "127.0.0.1", "--port", str(port),
                        *dashboard])  # fmt: skip
    deadline = time.monotonic() + timeout
    _wait_for_port(port, deadline, cluster.processes)
    for _ in range(n_workers):
        add_worker()
    from distributed import Client

    with Client(address, timeout=timeout) as client:
        if n_workers:
            client.wait_for_workers(n_workers, timeout=max(1.0, deadline - time.monotonic()))


@contextlib.contextmanager
def subprocess_cluster(
    n_workers: int = 2, nthreads: int = 1, timeout: float = 120.0, memory_limit: str = "2GiB", *,
    http: bool = False, nanny: bool = True,
) -> Iterator[SubprocessCluster]:
    """Start a scheduler and ``n_workers`` workers as subprocesses; yield; always tear down.

    ``http``: the scheduler serves its HTTP server (dashboard, ``/metrics``) on a free port
    (``cluster.http``); ``nanny=False`` starts workers without a nanny, so killing the process
    kills the worker. ``n_workers`` may be 0 (``cluster.add_worker()`` starts one later)."""
    log_dir = Path(tempfile.mkdtemp(prefix="cachescore-cluster-"))
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        OPENBLAS_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
    )
    env.setdefault("NUMBA_CACHE_DIR", str(Path(tempfile.gettempdir()) / "cachescore-numba-cache"))
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    cluster = SubprocessCluster(address=address, n_workers=n_workers, log_dir=log_dir)
    http_port = free_port() if http else None
    cluster.http = f"http://127.0.0.1:{http_port}" if http_port else None
    handles = []
    try:
        try:
            _start(cluster, port, n_workers, nthreads, memory_limit, timeout, env, handles, http_port=http_port,
                   nanny=nanny)
        except Exception as exc:
            raise RuntimeError(f"subprocess cluster failed to start: {exc}\n{cluster.logs()}") from exc
        yield cluster
    finally:
        for proc in reversed(cluster.processes):  # workers first, scheduler last
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(cluster.processes):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        for handle in handles:
            handle.close()
        shutil.rmtree(log_dir, ignore_errors=True)


@pytest.fixture
def dask_subprocess_cluster() -> Iterator[SubprocessCluster]:
    """A 2-worker, 1-thread-per-worker real-process cluster on 127.0.0.1, torn down afterwards."""
    with subprocess_cluster(n_workers=2, nthreads=1) as cluster:
        yield cluster


def mount_tmpfs(path, size: str) -> bool:
    """Mount a tmpfs of ``size`` (e.g. ``"5m"``) at ``path`` (created); False where mounting is not
    permitted (not root / no CAP_SYS_ADMIN), so the caller skips with that reason."""
    from pathlib import Path

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@contextlib.contextmanager
def tmpfs(size: str, prefix: str = "cachescore-tmpfs-"):
    """A fresh tmpfs of ``size`` mounted on a temporary folder (yielded as a ``Path``), unmounted and
    removed afterwards; the calling test is skipped, with the reason, where mounting is not
    permitted."""
    import pytest
    from pathlib import Path

    root = Path(tempfile.mkdtemp(prefix=prefix))
    if not mount_tmpfs(root, size):
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip("mount -t tmpfs is not permitted here (needs root / CAP_SYS_ADMIN)")
    try:
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


#: Set by ``.ci/run`` (which starts the dev SLURM and installs chromium): a missing service is then
#: a failure; elsewhere (README command 2 on a fresh machine) the tests needing it skip, saying why.
REQUIRE_SERVICES = os.environ.get("CACHESCORE_REQUIRE_SERVICES") == "1"


def service_missing(reason: str) -> None:
    """Skip the calling test because ``reason`` (a service it needs is absent), or fail when
    ``CACHESCORE_REQUIRE_SERVICES=1`` (``.ci/run``: everything it can start must run)."""
    import pytest

    if REQUIRE_SERVICES:
        pytest.fail(f"{reason} (CACHESCORE_REQUIRE_SERVICES=1: .ci/run starts it)")
    pytest.skip(f"{reason}; `bash .ci/run` starts it")
