"""Pins cachescore.probe.splits: grouped and centre holdouts (spec evaluation.md C.4, Part D).

Oracles: the invariants themselves (no group on both sides, every class on both sides, counts and
ratios), hand-built confounded designs (4 class-confounded slides at 25% -> 2 slides), and
scikit-learn's LeaveOneGroupOut for the enumeration of centres.
"""

from __future__ import annotations

import numpy as np
import pytest

from cachescore.probe.splits import centre_holdout, grouped_split


def design(n_slides=12, rows=5, n_cls=3, seed=0):
    rng = np.random.default_rng(seed)
    slide = np.repeat([f"s{i}" for i in range(n_slides)], rows)
    lab = np.repeat(rng.permutation(np.arange(n_slides) % n_cls), rows)
    return slide, lab


@pytest.mark.parametrize("level", ["Slide", "none", "well", "", None, 0])
def test_unknown_level_is_refused_with_the_valid_names(level):
    slide, lab = design()
    with pytest.raises(ValueError, match=r"valid levels are exactly \['tile', 'slide', 'case', 'patient'\]"):
        grouped_split(slide, lab, 0.25, group_level=level)


def test_blank_or_missing_ids_are_refused_naming_the_row():
    slide, lab = design()
    s = slide.astype(object)
    s[7] = "  "
    with pytest.raises(ValueError, match="column 'groups' is missing or blank at row 7"):
        grouped_split(s, lab, 0.25)
    s[7] = None
    with pytest.raises(ValueError, match="row 7"):
        grouped_split(s, lab, 0.25)


@pytest.mark.parametrize("bad", [0, 1, -0.2, 1.5, float("nan"), float("inf"), True])
def test_bad_holdout_fraction_is_refused(bad):
    slide, lab = design()
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        grouped_split(slide, lab, bad)


def test_length_mismatch_names_both_counts():
    slide, lab = design()
    with pytest.raises(ValueError, match="groups hold 59 values but labels hold 60"):
        grouped_split(slide[:-1], lab, 0.25)


def test_single_group_is_refused_with_the_memorisation_explanation():
    with pytest.raises(ValueError, match="only memorise this slide"):
        grouped_split(["a"] * 6, [0, 1] * 3, 0.5)


def test_never_a_group_on_both_sides_and_every_class_on_both_sides_across_seeds():
    slide, lab = design(n_slides=15, n_cls=3)
    for seed in range(25):
        tr, te, rep = grouped_split(slide, lab, 0.3, seed)
        assert not set(slide[tr]) & set(slide[te])
        assert set(lab[tr]) == set(lab[te]) == {0, 1, 2}
        assert np.array_equal(np.sort(np.concatenate([tr, te])), np.arange(slide.size))
        assert rep.train_rows + rep.test_rows == slide.size
        assert rep.train_groups + rep.test_groups == rep.total_groups == 15
        assert rep.row_fraction == te.size / slide.size
        assert rep.group_fraction == rep.test_groups / 15 == np.unique(slide[te]).size / 15
        assert "no group appears on both sides" in rep.rule and rep.grouped


def test_holdout_grows_to_keep_classes_and_reports_both_values():
    slide = np.repeat(["a", "b", "c", "d"], 3)
    lab = np.repeat([0, 0, 1, 1], 3)
    tr, te, rep = grouped_split(slide, lab, 0.25, seed=3)
    assert rep.test_groups == 2 and rep.group_fraction == 0.5 and rep.requested_fraction == 0.25
    assert rep.grew and any("grew" in w for w in rep.warnings)
    assert set(lab[te]) == {0, 1}


def test_impossible_class_coverage_is_refused_with_groups_per_class():
    slide = np.repeat(["a", "b", "c"], 2)
    lab = np.repeat([0, 0, 1], 2)  # class 1 lives in one slide only
    with pytest.raises(ValueError, match=r"independent slides per class: \{'0': 2, '1': 1\}"):
        grouped_split(slide, lab, 0.3)


def test_same_seed_same_split_and_tile_level_is_labelled_ungrouped():
    slide, lab = design()
    a = grouped_split(slide, lab, 0.25, 11)
    b = grouped_split(slide, lab, 0.25, 11)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]
    tiles = np.array([f"t{i}" for i in range(slide.size)])
    tr, te, rep = grouped_split(tiles, lab, 0.25, 0, group_level="tile")
    assert rep.grouped is False and "ungrouped" in rep.rule
    assert any("ungrouped" in w for w in rep.warnings)
    assert rep.to_dict()["grouped"] is False and "held out" in rep.summary()
    # repeated tile ids at tile level keep a tile's rows together
    tr, te, rep = grouped_split(slide, lab, 0.25, 0, group_level="tile")
    assert rep.grouped and not set(slide[tr]) & set(slide[te])


def centres_design():
    centre = np.repeat(["A", "B", "C"], 8)
    slide = np.array([f"{c}{i // 2}" for c, i in zip(centre, np.tile(np.arange(8), 3))])
    lab = np.tile([0, 0, 1, 1], 6)
    return centre, slide, lab


def test_centre_holdout_keeps_held_out_centres_out_and_enumerates_like_logo():
    from sklearn.model_selection import LeaveOneGroupOut

    centre, slide, lab = centres_design()
    splits = centre_holdout(centre, lab, slide)
    logo = list(LeaveOneGroupOut().split(np.zeros((24, 1)), groups=centre))
    assert len(splits) == 3
    for (kept, held, rep), (ltr, lte) in zip(splits, logo):
        np.testing.assert_array_equal(kept, ltr)
        np.testing.assert_array_equal(held, lte)
        assert not set(centre[kept]) & set(centre[held])
        assert rep.kept_rows + rep.held_out_rows == 24
    ((kept, held, rep),) = centre_holdout(centre, lab, slide, held_out=["B", "C"])
    assert set(centre[held]) == {"B", "C"} and set(centre[kept]) == {"A"}
    assert rep.to_dict()["held_out_centres"] == ["B", "C"]
    assert len(centre_holdout(centre, lab, slide, p=2)) == 3


def test_centre_holdout_refusals():
    centre, slide, lab = centres_design()
    lab2 = lab.copy()
    lab2[centre == "C"] = 0  # centre C lacks class 1
    with pytest.raises(ValueError, match=r"held-out centres lack class\(es\) \['1'\]"):
        centre_holdout(centre, lab2, slide, held_out=["C"])
    slide2 = slide.copy()
    slide2[0] = "B0"  # slide B0 now spans centres A and B
    with pytest.raises(ValueError, match=r"group\(s\) \['B0'\].*span held-out and kept centres"):
        centre_holdout(centre, lab, slide2, held_out=["B"])
    with pytest.raises(ValueError, match="not among the centres"):
        centre_holdout(centre, lab, slide, held_out=["Z"])
    with pytest.raises(ValueError, match="at least one centre must be kept"):
        centre_holdout(centre, lab, slide, held_out=["A", "B", "C"])


# --------------------------------------------------------------------------- nested folds + whole-CV audit


def test_nested_folds_cover_rows_once_stay_inside_outer_train_and_keep_groups_whole():
    from cachescore.probe.audit import audit_cv_folds
    from cachescore.probe.splits import nested_group_folds

    slide, lab = design(n_slides=24, rows=3, n_cls=2)
    folds = nested_group_folds(lab, outer_splits=4, inner_splits=3, groups=slide, seed=5)
    assert [f["outer_fold"] for f in folds] == [1, 2, 3, 4]
    val = np.concatenate([f["validation"] for f in folds])
    assert np.array_equal(np.sort(val), np.arange(slide.size))  # every row validated exactly once
    for f in folds:
        assert not set(slide[f["train"]]) & set(slide[f["validation"]])
        inner_val = np.concatenate([b for _, b in f["inner"]])
        assert np.array_equal(np.sort(inner_val), f["train"])  # inner folds partition outer train
        for a, b in f["inner"]:
            assert set(a) <= set(f["train"]) and not set(slide[a]) & set(slide[b])
    assert len({f["inner_seed"] for f in folds}) == 4
    layouts = {tuple(np.sort(slide[f["inner"][0][1]]).tolist()) for f in folds}
    assert len(layouts) == 4
    rep = audit_cv_folds([(f["train"], f["validation"]) for f in folds], n_rows=slide.size,
                         groups={"slide": slide}, tile_ids=np.arange(slide.size), labels=lab)
    assert rep["passed"] is True and rep["n_folds"] == 4
    with pytest.raises(ValueError, match="outer_splits must be at least 2"):
        nested_group_folds(lab, outer_splits=1.9, inner_splits=3)
    with pytest.raises(ValueError, match="inner_splits must be at least 2"):
        nested_group_folds(lab, outer_splits=2, inner_splits=0)
    with pytest.raises(ValueError, match="cannot build 30 folds from 24 groups"):
        nested_group_folds(lab, outer_splits=30, inner_splits=2, groups=slide)


def test_whole_cv_audit_membership_groups_examples_and_refusals():
    from cachescore.probe.audit import LeakageError, audit_cv_folds

    n = 60
    slide = np.array([f"s{i // 2}" for i in range(n)])
    tile = np.arange(n)
    folds = [(np.arange(30, 60), np.arange(0, 30)), (np.arange(0, 30), np.arange(30, 60))]
    ok = audit_cv_folds(folds, n_rows=n, groups={"slide": slide}, tile_ids=tile)
    assert ok["passed"] is True and ok["critical"] == []
    # row 59 never validated, rows 0..24 validated twice; slides s0..s12 in two validation folds
    bad = [(np.arange(30, 59), np.arange(0, 30)), (np.arange(25, 30), np.arange(0, 25)),
           (np.arange(0, 30), np.arange(30, 59))]
    rep = audit_cv_folds(bad, n_rows=n, groups={"slide": slide}, tile_ids=tile)
    assert rep["passed"] is False
    assert rep["critical"][:2] == ["validation_membership_missing", "validation_membership_duplicate"]
    assert rep["validation_membership_missing"] == [59]
    assert rep["n_validation_membership_duplicate"] == 25
    assert len(rep["validation_membership_duplicate"]) == 20  # lists capped at 20, counts exact
    assert rep["overlap_counts"]["slide"] == 13 and len(rep["examples"]["slide"]) == 10
    assert rep["examples"]["slide"][0] == "s0 -> folds 1,2"
    with pytest.raises(LeakageError, match="Cross-validation leakage audit failed: validation_membership_missing"):
        audit_cv_folds(bad, n_rows=n, groups={"slide": slide}, tile_ids=tile, raise_on_leakage=True)
    with pytest.raises(LeakageError, match="both train and validation"):
        audit_cv_folds([(np.arange(0, 31), np.arange(30, 60))], n_rows=n, groups={"slide": slide}, tile_ids=tile)
    with pytest.raises(ValueError, match=r"rows \[60\]"):
        audit_cv_folds([(np.arange(0, 30), np.arange(30, 61))], n_rows=n, groups={"slide": slide}, tile_ids=tile)
    # a tile with two labels is critical even inside one fold
    lab = np.zeros(n, int)
    tile2 = tile.copy()
    tile2[1] = 0
    lab[1] = 1
    rep = audit_cv_folds(folds, n_rows=n, groups={"slide": slide}, tile_ids=tile2, labels=lab)
    assert "conflicting_labels" in rep["critical"] and rep["examples"]["conflicting_labels"] == ["0"]
