"""Where the work runs: a LocalCluster on 127.0.0.1 by default, an existing scheduler, or a
batch / Kubernetes cluster sized to the plan.

One code path for both (DESIGN.md §5): :func:`open_client` yields a connected
:class:`distributed.Client`; every worker gets :class:`SingleThreadBLAS` so BLAS/OpenMP run one
thread per worker process (the tasks also pin threads themselves, see :mod:`.unit`) and numba is
asked for one thread. The LocalCluster binds the scheduler, workers and dashboard to 127.0.0.1
(the dashboard on a free port); its URL is printed by the CLI.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import sys
from collections.abc import Iterator

import dask
from distributed import Client, LocalCluster
from distributed.diagnostics.plugin import WorkerPlugin

from .._threads import THREAD_ENV, single_thread_blas
from .._warncapture import hold_capture
from .plan import Plan, UnitKind

__all__ = ["SingleThreadBLAS", "open_client", "open_cluster_client", "client_for", "batch_cluster_kwargs",
           "kubernetes_manifests", "plan_parallelism", "maximum_jobs", "THREAD_ENV"]

class SingleThreadBLAS(WorkerPlugin):
    """Worker plugin: one BLAS/OpenMP thread per worker process, one numba thread.

    On an external cluster the worker may already have imported numpy, so environment variables
    alone are too late; threadpoolctl changes the loaded libraries' pools in place.
    """

    name = "cachescore-single-thread-blas"

    def __init__(self):
        # Recorded where the plugin is created (the client) and shipped with it: a worker running
        # inside the client's process (LocalCluster(processes=False)) must not change that
        # process's thread pools behind the caller's back; its tasks still pin per task.
        self.client_pid = os.getpid()

    def setup(self, worker):  # noqa: D401 - plugin hook
        if os.getpid() == self.client_pid:
            return
        self._hold = hold_capture()  # per-unit warning capture stays reliable for the worker's life
        self._hold.__enter__()
        for k, v in THREAD_ENV.items():
            os.environ.setdefault(k, v)
        os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "cachescore-numba"))
        self._limits = single_thread_blas()

        if "numba" in sys.modules:  # only if already loaded: importing numba here costs seconds
            try:
                sys.modules["numba"].set_num_threads(1)
            except (ValueError, AttributeError):  # pragma: no cover - numba launched fewer threads
                pass

    def teardown(self, worker):
        limits = getattr(self, "_limits", None)
        if limits is not None:
            limits.restore_original_limits()
        hold = getattr(self, "_hold", None)
        if hold is not None:
            self._hold = None
            hold.__exit__(None, None, None)


def _worker_environment() -> dict:
    """What every worker process starts with: single-thread BLAS/OpenMP/numba and a numba cache."""
    numba_dir = os.environ.get("NUMBA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "cachescore-numba")
    return {**THREAD_ENV, "NUMBA_CACHE_DIR": numba_dir}


def batch_cluster_kwargs(kind: str, settings) -> dict:
    """dask-jobqueue arguments for ``kind`` (``"slurm"`` | ``"pbs"``) from the job's ``[cluster.<kind>]``
    section (:class:`~cachescore.jobs.schema.Slurm` / ``Pbs``): one thread per worker process (``cores`` shared by ``processes``), the worker environment
    of :func:`_worker_environment` exported in the job script, this interpreter as the workers'
    python, and the scheduler on an address the compute nodes reach (``interface``, else
    ``scheduler_host``, else this host's name) with its dashboard on 127.0.0.1 (reach it through
    an ssh tunnel)."""
    c = settings
    kwargs = {
        "cores": int(c.cores), "processes": int(c.processes), "memory": c.memory, "walltime": c.walltime,
        "job_extra_directives": list(c.job_extra_directives), "worker_extra_args": list(c.worker_extra_args),
        "python": c.python or sys.executable,
        "job_script_prologue": [f"export {k}={v}" for k, v in _worker_environment().items()],
        "queue": c.queue or None, "account": c.account or None,
        "local_directory": c.local_directory or None, "log_directory": c.log_directory or None,
    }
    if c.interface:
        kwargs["interface"] = c.interface
        kwargs["scheduler_options"] = {"interface": c.interface, "dashboard_address": "127.0.0.1:0"}
    else:
        kwargs["scheduler_options"] = {"host": c.scheduler_host or socket.gethostname(),
                                       "dashboard_address": "127.0.0.1:0"}
    if kind == "pbs" and c.resource_spec:
        kwargs["resource_spec"] = c.resource_spec
    return kwargs


def _batch_cluster(kind: str, settings):
    # deferred: dask-jobqueue is only needed for batch clusters
    from dask_jobqueue import PBSCluster, SLURMCluster

    return (SLURMCluster if kind == "slurm" else PBSCluster)(**batch_cluster_kwargs(kind, settings))


#: NUMBA_CACHE_DIR inside the container image (deploy/docker/Dockerfile warms it at build time).
CONTAINER_NUMBA_CACHE = "/opt/numba-cache"


def kubernetes_manifests(cluster) -> list[dict]:
    """The dask-kubernetes operator resources of a job's ``[cluster]`` section
    (:class:`~cachescore.jobs.schema.Cluster`): a ``DaskCluster``
    (``make_cluster_spec``: scheduler and worker pods from ``[cluster.kubernetes]`` image,
    resources and env; workers with one thread, the single-thread BLAS environment and the image's
    warmed numba cache) and a ``DaskAutoscaler`` between ``minimum_jobs`` and ``maximum_jobs``
    pods (0 = 8). ``deploy/kubernetes/daskcluster.yaml`` is this function's output for
    ``deploy/kubernetes/job.toml`` (tested). Raises ``ValueError`` without an image, or when the
    optional dask-kubernetes is missing."""
    k8s = cluster.kubernetes
    if not k8s.image:
        raise ValueError("[cluster.kubernetes] image is required for kind = 'kubernetes'")
    try:
        from dask_kubernetes.operator import make_cluster_spec  # deferred: the optional kubernetes extra
    except ImportError as exc:
        raise ValueError("[cluster] kind = 'kubernetes' needs the dask-kubernetes operator client: "
                         "pip install 'cachescore[kubernetes]'") from exc
    env = {**THREAD_ENV, "NUMBA_CACHE_DIR": CONTAINER_NUMBA_CACHE, **{str(k): str(v) for k, v in k8s.env.items()}}
    spec = make_cluster_spec(name=k8s.name, image=k8s.image, n_workers=int(cluster.minimum_jobs),
                             resources=dict(k8s.resources) or None, env=env)
    spec["metadata"]["namespace"] = k8s.namespace
    spec["spec"]["worker"]["spec"]["containers"][0]["args"] += ["--nthreads", "1"]
    for role in ("scheduler", "worker"):
        pod = spec["spec"][role]["spec"]
        pod["securityContext"] = {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 1000}  # the image's user
        if k8s.data_claim:  # the cache and the store, shared by every pod
            pod["volumes"] = [{"name": "data", "persistentVolumeClaim": {"claimName": k8s.data_claim}}]
            pod["containers"][0]["volumeMounts"] = [{"name": "data", "mountPath": k8s.data_mount}]
    autoscaler = {"apiVersion": "kubernetes.dask.org/v1", "kind": "DaskAutoscaler",
                  "metadata": {"name": k8s.name, "namespace": k8s.namespace},
                  "spec": {"cluster": k8s.name, "minimum": int(cluster.minimum_jobs),
                           "maximum": int(cluster.maximum_jobs) or 8}}
    return [spec, autoscaler]


def _kubernetes_cluster(cluster):
    from dask_kubernetes.operator import KubeCluster  # deferred: the optional kubernetes extra

    spec = kubernetes_manifests(cluster)[0]
    return KubeCluster(custom_cluster_spec=spec, namespace=cluster.kubernetes.namespace)


@contextlib.contextmanager
def open_cluster_client(cluster, *, maximum_jobs: int) -> Iterator[Client]:
    """Start the job's batch or Kubernetes cluster (``cluster``: its
    :class:`~cachescore.jobs.schema.Cluster` section, ``kind`` = slurm | pbs | kubernetes),
    scale it adaptively between ``minimum_jobs`` and ``maximum_jobs`` worker jobs, yield a Client.
    Closing it cancels every worker job (none is left queued or running). Raises ``ValueError``
    for a kind this function does not start (``local``) or a missing optional dependency."""
    kind = cluster.kind
    if kind in ("slurm", "pbs"):
        deployment = _batch_cluster(kind, getattr(cluster, kind))
    elif kind == "kubernetes":
        deployment = _kubernetes_cluster(cluster)
    else:
        raise ValueError(f"open_cluster_client starts slurm, pbs or kubernetes clusters, not {kind!r}")
    with _scheduler_config_restored(), deployment:
        deployment.adapt(minimum_jobs=int(cluster.minimum_jobs), maximum_jobs=max(1, int(maximum_jobs)))
        with Client(deployment, set_as_default=False) as client:
            client.register_plugin(SingleThreadBLAS())
            yield client


@contextlib.contextmanager
def open_client(scheduler: str | None = None, *, n_workers: int = 2, memory_limit: str = "auto",
                dashboard: bool = True, processes: bool = True) -> Iterator[Client]:
    """Connect to ``scheduler`` (``"tcp://host:port"``) or start a LocalCluster; yield a Client.

    Parameters
    ----------
    scheduler : str, optional
        Address of a running scheduler. Empty/None starts a LocalCluster on 127.0.0.1 with
        ``n_workers`` single-threaded workers.
    n_workers, memory_limit : LocalCluster settings (ignored with ``scheduler``).
    dashboard : bool
        Serve the LocalCluster dashboard on 127.0.0.1 (free port). ``client.dashboard_link`` has the URL.
    processes : bool
        LocalCluster worker processes (default) or threads in this process (tests).

    Raises
    ------
    OSError
        The scheduler cannot be reached (distributed's timeout error is an ``OSError``).
    """
    if scheduler:
        client = Client(scheduler, set_as_default=False)
        try:
            client.register_plugin(SingleThreadBLAS())
            yield client
        finally:
            client.close()
        return
    # The scheduler's HTTP server (health/metrics) starts even without the dashboard, on :8787 by
    # default: always bind it to a free port on 127.0.0.1 (a busy 8787 would make distributed
    # retry and leak a socket), and turn the dashboard pages off when not wanted.
    kwargs = dict(n_workers=n_workers, threads_per_worker=1, processes=processes, host="127.0.0.1",
                  dashboard_address="127.0.0.1:0", memory_limit=memory_limit)
    if not dashboard:
        kwargs["scheduler_kwargs"] = {"dashboard": False}
    if processes:
        kwargs["env"] = dict(THREAD_ENV)
    else:  # in-process workers talk over inproc://, no network address
        kwargs.pop("host")
    # in-process workers (processes=False) share this process's warnings state: hold the per-unit
    # capture installed for the cluster's life (see cachescore._warncapture)
    hold = contextlib.nullcontext() if processes else hold_capture()
    with _scheduler_config_restored(), hold, dask.config.set(_WORKER_MALLOC), LocalCluster(**kwargs) as cluster, \
            Client(cluster, set_as_default=False) as client:
        client.register_plugin(SingleThreadBLAS())
        yield client


#: distributed's nannies start workers with ``MALLOC_TRIM_THRESHOLD_=65536``, which also freezes
#: glibc's mmap threshold at 128 KiB: every array above it (a neighbour tile, a per-unit column, a
#: bootstrap matrix) is a fresh mmap whose pages fault in and are unmapped again. On the 960-unit
#: benchmark that was ~10 s of system time per worker (user 16 s) and halved the workers' speed
#: against the same batches in one process (``benchmarks/many_units.py``). Our LocalCluster workers
#: keep glibc's adaptive defaults (``None`` unsets the variable; ADR-0018).
_WORKER_MALLOC = {"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None}


@contextlib.contextmanager
def _scheduler_config_restored() -> Iterator[None]:
    """Restore dask's global ``scheduler`` setting on exit. In-process workers share this process's
    dask config, and a task that calls ``worker_client()`` (probe units) sets it to the
    distributed scheduler, which would outlive the cluster and break later plain dask calls."""
    had = "scheduler" in dask.config.config
    old = dask.config.config.get("scheduler")
    try:
        yield
    finally:
        if had:
            dask.config.config["scheduler"] = old
        else:
            dask.config.config.pop("scheduler", None)


def plan_parallelism(plan: Plan) -> int:
    """Tasks the plan's pending work can run at once: one per metric unit, one per probe replicate
    × split, a few per large unit (its search batches); the bound of adaptive scaling."""
    n = 0
    for u in plan.pending:
        if u.kind is UnitKind.PROBE and plan.job.probe is not None:
            n += int(plan.job.probe.iterations) * len(plan.job.probe.resolved_schedule())
        else:
            n += 4 if u.kind is UnitKind.LARGE else 1
    return max(1, n)


def maximum_jobs(job, plan: Plan, kind: str | None = None) -> int:
    """``[cluster] maximum_jobs``, or (0) the plan's parallelism over the processes per job of
    ``kind`` (default the job's ``[cluster] kind``), at most 32."""
    c = job.cluster
    kind = kind or c.kind
    if int(c.maximum_jobs) > 0:
        return int(c.maximum_jobs)
    per_job = int(getattr(c, kind).processes) if kind in ("slurm", "pbs") else 1
    return max(1, min(32, -(-plan_parallelism(plan) // max(1, per_job))))


def client_for(job, plan: Plan, scheduler: str | None, cluster_kind: str, processes: bool):
    """The one place a run gets its client (a context manager yielding it): an existing
    ``scheduler``, a batch / Kubernetes cluster of ``cluster_kind`` scaled adaptively up to
    :func:`maximum_jobs`, or (``"local"``) a LocalCluster from ``[execution]``."""
    ex = job.execution
    if scheduler:
        return open_client(scheduler)
    if cluster_kind != "local":
        return open_cluster_client(dataclasses.replace(job.cluster, kind=cluster_kind),
                                   maximum_jobs=maximum_jobs(job, plan, cluster_kind))
    return open_client(None, n_workers=ex.n_workers, memory_limit=ex.memory_limit, dashboard=ex.dashboard,
                       processes=processes)
