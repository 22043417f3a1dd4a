"""cachescore.store.ResultsStore: atomic, concurrent-safe unit records with explicit schemas.

Pins: write/has/record/scores/per_unit round-trip with exactly SCORES_SCHEMA; a crash at any
point of a write leaves no visible record and a readable store; leftovers of crashed writers and
malformed records are ignored (the unit counts as missing and is recomputed), never trusted; a
later success supersedes a failure; two processes writing concurrently lose nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from cachescore.store import FAILURES_SCHEMA, SCORES_SCHEMA, CorruptRecordError, ResultsStore, StoreError, fingerprint
from cachescore import _atomic as atomic_mod
from cachescore.store import results as results_mod


def fp_of(i) -> str:
    return fingerprint({"unit": i})


RECORD = {"encoder": "enc0", "view": "centre_all", "tileset": "demo", "scope": "dataset", "design": "all",
          "family": "ri", "metric": "RI", "params": {"k_candidates": [5, 11, 21]}, "value": np.float64(0.75),
          "std": np.float32(0.125), "q_alpha": 0.5, "ltm_alpha": 0.25, "f0": 0.0, "support": np.float32(0.75),
          "k": 11, "tau": None, "m": 5, "recall": 1.0, "n_units": 216, "n_defined": 213, "unit": "sample",
          "backend": "exact", "run_id": "r1", "code_version": "0.1.0", "seconds": 1.5,
          "finished_at": "2026-01-02T03:04:05+00:00", "warnings": "", "seconds_load": 0.25}


def test_round_trip_and_schema(tmp_path):
    store = ResultsStore(tmp_path / "s")
    empty = store.scores()
    assert list(empty.columns) == SCORES_SCHEMA.names and len(empty) == 0
    assert list(store.failures().columns) == FAILURES_SCHEMA.names
    per_unit = pd.DataFrame({"i": np.arange(4, dtype=np.int64), "v": [0.5, np.nan, 1.0, 2.0],
                             "s": ["a", "b", "c", "d"], "b": [True, False, True, True]})
    fp = fp_of(1)
    assert not store.has(fp)
    store.write_unit(fp, record=RECORD, per_unit=per_unit)
    assert store.has(fp) and store.fingerprints() == {fp}
    scores = store.scores()
    assert list(scores.columns) == SCORES_SCHEMA.names and len(scores) == 1
    row = scores.iloc[0]
    assert row["fingerprint"] == fp and row["encoder"] == "enc0" and row["metric"] == "RI"
    assert json.loads(row["params"]) == {"k_candidates": [5, 11, 21]} and row["params"] == '{"k_candidates":[5,11,21]}'
    assert row["value"] == 0.75 and row["std"] == 0.125 and row["support"] == 0.75 and row["k"] == 11
    assert pd.isna(row["tau"]) and row["n_defined"] == 213 and row["seconds"] == 1.5
    assert row["finished_at"] == pd.Timestamp("2026-01-02T03:04:05", tz="UTC")
    assert json.loads(row["extra"]) == {"warnings": "", "seconds_load": 0.25}
    assert scores["support"].dtype == np.float64 and scores["n_defined"].dtype == pd.Int64Dtype()
    assert scores["value"].dtype == np.float64
    # the frame converts back to the explicit schema, and the arrow view carries it exactly
    assert pa.Table.from_pandas(scores, schema=SCORES_SCHEMA, preserve_index=False).schema == SCORES_SCHEMA
    table = store.scores_table()
    assert table.schema == SCORES_SCHEMA and table.num_rows == 1
    pd.testing.assert_frame_equal(store.per_unit(fp), per_unit)
    assert store.record(fp)["support"] == 0.75
    # a unit without per-unit values
    store.write_unit(fp_of(2), record={"encoder": "enc1", "metric": "MaRI", "value": float("nan")})
    assert store.per_unit(fp_of(2)).empty
    assert pd.isna(store.scores().set_index("encoder").loc["enc1", "value"])
    with pytest.raises(KeyError, match="no complete record"):
        store.per_unit(fp_of(3))


def test_bad_arguments(tmp_path):
    store = ResultsStore(tmp_path / "s")
    with pytest.raises(StoreError, match="fingerprint must be 16-128 lowercase hex"):
        store.write_unit("../../etc", record={})
    with pytest.raises(TypeError, match="record must be a dict"):
        store.write_unit(fp_of(1), record=[1])
    with pytest.raises(ValueError, match="expected an integer"):
        store.write_unit(fp_of(1), record={"k": 2.5})
    with pytest.raises(TypeError, match="cannot fingerprint an object"):
        store.write_unit(fp_of(1), record={"x": object()})
    assert not store.has(fp_of(1))
    with pytest.raises(StoreError, match="run_id must be a plain name"):
        store.run_dir("a/b")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "data.csv").write_text("x")
    with pytest.raises(StoreError, match="refusing to use it as a results store"):
        ResultsStore(tmp_path / "other")


def test_failure_then_success(tmp_path):
    store = ResultsStore(tmp_path / "s")
    fp = fp_of(7)
    store.record_failure(fp, unit={"encoder": "enc2", "view": "v", "family": "croma", "run_id": "r9"},
                         error="ValueError: features contains NaN at rows [3]")
    fails = store.failures()
    assert list(fails.columns) == FAILURES_SCHEMA.names and len(fails) == 1
    assert fails.iloc[0]["encoder"] == "enc2" and "rows [3]" in fails.iloc[0]["error"] and fails.iloc[0]["run_id"] == "r9"
    assert not store.has(fp)
    store.write_unit(fp, record={"encoder": "enc2", "metric": "CRoMa", "value": 0.1})
    assert store.has(fp) and len(store.failures()) == 0
    # a later failure never hides the success
    store.record_failure(fp, unit={"encoder": "enc2"}, error="boom")
    assert store.has(fp) and len(store.failures()) == 0


def _visible(store_path):
    return sorted(p.relative_to(store_path).as_posix() for p in store_path.rglob("*")
                  if p.is_file() and not any(part.startswith(".") for part in p.relative_to(store_path).parts))


def test_crash_during_envelope_rename(tmp_path, monkeypatch):
    store = ResultsStore(tmp_path / "s")
    before = _visible(store.path)

    def crash(src, dst):
        raise KeyboardInterrupt("simulated kill during rename")

    monkeypatch.setattr(atomic_mod.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        store.write_unit(fp_of(1), record=RECORD, per_unit=pd.DataFrame({"x": [1]}))
    monkeypatch.undo()
    assert not store.has(fp_of(1)) and store.scores().empty
    assert _visible(store.path) == before, "no visible record after a crash"
    assert not list(store.path.rglob("*.partial")), "the writer removed its partial file"
    store.write_unit(fp_of(1), record=RECORD)  # the rerun succeeds
    assert store.has(fp_of(1))


def test_crash_between_table_and_envelope(tmp_path, monkeypatch):
    store = ResultsStore(tmp_path / "s")

    def crash(*args, **kwargs):
        raise SystemExit("simulated kill after the per-unit table was written")

    monkeypatch.setattr(results_mod, "atomic_write_json", crash)
    with pytest.raises(SystemExit):
        store.write_unit(fp_of(1), record=RECORD, per_unit=pd.DataFrame({"x": [1]}))
    monkeypatch.undo()
    assert not store.has(fp_of(1)) and store.scores().empty and store.fingerprints() == set()
    orphans = list(store.path.rglob(".*.parquet"))
    assert len(orphans) == 1
    assert store.sweep(older_than_s=3600) == 0  # too young: might belong to a live writer
    assert store.sweep(older_than_s=-1) == 1 and not orphans[0].exists()


def test_killed_writer_leftovers_are_ignored(tmp_path):
    store = ResultsStore(tmp_path / "s")
    store.write_unit(fp_of(1), record=RECORD)
    fp = fp_of(2)
    folder = store.path / "units" / fp[:2]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f".{fp}.json.123-abc.partial").write_text('{"version": 1, "fingerprint": "' + fp)
    assert not store.has(fp) and store.fingerprints() == {fp_of(1)} and len(store.scores()) == 1
    assert store.sweep(older_than_s=-1) == 1


@pytest.mark.parametrize("damage", ["truncated", "not_object", "wrong_version", "wrong_fp", "missing_table",
                                    "table_size", "bad_schema"])
def test_malformed_records_are_ignored(tmp_path, damage):
    store = ResultsStore(tmp_path / "s")
    fp, other = fp_of(1), fp_of(2)
    store.write_unit(fp, record=RECORD, per_unit=pd.DataFrame({"x": [1, 2]}))
    store.write_unit(other, record=RECORD)
    path = store.path / "units" / fp[:2] / f"{fp}.json"
    env = json.loads(path.read_text())
    table = path.parent / env["per_unit"]["file"]
    if damage == "truncated":
        path.write_text(path.read_text()[:40])
    elif damage == "not_object":
        path.write_text("[1, 2]")
    elif damage == "wrong_version":
        path.write_text(json.dumps({**env, "version": 999}))
    elif damage == "wrong_fp":
        path.write_text(json.dumps({**env, "fingerprint": other}))
    elif damage == "missing_table":
        table.unlink()
    elif damage == "table_size":
        table.write_bytes(table.read_bytes() + b"x")
    elif damage == "bad_schema":
        path.write_text(json.dumps({**env, "record": {**env["record"], "k": "eleven"}}))
    assert not store.has(fp) and store.record(fp) is None
    assert set(store.scores()["fingerprint"]) == {other}
    store.write_unit(fp, record=RECORD, per_unit=pd.DataFrame({"x": [1, 2]}))  # recomputed, replaces it
    assert store.has(fp) and len(store.scores()) == 2


def test_corrupt_table_checksum(tmp_path):
    store = ResultsStore(tmp_path / "s")
    fp = fp_of(1)
    store.write_unit(fp, record=RECORD, per_unit=pd.DataFrame({"x": np.arange(50)}))
    env = json.loads((store.path / "units" / fp[:2] / f"{fp}.json").read_text())
    table = store.path / "units" / fp[:2] / env["per_unit"]["file"]
    data = bytearray(table.read_bytes())
    data[len(data) // 2] ^= 0xFF
    table.write_bytes(bytes(data))
    with pytest.raises(CorruptRecordError, match="does not match its sha256 checksum.*recompute the unit"):
        store.per_unit(fp)
    assert not store.has(fp) and store.damaged([fp])  # damaged = not stored: the planner recomputes it
    with pytest.raises(KeyError):
        store.per_unit(fp_of(2))


_WRITER = textwrap.dedent("""
    import sys, pandas as pd
    from cachescore.store import ResultsStore, fingerprint
    store = ResultsStore(sys.argv[1])
    worker, ids = sys.argv[2], [int(i) for i in sys.argv[3].split(",")]
    for i in ids:
        store.write_unit(fingerprint({"unit": i}), record={"encoder": f"enc{i}", "metric": "RI", "value": i / 10,
                         "run_id": worker}, per_unit=pd.DataFrame({"i": [i] * 3}))
""")


def test_concurrent_writers_two_processes(tmp_path):
    path = tmp_path / "s"
    ResultsStore(path)
    ids_a = list(range(0, 40))
    ids_b = list(range(30, 70))  # 30..39 written by both
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), name, ",".join(map(str, ids))], env=env,
                              stderr=subprocess.PIPE) for name, ids in (("a", ids_a), ("b", ids_b))]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
    store = ResultsStore(path)
    scores = store.scores()
    assert len(scores) == 70 and scores["fingerprint"].is_unique
    assert store.fingerprints() == {fp_of(i) for i in range(70)}
    for i in (0, 35, 69):
        assert store.per_unit(fp_of(i))["i"].tolist() == [i] * 3
    assert not list(path.rglob("*.partial"))


def test_provenance_and_run_dir(tmp_path):
    store = ResultsStore(tmp_path / "s")
    run = store.run_dir("2026-11-29T12:00:00Z-abc")
    assert run.is_dir() and run.parent.name == "runs"
    store.write_provenance("r1", {"versions": {"numpy": np.__version__}, "n": np.int64(3), "recall": np.float32(0.5)})
    store.write_provenance("r1", {"versions": {"numpy": np.__version__}, "n": 4, "finished": True})
    assert store.read_provenance("r1") == {"versions": {"numpy": np.__version__}, "n": 4, "finished": True}
    assert store.runs() == ["r1"]
    (run / "performance-report.html").write_text("<html/>")
    ResultsStore(tmp_path / "s")  # a store with runs and units reopens fine


def test_record_version_bump_recomputes_and_support_is_a_fraction(tmp_path):
    """Records of another envelope version (version 1 stored ``support`` as a count) are ignored,
    so their units are recomputed, never converted; the store folder itself stays usable. A
    record whose ``support`` is not a fraction in [0, 1] is refused before publishing."""
    from cachescore.store.schema import RECORD_VERSION

    assert RECORD_VERSION == 2
    store = ResultsStore(tmp_path / "s")
    fp = fp_of(7)
    store.write_unit(fp, record=RECORD)
    path = tmp_path / "s" / "units" / fp[:2] / f"{fp}.json"
    env = json.loads(path.read_text())
    path.write_text(json.dumps({**env, "version": 1, "record": {**env["record"], "support": 216}}))
    store = ResultsStore(tmp_path / "s")  # the store folder (layout version 1) is still accepted
    assert not store.has(fp) and store.scores().empty
    store.write_unit(fp, record=RECORD)
    assert store.has(fp) and store.scores()["support"].tolist() == [0.75]
    with pytest.raises(ValueError, match="support must be a fraction"):
        store.write_unit(fp_of(8), record={**RECORD, "support": 216})
    assert not store.has(fp_of(8))
