"""Pins cachescore.probe.bundle: round trip, checksums, strict JSON, atomicity, overwrite refusal.

The evaluation written is a real one (a 2-iteration sweep on small synthetic data), so the
round trip covers float64 matrices, every frame's dtypes and the audit report.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from cachescore.probe import bundle as bundle_mod
from cachescore.probe.bundle import BundleError, BundleExistsError, read_bundle, write_bundle
from cachescore.probe.evaluate import SweepIdentities, SweepParams, evaluate_sweep

RPS = 3
D = 8
SCHEDULE = [
    ([(0, 0, 6), (0, 1, 6), (1, 0, 6), (1, 1, 6)], 4),
    ([(0, 0, 3), (0, 1, 9), (1, 0, 9), (1, 1, 3)], 4),
    ([(0, 0, 0), (0, 1, 12), (1, 0, 12), (1, 1, 0)], 4),
]
PROVENANCE = {"encoder_id": "toy-encoder", "cache_fingerprint": "abc123", "note": float("nan")}


@pytest.fixture(scope="module")
def evaluation():
    rng = np.random.default_rng(42)
    n_cell = 10 * RPS
    conf = np.repeat([0, 0, 1, 1], n_cell)
    lab = np.repeat([0, 1, 0, 1], n_cell)
    x = rng.normal(size=(4 * n_cell, D)) + 1.5 * np.eye(D)[lab] + 1.5 * np.eye(D)[2 + conf]
    slide = np.array([f"S{i // RPS}" for i in range(4 * n_cell)])
    tile = np.array([str(i % RPS) for i in range(4 * n_cell)])
    return evaluate_sweep(x, conf, lab, identities=SweepIdentities(groups={"slide": slide}, tile_ids=(slide, tile)),
                          params=SweepParams(schedule=SCHEDULE, rows_per_slide=RPS, iterations=2),
                          test_sets={"ood": (rng.normal(size=(6, D)), np.array([0, 1] * 3))})


def test_round_trip_is_exact(evaluation, tmp_path):
    path = write_bundle(evaluation, tmp_path / "run1", provenance=PROVENANCE)
    assert path == tmp_path / "run1"
    back = read_bundle(path)
    assert back.equals(evaluation)
    for k in evaluation.matrices:
        assert back.matrices[k].flags.c_contiguous and back.matrices[k].dtype == np.float64
    assert back.metrics.dtypes.equals(evaluation.metrics.dtypes)
    assert back.audit["passed"] is True
    assert back.confusion["count"].sum() == evaluation.confusion["count"].sum()
    # only the bundle itself is left in the parent (no staging folders)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run1"]


def test_manifest_records_checksums_provenance_and_versions(evaluation, tmp_path):
    path = write_bundle(evaluation, tmp_path / "b", provenance=PROVENANCE)
    manifest = json.loads((path / "manifest.json").read_text())
    files = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(manifest["files"]) == files
    assert {"summary.json", "metrics.parquet", "calibration.parquet", "leakage.json"} <= files
    assert any(f.startswith("matrices/") and f.endswith(".npy") for f in files)
    assert manifest["provenance"]["encoder_id"] == "toy-encoder"
    assert manifest["provenance"]["note"] is None  # NaN stored as null
    assert {"numpy", "scikit-learn", "scipy", "dask"} <= set(manifest["library_versions"])
    assert manifest["leakage_passed"] is True and manifest["schema_version"].startswith("2.")
    assert manifest["replicate_seeds"] == list(evaluation.replicate_seeds)
    summary = json.loads((path / "summary.json").read_text())
    assert summary["apd"] == evaluation.apd and summary["cramers_v"] == [0.0, 0.5, 1.0]


def test_every_json_file_is_strict(evaluation, tmp_path):
    path = write_bundle(evaluation, tmp_path / "b", provenance=PROVENANCE)

    def refuse(tok):
        raise AssertionError(f"non-strict token {tok}")

    for f in path.glob("*.json"):
        json.loads(f.read_text(encoding="utf-8"), parse_constant=refuse)


def test_matrices_load_without_pickle(evaluation, tmp_path):
    path = write_bundle(evaluation, tmp_path / "b", provenance={})
    for f in (path / "matrices").glob("*.npy"):
        np.load(f, allow_pickle=False)


@pytest.mark.parametrize("victim", ["metrics.parquet", "summary.json", "leakage.json", "predictions.parquet", "split_report.json", "matrices/000.npy"])
def test_tampered_file_is_refused_naming_it(evaluation, tmp_path, victim):
    path = write_bundle(evaluation, tmp_path / "b", provenance={})
    f = path / victim
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=f"checksum mismatch for '{victim}'"):
        read_bundle(path)


def test_missing_extra_and_resized_files_are_refused(evaluation, tmp_path):
    path = write_bundle(evaluation, tmp_path / "b", provenance={})
    (path / "confusion.parquet").unlink()
    with pytest.raises(BundleError, match="'confusion.parquet' listed in the manifest is missing"):
        read_bundle(path)
    path2 = write_bundle(evaluation, tmp_path / "c", provenance={})
    (path2 / "stray.csv").write_text("x")
    with pytest.raises(BundleError, match="not listed in the manifest.*stray.csv"):
        read_bundle(path2)
    path3 = write_bundle(evaluation, tmp_path / "d", provenance={})
    with open(path3 / "leakage.json", "a") as fh:
        fh.write(" ")
    with pytest.raises(BundleError, match="'leakage.json' has size"):
        read_bundle(path3)


def test_unknown_major_schema_and_missing_manifest_are_refused(evaluation, tmp_path):
    path = write_bundle(evaluation, tmp_path / "b", provenance={})
    m = json.loads((path / "manifest.json").read_text())
    m["schema_version"] = "3.0"
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="unknown bundle schema_version '3.0'"):
        read_bundle(path)
    (path / "manifest.json").unlink()
    with pytest.raises(BundleError, match="no manifest.json"):
        read_bundle(path)
    with pytest.raises(FileNotFoundError):
        read_bundle(tmp_path / "nowhere")


def test_existing_bundle_is_not_overwritten(evaluation, tmp_path):
    path = write_bundle(evaluation, tmp_path / "b", provenance={"run": 1})
    before = {p: p.read_bytes() for p in path.rglob("*") if p.is_file()}
    with pytest.raises(BundleExistsError, match="already exists; pass overwrite=True"):
        write_bundle(evaluation, path, provenance={"run": 2})
    assert {p: p.read_bytes() for p in path.rglob("*") if p.is_file()} == before
    assert isinstance(BundleExistsError("x"), ValueError) and isinstance(BundleExistsError("x"), FileExistsError)
    write_bundle(evaluation, path, provenance={"run": 2}, overwrite=True)
    assert json.loads((path / "manifest.json").read_text())["provenance"] == {"run": 2}
    assert read_bundle(path).equals(evaluation)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]  # old copy and staging removed


def test_crash_mid_write_leaves_target_untouched_and_no_bundle(evaluation, tmp_path, monkeypatch):
    target = tmp_path / "b"

    def boom(*a, **k):
        raise KeyboardInterrupt("simulated crash before the manifest")

    monkeypatch.setattr(bundle_mod, "_write_manifest", boom)
    with pytest.raises(KeyboardInterrupt):
        write_bundle(evaluation, target, provenance={})
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []  # staging cleaned up on an orderly failure

    # a hard crash (no cleanup) leaves only a staging folder, which is not a bundle
    monkeypatch.setattr(bundle_mod, "_discard", lambda p: None)
    with pytest.raises(KeyboardInterrupt):
        write_bundle(evaluation, target, provenance={})
    assert not target.exists()
    (staging,) = list(tmp_path.iterdir())
    assert staging.name.startswith(".b.tmp-")
    with pytest.raises(BundleError, match="no manifest.json"):
        read_bundle(staging)
    with pytest.raises(FileNotFoundError):
        read_bundle(target)


def test_crash_during_overwrite_keeps_the_old_bundle(evaluation, tmp_path, monkeypatch):
    path = write_bundle(evaluation, tmp_path / "b", provenance={"run": 1})
    before = {p.relative_to(path): p.read_bytes() for p in path.rglob("*") if p.is_file()}

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(bundle_mod, "_write_files", boom)
    with pytest.raises(OSError, match="disk full"):
        write_bundle(evaluation, path, provenance={"run": 2}, overwrite=True)
    assert {p.relative_to(path): p.read_bytes() for p in path.rglob("*") if p.is_file()} == before
    assert read_bundle(path).equals(evaluation)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_final_rename_is_a_single_step(evaluation, tmp_path, monkeypatch):
    renames = []
    real = os.rename

    def spy(src, dst):
        renames.append((Path(src).name, Path(dst).name))
        return real(src, dst)

    monkeypatch.setattr(bundle_mod.os, "rename", spy)
    write_bundle(evaluation, tmp_path / "b", provenance={})
    assert len(renames) == 1 and renames[0][0].startswith(".b.tmp-") and renames[0][1] == "b"


def test_bad_arguments(evaluation, tmp_path):
    with pytest.raises(FileNotFoundError, match="parent folder"):
        write_bundle(evaluation, tmp_path / "missing" / "b", provenance={})
    with pytest.raises(ValueError, match="JSON-serialisable"):
        write_bundle(evaluation, tmp_path / "b", provenance={"x": object()})
    with pytest.raises(TypeError, match="SweepEvaluation"):
        write_bundle({"not": "an evaluation"}, tmp_path / "b", provenance={})
    assert list(tmp_path.iterdir()) == []
