"""`cachescore run --cluster slurm` on a real one-node SLURM (deploy/slurm/dev-cluster.sh; .ci/run
starts it before the test run). Marked ``slurm``.

Pins: the demo job's workers are SLURM jobs (seen in ``squeue`` while it runs) and every stored
value equals a LocalCluster run's, unit by unit; no worker job is left afterwards; a second run
with nothing pending requests no job; a worker job cancelled mid-run (``scancel``) is replaced by
adaptive scaling and the values are still identical; the rescore sbatch script runs to completion
as a SLURM job. PBS has no server here: its generated job script is checked instead.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
from tomllib import loads as tomllib_loads
import pytest

from cachescore.jobs import load_job
from cachescore.pipeline import run_job
from cachescore.pipeline.cluster import batch_cluster_kwargs
from cachescore.store import ResultsStore
from cluster_utils import service_missing

REPO = Path(__file__).resolve().parents[1]
slurm_only = pytest.mark.slurm


def _squeue() -> list[tuple[str, str, str]]:
    out = subprocess.run(["squeue", "-h", "-o", "%i|%j|%T"], capture_output=True, text=True, check=True).stdout
    return [tuple(line.split("|")) for line in out.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def slurm():
    if shutil.which("sinfo") is None or subprocess.run(["sinfo"], capture_output=True).returncode != 0:
        service_missing("no SLURM here: start the dev cluster first (bash deploy/slurm/dev-cluster.sh, as root)")
    assert not [j for j in _squeue() if j[1].startswith("dask-wor")], "stale dask worker jobs in the queue"


def _job(tmp_path, name, **cluster_extra) -> Path:
    text = (REPO / "jobs" / "demo.toml").read_text()
    text = text.replace('cache = "../demo-cache"', f'cache = "{tmp_path / "cache"}"').replace(
        'store = "../results/demo"', f'store = "{tmp_path / name}"').replace(
        "performance_report = true", "performance_report = false")
    extra = "".join(f"{k} = {v}\n" for k, v in cluster_extra.items())
    text += ("\n[cluster]\nmaximum_jobs = 2\n" + extra + "\n[cluster.slurm]\nmemory = \"3GiB\"\n"
             f"walltime = \"00:20:00\"\nlog_directory = \"{tmp_path / 'logs'}\"\n")
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


def _values(store_path) -> dict:
    store = ResultsStore(store_path)
    out = {}
    for fp in store.fingerprints():
        rec = store.record(fp)
        keep = {k: rec.get(k) for k in ("encoder", "view", "metric", "value", "k", "support", "tau", "f0", "matrix")}
        out[fp] = (keep, store.per_unit(fp) if rec.get("design") != "probe" else None)
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert set(a) == set(b) and len(a) == 40
    for fp in a:
        assert a[fp][0] == b[fp][0], fp
        if a[fp][1] is not None:
            pd.testing.assert_frame_equal(a[fp][1], b[fp][1])


class _QueueWatch(threading.Thread):
    """Polls squeue every 0.3 s while a run lasts; ``seen`` = dask worker job ids observed."""

    def __init__(self):
        super().__init__(daemon=True)
        self.seen: set = set()
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            self.seen |= {j[0] for j in _squeue() if j[1].startswith("dask-wor")}
            time.sleep(0.3)


@pytest.fixture(scope="module")
def local_values(tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm-local")
    job = load_job(_job(root, "local"))
    assert run_job(job, out=io.StringIO()).ok
    return root, _values(job.store)


@slurm_only
def test_demo_on_slurm_equals_local_and_leaves_no_job(slurm, local_values, tmp_path_factory):
    root, local = local_values
    job = load_job(_job(root, "slurm"))
    watch = _QueueWatch()
    watch.start()
    try:
        summary = run_job(job, out=io.StringIO(), cluster="slurm")
    finally:
        watch.stop.set()
        watch.join()
    assert summary.ok and summary.executed == 28 and watch.seen, "no dask worker job was seen in squeue"
    assert len(watch.seen) <= 2 + 1  # adaptive, bounded by maximum_jobs (a replacement at most)
    _assert_same(_values(job.store), local)
    time.sleep(1)
    assert not [j for j in _squeue() if j[1].startswith("dask-wor")], "a worker job outlived the run"
    prov = ResultsStore(job.store).read_provenance(summary.run_id)
    assert prov["cluster"] == "slurm" and prov["state"] == "finished"
    # nothing pending: plan first, then scale -- no cluster, no job
    watch = _QueueWatch()
    watch.start()
    again = run_job(job, out=io.StringIO(), cluster="slurm")
    watch.stop.set()
    watch.join()
    assert again.executed == 0 and again.dashboard is None and not watch.seen


@slurm_only
def test_a_cancelled_worker_job_is_replaced_and_values_are_identical(slurm, local_values):
    root, local = local_values
    job = load_job(_job(root, "scancel"))
    cancelled: list[str] = []

    def cancel_one():
        deadline = time.time() + 60
        while time.time() < deadline:
            running = [j for j in _squeue() if j[1].startswith("dask-wor") and j[2] == "RUNNING"]
            if len(running) >= 1 and any((job.store / "units").glob("*/*.json")):
                subprocess.run(["scancel", running[0][0]], check=True)
                cancelled.append(running[0][0])
                return
            time.sleep(0.2)

    killer = threading.Thread(target=cancel_one, daemon=True)
    killer.start()
    summary = run_job(job, out=io.StringIO(), cluster="slurm")
    killer.join()
    assert cancelled, "no worker job was running to cancel"
    assert summary.ok, summary.failures
    _assert_same(_values(job.store), local)
    time.sleep(1)
    assert not [j for j in _squeue() if j[1].startswith("dask-wor")]


@slurm_only
def test_rescore_sbatch_script_runs_as_a_slurm_job(slurm, tmp_path):
    job = _job(tmp_path, "sbatch")
    env = {**os.environ, "CACHESCORE_JOB": str(job), "CACHESCORE": str(Path(sys.executable).with_name("cachescore"))}
    done = subprocess.run(["sbatch", "--wait", "--export=ALL", f"--output={tmp_path / 'rescore.log'}",
                           str(REPO / "deploy" / "slurm" / "rescore.sbatch")], env=env, capture_output=True,
                          text=True, timeout=600)
    log = (tmp_path / "rescore.log").read_text() if (tmp_path / "rescore.log").exists() else ""
    assert done.returncode == 0, done.stderr + log
    assert "executed 28" in log and "failed 0" in log
    assert (tmp_path / "sbatch" / "scores.parquet").is_file()


def test_pbs_job_script_is_generated_from_the_cluster_table():
    from dask_jobqueue.pbs import PBSJob

    from cachescore.jobs.schema import Pbs

    settings = Pbs(queue="short", account="lab", cores=4, processes=4, memory="16GiB", walltime="02:00:00",
                   job_extra_directives=["-m n"], worker_extra_args=[], local_directory="$TMPDIR", interface="",
                   scheduler_host="login1", python="", log_directory="", resource_spec="select=1:ncpus=4:mem=16GB")
    kwargs = batch_cluster_kwargs("pbs", settings)
    assert kwargs["scheduler_options"] == {"host": "login1", "dashboard_address": "127.0.0.1:0"}
    kwargs.pop("scheduler_options")
    script = PBSJob(scheduler="tcp://login1:8786", name="cachescore-worker", **kwargs).job_script()
    for line in ("#PBS -q short", "#PBS -A lab", "#PBS -l select=1:ncpus=4:mem=16GB", "#PBS -l walltime=02:00:00",
                 "#PBS -m n", "export OPENBLAS_NUM_THREADS=1", "export NUMBA_NUM_THREADS=1", sys.executable,
                 "--nthreads 1", "--nworkers 4", "tcp://login1:8786"):
        assert line in script, (line, script)


def test_scheduler_and_cluster_are_exclusive(capsys):
    from cachescore.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["run", "jobs/demo.toml", "--scheduler", "tcp://127.0.0.1:1", "--cluster", "slurm"])
    assert exc.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_schema_documents_the_cluster_keys():
    from cachescore.jobs import describe_schema

    text = describe_schema()
    for line in ("[cluster]", "  kind = 'local'", "[cluster.slurm]", "  job_extra_directives = []",
                 "[cluster.pbs]", "  resource_spec = ''", "[cluster.kubernetes]", "  image = ''"):
        assert line in text, line


@slurm_only
def test_self_resubmitting_rescore_runs_once_with_every_zero(slurm, tmp_path):
    job = _job(tmp_path, "every")
    env = {**os.environ, "CACHESCORE_JOB": str(job), "CACHESCORE_EVERY": "0",
           "CACHESCORE_SELF": str(REPO / "deploy" / "slurm" / "rescore-every.sbatch"),
           "CACHESCORE": str(Path(sys.executable).with_name("cachescore"))}
    done = subprocess.run(["sbatch", "--wait", "--export=ALL", f"--output={tmp_path / 'every.log'}",
                           str(REPO / "deploy" / "slurm" / "rescore-every.sbatch")], env=env, capture_output=True,
                          text=True, timeout=600)
    log = (tmp_path / "every.log").read_text() if (tmp_path / "every.log").exists() else ""
    assert done.returncode == 0, done.stderr + log
    assert "executed 28" in log and "Submitted batch job" not in log  # EVERY=0: not queued again
    assert not [j for j in _squeue() if j[1] == "cachescore-rescore-every"]


def test_maximum_jobs_follows_the_plan_and_the_kind(tmp_path):
    from cachescore.jobs import parse_job
    from cachescore.pipeline import plan_job
    from cachescore.pipeline.cluster import maximum_jobs, plan_parallelism
    from cachescore.pipeline.run import ensure_demo_cache

    job_path = _job(tmp_path, "bound")
    job = load_job(job_path)
    ensure_demo_cache(job, out=None)
    plan = plan_job(job)
    assert plan_parallelism(plan) == 24 + 4 * 5 * 2  # 24 metric units + 4 probe units x 5 replicates x 2 splits
    assert maximum_jobs(job, plan) == 2  # the job's [cluster] maximum_jobs
    doc = tomllib_loads(job_path.read_text())
    doc["cluster"]["maximum_jobs"] = 0
    doc["cluster"]["slurm"]["processes"] = doc["cluster"]["slurm"]["cores"] = 4
    derived = parse_job(doc, path=job_path)
    assert maximum_jobs(derived, plan, "slurm") == 16 and maximum_jobs(derived, plan, "local") == 32
