"""Pins the probe sweep as a cache work unit (``cachescore.pipeline.probe_unit``).

- ``ProbeParams``: defaults, normalisation, ``to_dict``/``from_dict`` round trip, and errors that
  name the source and the dotted key (unknown key, missing key, bad values).
- ``prepare_probe_inputs``: names mapped to indices (sorted by default, explicit orders honoured),
  in-domain rows reordered so each slide is contiguous (slides in order of first appearance, rows
  in view order), test sets built from their filters with unseen centres coded after the known
  ones; the expected arrays are built here by a plain loop over the generating table.
- ``run_probe_unit``: the matrices equal ``probe_sweep_over_test_sets`` AND croma 1.0.1 called
  directly on the same arrays; record values equal croma's ``apd`` / ``nipd`` of those matrices
  (Cramér's V of the 2-split schedule is [0, 1] by construction: balanced, then fully confounded);
  the bundle round-trips and a rerun reuses it without fitting; a tampered bundle is recomputed;
  a Dask client gives the same matrices.
- Fingerprints are stable and change with params, embeddings and code version; records land in
  a ``ResultsStore`` and ``probe_unit_done`` sees them.
- Bad inputs give precise errors (slide row counts, labels outside ``class_order``, slides in two
  cells, overlapping filters, empty test sets, missing columns).
"""

from __future__ import annotations

import gc
import json
import warnings

import croma.downstream as cd
import numpy as np
import pandas as pd
import pytest
from sklearn.exceptions import ConvergenceWarning
from threadpoolctl import threadpool_limits

import cachescore.probe.distributed as dist
from cachescore.cache import Cache, write_embeddings, write_tileset, write_view
from cachescore.probe.params import ProbeParams, ProbeParamsError
from cachescore.probe.views import prepare_probe_inputs, select_probe_rows
from cachescore.pipeline.probe_unit import (
    probe_record_keys,
    probe_unit_done,
    probe_unit_fingerprint,
    run_probe_and_store,
    run_probe_unit,
    write_probe_records,
)
from cachescore.probe.bundle import read_bundle, read_manifest
from cachescore.probe.schedule import pathorob_schedule
from cachescore.probe.sweep import probe_sweep_over_test_sets
from cachescore.store import ResultsStore

RPS = 3  # tiles per slide
SLIDES = 8  # slides per in-domain cell
SCHEDULE = [  # balanced (V = 0), then fully confounded (V = 1)
    {"split_map": [[0, 0, 2 * RPS], [0, 1, 2 * RPS], [1, 0, 2 * RPS], [1, 1, 2 * RPS]], "max_train_slides": 3},
    {"split_map": [[0, 0, 3 * RPS], [1, 1, 3 * RPS]], "max_train_slides": 3},
]
RAW = {
    "schedule": SCHEDULE, "rows_per_slide": RPS, "iterations": 2, "seed": 1000,
    "id_filter": {"column": "subset", "value": "ID"},
    "test_sets": {"out_of_domain": {"column": "subset", "value": "OOD"}},
}


def make_tiles() -> pd.DataFrame:
    rows = []
    for cen in ("A", "B"):
        for lab in ("tumor", "normal"):
            for s in range(SLIDES):
                for t in range(RPS):
                    rows.append((f"{cen}-{lab}-s{s}-t{t}", cen, lab, f"{cen}-{lab}-s{s}", "ID"))
    for lab in ("tumor", "normal"):
        for s in range(2):
            for t in range(RPS):
                rows.append((f"C-{lab}-s{s}-t{t}", "C", lab, f"C-{lab}-s{s}", "OOD"))
    tiles = pd.DataFrame(rows, columns=["sample_id", "centre", "label", "group_id", "subset"])
    tiles["image_path"] = "img/" + tiles["sample_id"] + ".png"
    return tiles


def make_x(tiles: pd.DataFrame, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((len(tiles), 8))
    x[:, 0] += 1.5 * (tiles["label"] == "tumor").to_numpy()
    x[:, 1] += 1.0 * (tiles["centre"] == "A").to_numpy()
    return x.astype(np.float32)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("probe-cache")
    tiles = make_tiles()
    write_tileset(root, "ts", tiles)
    write_embeddings(root, "enc", "ts", make_x(tiles, 0))
    write_embeddings(root, "enc_other", "ts", make_x(tiles, 1))
    # the view lists tiles in a shuffled order: slides are interleaved, as in a real cache
    view = tiles.sample(frac=1.0, random_state=3)[["sample_id", "label", "group_id", "centre", "subset"]]
    write_view(root, "v", view, tileset="ts", confounder_column="centre")
    return Cache(root)


@pytest.fixture(scope="module")
def params():
    return ProbeParams.from_dict(RAW, source="test.toml")


@pytest.fixture(scope="module")
def unit(cache, params, tmp_path_factory):
    bundles = tmp_path_factory.mktemp("bundles")
    records, path = run_probe_unit(cache.root, "enc", "v", params, bundle_root=bundles)
    return records, path, bundles


def croma_over_test_sets(*args, **kwargs):
    with warnings.catch_warnings(), threadpool_limits(limits=1):
        warnings.simplefilter("ignore", ConvergenceWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module="sklearn")
        return cd.probe_sweep_over_test_sets(*args, **kwargs)


class FitSpy:
    def __init__(self, monkeypatch):
        self.calls = 0
        real = dist.fit_probe

        def spy(*a, **k):
            self.calls += 1
            return real(*a, **k)

        monkeypatch.setattr(dist, "fit_probe", spy)


# ------------------------------------------------------------------------------------ params


def test_params_defaults_normalisation_and_roundtrip(params):
    assert params.iterations == 2 and params.seed == 1000 and params.validation_fraction is None
    assert params.group_levels == (("slide", "group_id"),) and params.tile_key == ("sample_id",)
    assert params.temperature is False and params.n_bins == 15 and params.class_order is None
    assert params.schedule[1] == (((0, 0, 9), (1, 1, 9)), 3)
    assert params.matrix_names == ["in_domain", "out_of_domain"]
    assert probe_record_keys(params) == [("in_domain", "apd"), ("in_domain", "nipd"),
                                         ("out_of_domain", "apd"), ("out_of_domain", "nipd")]
    again = ProbeParams.from_dict(json.loads(json.dumps(params.to_dict())), source="roundtrip")
    assert again == params and again.to_dict() == params.to_dict()
    direct = ProbeParams(schedule=SCHEDULE, rows_per_slide=RPS, iterations=2,
                         id_filter={"column": "subset", "value": "ID"},
                         test_sets={"out_of_domain": {"column": "subset", "values": ["OOD"]}})
    assert direct == params
    named = ProbeParams.from_dict({"schedule": "camelyon", "rows_per_slide": 300, "n_splits": 3}, source="s")
    assert named.resolved_schedule() == pathorob_schedule("camelyon", rows_per_slide=300, n_splits=3)


@pytest.mark.parametrize(("change", "message"), [
    ({"bogus": 1}, r"jobs/x\.toml: unknown key 'probe\.bogus' \(known: schedule, rows_per_slide"),
    ({"rows_per_slide": None}, r"jobs/x\.toml: missing required key 'probe\.rows_per_slide'"),
    ({"schedule": "camelyonn"}, r"'probe\.schedule' must be one of \['camelyon', 'tcga', 'tolkach_esca'\]"),
    ({"schedule": SCHEDULE[:1]}, r"'probe\.schedule' must hold the balanced split and at least one"),
    ({"schedule": [SCHEDULE[0], {"split_map": [[0, 0, 4]], "max_train_slides": 3}]},
     r"'probe\.schedule\[1\]\.split_map\[0\]' takes 4 training rows, not a multiple of rows_per_slide=3"),
    ({"schedule": [SCHEDULE[0], {"split_map": [[0, 0, 3]], "max_train_slide": 3}]},
     r"unknown key 'probe\.schedule\[1\]\.max_train_slide'"),
    ({"n_splits": 2}, r"'probe\.n_splits' applies to a named schedule only"),
    ({"iterations": 0}, r"'probe\.iterations' must be an integer >= 1, got 0"),
    ({"validation_fraction": 1.0}, r"'probe\.validation_fraction' must be a number in \[0, 1\), got 1\.0"),
    ({"test_sets": {"ood": {"colum": "subset", "value": "OOD"}}}, r"unknown key 'probe\.test_sets\.ood\.colum'"),
    ({"test_sets": {"in_domain": {"column": "subset", "value": "OOD"}}}, r"reserved roles"),
    ({"id_filter": {"column": "subset", "value": "ID", "values": ["ID"]}},
     r"'probe\.id_filter' needs exactly one of 'value' or 'values'"),
    ({"group_levels": {"patient": "group_id"}}, r"'probe\.group_levels' must name the 'slide' level"),
    ({"protected_level": "patient"}, r"'probe\.protected_level' must be one of the group levels \['slide'\], got 'patient'"),
    ({"class_order": ["a", "a"]}, r"'probe\.class_order' lists \['a'\] more than once"),
    ({"temperature": "yes"}, r"'probe\.temperature' must be true or false, got 'yes'"),
])
def test_params_errors_name_source_and_key(change, message):
    raw = {k: v for k, v in {**RAW, **change}.items() if v is not None}
    with pytest.raises(ProbeParamsError, match=message):
        ProbeParams.from_dict(raw, source="jobs/x.toml")


# ------------------------------------------------------------------------------------ inputs


def expected_arrays(frame: pd.DataFrame):
    """The sweep's in-domain order by a plain loop: slides by first appearance, rows in view order."""
    slides: dict[str, list[int]] = {}
    for pos, (subset, slide) in enumerate(zip(frame["subset"], frame["group_id"])):
        if subset == "ID":
            slides.setdefault(slide, []).append(pos)
    order = [pos for rows in slides.values() for pos in rows]
    classes, centres = {"normal": 0, "tumor": 1}, {"A": 0, "B": 1, "C": 2}
    return order, classes, centres


def test_prepare_orders_slides_contiguously_and_maps_names(cache, params):
    frame = cache.read_view("v")
    x_view = cache.view_embeddings("enc", "v").compute()
    inputs = prepare_probe_inputs(frame, x_view, params)
    order, classes, centres = expected_arrays(frame)
    s = inputs.selection
    assert s.id_rows.tolist() == order
    assert np.array_equal(inputs.embeddings, x_view[order])
    assert inputs.labels.tolist() == [classes[v] for v in frame["label"].to_numpy()[order]]
    assert inputs.confounders.tolist() == [centres[v] for v in frame["centre"].to_numpy()[order]]
    assert inputs.labels.dtype == np.int64 and inputs.confounders.dtype == np.int64
    assert s.class_names == ("normal", "tumor") and s.confounder_names == ("A", "B", "C")
    # every slide is RPS consecutive rows of one cell
    slides = s.groups["slide"]
    assert all(len(set(slides[i:i + RPS])) == 1 for i in range(0, len(slides), RPS))
    assert list(s.tile_ids) == frame["sample_id"].to_numpy()[order].tolist()
    ood = [pos for pos, sub in enumerate(frame["subset"]) if sub == "OOD"]
    tx, ty = inputs.test_sets["out_of_domain"]
    assert np.array_equal(tx, x_view[ood])
    assert ty.tolist() == [classes[v] for v in frame["label"].to_numpy()[ood]]
    assert s.test_confounders["out_of_domain"].tolist() == [2] * len(ood)
    assert list(s.test_groups["out_of_domain"]["tile"]) == frame["sample_id"].to_numpy()[ood].tolist()
    assert s.n_ignored == 0
    # explicit orders are honoured
    flipped = ProbeParams.from_dict({**RAW, "class_order": ["tumor", "normal"], "confounder_order": ["B", "A"]},
                                    source="t")
    s2 = select_probe_rows(frame, flipped)
    assert s2.id_rows.tolist() == order
    assert s2.labels.tolist() == [1 - v for v in inputs.labels.tolist()]
    assert s2.confounders.tolist() == [1 - v for v in inputs.confounders.tolist()]


# ------------------------------------------------------------------------------------ the unit


def test_unit_matrices_equal_direct_sweep_and_croma(cache, params, unit):
    records, path, _ = unit
    frame = cache.read_view("v")
    inputs = prepare_probe_inputs(frame, cache.view_embeddings("enc", "v"), params)
    ours = probe_sweep_over_test_sets(inputs.embeddings, inputs.confounders, inputs.labels,
                                      **inputs.sweep_kwargs(params))
    theirs = croma_over_test_sets(inputs.embeddings, inputs.confounders, inputs.labels,
                                  **inputs.sweep_kwargs(params))
    ev = read_bundle(path)
    assert list(ev.matrices) == list(theirs) == ["in_domain", "out_of_domain"]
    for name in theirs:
        assert np.array_equal(ev.matrices[name], theirs[name]) and np.array_equal(ours[name], theirs[name])
    assert [(r["scope"], r["metric"]) for r in records] == probe_record_keys(params)
    for r in records:
        m = theirs[r["scope"]]
        assert np.array_equal(np.asarray(r["matrix"]), m)
        expected = cd.apd(m) if r["metric"] == "apd" else cd.nipd(m, [0.0, 1.0], 0.5)
        assert r["value"] == expected
        assert r["encoder"] == "enc" and r["view"] == "v" and r["tileset"] == "ts"
        assert r["design"] == r["family"] == "probe" and r["n_units"] == 4 and r["n_defined"] == 4
        assert r["leakage_passed"] is True and r["reused_bundle"] is False and r["bundle"] == str(path)
    assert records[0]["n_rows"] == 2 * 2 * SLIDES * RPS and records[2]["n_rows"] == 4 * RPS


def test_bundle_roundtrip_provenance_and_rerun(cache, params, unit, monkeypatch):
    records, path, bundles = unit
    fp = probe_unit_fingerprint(cache, "enc", "v", params)
    assert path == bundles / "enc" / "v" / fp
    manifest = read_manifest(path)
    prov = manifest["provenance"]
    assert manifest["encoder_id"] == "enc" and prov["unit_fingerprint"] == fp
    assert prov["params"] == params.to_dict() and prov["class_names"] == ["normal", "tumor"]
    assert prov["inputs"] == {"embeddings": cache.embedding_fingerprint("enc", "ts"),
                              "view": cache.view_fingerprint("v")}
    assert prov["rows"] == {"in_domain": 96, "out_of_domain": 12, "ignored": 0}
    ev = read_bundle(path)
    assert ev.class_names == ("normal", "tumor") and ev.parameters["seed"] == 1000

    spy = FitSpy(monkeypatch)
    again, path2 = run_probe_unit(cache.root, "enc", "v", params.to_dict(), bundle_root=bundles)
    assert path2 == path and spy.calls == 0
    assert all(r["reused_bundle"] for r in again)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in ("seconds", "reused_bundle")} for r in rs]  # noqa: E731
    assert strip(again) == strip(records)

    (path / "summary.json").write_text("{}", encoding="utf-8")  # tampered: recomputed, replaced
    third, _ = run_probe_unit(cache.root, "enc", "v", params, bundle_root=bundles)
    assert spy.calls == 4 and not any(r["reused_bundle"] for r in third)
    assert strip(third) == strip(records)
    assert read_bundle(path).matrices.keys() == ev.matrices.keys()


@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_client_fans_out_and_gives_the_same_matrices(cache, params, unit, tmp_path):
    from distributed import Client, LocalCluster

    records, _, _ = unit
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=None) as cluster, Client(cluster) as client:  # fmt: skip
        distributed_records, path = run_probe_unit(cache.root, "enc", "v", params, bundle_root=tmp_path,
                                                   client=client)
    # the in-process cluster leaves an unbound socket to the garbage collector; collect it here,
    # where its ResourceWarning is ignored, instead of in whichever test the collector next runs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    assert [r["matrix"] for r in distributed_records] == [r["matrix"] for r in records]
    assert [r["value"] for r in distributed_records] == [r["value"] for r in records]


def test_fingerprint_stable_and_sensitive(cache, params):
    fp = probe_unit_fingerprint(cache, "enc", "v", params)
    assert fp == probe_unit_fingerprint(str(cache.root), "enc", "v", RAW) and len(fp) == 64
    changed = [
        probe_unit_fingerprint(cache, "enc", "v", {**RAW, "seed": 1001}),
        probe_unit_fingerprint(cache, "enc", "v", {**RAW, "iterations": 3}),
        probe_unit_fingerprint(cache, "enc", "v", {**RAW, "test_sets": {}}),
        probe_unit_fingerprint(cache, "enc", "v", {**RAW, "temperature": True}),
        probe_unit_fingerprint(cache, "enc_other", "v", params),
        probe_unit_fingerprint(cache, "enc", "v", params, code_version="other"),
    ]
    assert len({fp, *changed}) == len(changed) + 1


def test_records_go_to_the_store(cache, params, unit, tmp_path):
    records, _, _ = unit
    store = ResultsStore(tmp_path / "store")
    fp = probe_unit_fingerprint(cache, "enc", "v", params)
    assert not probe_unit_done(store, fp, params)
    written = write_probe_records(store, records, run_id="run1")
    assert probe_unit_done(store, fp, params) and len(set(written)) == 4
    scores = store.scores().set_index("fingerprint").loc[written]
    assert scores["metric"].tolist() == ["apd", "nipd", "apd", "nipd"]
    assert scores["scope"].tolist() == ["in_domain", "in_domain", "out_of_domain", "out_of_domain"]
    assert scores["value"].tolist() == [r["value"] for r in records]
    assert (scores["design"] == "probe").all() and (scores["run_id"] == "run1").all()
    assert json.loads(scores["params"].iloc[0]) == params.to_dict()
    extra = json.loads(scores["extra"].iloc[0])
    assert extra["matrix"] == records[0]["matrix"] and extra["unit_fingerprint"] == fp


# ------------------------------------------------------------------------------------ bad inputs


def frame_and_x(cache):
    frame = cache.read_view("v")
    return frame, np.zeros((len(frame), 8))


def test_slide_with_wrong_row_count_is_named(cache, params):
    frame, x = frame_and_x(cache)
    drop = frame.index[frame["group_id"] == "B-normal-s5"][0]
    frame2, x2 = frame.drop(index=drop).reset_index(drop=True), x[:-1]
    frame2.attrs = frame.attrs
    with pytest.raises(ProbeParamsError, match=r"rows_per_slide=3 rows; 1 of 32 slides \(column 'group_id'\) "
                                               r"do not: B-normal-s5 \(2 rows\)"):
        prepare_probe_inputs(frame2, x2, params)


def test_label_outside_class_order_is_named(cache, params):
    frame, x = frame_and_x(cache)
    p = ProbeParams.from_dict({**RAW, "class_order": ["normal"]}, source="t")
    with pytest.raises(ProbeParamsError, match=r"in-domain rows: class value\(s\) \['tumor'\] not in the "
                                               r"class_order \['normal'\], at view rows .* \(48 in all\)"):
        prepare_probe_inputs(frame, x, p)
    frame.loc[frame["subset"] == "OOD", "label"] = "stroma"
    with pytest.raises(ProbeParamsError, match=r"test set 'out_of_domain': class value\(s\) \['stroma'\] not in"):
        prepare_probe_inputs(frame, x, params)


@pytest.mark.parametrize(("edit", "change", "message"), [
    (lambda f: f.__setitem__("label", f["label"].where(f["sample_id"] != "A-tumor-s0-t0", "normal")), {},
     r"slide\(s\) \['A-tumor-s0'\] \(1 in all, column 'group_id'\) hold rows of more than one"),
    (None, {"id_filter": {"column": "centre", "values": ["A", "B", "C"]}},
     r"are both in-domain \(centre in \['A', 'B', 'C'\]\) and in test set 'out_of_domain'"),
    (None, {"test_sets": {"empty": {"column": "subset", "value": "nope"}}},
     r"test set 'empty' \(subset == 'nope'\) selects no row"),
    (None, {"group_levels": {"slide": "slide_id"}}, r"missing column\(s\) \['slide_id'\] needed by the probe sweep"),
    (None, {"confounder_order": ["A"]}, r"confounder value\(s\) \['B'\] not in the confounder_order \['A'\]"),
])
def test_view_errors(cache, edit, change, message):
    frame, x = frame_and_x(cache)
    if edit is not None:
        edit(frame)
    p = ProbeParams.from_dict({**RAW, **change}, source="t")
    with pytest.raises(ProbeParamsError, match=message):
        prepare_probe_inputs(frame, x, p)


def test_unit_errors_before_fitting(cache, tmp_path, monkeypatch):
    spy = FitSpy(monkeypatch)
    too_big = [SCHEDULE[0], {"split_map": [[0, 0, 8 * RPS], [1, 1, 8 * RPS]], "max_train_slides": 8}]
    with pytest.raises(ValueError, match=r"cell \(0, 0\) holds 24 rows, too few"):
        run_probe_unit(cache.root, "enc", "v", {**RAW, "schedule": too_big}, bundle_root=tmp_path)
    with pytest.raises(ProbeParamsError, match=r"view 'v' .*: no column 'subsett'"):
        run_probe_unit(cache.root, "enc", "v", {**RAW, "id_filter": {"column": "subsett", "value": "ID"}},
                       bundle_root=tmp_path)
    assert spy.calls == 0 and not any(tmp_path.rglob("manifest.json"))


def test_run_and_store_skips_done_units_and_records_failures(cache, params, unit, tmp_path, monkeypatch):
    _, _, bundles = unit  # the bundle exists already: the first call reuses it
    store = ResultsStore(tmp_path / "store")
    spy = FitSpy(monkeypatch)
    first = run_probe_and_store(cache.root, store, "enc", "v", params, bundle_root=bundles, run_id="r1")
    assert first.status == "done" and probe_unit_done(store, first.fingerprint, params)
    second = run_probe_and_store(cache.root, store, "enc", "v", params, bundle_root=bundles)
    assert second.status == "skipped" and spy.calls == 0

    bad = {**RAW, "class_order": ["normal"]}
    failed = run_probe_and_store(cache.root, store, "enc", "v", bad, bundle_root=bundles, run_id="r1")
    assert failed.status == "failed" and "ProbeParamsError" in failed.error and spy.calls == 0
    failures = store.failures()
    assert sorted(failures["fingerprint"]) == sorted(failed.records)
    assert set(failures["metric"]) == {"apd", "nipd"} and "not in the class_order" in failures["error"].iloc[0]
