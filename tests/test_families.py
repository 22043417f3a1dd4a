"""The metric-family table (issue 23): a family is data, and a new one runs end to end.

A toy neighbour family ("nn1": the share of units whose nearest cross-group neighbour has their
label) is registered with one :class:`Family` and no other change, then runs through plan -> run
(in-process cluster) -> store -> scores.parquet -> report. Its value is checked against a brute
force computed here from the view and the embeddings (not from our output).
"""

from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pytest

from cachescore._keys import Key, positive_int
from cachescore.cache import Cache, make_demo_cache
from cachescore.jobs.schema import JobError, describe_schema, parse_job
from cachescore.manifest import prepare
from cachescore.metrics import families
from cachescore.neighbors.normalize import normalize_rows
from cachescore.pipeline import plan_job, run_job
from cachescore.report import build_report


@dataclass(frozen=True)
class ToyResult:
    value: float
    sample_values_aligned: np.ndarray
    occurrence_source_indices: np.ndarray


def _toy_compute(params, features, manifest, *, confounder_column, design, searcher):
    prepared = prepare(manifest, confounder_column=confounder_column, evaluation_design=design)
    values, rows = [], []
    for scope in prepared.scopes:
        u = normalize_rows(np.asarray(features)[scope.rows])
        idx, _ = searcher.cross(u, scope.groups, int(params["k"]))
        values.append((scope.labels[idx[:, 0]] == scope.labels).astype(float))
        rows.append(scope.rows)
    v = np.concatenate(values)
    return ToyResult(value=float(v.mean()), sample_values_aligned=v, occurrence_source_indices=np.concatenate(rows))


TOY = families.Family(
    name="nn1", label="NN-1", kind=families.NEIGHBOUR, value_range=(0.0, 1.0), neutral=0.5,
    doc="Share of units whose nearest cross-group neighbour has their label (a test family).",
    keys={"k": Key((int,), 1, "Neighbours searched (the nearest one is used).", positive_int)},
    units=lambda section: [{"k": int(section["k"])}], compute=_toy_compute,
    record=lambda result: ({"k": 1, "toy_field": "yes"}, {}),
    replicates=lambda per_unit, member, counts, subsets: (None, "toy: no interval rule"),
)


@pytest.fixture
def toy_family():
    families.register(TOY)
    try:
        yield TOY
    finally:
        families.unregister(TOY.name)


def _job(tmp_path, cache, fams):
    doc = {"schema_version": 1, "job": {"cache": str(cache), "store": str(tmp_path / "store"), "views": ["centre_all"]},
           "metrics": {"families": fams},
           "execution": {"n_workers": 1, "retries": 0, "dashboard": False, "performance_report": False}}
    return parse_job(doc, path=tmp_path / "job.toml")


def _brute_nn1(cache_root, encoder: str) -> float:
    cache = Cache(cache_root)
    view = cache.read_view("centre_all")
    x = cache.load_rows(encoder, cache.view_spec("centre_all").tileset, view["row"].to_numpy())
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    d = 1.0 - x @ x.T
    g = view["group_id"].astype(str).to_numpy()
    d[g[:, None] == g[None, :]] = np.inf
    nearest = np.lexsort((np.arange(len(view))[None, :].repeat(len(view), 0), d), axis=1)[:, 0]
    labels = view["label"].astype(str).to_numpy()
    return float((labels[nearest] == labels).mean())


def test_a_registered_family_runs_plan_run_store_scores_report(tmp_path, toy_family):
    cache = tmp_path / "cache"
    make_demo_cache(cache, n_slides_per_cell=2, tiles_per_slide=5, dim=8, encoders=2, seed=3)
    job = _job(tmp_path, cache, ["ri", "nn1"])
    assert job.metrics.family("nn1") == {"k": 1}
    plan = plan_job(job)
    labels = sorted(u.label for u in plan.pending)
    assert any(lab.endswith("/nn1") for lab in labels) and len(plan.pending) == 4
    summary = run_job(job, processes=False, out=io.StringIO())
    assert summary.ok, summary
    scores = pd.read_parquet(job.store / "scores.parquet")
    toy = scores[scores["metric"] == "nn1"].set_index("encoder")
    assert len(toy) == 2 and (toy["ci_method"] == "toy: no interval rule").all()
    for enc, row in toy.iterrows():
        assert row["value"] == pytest.approx(_brute_nn1(cache, enc), abs=0)
        assert row["defined"] and row["k"] == 1
    assert set(toy["rank"]) == {1, 2} or toy["value"].nunique() == 1
    page = build_report(job.store, tmp_path / "report.html", cache=job.cache).read_text()
    assert "NN-1" in page
    # the second run has nothing new: every unit (the toy ones too) is found in the store
    assert not plan_job(job).pending


def test_a_registered_family_brings_its_job_keys(tmp_path, toy_family):
    cache = tmp_path / "cache"
    make_demo_cache(cache, n_slides_per_cell=2, tiles_per_slide=3, dim=4, encoders=2, seed=0)
    assert "[metrics.nn1]" in describe_schema()
    doc = {"schema_version": 1, "job": {"cache": str(cache), "store": str(tmp_path / "s")},
           "metrics": {"families": ["nn1"], "nn1": {"k": 0}}}
    with pytest.raises(JobError, match=r"key 'metrics.nn1.k' must be a positive integer, got 0"):
        parse_job(doc, path=tmp_path / "job.toml")


def test_unknown_family_is_named_with_the_known_ones(tmp_path):
    doc = {"schema_version": 1, "job": {"cache": str(tmp_path / "c"), "store": str(tmp_path / "s")},
           "metrics": {"families": ["ri", "nope"]}}
    with pytest.raises(JobError, match=r"drawn from ri, mari, croma \(got nope\)"):
        parse_job(doc, path=tmp_path / "job.toml")
    with pytest.raises(ValueError, match=r"unknown metric family 'nope' \(known: ri, mari, croma, apd, nipd\)"):
        families.get("nope")


def test_the_table_states_what_every_family_needs():
    """Every built-in family has a label, a direction and an interval rule; neighbour families
    expand units, compute and record; probe families name their evaluation field."""
    assert families.names() == ("ri", "mari", "croma", "apd", "nipd")
    for name in families.names():
        f = families.get(name)
        assert f.label and f.direction == families.HIGHER and f.replicates is not None
        if f.kind == families.NEIGHBOUR:
            assert f.units and f.compute and f.record and f.keys
        else:
            assert f.evaluation_field in ("apd", "nipd")
    assert families.display("croma", 5) == "CRoMa (m=5)" and families.display("ri", 5) == "RI"
    assert families.display("apd", None, "centre_C") == "APD [centre_C]" and families.display(None) == "?"
    assert families.get("croma").tag({"m": 5}) == "croma[m=5]"
    with pytest.raises(ValueError, match="already registered"):
        families.register(families.get("ri"))
    with pytest.raises(ValueError, match="cannot be unregistered"):
        families.unregister("ri")


def test_the_reading_guide_comes_from_the_table_and_covers_every_family():
    """Issue 24: direction and range are stated once, in the table; the report, the run table's
    header and a registered family all read them from there."""
    guide = families.reading_guide()
    assert guide.startswith("Higher is more robust, for every metric: ")
    for fam in families.FAMILIES.values():
        assert f"{fam.label} is {fam.reading}" in guide
    assert families.direction_header(["ri", "apd"]) == "value (higher = more robust)"
    assert families.direction_header(["ri", "not-a-family"]) == "value"
    toy = dataclasses.replace(TOY, name="nn1guide", reading="the share of 1-NN with the same label, 0–1")
    families.register(toy)
    try:
        assert "NN-1 is the share of 1-NN with the same label, 0–1" in families.reading_guide()
    finally:
        families.unregister(toy.name)
