"""Pins cachescore.probe.evaluate end to end on a small synthetic sweep.

2 confounders x 2 classes, 10 slides x 3 rows per cell, D = 8, 2 iterations, a 3-split camelyon-
pattern schedule (V = 0, 0.5, 1). Oracles: croma 1.0.1 (the matrices, APD, nIPD), scikit-learn
(balanced accuracy), and the sweep's own matrix entries (balanced accuracy recomputed from the
kept decision scores must equal them bit for bit). Leakage: a custom ``arrange_slides`` that
splits a patient's slides across roles, and outcomes tampered with by hand, must be refused.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from croma.downstream import apd as croma_apd
from croma.downstream import nipd as croma_nipd
from croma.downstream import probe_sweep_over_test_sets

from cachescore.probe import calibration as cal
from cachescore.probe.audit import LeakageError
from cachescore.probe.evaluate import (
    METRIC_COLUMNS,
    SweepIdentities,
    SweepParams,
    evaluate_outcome,
    evaluate_run,
    evaluate_sweep,
    sweep_arguments,
)
from cachescore.probe.sweep import sweep_outcomes

RPS = 3
N_SLIDES = 10
D = 8
SCHEDULE = [
    ([(0, 0, 2 * RPS), (0, 1, 2 * RPS), (1, 0, 2 * RPS), (1, 1, 2 * RPS)], 4),
    ([(0, 0, 1 * RPS), (0, 1, 3 * RPS), (1, 0, 3 * RPS), (1, 1, 1 * RPS)], 4),
    ([(0, 0, 0), (0, 1, 4 * RPS), (1, 0, 4 * RPS), (1, 1, 0)], 4),
]


def make_data(seed=0):
    rng = np.random.default_rng(seed)
    x, conf, lab, slide, tile, patient = [], [], [], [], [], []
    sid = 0
    for i in range(2):
        for j in range(2):
            for k in range(N_SLIDES):
                centre = rng.normal(size=D) * 0.7 + 1.2 * np.eye(D)[j] + 1.2 * np.eye(D)[2 + i]
                for t in range(RPS):
                    x.append(centre + rng.normal(size=D) * 0.8)
                    conf.append(i)
                    lab.append(j)
                    slide.append(f"S{sid}")
                    patient.append(f"P{sid // 2}")  # two consecutive slides of a cell per patient
                    tile.append(f"{t}_0")  # tile ids repeat across slides
                sid += 1
    n_ood = 16
    ood_x = rng.normal(size=(n_ood, D)) + 1.2 * np.eye(D)[np.arange(n_ood) % 2]
    return dict(
        x=np.asarray(x), conf=np.asarray(conf), lab=np.asarray(lab), slide=np.asarray(slide),
        patient=np.asarray(patient), tile=np.asarray(tile),
        ood=(ood_x, np.arange(n_ood) % 2),
        ood_slide=np.array([f"O{k // 4}" for k in range(n_ood)]),
        ood_patient=np.array([f"OP{k // 8}" for k in range(n_ood)]),
        ood_conf=np.array([2, 3] * (n_ood // 2)),
    )


def run_eval(data, **kw):
    args = dict(
        groups={"slide": data["slide"]}, tile_ids=(data["slide"], data["tile"]), schedule=SCHEDULE,
        test_sets={"out_of_domain": data["ood"]},
        test_set_groups={"out_of_domain": {"slide": data["ood_slide"]}},
        test_set_confounders={"out_of_domain": data["ood_conf"]},
        rows_per_slide=RPS, iterations=2, seed=1000,
    )
    args.update(kw)
    client = args.pop("client", None)
    return evaluate_sweep(data["x"], data["conf"], data["lab"], client=client, **sweep_arguments(**args))


@pytest.fixture(scope="module")
def data():
    return make_data()


@pytest.fixture(scope="module")
def evaluation(data):
    return run_eval(data)


def test_matrices_equal_croma(data, evaluation):
    ref = probe_sweep_over_test_sets(
        data["x"], data["conf"], data["lab"], schedule=SCHEDULE, test_sets={"out_of_domain": data["ood"]},
        rows_per_slide=RPS, iterations=2, seed=1000,
    )
    assert list(evaluation.matrices) == list(ref) == ["in_domain", "out_of_domain"]
    for k in ref:
        np.testing.assert_array_equal(evaluation.matrices[k], ref[k])
        assert evaluation.apd[k] == croma_apd(ref[k])
    np.testing.assert_array_equal(evaluation.cramers_v, [0.0, 0.5, 1.0])
    assert evaluation.chance == 0.5 and evaluation.n_classes == 2
    for k in ref:
        try:
            expected = croma_nipd(ref[k], evaluation.cramers_v, 0.5)
        except ValueError:
            assert evaluation.nipd[k] is None and any(f"nIPD of '{k}'" in w for w in evaluation.warnings)
        else:
            assert evaluation.nipd[k] == expected


def test_balanced_accuracy_equals_matrix_entries_exactly(evaluation):
    m = evaluation.metrics
    assert list(m.columns) == list(METRIC_COLUMNS)
    held = m[m.role != "val"]
    assert len(held) == 3 * 2 * 2
    for row in held.itertuples():
        assert row.balanced_accuracy == evaluation.matrices[row.role][row.split, row.replicate]
    assert set(m.role) == {"val", "in_domain", "out_of_domain"}
    assert (m.groupby(["replicate", "split"]).size() == 3).all()


def test_audit_passed_and_recorded(evaluation):
    a = evaluation.audit
    assert a["passed"] is True and a["n_outcomes"] == 6
    assert a["test_sets"]["out_of_domain"] == {"n_rows": 16, "levels_checked": ["slide"],
                                               "confounders_checked": True}
    assert "ood_centre" in a["checks"] and "test_set_drift" in a["checks"]


def test_confusion_and_calibration_tables_are_consistent(evaluation):
    m = evaluation.metrics.set_index(["replicate", "split", "role"])
    conf = evaluation.confusion.groupby(["replicate", "split", "role"])["count"].sum()
    for key, n in m["n"].items():
        assert conf[key] == n
    cal_t = evaluation.calibration
    sums = cal_t.groupby(["replicate", "split", "role", "stage", "class_index"])["n"].sum()
    for (r, s, role, stage, k), n in sums.items():
        assert n == m.loc[(r, s, role), "n"]
    assert set(cal_t.stage) == {"raw"}  # temperature scaling is off by default (spec C.5)
    sel = evaluation.probe_selection
    assert len(sel) == 6 * 15 and sel.groupby(["replicate", "split"])["selected"].sum().eq(1).all()


def test_temperature_fitted_on_validation_only_and_never_changes_accuracy(data, monkeypatch):
    run = sweep_outcomes(data["x"], data["conf"], data["lab"], schedule=SCHEDULE,
                         test_sets={"out_of_domain": data["ood"]}, rows_per_slide=RPS, iterations=2,
                         keep_predictions=True)
    seen = []
    real = cal.fit_temperature

    def spy(y, decision):
        seen.append((np.asarray(y).copy(), np.asarray(decision).copy()))
        return real(y, decision)

    monkeypatch.setattr(cal, "fit_temperature", spy)
    for oc in run.outcomes:
        seen.clear()
        rows = evaluate_outcome(oc, n_classes=2, temperature_scaling=True).metrics
        assert len(seen) == 1
        np.testing.assert_array_equal(seen[0][1], oc.val_decision)
        np.testing.assert_array_equal(oc.classes[seen[0][0]], oc.val_labels)
        # perturbing every test row changes nothing about the fitted temperature
        rng = np.random.default_rng(oc.split)
        wild = {k: v * rng.uniform(-50, 50, size=v.shape) for k, v in oc.test_decision.items()}
        wild_scores = {k: float(np.nan) for k in oc.scores}
        tampered = dataclasses.replace(oc, test_decision=wild, scores=wild_scores)
        with pytest.raises(RuntimeError, match="differs from the sweep"):
            evaluate_outcome(tampered, n_classes=2, temperature_scaling=True)  # scores no longer match: internal check
        val_only = dataclasses.replace(oc, test_decision={}, test_labels={})
        rows_v = evaluate_outcome(val_only, n_classes=2, temperature_scaling=True).metrics
        assert all(r["temperature"] == rows_v[0]["temperature"] for r in rows)
        assert rows_v[0] == rows[0]  # the val row is identical with or without any test rows
        # temperature never changes the argmax, so accuracies cannot move
        for name, dec in oc.test_decision.items():
            raw = cal.decision_to_probabilities(dec)
            scaled = cal.apply_temperature(dec, rows[0]["temperature"])
            np.testing.assert_array_equal(raw.argmax(axis=1), scaled.argmax(axis=1))


def test_temperature_fit_failure_keeps_raw_with_a_warning(data):
    run = sweep_outcomes(data["x"], data["conf"], data["lab"], schedule=SCHEDULE, rows_per_slide=RPS,
                         iterations=1, keep_predictions=True)
    oc = run.outcomes[0]
    one_class = np.flatnonzero(oc.val_labels == oc.val_labels[0])
    oc1 = dataclasses.replace(oc, val_decision=oc.val_decision[one_class], val_labels=oc.val_labels[one_class],
                              val_rows=oc.val_rows[one_class])
    ev = evaluate_outcome(oc1, n_classes=2, temperature_scaling=True)
    rows, notes = ev.metrics, ev.warnings
    assert all(r["temperature"] == 1.0 and r["temperature_fitted"] is False for r in rows)
    assert "temperature not fitted" in notes[0]
    assert all(r["ece_raw"] == r["ece_calibrated"] for r in rows)


def leaky_arrangement(patient_of_row):
    """A slide arrangement that splits patients: shuffle, then send the partner slide of each
    cell's first slide to the end (the test tail)."""
    def leaky(cells, rng):
        for per_conf in cells:
            for slides in per_conf:
                rng.shuffle(slides)
                first = patient_of_row[slides[0][0]]
                k = next(i for i in range(1, len(slides)) if patient_of_row[slides[i][0]] == first)
                slides.append(slides.pop(k))
        return cells
    return leaky


def test_leaky_arrangement_is_caught(data):
    leaky = leaky_arrangement(data["patient"])
    with pytest.raises(LeakageError, match="patient leaks across train / in_domain") as ei:
        run_eval(data, groups={"slide": data["slide"], "patient": data["patient"]}, arrange_slides=leaky,
                 test_set_groups={"out_of_domain": {"slide": data["ood_slide"], "patient": data["ood_patient"]}})
    b = [b for b in ei.value.breaches if b["level"] == "patient"][0]
    assert b["ids"] and all(str(i).startswith("P") for i in b["ids"])
    assert b["rows"]


def test_patient_leak_under_slide_protection_is_a_recorded_warning(data):
    """Spec C.3 rule 5: the same leaky arrangement with ``protected_level="slide"`` runs; the
    patient overlaps are counted and shown in the audit (never hidden), and the evaluation records
    the protected level."""
    ev = run_eval(data, groups={"slide": data["slide"], "patient": data["patient"]},
                  arrange_slides=leaky_arrangement(data["patient"]),
                  test_set_groups={"out_of_domain": {"slide": data["ood_slide"], "patient": data["ood_patient"]}},
                  protected_level="slide")
    assert ev.audit["passed"] is True and ev.audit["protected_level"] == "slide"
    coarse = ev.audit["coarser_overlaps"]
    assert coarse and {b["level"] for b in coarse} == {"patient"} and all(b["ids"] and b["rows"] for b in coarse)
    assert any(w.startswith("patient overlaps across roles") for w in ev.audit["warnings"])
    assert ev.parameters["protected_level"] == "slide"


def test_tampered_outcomes_are_caught(data):
    run = sweep_outcomes(data["x"], data["conf"], data["lab"], schedule=SCHEDULE, rows_per_slide=RPS,
                         iterations=2, keep_predictions=True)
    kw = dict(n_rows=len(data["lab"]), confounders=data["conf"], labels=data["lab"],
              identities=SweepIdentities(groups={"slide": data["slide"]}, tile_ids=(data["slide"], data["tile"])),
              params=SweepParams(schedule=SCHEDULE, rows_per_slide=RPS))
    assert evaluate_run(run, **kw).audit["passed"]
    oc = run.outcomes[1]
    # move one training row's slide-mate into the test set of the same split
    train_row = int(oc.train_rows[0])
    mate = int(np.flatnonzero(data["slide"] == data["slide"][train_row])[1])
    new_train = oc.train_rows[oc.train_rows != mate]
    new_test = np.union1d(oc.test_rows, [mate])
    leaked = dataclasses.replace(oc, train_rows=new_train, test_rows=new_test)
    bad = dataclasses.replace(run, outcomes=[leaked if o is oc else o for o in run.outcomes])
    with pytest.raises(LeakageError) as ei:
        evaluate_run(bad, **kw)
    levels = {b["level"] for b in ei.value.breaches}
    assert "slide" in levels and "test_set_drift" in levels
    slide_b = [b for b in ei.value.breaches if b["level"] == "slide"][0]
    assert slide_b["ids"] == [str(data["slide"][train_row])] and mate in slide_b["rows"]


def test_outcomes_without_predictions_and_bad_n_bins_are_refused(data):
    run = sweep_outcomes(data["x"], data["conf"], data["lab"], schedule=SCHEDULE, rows_per_slide=RPS,
                         iterations=1)
    with pytest.raises(ValueError, match="keep_predictions=True"):
        evaluate_outcome(run.outcomes[0], n_classes=2)
    with pytest.raises(ValueError, match="n_bins must be at least 2"):
        run_eval(data, n_bins=1)
