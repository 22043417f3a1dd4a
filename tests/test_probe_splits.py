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
