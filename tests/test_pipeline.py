"""Planning and Dask execution of work units (cachescore.pipeline).

Pins: the unit grid (encoder × view × design × metric × m) and its fingerprints (stable, sensitive
to parameters, inputs and only to the backend that is actually used); a second run executes no
unit (counted, not timed); a failing encoder (corrupt shard, NaN rows) or view (misaligned
manifest) is recorded with its error while the other units finish; transient failures are
retried; an interrupted run resumes with the remainder only and ends with the same results as an
uninterrupted one; provenance and the performance report are written; ``score_unit`` gives
croma's numbers.

Most tests use a tiny in-process LocalCluster and stand in for the unit's scoring function
(``fake_score``, patched into ``cachescore.pipeline.unit`` for the run: the workers are threads of
this process), so they exercise the orchestration and not the metrics; ``test_score_unit_matches_croma`` checks the
metric wiring against the oracle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
import shutil
import threading
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from cachescore.cache import Cache, make_demo_cache, write_embeddings, write_view
from cachescore.jobs import parse_job
from cachescore.pipeline import plan_job, run_job
from cachescore.pipeline.execute import execute_plan
from cachescore.pipeline.cluster import open_client
from cachescore.neighbors.registry import OUT_OF_CORE, engine_params, in_memory_searcher, is_out_of_core
from cachescore.store import ResultsStore
import cachescore.pipeline.batch as batch_mod
import cachescore.pipeline.unit as unit_mod

#: The real functions, captured before any test patches the module.
REAL_LOAD = unit_mod.load_unit_inputs
CALLS: list[str] = []
_LOCK = threading.Lock()


@pytest.fixture(autouse=True)
def _pinned_code_version(monkeypatch):
    """Pin the code version: other people edit metrics/ and neighbors/ while these tests run, and
    an edit between two runs would (correctly) change every fingerprint."""
    monkeypatch.setenv("CACHESCORE_CODE_VERSION", "test-pinned")


def fake_score(unit, features, manifest, searcher=None):
    """Deterministic stand-in for the metric API: summary statistics of the unit's features."""
    with _LOCK:
        CALLS.append(unit.fingerprint)
    x = features.astype(np.float64)
    salt = {"ri": 1.0, "mari": 2.0, "croma": 3.0}[unit.metric] + 0.01 * unit.params.get("m", 0)
    record = {"encoder": unit.encoder, "view": unit.view, "design": unit.design, "family": unit.metric,
              "metric": unit.metric, "params": json.dumps(unit.params, sort_keys=True),
              "value": float(x.mean() * salt), "std": float(x.std()), "n_units": int(len(manifest)),
              "k": int(len(manifest))}
    per_unit = pd.DataFrame({"unit": np.arange(len(manifest)), "value": x.mean(axis=1)})
    return record, per_unit


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache") / "demo"
    make_demo_cache(root, n_slides_per_cell=2, tiles_per_slide=4, dim=8, encoders=3, seed=1)
    return root


def make_job(tmp_path, cache, **sections):
    doc = {"schema_version": 1, "job": {"cache": str(cache), "store": str(tmp_path / "store")},
           "metrics": {"croma": {"m": [1, 5]}},
           "execution": {"n_workers": 1, "retries": 1, "dashboard": False, "performance_report": False}}
    for name, values in sections.items():
        if "." in name:
            a, b = name.split(".")
            doc.setdefault(a, {}).setdefault(b, {}).update(values)
        else:
            doc.setdefault(name, {}).update(values)
    return parse_job(doc, path=tmp_path / "job.toml")


@contextlib.contextmanager
def stand_ins(score=fake_score, load=None, probe=None):
    """Replace what the unit tasks call (``score_unit``, ``load_unit_inputs``, ``run_probe_unit``,
    wherever :mod:`cachescore.pipeline.batch` and :mod:`cachescore.pipeline.unit` name them) for the
    duration of a run on an in-process cluster."""
    names = {"score_unit": score, "load_unit_inputs": load, "run_probe_unit": probe}
    saved = {(mod, k): getattr(mod, k) for k, f in names.items() if f is not None
             for mod in (batch_mod, unit_mod) if hasattr(mod, k)}
    try:
        for mod, k in saved:
            setattr(mod, k, names[k])
        yield
    finally:
        for (mod, k), f in saved.items():
            setattr(mod, k, f)


def run(job, *, score=fake_score, load=None, probe=None, out=None):
    with stand_ins(score, load, probe):
        return run_job(job, processes=False, out=io.StringIO() if out is None else out)


def test_plan_grid_and_fingerprints(tmp_path, demo_cache):
    job = make_job(tmp_path, demo_cache)
    plan = plan_job(job)
    # 3 encoders x 2 views x (ri, mari, croma m=1, croma m=5)
    assert len(plan.pending) == 3 * 2 * 4 and not plan.done and not plan.invalid
    fps = [u.fingerprint for u in plan.pending]
    assert len(set(fps)) == len(fps)
    designs = {u.view: u.design for u in plan.pending}
    assert designs == {"centre_all": "all", "centre_paired": "paired_2x2"}
    assert {u.params["backend"] for u in plan.pending} == {"exact"}
    assert [u.fingerprint for u in plan_job(job).pending] == fps  # stable
    assert set(plan.inputs) == {"views/centre_all", "views/centre_paired"} | {
        f"embeddings/enc{i}/demo" for i in range(3)}

    # a MaRI parameter changes exactly the MaRI units
    job2 = make_job(tmp_path, demo_cache, **{"metrics.mari": {"tau": 0.3}})
    changed = {u.metric for u, v in zip(plan.pending, plan_job(job2).pending) if u.fingerprint != v.fingerprint}
    assert changed == {"mari"}

    # the auto threshold matters only when it changes the backend actually used
    same = plan_job(make_job(tmp_path, demo_cache, neighbors={"auto_threshold": 1e9}))
    assert [u.fingerprint for u in same.pending] == fps
    ann = plan_job(make_job(tmp_path, demo_cache, neighbors={"auto_threshold": 10.0}))
    assert {u.params["backend"] for u in ann.pending} == {"ann"}
    assert not set(fps) & {u.fingerprint for u in ann.pending}

    # a forced design and a subset of encoders/views
    forced = plan_job(make_job(tmp_path, demo_cache, job={"design": "all", "encoders": ["enc2"],
                                                          "views": ["centre_paired"]}))
    assert {(u.encoder, u.view, u.design) for u in forced.pending} == {("enc2", "centre_paired", "all")}


def test_plan_rejects_unknown_encoder(tmp_path, demo_cache):
    job = make_job(tmp_path, demo_cache, job={"encoders": ["enc0", "nope"]})
    with pytest.raises(ValueError, match=r"encoder\(s\) nope not in cache .* \(it has: enc0, enc1, enc2\)"):
        plan_job(job)


def test_code_version_enters_fingerprints(tmp_path, demo_cache, monkeypatch):
    from cachescore import __version__
    from cachescore.fingerprint import code_version, source_digest, CODE_SOURCES

    pinned = [u.fingerprint for u in plan_job(make_job(tmp_path, demo_cache)).pending]
    monkeypatch.setenv("CACHESCORE_CODE_VERSION", "other")
    assert code_version() == "other"
    assert not set(pinned) & {u.fingerprint for u in plan_job(make_job(tmp_path, demo_cache)).pending}
    monkeypatch.delenv("CACHESCORE_CODE_VERSION")
    assert code_version().endswith("+" + source_digest(CODE_SOURCES["score"])[:12])
    assert re.fullmatch(re.escape(__version__) + r"\+[0-9a-f]{12}", code_version())


def test_engine_params_resolve_auto_and_mark_large_scopes():
    nb = {"auto_threshold": 1e5, "recall_target": 0.99, "recall_sample": 100, "seed": 3, "large_scope_rows": 1000}
    assert engine_params("auto", scope_rows=100, dim=10, neighbors=nb) == {"backend": "exact"}
    assert engine_params("auto", scope_rows=101, dim=10, neighbors=nb) == {
        "backend": "ann", "recall_target": 0.99, "recall_sample": 100, "seed": 3}
    assert engine_params("exact", scope_rows=10**6, dim=768, neighbors=dict(nb, auto_threshold=1.0)) == {
        "backend": "exact", "engine": OUT_OF_CORE, "seed": 3}
    assert engine_params("ann", scope_rows=2, dim=2, neighbors=dict(nb, auto_threshold=1e30))["backend"] == "ann"
    assert is_out_of_core({"engine": OUT_OF_CORE}) and not is_out_of_core({"backend": "exact"})
    assert type(in_memory_searcher({"backend": "exact"})).__name__ == "ExactSearch"  # no None engine
    assert type(in_memory_searcher({"backend": "ann", "seed": 0, "recall_target": 0.9, "recall_sample": 5})).__name__ == "AnnSearch"
    with pytest.raises(ValueError, match="unknown neighbour backend 'fast'"):
        engine_params("fast", scope_rows=1, dim=1, neighbors=nb)


def test_second_run_executes_nothing(tmp_path, demo_cache):
    job = make_job(tmp_path, demo_cache)
    CALLS.clear()
    first = run(job)
    assert first.ok and first.executed == first.succeeded == 24 and first.skipped == 0
    assert len(CALLS) == 24 and len(set(CALLS)) == 24
    store = ResultsStore(job.store)
    scores = store.scores()
    assert len(scores) == 24 and set(scores["fingerprint"]) == set(CALLS)

    CALLS.clear()
    second = run(job)
    assert second.ok and second.executed == 0 and second.skipped == 24 and CALLS == []
    pd.testing.assert_frame_equal(store.scores().drop(columns=["finished_at"]), scores.drop(columns=["finished_at"]))

    prov = store.read_provenance(first.run_id)
    assert prov["state"] == "finished" and prov["finished_at"]
    assert prov["units"] == {"planned": 24, "executed": 24, "skipped": 0, "succeeded": 24, "failed": 0, "not_run": 0}
    assert prov["job"]["job"]["cache"] == str(demo_cache)
    assert set(prov["input_fingerprints"]) == set(plan_job(job).inputs)
    assert prov["versions"]["cachescore"] and prov["versions"]["numpy"] == np.__version__
    assert prov["hardware"]["workers"] and prov["code_version"]
    assert store.read_provenance(second.run_id)["executed_fingerprints"] == []

    # the records are the unit function's output, keyed by the planned fingerprints
    rec = store.record(CALLS[0] if CALLS else scores["fingerprint"].iloc[0])
    assert rec["seconds"] >= 0 and rec["run_id"] == first.run_id


def _corrupt_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_failing_inputs_are_recorded_and_the_rest_finishes(tmp_path, demo_cache):
    cache_root = _corrupt_copy(demo_cache, tmp_path / "cache")
    cache = Cache(cache_root)
    # enc1: a corrupt shard (bytes flipped after the .npy header; checksum no longer matches)
    shard = sorted((cache_root / "embeddings" / "enc1" / "demo").glob("*.npy"))[0]
    data = bytearray(shard.read_bytes())
    data[-8:] = b"\xff" * 8
    shard.write_bytes(bytes(data))
    # enc2: NaN rows (written with the writer's finiteness check off)
    x = cache.load_rows("enc2", "demo")
    x[[3, 7]] = np.nan
    write_embeddings(cache_root, "enc2", "demo", x, overwrite=True, check_finite=False)
    # a misaligned view: a sample_id that the tileset does not have
    frame = cache.read_view("centre_all")[["sample_id", "label", "group_id", "centre"]].copy()
    write_view(cache_root, "broken", frame, tileset="demo", confounder_column="centre", design="all")
    frame.loc[5, "sample_id"] = "no-such-tile"  # edited outside cachescore: the writer would refuse it
    frame.to_parquet(cache_root / "views" / "broken.parquet", index=False)
    # ... with a sidecar that records no table sha256 (as written before it was recorded; with
    # it, the reader would refuse the hand-edited table as not belonging to its sidecar)
    side = cache_root / "views" / "broken.json"
    side.write_text(json.dumps({k: v for k, v in json.loads(side.read_text()).items() if not k.startswith("table_")}))

    job = make_job(tmp_path, cache_root, metrics={"families": ["ri", "croma"]}, **{"metrics.croma": {"m": [5]}})
    CALLS.clear()
    summary = run(job)
    # 3 views x 3 encoders x 2 families
    assert summary.planned == 18 and not summary.ok
    failed = {f["label"].split("/")[0] + "/" + f["label"].split("/")[1] for f in summary.failures}
    assert {f"enc1/{v}" for v in ("centre_all", "centre_paired")} <= failed
    assert {f"enc2/{v}" for v in ("centre_all", "centre_paired")} <= failed
    assert {f"enc{i}/broken" for i in range(3)} <= failed
    assert len(summary.failures) == 2 * 2 + 2 * 2 + 3 * 2
    assert summary.succeeded == 4  # enc0 on the two good views, two families
    errors = {f["label"]: f["error"] for f in summary.failures}
    assert any("ShardError" in e and "enc1" in e and shard.name in e for k, e in errors.items() if k.startswith("enc1/"))
    assert any("NonFiniteError" in e and "3" in e for k, e in errors.items() if k.startswith("enc2/"))
    assert all("no-such-tile" in e for k, e in errors.items() if "/broken/" in k)

    store = ResultsStore(job.store)
    assert len(store.scores()) == 4 and set(store.scores()["encoder"]) == {"enc0"}
    fails = store.failures()
    assert len(fails) == len(summary.failures)
    assert set(fails["fingerprint"]) == {f["fingerprint"] for f in summary.failures}


_ATTEMPTS: dict[str, int] = {}


def flaky_load(unit):
    """Loads normally, but the first load of the centre_paired view (per encoder) loses its connection."""
    key = (unit.encoder, unit.view)
    with _LOCK:
        _ATTEMPTS[key] = _ATTEMPTS.get(key, 0) + 1
        first = _ATTEMPTS[key] == 1
    if unit.view == "centre_paired" and first:
        raise ConnectionResetError("simulated transient failure")
    return REAL_LOAD(unit)


def always_lost(unit):
    raise ConnectionResetError("simulated persistent transport failure")


def test_transient_failures_are_retried(tmp_path, demo_cache):
    job = make_job(tmp_path, demo_cache, job={"encoders": ["enc0"]})
    _ATTEMPTS.clear()
    summary = run(job, load=flaky_load)
    assert summary.ok and summary.succeeded == 8
    # the units of one (encoder, view) load their inputs once per try: the paired view's batch twice
    assert _ATTEMPTS == {("enc0", "centre_all"): 1, ("enc0", "centre_paired"): 2}
    assert len(plan_job(job).done) == 8


def test_exhausted_retries_are_recorded(tmp_path, demo_cache):
    job = make_job(tmp_path, demo_cache, job={"encoders": ["enc0"], "views": ["centre_all"]},
                   metrics={"families": ["ri"]})
    summary = run(job, load=always_lost)
    assert not summary.ok and summary.succeeded == 0 and len(summary.failures) == 1
    assert "ConnectionResetError" in summary.failures[0]["error"]
    fails = ResultsStore(job.store).failures()
    assert list(fails["error"]) == [summary.failures[0]["error"]]
    # once the cause is gone, the next run scores it and the failure disappears
    assert run(job).ok
    assert len(ResultsStore(job.store).failures()) == 0


def test_interrupted_run_resumes_with_identical_results(tmp_path, demo_cache):
    job = make_job(tmp_path, demo_cache)
    plan = plan_job(job)
    # an interrupted run: only the first 10 units got written before the client died
    partial = dataclasses.replace(plan, pending=plan.pending[:10])
    with open_client(None, n_workers=1, dashboard=False, processes=False) as client:
        with stand_ins():
            ok, fails = execute_plan(partial, client, retries=0, out=None)
    assert ok == 10 and not fails
    CALLS.clear()
    resumed = run(job)
    assert resumed.executed == 14 and resumed.skipped == 10 and resumed.ok
    assert set(CALLS) == {u.fingerprint for u in plan.pending[10:]}

    clean_job = make_job(tmp_path / "clean", demo_cache)
    assert run(clean_job).executed == 24
    cols = ["fingerprint", "encoder", "view", "design", "metric", "value", "std", "k", "n_units"]
    a = ResultsStore(job.store).scores()[cols].sort_values("fingerprint").reset_index(drop=True)
    b = ResultsStore(clean_job.store).scores()[cols].sort_values("fingerprint").reset_index(drop=True)
    pd.testing.assert_frame_equal(a, b)
    for fp in a["fingerprint"]:
        pd.testing.assert_frame_equal(ResultsStore(job.store).per_unit(fp), ResultsStore(clean_job.store).per_unit(fp))


def test_an_early_end_counts_units_the_workers_stored_before_it(tmp_path, demo_cache):
    """A worker writes a unit's record before the client fetches the unit's result: when the run
    ends early in between, the summary and the provenance count that unit as done, not as not
    run (the next run's plan skips it)."""
    from cachescore.pipeline.run import _settle_from_store

    job = make_job(tmp_path, demo_cache)
    plan = plan_job(job)
    stored = dataclasses.replace(plan, pending=plan.pending[:3])
    with open_client(None, n_workers=1, dashboard=False, processes=False) as client:
        with stand_ins():
            assert execute_plan(stored, client, retries=0, out=None) == (3, [])
    ended = {plan.pending[0].fingerprint: {"status": "done"}}  # the one result this process fetched
    _settle_from_store(plan, ResultsStore(job.store), ended)
    assert set(ended) == {u.fingerprint for u in plan.pending[:3]}
    assert all(ended[u.fingerprint].status == "done" and ended[u.fingerprint].label == u.label
               for u in plan.pending[1:3])
    assert len(plan_job(job).pending) == len(plan.pending) - 3


def test_performance_report_and_progress(tmp_path, demo_cache):
    job = make_job(tmp_path, demo_cache, job={"encoders": ["enc0"], "views": ["centre_all"]},
                   metrics={"families": ["ri"]}, execution={"performance_report": True})
    out = io.StringIO()
    summary = run(job, out=out)
    assert summary.ok and summary.report_path
    report = Path(summary.report_path)
    assert report.is_file() and report.parent == ResultsStore(job.store).run_dir(summary.run_id)
    assert "<html" in report.read_text(encoding="utf-8", errors="replace").lower()
    text = out.getvalue()
    assert "1/1 units" in text and "done enc0/centre_all/all/ri" in text
    assert ResultsStore(job.store).read_provenance(summary.run_id)["performance_report"] == str(report)


def test_score_unit_matches_croma(tmp_path, demo_cache):
    """score_unit wires the metric API: its records equal croma 1.0.1 on the demo cache.

    The demo embeddings are Gaussian float32 draws, so distance ties at window boundaries have
    probability ~0; RI/k/support are compared exactly, MaRI/CRoMa within the spec's float32
    tolerance (spec/metrics.md §12.3).
    """
    import croma

    from cachescore.pipeline import score_unit
    from cachescore.pipeline.unit import load_unit_inputs

    job = make_job(tmp_path, demo_cache, job={"encoders": ["enc0", "enc2"]}, **{"metrics.croma": {"m": [1, 5]}})
    plan = plan_job(job)
    for unit in plan.pending:
        features, manifest = load_unit_inputs(unit)
        kw = dict(confounder_column=unit.confounder_column, evaluation_design=unit.design)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # metric notes (e.g. MaRI auto tau) are not under test here
            record, per_unit = score_unit(unit, features, manifest)
            if unit.metric == "ri":
                ref = croma.RI.compute(features, manifest, k_candidates=unit.params["k_candidates"], **kw)
            elif unit.metric == "mari":
                ref = croma.MaRI.compute(features, manifest, k_candidates=unit.params["k_candidates"], **kw)
            else:
                ref = croma.CRoMa.compute(features, manifest, m=unit.params["m"], alpha=unit.params["alpha"], **kw)
        if unit.metric == "croma":
            assert record["m"] == ref.m
            np.testing.assert_allclose(record["value"], ref.value, rtol=0, atol=1e-6)
            np.testing.assert_allclose(record["f0"], ref.f0, rtol=0, atol=0)
        else:
            assert record["k"] == ref.k
            assert record["support"] == ref.support and isinstance(record["support"], float)
            assert record["n_defined"] == int(np.asarray(ref.occurrence_defined_mask).sum())
            if unit.metric == "ri":
                assert record["value"] == ref.value
            else:
                np.testing.assert_allclose(record["value"], ref.value, rtol=0, atol=1e-6)
                np.testing.assert_allclose(record["tau"], ref.tau, rtol=0, atol=4e-7)
        np.testing.assert_allclose(per_unit["value"].to_numpy(), np.asarray(ref.sample_values_aligned, float),
                                   rtol=0, atol=1e-6, equal_nan=True)
        np.testing.assert_array_equal(per_unit["source_index"].to_numpy(), ref.occurrence_source_indices)


def _ann_vs_exact(tmp_path, demo_cache, families):
    from cachescore.pipeline import score_unit
    from cachescore.pipeline.unit import load_unit_inputs

    sel = {"encoders": ["enc1"]}
    met = {"families": families}
    exact = plan_job(make_job(tmp_path, demo_cache, job=sel, metrics=met, neighbors={"backend": "exact"})).pending
    ann = plan_job(make_job(tmp_path, demo_cache, job=sel, metrics=met,
                            neighbors={"backend": "ann", "recall_sample": 50})).pending
    assert len(exact) == len(ann) > 0
    for ue, ua in zip(exact, ann):
        assert ua.params["backend"] == "ann" and ua.params["recall_sample"] == 50
        features, manifest = load_unit_inputs(ue)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            re_, pe = score_unit(ue, features, manifest)
            ra, pa_ = score_unit(ua, features, manifest)
        assert np.isnan(re_["recall"]) and ra["recall"] == 1.0
        assert ra["value"] == re_["value"]
        if ue.metric == "croma":
            # ANN CRoMa skips the O(n^2 d) counting pass behind croma's schedule diagnostics
            assert ra["k"] == -1 and re_["k"] > 0
        else:
            assert ra["k"] == re_["k"]
        pd.testing.assert_frame_equal(pa_, pe)


def test_ann_backend_wiring_records_recall(tmp_path, demo_cache):
    """backend = "ann" goes through the ANN searches and records their measured recall.

    The demo scopes are small, so the ANN engine answers them by exact brute force (its own
    policy below BRUTE_MAX_ROWS): recall is exactly 1 and the values equal the exact backend's.
    """
    _ann_vs_exact(tmp_path, demo_cache, ["ri", "mari"])


def test_ann_backend_wiring_croma(tmp_path, demo_cache):
    _ann_vs_exact(tmp_path, demo_cache, ["croma"])


RPS = 3  # probe test cache: tiles per slide


def _probe_cache(root: Path) -> Path:
    """Two in-domain centres (A, B) x two labels x 8 slides of RPS tiles, plus an OOD centre C."""
    from cachescore.cache import write_tileset

    rows = []
    for cen, n_slides, subset in (("A", 8, "ID"), ("B", 8, "ID"), ("C", 2, "OOD")):
        for lab in ("tumor", "normal"):
            for s in range(n_slides):
                for t in range(RPS):
                    rows.append((f"{cen}-{lab}-s{s}-t{t}", cen, lab, f"{cen}-{lab}-s{s}", subset))
    tiles = pd.DataFrame(rows, columns=["sample_id", "centre", "label", "group_id", "subset"])
    tiles["image_path"] = "img/" + tiles["sample_id"] + ".png"
    write_tileset(root, "ts", tiles)
    rng = np.random.default_rng(0)
    for enc, shift in (("encA", 0.5), ("encB", 2.0)):
        x = rng.standard_normal((len(tiles), 8))
        x[:, 0] += 1.5 * (tiles["label"] == "tumor").to_numpy()
        x[:, 1] += shift * (tiles["centre"] == "A").to_numpy()
        write_embeddings(root, enc, "ts", x.astype(np.float32))
    view = tiles.sample(frac=1.0, random_state=3)[["sample_id", "label", "group_id", "centre", "subset"]]
    write_view(root, "v", view, tileset="ts", confounder_column="centre")
    # a view the probe cannot use: one slide has a tile too few
    write_view(root, "short", view[view["sample_id"] != "A-tumor-s0-t0"], tileset="ts", confounder_column="centre")
    return root


PROBE = {
    "schedule": [
        {"split_map": [[0, 0, 2 * RPS], [0, 1, 2 * RPS], [1, 0, 2 * RPS], [1, 1, 2 * RPS]], "max_train_slides": 3},
        {"split_map": [[0, 0, 3 * RPS], [1, 1, 3 * RPS]], "max_train_slides": 3},
    ],
    "rows_per_slide": RPS, "iterations": 2, "seed": 1000,
    "id_filter": {"column": "subset", "value": "ID"},
    "test_sets": {"out_of_domain": {"column": "subset", "value": "OOD"}},
}


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_probe_units_run_once_and_record_failures(tmp_path):
    """A job with a [probe] table plans one probe-sweep unit per encoder x probe view; the sweep
    fans out on the run's client, its APD/nIPD records land in the store (equal to a direct
    run_probe_unit call), a second run executes nothing, an unfit view is a recorded failure."""
    from cachescore.pipeline.probe_unit import run_probe_unit
    from cachescore.pipeline.status import unit_status

    root = _probe_cache(tmp_path / "cache")
    job = parse_job({"schema_version": 1,
                     "job": {"cache": str(root), "store": str(tmp_path / "store"), "views": ["v"],
                             "probe_views": ["v", "short"]},
                     "metrics": {"families": ["ri"]}, "probe": PROBE,
                     "execution": {"n_workers": 1, "retries": 0, "dashboard": False, "performance_report": False}},
                    path=tmp_path / "job.toml")
    plan = plan_job(job)
    probe_units = [u for u in plan.pending if u.metric == "probe"]
    assert sorted((u.encoder, u.view) for u in probe_units) == [
        ("encA", "short"), ("encA", "v"), ("encB", "short"), ("encB", "v")]
    first = run(job)  # the unfit view's units are refused by the pre-flight checks: recorded, never started
    assert first.executed == 4 and first.succeeded == 4 and len(first.failures) == 2
    assert all(f["label"].endswith("/short/probe") and "rows_per_slide" in f["error"] for f in first.failures), \
        first.failures

    scores = ResultsStore(job.store).scores()
    probe = scores[scores["family"] == "probe"]
    assert len(probe) == 2 * 2 * 2  # encoders x (in_domain, out_of_domain) x (apd, nipd)
    records, _ = run_probe_unit(root, "encB", "v", job.probe, bundle_root=tmp_path / "direct",
                                code_version="test-pinned")
    for rec in records:
        row = probe[probe["fingerprint"] == rec["fingerprint"]]
        assert len(row) == 1 and row["value"].iloc[0] == pytest.approx(rec["value"], rel=0, abs=0, nan_ok=True)
    assert (job.bundles / "encB" / "v").is_dir()

    status = [r for r in unit_status(job) if r["design"] == "probe"]
    assert len(status) == 2 * 2 * 2 * 2  # encoders x probe views x matrices x (apd, nipd): one row per record
    by_unit: dict = {}
    for r in status:
        by_unit.setdefault((r["encoder"], r["view"]), set()).add(r["state"])
    assert by_unit[("encA", "v")] == {"done"} and by_unit[("encA", "short")] == {"failed"}
    shown = {(r["encoder"], r["scope"], r["metric"]): r["value"] for r in status if r["view"] == "v"}
    for rec in records:  # encB's stored values show in the status
        assert shown[("encB", rec["scope"], rec["metric"])] == pytest.approx(rec["value"], rel=0, abs=0, nan_ok=True)
    assert all("rows_per_slide" in r["detail"] for r in status if r["view"] == "short")
    second = run(job)  # the two unfit units are refused again at pre-flight; nothing else runs
    assert second.executed == 0 and second.skipped == 4 and len(second.failures) == 2



PROBE_STARTED = threading.Event()
METRIC_DURING_PROBE = threading.Event()


def probe_waiting_for_metrics(*args, **kwargs):
    """The real sweep, but only once a metric unit has run while this probe unit is in flight
    (waits at most 30 s, so a sequential executor fails the test instead of hanging)."""
    from cachescore.pipeline.probe_unit import run_probe_unit

    PROBE_STARTED.set()
    METRIC_DURING_PROBE.wait(timeout=30)
    return run_probe_unit(*args, **kwargs)


def score_noting_probe(unit, features, manifest, searcher=None):
    if PROBE_STARTED.is_set():
        METRIC_DURING_PROBE.set()
    return fake_score(unit, features, manifest)


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_probe_units_run_concurrently_with_metric_units(tmp_path):
    """Probe-sweep units are tasks in the same as_completed loop as metric units (submitted first,
    seceding from the worker's pool): with ONE single-threaded worker, a metric unit still runs
    while the probe unit is in flight, and the sweep's own replicate tasks run too. The probe's
    records equal a direct run_probe_unit call; retries/skip semantics are those of metric units."""
    from cachescore.pipeline.probe_unit import run_probe_unit

    PROBE_STARTED.clear()
    METRIC_DURING_PROBE.clear()
    root = _probe_cache(tmp_path / "cache")
    job = parse_job({"schema_version": 1,
                     "job": {"cache": str(root), "store": str(tmp_path / "store"), "views": ["v"],
                             "encoders": ["encA"]},
                     "metrics": {"families": ["ri", "mari"]}, "probe": PROBE,
                     "execution": {"n_workers": 1, "retries": 0, "dashboard": False, "performance_report": False}},
                    path=tmp_path / "job.toml")
    summary = run(job, score=score_noting_probe, probe=probe_waiting_for_metrics)
    assert summary.executed == 3 and summary.succeeded == 3 and not summary.failures
    assert METRIC_DURING_PROBE.is_set(), "no metric unit ran while the probe unit was in flight"
    scores = ResultsStore(job.store).scores()
    probe = scores[scores["family"] == "probe"]
    records, _ = run_probe_unit(root, "encA", "v", job.probe, bundle_root=tmp_path / "direct",
                                code_version="test-pinned")
    assert sorted(probe["fingerprint"]) == sorted(r["fingerprint"] for r in records)
    for rec in records:
        row = probe[probe["fingerprint"] == rec["fingerprint"]]
        assert row["value"].iloc[0] == pytest.approx(rec["value"], rel=0, abs=0, nan_ok=True)
    assert run(job).executed == 0  # skip semantics: everything is in the store


_PROBE_ATTEMPTS: list[str] = []


def probe_flaky(*args, **kwargs):
    """First attempt: a transport failure (not a data error: Dask retries it); then the real sweep."""
    from cachescore.pipeline.probe_unit import run_probe_unit

    with _LOCK:
        _PROBE_ATTEMPTS.append(args[1])
        first = len(_PROBE_ATTEMPTS) == 1
    if first:
        raise ConnectionResetError("simulated transient transport failure")
    return run_probe_unit(*args, **kwargs)


def probe_always_lost(*args, **kwargs):
    raise ConnectionResetError("simulated persistent transport failure")


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_probe_unit_retry_semantics(tmp_path):
    """Probe units follow the metric units' policy: a transient failure is retried by Dask (the
    retry succeeds and stores the records); when retries run out the client records the unit as
    failed with its error (status lists its records as failed), and a later run scores it."""
    from cachescore.pipeline.status import unit_status

    root = _probe_cache(tmp_path / "cache")

    def job_at(name, retries):
        return parse_job({"schema_version": 1,
                          "job": {"cache": str(root), "store": str(tmp_path / name), "views": ["v"], "encoders": ["encA"]},
                          "metrics": {"families": ["ri"]}, "probe": PROBE,
                          "execution": {"n_workers": 1, "retries": retries, "dashboard": False,
                                        "performance_report": False}}, path=tmp_path / f"{name}.toml")

    _PROBE_ATTEMPTS.clear()
    job = job_at("flaky", 1)
    summary = run(job, probe=probe_flaky)
    assert summary.ok and summary.succeeded == 2 and _PROBE_ATTEMPTS == ["encA", "encA"]
    assert (ResultsStore(job.store).scores()["design"] == "probe").sum() == 4

    lost = job_at("lost", 0)
    summary = run(lost, probe=probe_always_lost)
    assert summary.succeeded == 1 and [f["label"] for f in summary.failures] == ["encA/v/probe"]
    assert "ConnectionResetError" in summary.failures[0]["error"]
    rows = [r for r in unit_status(lost) if r["design"] == "probe"]
    assert len(rows) == 4 and all(r["state"] == "failed" and "ConnectionResetError" in r["detail"] for r in rows)
    again = run(lost)
    assert again.ok and again.executed == 1 and again.skipped == 1
    assert ResultsStore(lost.store).failures().empty  # the success supersedes the unit's failure


_BUG_CALLS: list[str] = []


def buggy_score(unit, features, manifest, searcher=None):
    with _LOCK:
        _BUG_CALLS.append(unit.fingerprint)
    raise TypeError("unsupported operand type(s) for +: 'int' and 'str'")  # a bug in our code


def test_a_bug_is_retried_and_reported_not_filed_as_bad_data(tmp_path, demo_cache):
    """DATA_ERRORS is narrow (ADR-0008): a TypeError/KeyError from our code is not recorded as the
    unit's bad data at once; Dask retries it, then the client records it with its type and message."""
    from cachescore.errors import DATA_ERRORS, UnscorableError

    assert not issubclass(TypeError, DATA_ERRORS) and not issubclass(KeyError, DATA_ERRORS)
    assert issubclass(UnscorableError, DATA_ERRORS) and issubclass(UnscorableError, RuntimeError)
    job = make_job(tmp_path, demo_cache, job={"encoders": ["enc0"], "views": ["centre_all"]},
                   metrics={"families": ["ri"]}, execution={"retries": 2})
    _BUG_CALLS.clear()
    summary = run(job, score=buggy_score)
    assert summary.succeeded == 0 and len(summary.failures) == 1
    assert summary.failures[0]["error"].startswith("TypeError: unsupported operand")
    assert len(_BUG_CALLS) == 3  # the first attempt and two retries: never filed as data at once


def croma_bug_score(unit, features, manifest, searcher=None):
    """fake_score, except that every croma unit hits a bug; counts the calls per metric."""
    with _LOCK:
        _BUG_CALLS.append(unit.metric)
    if unit.metric == "croma":
        raise ZeroDivisionError("float division by zero")  # a bug in our code, for this unit only
    return fake_score(unit, features, manifest)


def test_a_bug_in_one_unit_of_a_batch_hides_no_other_unit(tmp_path, demo_cache):
    """The units of one (encoder, view) run as one task (ADR-0018): a unit whose scoring raises a
    bug is retried and finally recorded with its own error, while the batch's other units are
    stored once (a retry skips what this run already stored) and count as done."""
    job = make_job(tmp_path, demo_cache, job={"encoders": ["enc0"], "views": ["centre_all"]},
                   metrics={"families": ["ri", "mari", "croma"], "croma": {"m": [5]}}, execution={"retries": 2})
    _BUG_CALLS.clear()
    summary = run(job, score=croma_bug_score)
    assert summary.executed == 3 and summary.succeeded == 2 and len(summary.failures) == 1
    assert summary.failures[0]["label"].endswith("/croma[m=5]")
    assert summary.failures[0]["error"] == "ZeroDivisionError: float division by zero"
    assert sorted(_BUG_CALLS) == ["croma"] * 3 + ["mari", "ri"]  # croma tried 3 times, the others once
    store = ResultsStore(job.store)
    assert len(store.fingerprints()) == 2 and list(store.failures()["error"]) == [summary.failures[0]["error"]]
    import pickle

    from cachescore.pipeline.batch import BatchErrors

    sent = pickle.loads(pickle.dumps(BatchErrors({"f" * 64: "ZeroDivisionError: x"}, {"f" * 64: "e/v/all/croma"})))
    assert sent.errors == {"f" * 64: "ZeroDivisionError: x"} and str(sent) == "e/v/all/croma: ZeroDivisionError: x"


def test_a_metric_refusal_is_a_data_error_with_the_unit_label(tmp_path):
    """croma's RuntimeError refusals (here: a view whose scope has one group) are recorded at once,
    as UnscorableError naming the unit, and never retried."""
    root = tmp_path / "cache"
    make_demo_cache(root, n_slides_per_cell=1, tiles_per_slide=3, dim=4, encoders=2, seed=0)
    frame = Cache(root).read_view("centre_all")
    one_group = frame.assign(group_id="g0")
    write_view(root, "one_group", one_group[[c for c in one_group.columns if c != "row"]], tileset="demo",
               confounder_column="centre", design="all")
    job = make_job(tmp_path, root, job={"views": ["one_group"], "encoders": ["enc0"]}, metrics={"families": ["ri"]},
                   execution={"retries": 2})
    summary = run(job, score=unit_mod.score_unit)
    assert len(summary.failures) == 1
    err = summary.failures[0]["error"]
    assert err.startswith("UnscorableError: enc0/one_group/all/ri: ") and "cross-group neighbor" in err


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_probe_tasks_use_the_planned_input_fingerprints(tmp_path, monkeypatch):
    """A probe task does not hash the view or read meta.json again: it uses the fingerprints the
    plan computed (after planning, hashing inputs fails here, and the run still succeeds with the
    planned fingerprints)."""
    root = _probe_cache(tmp_path / "cache")
    job = parse_job({"schema_version": 1,
                     "job": {"cache": str(root), "store": str(tmp_path / "store"), "views": ["v"], "encoders": ["encA"]},
                     "metrics": {"families": ["ri"]}, "probe": PROBE,
                     "execution": {"n_workers": 1, "retries": 0, "dashboard": False, "performance_report": False}},
                    path=tmp_path / "job.toml")
    plan = plan_job(job)

    def no_rehash(*args, **kwargs):
        raise AssertionError("an input was fingerprinted again after planning")

    monkeypatch.setattr(Cache, "view_fingerprint", no_rehash)
    monkeypatch.setattr(Cache, "embedding_fingerprint", no_rehash)
    with open_client(None, n_workers=1, dashboard=False, processes=False) as client, stand_ins():
        ok, fails = execute_plan(plan, client, retries=0, out=None)
    assert not fails and ok == 2
    probe_unit = next(u for u in plan.pending if u.metric == "probe")
    stored = ResultsStore(job.store).scores()
    assert (stored["design"] == "probe").sum() == 4
    assert all(json.loads(e).get("unit_fingerprint") == probe_unit.fingerprint
               for e in stored[stored["design"] == "probe"]["extra"])


def test_prune_lists_then_removes_what_no_current_fingerprint_names(tmp_path, demo_cache, monkeypatch):
    from cachescore.pipeline.prune import prune_store

    job = make_job(tmp_path, demo_cache, job={"encoders": ["enc0"]})
    monkeypatch.setenv("CACHESCORE_CODE_VERSION", "old")
    old = run(job)
    monkeypatch.setenv("CACHESCORE_CODE_VERSION", "new")
    new = run(job)
    assert old.succeeded == new.succeeded == 8
    store = ResultsStore(job.store)
    store.record_failure("ab" * 32, unit={"encoder": "gone", "view": "v", "metric": "ri"}, error="old failure")
    plan = plan_job(job, store=store)
    current = {u.fingerprint for u in plan.units}
    dry = prune_store(plan, store)
    assert len(dry.stale_records) == 8 and dry.abandoned_failures == [] and not dry.applied
    assert dry.outside_failures == ["ab" * 32]  # encoder 'gone' is not in this job's scope: kept by default
    assert not set(dry.stale_records) & current and len(store.stored_fingerprints()) == 16  # nothing deleted
    assert prune_store(plan, store, apply=True).abandoned_failures == [] and store.failure_fingerprints()
    done = prune_store(plan, store, apply=True, all_jobs=True)
    assert done.bytes_freed == 0 and store.stored_fingerprints() == current  # the first apply freed the 8
    assert store.failure_fingerprints() == set() and len(list((job.store / "units").glob("*/.*.parquet"))) == 8
    assert run(job).executed == 0  # the current results are intact
    assert prune_store(plan_job(job, store=store), store).stale_records == []


def test_tables_are_written_even_for_records_without_units_to_resample(tmp_path, demo_cache):
    """fake_score's per-unit tables lack source_index / subset (not result_record's): the scores
    table still lists them, with no interval and the reason in ci_method."""
    job = make_job(tmp_path, demo_cache, job={"encoders": ["enc0"], "views": ["centre_all"]},
                   metrics={"families": ["ri"]})
    summary = run(job)
    assert summary.ok and summary.tables
    df = pd.read_parquet(job.store / "scores.parquet")
    assert len(df) == 1 and df["ci_low"].isna().all() and df["defined"].all()
    assert df["ci_method"].iloc[0] == "not available: the per-unit table lacks source_index, subset"
