"""Pins the C.6 results tree and the distributed evaluation (spec evaluation.md C.6, Part D).

- ``<results>/<encoder_id>/<run_id>/`` with every C.6 file; the manifest records encoder id,
  cache fingerprint, split-plan hash, seeds, library versions and the file map.
- A rerun with the same plan hash and cache fingerprint skips the work (no probe fitted); a new
  fingerprint, a new seed or a tampered bundle is recomputed.
- Discovery lists bundles newest first (explicit modification times).
- With a Dask client every (replicate, split) is fitted AND evaluated inside its task; 1 worker,
  2 worker processes and no client give identical evaluations and identical bundle files.
"""

from __future__ import annotations

import json
import os

import pytest
from distributed import Client, LocalCluster

import cachescore.probe.distributed as dist
from cachescore.probe.evaluate import sweep_arguments
from cachescore.probe.bundle import (
    bundle_is_current,
    find_bundle,
    list_bundles,
    read_bundle,
    run_encoder_evaluation,
    write_encoder_bundle,
)
from test_probe_evaluate import RPS, SCHEDULE, make_data

C6_FILES = {"manifest.json", "summary.json", "predictions.parquet", "confusion.parquet",
            "per_centre_metrics.parquet", "calibration.parquet", "probe_selection.parquet",
            "split_report.json", "leakage.json", "metrics.parquet"}


@pytest.fixture(scope="module")
def data():
    return make_data(1)


def kwargs(data, **kw):
    args = dict(groups={"slide": data["slide"]}, tile_ids=(data["slide"], data["tile"]), schedule=SCHEDULE,
                test_sets={"out_of_domain": data["ood"]},
                test_set_groups={"out_of_domain": {"slide": data["ood_slide"]}},
                test_set_confounders={"out_of_domain": data["ood_conf"]},
                rows_per_slide=RPS, iterations=2, seed=1000)
    args.update(kw)
    return sweep_arguments(**args)


class FitSpy:
    def __init__(self, monkeypatch):
        self.calls = 0
        real = dist.fit_probe

        def spy(*a, **k):
            self.calls += 1
            return real(*a, **k)

        monkeypatch.setattr(dist, "fit_probe", spy)


def test_results_tree_manifest_and_rerun_skip(data, tmp_path, monkeypatch):
    spy = FitSpy(monkeypatch)
    def run(cache_fingerprint, run_id=None, overwrite=False, **kw):
        return run_encoder_evaluation(data["x"], data["conf"], data["lab"], results=tmp_path, encoder_id="enc-A",
                                      cache_fingerprint=cache_fingerprint, run_id=run_id, overwrite=overwrite,
                                      **kwargs(data, **kw))
    path, skipped = run(cache_fingerprint="fp1", run_id="run1")
    assert not skipped and path == tmp_path / "enc-A" / "run1" and spy.calls == 6
    files = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}
    assert C6_FILES <= files
    manifest = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
    ev = read_bundle(path)
    assert manifest["encoder_id"] == "enc-A" and manifest["cache_fingerprint"] == "fp1"
    assert manifest["split_plan_sha256"] == ev.plan_sha256 and len(ev.plan_sha256) == 64
    assert manifest["seeds"] == {"base": 1000, "replicates": list(ev.replicate_seeds)}
    assert {"numpy", "scikit-learn", "scipy", "dask"} <= set(manifest["library_versions"])
    assert manifest["created_utc"].endswith("+00:00") and manifest["leakage_passed"] is True
    assert set(manifest["files"]) == files - {"manifest.json"}
    leak = json.loads((path / "leakage.json").read_text())
    assert leak["passed"] is True and leak["plan"]["passed"] and leak["content"]["passed"]
    summary = json.loads((path / "summary.json").read_text())
    assert len(summary["metrics"]) == len(ev.metrics) and "in_domain" in summary["aggregates"]
    assert len(json.loads((path / "split_report.json").read_text())) == 6

    # rerun: same plan, same cache -> skipped, nothing fitted
    n = spy.calls
    again, skipped = run(cache_fingerprint="fp1")
    assert skipped and again == path and spy.calls == n
    assert bundle_is_current(path, split_plan_sha256=ev.plan_sha256, cache_fingerprint="fp1")
    # a new cache fingerprint or a new seed is recomputed into a new run folder
    other, skipped = run(cache_fingerprint="fp2", run_id="run2")
    assert not skipped and other.name == "run2" and spy.calls > n
    _, skipped = run(cache_fingerprint="fp1", seed=1001, run_id="run3")
    assert not skipped
    # a tampered bundle is not current and is recomputed
    (path / "split_report.json").write_text("[]\n")
    assert not bundle_is_current(path, split_plan_sha256=ev.plan_sha256, cache_fingerprint="fp1")
    assert find_bundle(tmp_path, "enc-A", split_plan_sha256=ev.plan_sha256, cache_fingerprint="fp1") is None
    fresh, skipped = run(cache_fingerprint="fp1", run_id="run4")
    assert not skipped and fresh.name == "run4"
    assert find_bundle(tmp_path, "enc-A", split_plan_sha256=ev.plan_sha256, cache_fingerprint="fp1") == fresh


def test_discovery_is_newest_first(data, tmp_path):
    from cachescore.probe.evaluate import evaluate_sweep

    ev = evaluate_sweep(data["x"], data["conf"], data["lab"], **kwargs(data, iterations=1))
    paths = [write_encoder_bundle(ev, tmp_path, encoder_id="e", cache_fingerprint="f", run_id=f"r{i}")
             for i in range(3)]
    for t, p in zip((300, 100, 200), paths):
        os.utime(p / "manifest.json", (1_700_000_000 + t, 1_700_000_000 + t))
    (tmp_path / "e" / ".r9.tmp-x").mkdir()
    (tmp_path / "e" / ".r9.tmp-x" / "manifest.json").write_text("{}")
    assert list_bundles(tmp_path) == [paths[0], paths[2], paths[1]]
    with pytest.raises(FileNotFoundError):
        list_bundles(tmp_path / "missing")
    with pytest.raises(ValueError, match="encoder_id"):
        write_encoder_bundle(ev, tmp_path, encoder_id="../x", cache_fingerprint="f")


def test_one_and_two_worker_processes_give_identical_bundles(data, tmp_path):
    from cachescore.probe.evaluate import _fit_and_evaluate, evaluate_sweep

    kw = kwargs(data, temperature_scaling=True)
    local = evaluate_sweep(data["x"], data["conf"], data["lab"], **kw)
    results = {}
    # 1 in-process worker; 2 worker processes (real pickling of tasks and results)
    for n_workers, processes in ((1, False), (2, True)):
        net = {"host": "127.0.0.1"} if processes else {}
        with LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=processes,
                          dashboard_address=None, **net) as cluster, Client(cluster) as client:
            submitted = []
            real_submit = client.submit

            def submit(fn, *a, _real=real_submit, **k):
                submitted.append(fn)
                return _real(fn, *a, **k)

            client.submit = submit
            results[n_workers] = evaluate_sweep(data["x"], data["conf"], data["lab"], client=client, **kw)
            assert submitted == [_fit_and_evaluate] * 6  # fit + evaluation inside each task
    for ev in results.values():
        assert ev.equals(local)
    # identical bundle files (manifest aside: it carries the creation time)
    digests = []
    for i, ev in enumerate((local, results[2])):
        p = write_encoder_bundle(ev, tmp_path, encoder_id="e", cache_fingerprint="f", run_id=f"r{i}")
        digests.append(json.loads((p / "manifest.json").read_text())["files"])
    assert digests[0] == digests[1]
