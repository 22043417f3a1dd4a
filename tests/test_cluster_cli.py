"""``cachescore run --scheduler`` against a real ``dask scheduler`` + 2 ``dask worker`` processes.

Pins: the numbers scored on the cluster equal the single-process metric API on the same cache
(same code, BLAS pinned to one thread on both sides: exact equality); a second run executes
nothing; a client killed (SIGKILL) midway leaves a valid store, and the restarted run executes
only the remainder and ends with exactly the results of an uninterrupted run.
"""

from __future__ import annotations

import re
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import distributed
import pytest

from cachescore.cache import Cache, make_demo_cache
from cachescore.cli import main
from cachescore.jobs import load_job
from cachescore.pipeline import plan_job
from cachescore.store import ResultsStore

from cluster_utils import dask_subprocess_cluster  # noqa: F401  (fixture)

pytestmark = pytest.mark.cluster


@pytest.fixture(autouse=True)
def _pinned_code_version(monkeypatch):
    """Pin the code version: other people edit metrics/ and neighbors/ while these tests run, and
    an edit between two runs would (correctly) change every fingerprint."""
    monkeypatch.setenv("CACHESCORE_CODE_VERSION", "test-pinned")

JOB = """schema_version = 1
[job]
cache = "{cache}"
store = "{store}"
[metrics]
families = ["ri", "mari", "croma"]
[metrics.croma]
m = [1, 5]
[execution]
retries = 1
"""



@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster") / "cache"
    make_demo_cache(root, n_slides_per_cell=3, tiles_per_slide=8, dim=16, encoders=2, seed=3)
    return root


def write_job(tmp_path, cache_root, name):
    path = tmp_path / f"{name}.toml"
    path.write_text(JOB.format(cache=cache_root, store=tmp_path / f"store-{name}"), encoding="utf-8")
    return path


def api_value(unit, cache: Cache):
    """The same unit scored in this process through the public metric API."""
    from threadpoolctl import threadpool_limits

    from cachescore.metrics.croma import CRoMa
    from cachescore.metrics.mari import MaRI
    from cachescore.metrics.ri import RI

    manifest = cache.read_view(unit.view)
    features = cache.load_rows(unit.encoder, unit.tileset, manifest["row"].to_numpy())
    kw = dict(confounder_column=unit.confounder_column, evaluation_design=unit.design)
    p = unit.params
    with threadpool_limits(limits=1), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # metric notes are not under test here
        if unit.metric == "ri":
            return RI.compute(features, manifest, k_candidates=p["k_candidates"], **kw)
        if unit.metric == "mari":
            return MaRI.compute(features, manifest, k_candidates=p["k_candidates"], tau=None, **kw)
        return CRoMa.compute(features, manifest, m=p["m"], alpha=p["alpha"], **kw)


def _missing(v) -> bool:
    return v is None or v is pd.NA or (isinstance(v, float) and np.isnan(v))


def same(a, b) -> bool:
    """Equal, or both missing (the store keeps NaN as null)."""
    return (_missing(a) and _missing(b)) or (not _missing(a) and not _missing(b) and a == b)


def scores_by_fp(store_path):
    s = ResultsStore(store_path).scores()
    return {r["fingerprint"]: r for r in s.to_dict("records")}


def test_cluster_run_matches_api_and_resumes(tmp_path, cache_root, dask_subprocess_cluster, capsys):
    addr = dask_subprocess_cluster.address
    clean = write_job(tmp_path, cache_root, "clean")
    assert main(["run", str(clean), "--scheduler", addr, "-q"]) == 0
    out = capsys.readouterr().out
    assert "executed 16" in out and "failed 0" in out

    job = load_job(clean)
    cache = Cache(job.cache)
    units = plan_job(job).done
    assert len(units) == 16
    stored = scores_by_fp(job.store)
    for unit in units:
        ref = api_value(unit, cache)
        rec = stored[unit.fingerprint]
        assert same(rec["value"], ref.value), (unit.label, rec["value"], ref.value)
        if unit.metric == "croma":
            assert rec["m"] == ref.m and same(rec["f0"], ref.f0)
        else:
            assert rec["k"] == ref.k and rec["support"] == ref.support
        per_unit = ResultsStore(job.store).per_unit(unit.fingerprint)
        np.testing.assert_array_equal(per_unit["value"].to_numpy(), np.asarray(ref.sample_values_aligned, float))

    # a second run executes nothing
    assert main(["run", str(clean), "--scheduler", addr, "-q"]) == 0
    assert "executed 0, skipped 16" in capsys.readouterr().out

    # a client killed midway, then restarted
    killed = write_job(tmp_path, cache_root, "killed")
    kjob = load_job(killed)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.Popen([sys.executable, "-m", "cachescore.cli", "run", str(killed), "--scheduler", addr, "-q"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 120
        units_dir = Path(kjob.store) / "units"
        while time.monotonic() < deadline and proc.poll() is None:
            if units_dir.is_dir() and any(units_dir.glob("*/*.json")):
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the run finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    done_at_kill = len(ResultsStore(kjob.store).fingerprints())
    (killed_run,) = ResultsStore(kjob.store).runs()  # its provenance says it never finished
    assert ResultsStore(kjob.store).read_provenance(killed_run)["state"] == "running"
    assert 1 <= done_at_kill < 16
    time.sleep(1.0)  # tasks already running on the workers may still finish and write (atomically)

    assert main(["run", str(killed), "--scheduler", addr]) == 0
    cap = capsys.readouterr()
    counts = re.search(r"executed (\d+), skipped (\d+)", cap.out)
    executed, skipped = int(counts.group(1)), int(counts.group(2))
    assert executed + skipped == 16 and 1 <= executed <= 16 - done_at_kill

    a, b = scores_by_fp(job.store), scores_by_fp(kjob.store)
    assert set(a) == set(b)
    for fp in a:
        for col in ("value", "std", "q_alpha", "ltm_alpha", "f0", "k", "support", "tau", "m"):
            assert same(a[fp][col], b[fp][col]), (fp, col, a[fp][col], b[fp][col])


LARGE_JOB = JOB + """
[metrics.ri]
k_candidates = [3, 5, 11]
[metrics.mari]
k_candidates = [3, 5, 11]
[neighbors]
backend = "{backend}"
large_scope_rows = 50
recall_sample = 50
"""


@pytest.mark.parametrize("backend", ["exact", "ann"])
def test_cluster_large_scope_units(tmp_path, cache_root, dask_subprocess_cluster, capsys, backend):
    """Units planned out of core (``engine = "distributed"``) on real worker processes: RI and MaRI
    share one table through a scheduler lock, values equal the in-process API, scratch is removed."""
    addr = dask_subprocess_cluster.address
    path = tmp_path / "large.toml"
    path.write_text(LARGE_JOB.format(cache=cache_root, store=tmp_path / "store", backend=backend), encoding="utf-8")
    assert main(["run", str(path), "--scheduler", addr, "-q"]) == 0
    assert "executed 16" in capsys.readouterr().out
    job = load_job(path)
    units = plan_job(job).done
    assert {u.params.get("engine") for u in units} == {"distributed"}
    assert not any((Path(job.store) / "scratch" / "large").glob("*"))
    with distributed.Client(addr) as client:  # the dashboard's task groups name phase and unit
        prefixes = set(client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.task_prefixes)))
    for u in units:  # the unit that builds a shared partition / table names its tasks
        for phase in ("partition", "search"):
            assert any(p.startswith(f"{phase}.{u.encoder}.{u.view}.") for p in prefixes), (phase, sorted(prefixes))
    if backend == "ann":
        assert any(p.startswith("calibrate.") for p in prefixes), sorted(prefixes)
    stored = scores_by_fp(job.store)
    cache = Cache(job.cache)
    for unit in units:
        ref = api_value(unit, cache)
        rec = stored[unit.fingerprint]
        if unit.metric == "ri":
            assert rec["value"] == ref.value and rec["k"] == ref.k, unit.label
        else:  # typed distances and MaRI evidence: float32 distance tolerance of spec §12.3
            assert rec["value"] == pytest.approx(ref.value, rel=1e-6, abs=1e-7), unit.label
        assert rec["recall"] == 1.0 if backend == "ann" else _missing(rec["recall"])
