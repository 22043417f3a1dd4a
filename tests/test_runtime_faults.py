"""What a run does when clusters and disks misbehave, with real processes (issue 14).

Every test starts ``cachescore run`` as a subprocess (``python -m cachescore.cli``), on its own
LocalCluster or on a real ``dask scheduler`` / ``dask worker`` started here, and then breaks
something: the workers, the scheduler, a signal, SIGKILL, a full disk, a second run, a
read-only store. Afterwards the provenance never says ``running`` and the next run resumes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from cachescore.cache.synthetic import make_demo_cache
from cachescore.cli import DEMO_JOB
from cachescore.store import ResultsStore
from cachescore.store.lock import LOCK_NAME
from cachescore.store.verify import verify_store
from cluster_utils import subprocess_cluster, tmpfs

pytestmark = pytest.mark.cluster

#: Units of the demo job (4 encoders × (3 metrics × 2 views + 1 probe unit)).
N_UNITS = 28
TILES = 24


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The demo cache with twice the demo's tiles (units take long enough to be interrupted)."""
    root = tmp_path_factory.mktemp("faults") / "cache"
    make_demo_cache(root, n_slides_per_cell=3, tiles_per_slide=TILES, dim=32, seed=0)
    return root


def write_job(folder: Path, cache: Path, store: Path, **execution) -> Path:
    """The demo job on ``cache`` into ``store``; ``execution`` keys are added to ``[execution]``."""
    text = DEMO_JOB.replace('cache = "../demo-cache"', f'cache = "{cache}"').replace(
        'store = "../results/demo"', f'store = "{store}"').replace("synthesise = true", "synthesise = false")
    text = text.replace("rows_per_slide = 12", f"rows_per_slide = {TILES}")
    text = re.sub(r"split_map = \[(.*)\]", lambda m: "split_map = [" + m.group(1).replace(", 12]", f", {TILES}]") + "]",
                  text)
    for key in execution:  # replaces the demo's own setting
        text = re.sub(rf"^{key} = .*\n", "", text, flags=re.M)
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in execution.items())
    text = text.replace("[execution]\n", "[execution]\n" + extra)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "job.toml"
    path.write_text(text)
    return path


def cli(*args, log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    fh = open(log, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "cachescore.cli", *map(str, args)], stdout=fh,
                            stderr=subprocess.STDOUT, env=env)
    fh.close()
    return proc


def run_cli(*args, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "cachescore.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout)


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.05)
    text = log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""
    raise AssertionError(f"timed out waiting for {what}\n{text}")


def n_records(store: Path) -> int:
    units = store / "units"
    return len(list(units.glob("*/*.json"))) if units.is_dir() else 0


def provenances(store: Path) -> list[dict]:
    s = ResultsStore(store)
    return [s.read_provenance(r) for r in s.runs()]


def finish(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def break_after_first_unit(proc: subprocess.Popen, store: Path, log: Path, breaking, timeout: float = 120):
    """Once ``proc`` (a run) has stored its first unit, call ``breaking()``; return ``(exit code,
    seconds from the break to the exit)``. The run is killed if it outlives ``timeout``."""
    try:
        wait_for(lambda: n_records(store) >= 1, 120, "the first unit", proc, log)
        breaking()
        t0 = time.monotonic()
        rc = finish(proc, timeout)
        return rc, time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_all_workers_lost_ends_in_bounded_time(tmp_path, cache):
    with subprocess_cluster(n_workers=1, nanny=False) as cluster:
        store = tmp_path / "store"
        job = write_job(tmp_path, cache, store, no_workers_timeout=5, retries=0)
        log = tmp_path / "run.log"
        rc, waited = break_after_first_unit(cli("run", job, "--scheduler", cluster.address, log=log), store, log,
                                            cluster.workers[0].kill)
    text = log.read_text()
    assert rc == 2, text
    assert waited < 60, f"took {waited:.0f} s"
    assert "waiting for workers" in text
    assert f"no Dask worker joined the scheduler at {cluster.address} for" in text and "not run" in text
    assert "Traceback" not in text
    (prov,) = provenances(store)
    assert prov["state"] == "aborted" and "no Dask worker" in prov["reason"]
    assert prov["units"]["not_run"] >= 1 and len(prov["not_run"]) == prov["units"]["not_run"]
    assert (store / LOCK_NAME).read_text() == ""  # lock released


def test_scheduler_killed_mid_run(tmp_path, cache):
    with subprocess_cluster(n_workers=1) as cluster:
        store = tmp_path / "store"
        job = write_job(tmp_path, cache, store)
        log = tmp_path / "run.log"
        rc, waited = break_after_first_unit(cli("run", job, "--scheduler", cluster.address, log=log), store, log,
                                            cluster.scheduler.kill)
    text = log.read_text()
    assert rc == 2, text
    assert waited < 60, f"took {waited:.0f} s"
    assert f"lost the Dask scheduler at {cluster.address}" in text and "unit(s) done" in text, text
    assert "FAILED" not in text, text  # the loss is not a unit's failure (distributed may still log its reconnect)
    (prov,) = provenances(store)
    assert prov["state"] == "aborted" and "lost the Dask scheduler" in prov["reason"]
    assert prov["units"]["not_run"] >= 1


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupt_finishes_what_is_complete(tmp_path, cache, signum):
    store = tmp_path / "store"
    job = write_job(tmp_path, cache, store)
    log = tmp_path / "run.log"
    proc = cli("run", job, log=log)
    rc, _ = break_after_first_unit(proc, store, log, lambda: proc.send_signal(signum), timeout=90)
    text = log.read_text()
    assert rc == 128 + signum, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    lines = [ln for ln in text.splitlines() if ln.startswith("interrupted by")]
    assert len(lines) == 1 and signal.Signals(signum).name in lines[0] and "not run" in lines[0], text
    (prov,) = provenances(store)
    assert prov["state"] == "interrupted" and signal.Signals(signum).name in prov["reason"]
    assert prov["units"]["not_run"] >= 1
    done = int(re.search(r"stopped with (\d+) unit\(s\) done", lines[0]).group(1))
    assert prov["units"]["succeeded"] == done and done + prov["units"]["not_run"] + prov["units"]["failed"] == N_UNITS
    kept = len(ResultsStore(store).fingerprints())
    again = run_cli("run", job, "-q")
    assert again.returncode == 0, again.stderr
    executed = int(re.search(r"executed (\d+)", again.stdout).group(1))
    assert kept >= 1 and executed <= N_UNITS - done  # the next run resumes (workers may store more after the end)


def test_sigkill_is_noticed_by_status_and_the_next_run(tmp_path, cache):
    store = tmp_path / "store"
    job = write_job(tmp_path, cache, store)
    log = tmp_path / "run.log"
    proc = cli("run", job, log=log)
    break_after_first_unit(proc, store, log, proc.kill, timeout=30)
    (prov,) = provenances(store)
    assert prov["state"] == "running"  # SIGKILL can write nothing
    status = run_cli("status", job)
    assert status.returncode == 0, status.stderr
    assert "marked 'interrupted'" in status.stderr
    (prov,) = provenances(store)
    assert prov["state"] == "interrupted" and "ended without finishing" in prov["reason"]
    again = run_cli("run", job, "-q")
    assert again.returncode == 0, again.stderr
    assert "took over the stale lock of run" in again.stderr and "its process is gone" in again.stderr
    assert sorted(p["state"] for p in provenances(store)) == ["finished", "interrupted"]


def test_second_run_on_the_same_store_is_refused_at_once(tmp_path, cache):
    store = tmp_path / "store"
    job = write_job(tmp_path, cache, store)
    log = tmp_path / "first.log"
    first = cli("run", job, log=log)
    try:
        holder = wait_for(lambda: (store / LOCK_NAME).is_file() and (store / LOCK_NAME).read_text(), 120,
                          "the first run's lock", first, log)
        t0 = time.monotonic()
        second = run_cli("run", job, "-q")
        refused_in = time.monotonic() - t0
        assert first.poll() is None, "the first run ended before the second started"
        rc = finish(first, 240)
    finally:
        if first.poll() is None:
            first.kill()
    info = json.loads(holder)
    assert second.returncode == 2 and refused_in < 30
    assert f"in use by run {info['run_id']}" in second.stderr and f"pid {info['pid']}" in second.stderr
    assert rc == 0, log.read_text()
    assert [p["state"] for p in provenances(store)] == ["finished"]
    assert "executed 0," in run_cli("run", job, "-q").stdout  # the first run scored everything
    assert verify_store(store) == []  # no orphans


@pytest.fixture
def small_disk():
    with tmpfs("5m") as root:
        yield root


def test_disk_full_is_recorded_per_unit_and_the_rest_still_runs(tmp_path, cache, small_disk):
    store = small_disk / "store"
    job = write_job(tmp_path, cache, store, performance_report=False)
    ResultsStore(store)
    free = shutil.disk_usage(small_disk).free
    (small_disk / "filler").write_bytes(b"\0" * max(0, free - 96 * 1024))  # about 24 blocks left
    result = run_cli("run", job)
    assert result.returncode == 1, result.stdout + result.stderr
    done = int(re.search(r"succeeded (\d+)", result.stdout).group(1))
    failed = int(re.search(r"failed (\d+)", result.stdout).group(1))
    assert done + failed == N_UNITS and failed >= 1  # every unit was attempted
    assert f"could not be written to the results store {store}" in result.stderr and "MiB free" in result.stderr
    assert "No space left on device" in result.stderr and f"cannot write {store}" in result.stderr
    assert "Traceback" not in result.stderr
    (prov,) = provenances(store)
    assert prov["state"] != "running"
    (small_disk / "filler").unlink()
    again = run_cli("run", job, "-q")
    assert again.returncode == 0, again.stderr
    assert f"executed {failed}," in again.stdout
    leftovers = [p for p in verify_store(store) if p.kind != "provenance"]
    assert leftovers == [], leftovers


@pytest.fixture
def read_only_store(tmp_path, cache):
    """A store scored in full on its own tmpfs, then remounted read-only."""
    with tmpfs("64m", prefix="cachescore-ro-") as mount:
        store = mount / "store"
        job = write_job(tmp_path, cache, store)
        first = run_cli("run", job, "-q")
        assert first.returncode == 0, first.stderr
        assert subprocess.run(["mount", "-o", "remount,ro", str(mount)], capture_output=True).returncode == 0
        yield job, store


def test_read_only_store_serves_every_reading_command(tmp_path, read_only_store):
    job, store = read_only_store
    with pytest.raises(OSError):
        (store / "probe").write_text("x")
    run = run_cli("run", job)
    assert run.returncode == 0, run.stderr
    assert "read-only and every unit is up to date: nothing needed writing" in run.stderr
    assert run_cli("status", job, "--verify").returncode == 0
    assert run_cli("export", job, "-o", tmp_path / "out" / "scores.csv", "--format", "csv").returncode == 0
    assert run_cli("report", job, "--out", tmp_path / "report.html").returncode == 0
    more = Path(str(job).replace("job.toml", "more.toml"))
    more.write_text(job.read_text().replace("m = [5]", "m = [5, 3]"))
    refused = run_cli("run", more)
    assert refused.returncode == 2 and f"results store {store} cannot be written" in refused.stderr


def test_metrics_and_status_page_on_a_real_scheduler(tmp_path, cache):
    """``/metrics`` has cachescore_units by state and ``/cachescore`` names the encoders while the
    run waits for workers; a worker joins and the board ends ``finished``."""
    with subprocess_cluster(n_workers=0, http=True) as cluster:
        store = tmp_path / "store"
        job = write_job(tmp_path, cache, store)
        log = tmp_path / "run.log"
        proc = cli("run", job, "--scheduler", cluster.address, log=log)
        try:
            def board():
                try:
                    with urllib.request.urlopen(cluster.http + "/cachescore/units.json", timeout=5) as r:
                        snap = json.loads(r.read())
                except OSError:
                    return None
                return snap if snap["run"].get("state") == "running" else None

            snap = wait_for(board, 120, "the run on the board", proc, log)
            assert snap["counts"]["pending"] == N_UNITS and {u["encoder"] for u in snap["units"]} == {
                "enc0", "enc1", "enc2", "enc3"}
            with urllib.request.urlopen(cluster.http + "/metrics", timeout=5) as r:
                metrics = r.read().decode()
            assert re.search(rf'cachescore_units\{{encoder="enc0",state="pending"\}} {N_UNITS // 4}\.0',
                             metrics), metrics[:2000]
            assert 'cachescore_run_info{' in metrics and "dask_scheduler_workers" in metrics
            with urllib.request.urlopen(cluster.http + "/cachescore", timeout=5) as r:
                assert r.status == 200
                page = r.read().decode()
            assert all(f"<td class=\"\">enc{i}</td>" in page for i in range(4))
            assert "waiting for workers" in wait_for(lambda: "waiting for workers" in log.read_text()
                                                     and log.read_text(), 30, "the waiting line", proc, log)
            cluster.add_worker()
            assert finish(proc, 240) == 0, log.read_text()
            with urllib.request.urlopen(cluster.http + "/cachescore/units.json", timeout=5) as r:
                snap = json.loads(r.read())
            assert snap["run"]["state"] == "finished" and snap["counts"]["done"] == N_UNITS
            with urllib.request.urlopen(cluster.http + "/metrics", timeout=5) as r:
                metrics = r.read().decode()
            assert re.search(rf'cachescore_units\{{encoder="enc3",state="done"\}} {N_UNITS // 4}\.0', metrics)
            assert re.search(r"cachescore_rows_scored_total [1-9]", metrics)
            import distributed

            with distributed.Client(cluster.address) as client:  # what the dashboard groups tasks by
                prefixes = set(client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.task_prefixes)))
            assert {"score.enc0.centre_all.ri+mari+croma", "score.enc3.centre_paired.ri+mari+croma", "probe.enc1.centre_all.probe",
                    "probe_evaluate.enc1.centre_all.probe"} <= prefixes, sorted(prefixes)
        finally:
            if proc.poll() is None:
                proc.kill()
