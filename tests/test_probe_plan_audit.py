"""Pins the plan-first protocol of cachescore.probe.evaluate (spec evaluation.md C.3-C.5).

- The split plan equals the rows the sweep itself uses, its sha256 is reproducible, encoder
  independent and changes with the seed.
- A failing plan audit or content audit raises LeakageError BEFORE any probe is fitted or any
  task submitted (spies on the fit and on the client); fail_on_leakage=False records instead.
- Content audit: byte-identical embedding rows under different tile ids in two roles are
  critical ``content``; the explicit ``"warning"`` setting lowers it and is recorded; digests are
  sha256 of the float64 little-endian row bytes (hashlib oracle).
- Metrics per (replicate, split, role) and per centre equal scikit-learn recomputed from the
  prediction table; raw probabilities equal LogisticRegression.predict_proba of a probe refitted
  at the selected C on the plan's training rows.
- Split reports: realised bias = scipy's Cramér's V of the realised train table; counts add up.
- Temperature scaling off by default; on: fitted on val, never moves the argmax.
"""

from __future__ import annotations

import hashlib
import warnings

import numpy as np
import pandas as pd
import pytest
from scipy.stats.contingency import association
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import accuracy_score, balanced_accuracy_score, f1_score, log_loss

import cachescore.probe.distributed as dist
from cachescore.probe import calibration as cal
from cachescore.probe.audit import LeakageError, audit_content
from cachescore.probe.evaluate import SCALAR_METRICS, SweepIdentities, SweepParams, evaluate_run, safe_class_columns
from cachescore.probe.plan import build_probe_plan
from cachescore.probe.sweep import sweep_outcomes
from test_probe_evaluate import RPS, SCHEDULE, leaky_arrangement, make_data, run_eval


@pytest.fixture(scope="module")
def data():
    return make_data()


@pytest.fixture(scope="module")
def evaluation(data):
    return run_eval(data, class_names=["tumour A", "tumour/B"])


class FitSpy:
    def __init__(self, monkeypatch):
        self.calls = 0
        real = dist.fit_probe

        def spy(*a, **k):
            self.calls += 1
            return real(*a, **k)

        monkeypatch.setattr(dist, "fit_probe", spy)


class RefusingClient:
    """A client stand-in that fails the test if anything is scattered or submitted."""

    def scatter(self, *a, **k):
        raise AssertionError("data scattered although the audit failed")

    def submit(self, *a, **k):
        raise AssertionError("task submitted although the audit failed")


# --------------------------------------------------------------------------- plan


def test_plan_equals_the_sweep_rows_and_hash_is_reproducible(data):
    kw = dict(schedule=SCHEDULE, rows_per_slide=RPS, iterations=2, test_sets={"ood": data["ood"]})
    plan = build_probe_plan(data["x"], data["conf"], data["lab"], **kw)
    run = sweep_outcomes(data["x"], data["conf"], data["lab"], **kw)
    assert len(plan.jobs) == len(run.outcomes) == 6
    for job, oc in zip(plan.jobs, run.outcomes):
        assert (job.replicate, job.split, job.seed) == (oc.replicate, oc.split, oc.seed)
        for role in ("train_rows", "val_rows", "test_rows"):
            np.testing.assert_array_equal(getattr(job, role), getattr(oc, role))
    assert list(plan.replicate_seeds) == run.replicate_seeds
    # encoder independent: other embedding values, same plan and hash
    other = build_probe_plan(np.random.default_rng(5).normal(size=data["x"].shape), data["conf"],
                             data["lab"], **kw)
    assert other.sha256 == plan.sha256 and len(plan.sha256) == 64
    assert build_probe_plan(data["x"], data["conf"], data["lab"], **{**kw, "seed": 7}).sha256 != plan.sha256


def test_evaluation_records_the_plan_hash(data, evaluation):
    plan = build_probe_plan(data["x"], data["conf"], data["lab"], schedule=SCHEDULE, rows_per_slide=RPS,
                            iterations=2, test_sets={"out_of_domain": data["ood"]})
    assert evaluation.plan_sha256 == plan.sha256
    assert evaluation.leakage["passed"] is True and evaluation.content_audit["passed"] is True


# --------------------------------------------------------------------------- audit before fit


def test_failing_plan_audit_fits_nothing_and_submits_nothing(data, monkeypatch):
    spy = FitSpy(monkeypatch)
    kw = dict(groups={"slide": data["slide"], "patient": data["patient"]},
              test_set_groups={"out_of_domain": {"slide": data["ood_slide"], "patient": data["ood_patient"]}},
              arrange_slides=leaky_arrangement(data["patient"]))
    with pytest.raises(LeakageError, match="patient leaks across train / in_domain"):
        run_eval(data, **kw)
    with pytest.raises(LeakageError, match="patient"):
        run_eval(data, client=RefusingClient(), **kw)
    assert spy.calls == 0
    # explicitly not failing: the sweep runs and the failure is recorded, never hidden
    ev = run_eval(data, fail_on_leakage=False, **kw)
    assert spy.calls > 0
    assert ev.audit["passed"] is False and "patient" in ev.audit["critical"]
    assert ev.leakage["passed"] is False and ev.parameters["fail_on_leakage"] is False


def test_duplicate_content_across_roles_is_critical_before_any_fit(data, monkeypatch):
    plan = build_probe_plan(data["x"], data["conf"], data["lab"], schedule=SCHEDULE, rows_per_slide=RPS,
                            iterations=2)
    job = plan.jobs[0]
    a, b = int(job.train_rows[0]), int(job.test_rows[-1])
    x = data["x"].copy()
    x[b] = x[a]  # same embedding bytes, different tile ids and slides
    spy = FitSpy(monkeypatch)
    with pytest.raises(LeakageError, match="content leaks across train / test_id") as ei:
        run_eval({**data, "x": x}, client=RefusingClient())
    assert spy.calls == 0
    br = [br for br in ei.value.breaches if br["level"] == "content"]
    digest = hashlib.sha256(np.ascontiguousarray(x[a], dtype="<f8").tobytes()).hexdigest()
    assert br and all(digest in b_["ids"] for b_ in br) and a in br[0]["rows"] and b in br[0]["rows"]
    # the explicit relaxation is a recorded warning, and the sweep runs
    ev = run_eval({**data, "x": x}, content_audit="warning")
    assert spy.calls > 0
    assert ev.content_audit["severity"] == "warning" and ev.content_audit["passed"] is True
    assert ev.content_audit["lowered_breaches"] and ev.leakage["passed"] is True
    assert any("lowered to a warning" in w for w in ev.warnings)
    assert ev.parameters["content_audit"] == "warning"


def test_content_audit_float32_duplicates_inside_a_role_and_test_sets():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(10, 4)).astype(np.float32)
    x[1] = x[0]  # duplicate inside train: counted, not critical
    x[7] = x[2]  # train vs test_id: critical
    ood = rng.normal(size=(3, 4))
    ood[2] = x[8].astype(np.float64)  # val row's exact float32 value in the OOD set
    job = type("J", (), dict(replicate=0, split=0, train_rows=np.array([0, 1, 2, 3]),
                             val_rows=np.array([8, 9]), test_rows=np.array([4, 5, 6, 7])))
    rep = audit_content(x, [job], test_sets={"ood": ood})
    assert rep["passed"] is False and rep["critical"] == ["content"]
    pairs = {tuple(b["roles"]): b for b in rep["breaches"]}
    assert set(pairs) == {("train", "test_id"), ("val", "ood")}
    assert pairs[("val", "ood")]["test_set_rows"] == [2] and pairs[("val", "ood")]["rows"] == [8]
    assert pairs[("train", "test_id")]["rows"] == [2, 7]
    assert rep["per_outcome"][0]["duplicate_rows_within_role"]["train"] == 1
    with pytest.raises(ValueError, match="severity"):
        audit_content(x, [job], severity="off")
    with pytest.raises(ValueError, match="never passes"):
        audit_content(x, [])


# --------------------------------------------------------------------------- metrics


def test_metrics_equal_sklearn_from_the_prediction_table(evaluation):
    p = evaluation.predictions
    raw_cols = [c for c in p.columns if c.startswith("raw_prob_")]
    assert raw_cols == ["raw_prob_tumour_A", "raw_prob_tumour_B"]
    m = evaluation.metrics.set_index(["replicate", "split", "role"])
    for (r, s, role), g in p.groupby(["replicate", "split", "role"]):
        row = m.loc[(r, s, role)]
        y, yhat = g["true"].to_numpy(), g["predicted"].to_numpy()
        probs = g[raw_cols].to_numpy()
        assert row["n"] == len(g)
        assert row["balanced_accuracy"] == balanced_accuracy_score(y, yhat)
        assert row["accuracy"] == pytest.approx(accuracy_score(y, yhat), rel=1e-15)
        assert row["f1_macro"] == pytest.approx(
            f1_score(y, yhat, labels=np.union1d(y, yhat), average="macro", zero_division=0), rel=1e-12)
        assert row["nll_raw"] == pytest.approx(log_loss(y, probs, labels=[0, 1]), rel=1e-12)
        onehot = np.eye(2)[y]
        assert row["brier_raw"] == pytest.approx(np.mean(((probs - onehot) ** 2).sum(1)), rel=1e-12)
        assert row["mean_confidence_raw"] == pytest.approx(probs.max(1).mean(), rel=1e-12)
        assert (g["correct"] == (y == yhat)).all()
    # balanced accuracy of every held-out role is the matrix entry (APD recomputable from the bundle)
    held = evaluation.metrics[evaluation.metrics.role != "val"]
    for row in held.itertuples():
        assert row.balanced_accuracy == evaluation.matrices[row.role][row.split, row.replicate]
    assert set(evaluation.metrics.role_kind) == {"val", "test_id", "test_ood"}
    # confusion: counts add to n, fractions are row-normalised
    conf = evaluation.confusion
    tot = conf.groupby(["replicate", "split", "role"])["count"].sum()
    for key, n in m["n"].items():
        assert tot[key] == n
    assert np.allclose(conf.groupby(["replicate", "split", "role", "true"])["fraction"].sum(), 1.0)


def test_per_centre_metrics_cover_every_centre(evaluation, data):
    pc = evaluation.per_centre
    assert pc.columns[0] == "centre"
    n_by = pc.groupby(["replicate", "split", "role"])["n"].sum()
    m = evaluation.metrics.set_index(["replicate", "split", "role"])["n"]
    assert (n_by.sort_index() == m.sort_index()).all()
    assert set(pc[pc.role == "in_domain"].centre) == {"0", "1"}
    assert set(pc[pc.role == "out_of_domain"].centre) == {"2", "3"}
    p = evaluation.predictions
    for (r, s, role, c), g in p.groupby(["replicate", "split", "role", "centre"]):
        row = pc[(pc.replicate == r) & (pc.split == s) & (pc.role == role) & (pc.centre == c)].iloc[0]
        assert row["n"] == len(g)
        with warnings.catch_warnings():  # a centre may see predictions of a class it lacks
            warnings.filterwarnings("ignore", message="y_pred contains classes not in y_true")
            warnings.filterwarnings("ignore", message="A single label was found")
            assert row["balanced_accuracy"] == balanced_accuracy_score(g["true"], g["predicted"])
    assert set(SCALAR_METRICS) <= set(pc.columns)


def test_raw_probabilities_are_predict_proba_of_the_selected_probe(evaluation, data):
    plan = build_probe_plan(data["x"], data["conf"], data["lab"], schedule=SCHEDULE, rows_per_slide=RPS,
                            iterations=2)
    job = plan.jobs[3]
    c = evaluation.metrics.query("replicate == @job.replicate and split == @job.split").best_C.iloc[0]
    model = LogisticRegression(C=c, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.fit(data["x"][job.train_rows], data["lab"][job.train_rows])
    g = evaluation.predictions.query("replicate == @job.replicate and split == @job.split and role == 'in_domain'")
    np.testing.assert_array_equal(g["row"].to_numpy(), job.test_rows)
    np.testing.assert_allclose(g[["raw_prob_tumour_A", "raw_prob_tumour_B"]].to_numpy(),
                               model.predict_proba(data["x"][job.test_rows]), rtol=1e-10, atol=1e-12)
    # identities come from the inputs, by row
    np.testing.assert_array_equal(g["slide_id"].to_numpy(dtype=object), data["slide"][job.test_rows])
    np.testing.assert_array_equal(g["tile_key_1"].to_numpy(dtype=object), data["tile"][job.test_rows])
    np.testing.assert_array_equal(g["centre"].to_numpy(dtype=object), data["conf"][job.test_rows].astype(str))


def test_temperature_off_by_default_and_on_side_by_side(data, evaluation):
    m = evaluation.metrics
    assert (m.calibration_method == "none").all() and (m.temperature == 1.0).all()
    assert not m.temperature_fitted.any()
    ev = run_eval(data, temperature_scaling=True)
    mt = ev.metrics
    assert (mt.calibration_method == "temperature").all() and mt.temperature_fitted.any()
    for col in ("balanced_accuracy", "accuracy", "f1_macro", "nll_raw", "brier_raw", "ece_raw"):
        np.testing.assert_array_equal(mt[col].to_numpy(), m[col].to_numpy())
    assert set(ev.calibration.stage) == {"raw", "temperature"}
    assert (ev.predictions.filter(like="prob_tumour").shape[1] == 0)
    p = ev.predictions
    raw = p[["raw_prob_0", "raw_prob_1"]].to_numpy()
    calp = p[["prob_0", "prob_1"]].to_numpy()
    np.testing.assert_array_equal(raw.argmax(1), calp.argmax(1))
    fitted = mt[mt.temperature_fitted]
    assert ((fitted.temperature >= 0.05) & (fitted.temperature <= 20)).all()
    assert not np.allclose(raw, calp)


def test_class_names_are_sanitised_and_unique():
    assert safe_class_columns(["A B", "A/B", ""]) == ["A_B", "A_B_2", "class_2"]
    with pytest.raises(ValueError, match="unique"):
        safe_class_columns(["x", "y", "x"])


# --------------------------------------------------------------------------- split reports


def test_split_reports_match_an_independent_recount(evaluation, data):
    plan = build_probe_plan(data["x"], data["conf"], data["lab"], schedule=SCHEDULE, rows_per_slide=RPS,
                            iterations=2)
    reports = evaluation.split_reports
    assert len(reports) == 6
    for rep, job in zip(reports, plan.jobs):
        assert (rep["replicate"], rep["split"], rep["seed"]) == (job.replicate, job.split, job.seed)
        table = pd.crosstab(data["conf"][job.train_rows], data["lab"][job.train_rows]).to_numpy()
        assert rep["train_contingency"]["tiles"] == table.tolist()
        expected_v = association(table, method="cramer")
        assert rep["realised_bias"] == pytest.approx(expected_v, abs=1e-12)
        assert rep["requested_bias"] == pytest.approx([0.0, 0.5, 1.0][job.split], abs=1e-12)
        assert rep["rows"]["train"] == job.train_rows.size and rep["rows"]["test_id"] == job.test_rows.size
        assert rep["rows"]["val"] == job.val_rows.size and rep["rows"]["out_of_domain"] == 16
        assert rep["groups"]["train"]["slide"] == np.unique(data["slide"][job.train_rows]).size
        slides = pd.crosstab(data["conf"][job.train_rows], data["lab"][job.train_rows],
                             values=data["slide"][job.train_rows], aggfunc="nunique").fillna(0)
        assert rep["train_contingency"]["groups"]["slide"] == slides.astype(int).to_numpy().tolist()
        assert "whole slides" in rep["rule"]


def test_post_hoc_evaluation_without_content_audit_is_not_passed(data):
    run = sweep_outcomes(data["x"], data["conf"], data["lab"], schedule=SCHEDULE, rows_per_slide=RPS,
                         iterations=1, keep_predictions=True)
    kw = dict(n_rows=len(data["lab"]), confounders=data["conf"], labels=data["lab"],
              identities=SweepIdentities(groups={"slide": data["slide"]}, tile_ids=(data["slide"], data["tile"])),
              params=SweepParams(schedule=SCHEDULE, rows_per_slide=RPS))
    ev = evaluate_run(run, **kw)
    assert ev.plan_sha256 is None and ev.content_audit is None
    assert ev.leakage["passed"] is None and "not_audited" in ev.leakage["critical"]
    assert ev.leakage["not_audited"] == ["content"]
    ev2 = evaluate_run(run, embeddings=data["x"], **kw)
    assert ev2.leakage["passed"] is True
    np.testing.assert_array_equal(cal.confusion_counts([0, 1], [0, 0], 2), [[1, 0], [1, 0]])


def test_content_codes_equal_a_hashlib_grouping_across_blocks(monkeypatch):
    import cachescore.probe.audit as audit_mod

    monkeypatch.setattr(audit_mod, "_CONTENT_BLOCK_ROWS", 7)  # many block edges
    rng = np.random.default_rng(11)
    a = rng.normal(size=(60, 5)).astype(np.float32)
    a[rng.integers(0, 60, 20)] = a[rng.integers(0, 60, 20)]  # planted duplicates
    a[3] = 0.0
    a[4] = 0.0
    a[4, 2] = -0.0  # different bytes, equal values: a different content
    b = rng.normal(size=(9, 5))
    b[0] = a[10].astype(np.float64)
    codes, row = audit_mod._row_content_codes([a, b])
    digests = [hashlib.sha256(np.ascontiguousarray(r, dtype="<f8").tobytes()).hexdigest()
               for r in np.concatenate([a.astype(np.float64), b])]
    _, oracle = np.unique(np.array(digests), return_inverse=True)
    # same partition of the rows
    pairs = set(zip(codes.tolist(), oracle.tolist()))
    assert len(pairs) == len(set(codes.tolist())) == len(set(oracle.tolist()))
    assert codes[3] != codes[4] and codes[60] == codes[10]
    assert hashlib.sha256(row(60).tobytes()).hexdigest() == digests[60]
