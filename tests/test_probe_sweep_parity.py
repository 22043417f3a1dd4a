"""Pins the probe sweep against croma 1.0.1 (spec downstream §3-§4, §6).

Every matrix is compared with ``np.array_equal`` (bit-identical), never with a tolerance:
the spec's determinism contract (Python ``random`` streams, carry-over arrangement, exact cuts,
lbfgs on float64 training rows in schedule order, first-max C) makes exact equality the claim.
Cases: 2x2 binary cells (D 4 and 16, several seeds), a 4x4 multinomial tcga-like grid, slide-level
sweeps with validation_fraction 0.1 / 0.25, a ragged cell (carry-over re-chunking), extra test
sets, custom ``arrange_slides`` hooks, all three PathoROB schedules at small rows-per-slide,
float32 and unsigned inputs. Every ValueError of §6 #1-#22 is raised by both croma and us with
the same key phrase, including which fault wins when several are present.
``sweep_outcomes`` is checked against scikit-learn directly (refit at best C, recompute scores).

croma runs under ``threadpool_limits(1)`` to keep the file fast: BLAS thread count does not
change croma's numbers (spec §0.2.5; the slow test runs croma at its default threads).
"""

from __future__ import annotations

import random
import warnings

import croma
import croma.downstream as cd
import numpy as np
import pytest
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import balanced_accuracy_score
from threadpoolctl import threadpool_limits

from cachescore.downstream import IN_DOMAIN, pathorob_schedule, probe_sweep, probe_sweep_over_test_sets
from cachescore.probe.fit import C_GRID, balanced_accuracy
from cachescore.probe.sweep import sweep_outcomes


# ------------------------------------------------------------------------------------ helpers


def cohort(n_conf=2, n_cls=2, slides=10, rps=3, dim=4, seed=0, extra=None, dtype=np.float64):
    """Rows grouped by cell in input order, slides contiguous; class on dim 0, confounder on dim 1.

    ``extra`` maps (i, j) to a number of extra rows appended to that cell (a ragged cell).
    Rows are interleaved across cells (cell-major blocks shuffled) so cell order != input order.
    """
    rng = np.random.default_rng(seed)
    blocks = []
    for i in range(n_conf):
        for j in range(n_cls):
            n = slides * rps + (extra or {}).get((i, j), 0)
            centre = np.zeros(dim)
            centre[0] += 2.0 * j / max(n_cls - 1, 1) * (1 + j % 2)
            centre[1 % dim] += 2.0 * i / max(n_conf - 1, 1)
            if dim > 2:
                centre[2 + (j % (dim - 2))] += 1.0
            slide_shift = np.repeat(rng.normal(0, 0.3, size=(-(-n // rps), dim)), rps, axis=0)[:n]
            x = centre + slide_shift + rng.normal(0, 0.25, size=(n, dim))
            blocks.append((x, np.full(n, i), np.full(n, j)))
    x = np.concatenate([b[0] for b in blocks]).astype(dtype)
    c = np.concatenate([b[1] for b in blocks]).astype(np.int64)
    y = np.concatenate([b[2] for b in blocks]).astype(np.int64)
    return x, c, y


def two_by_two(fs, rps=3, mts=8, total=8):
    """croma's test helper schedule: favourable f, unfavourable total - f slides, sorted (i, j)."""
    return [
        ([(0, 0, f * rps), (0, 1, (total - f) * rps), (1, 0, (total - f) * rps), (1, 1, f * rps)], mts)
        for f in fs
    ]


def croma_over_test_sets(*args, **kwargs):
    with warnings.catch_warnings(), threadpool_limits(limits=1):
        warnings.simplefilter("ignore", ConvergenceWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module="sklearn")
        return cd.probe_sweep_over_test_sets(*args, **kwargs)


def assert_same(ours: dict, theirs: dict):
    assert list(ours) == list(theirs)
    for name in theirs:
        assert ours[name].dtype == np.float64 and ours[name].flags.c_contiguous
        assert ours[name].shape == theirs[name].shape
        assert np.array_equal(ours[name], theirs[name]), name


def check(x, c, y, **kwargs):
    theirs = croma_over_test_sets(x, c, y, **kwargs)
    ours = probe_sweep_over_test_sets(x, c, y, **kwargs)
    assert_same(ours, theirs)
    return ours


# ------------------------------------------------------------------------------------ parity


@pytest.mark.parametrize(
    ("seed", "iterations"), [(7, 3), (11, 2), pytest.param(1000, 3, marks=pytest.mark.slow)]
)
def test_binary_2x2_matches_croma(seed, iterations):
    x, c, y = cohort(seed=seed)
    check(x, c, y, schedule=two_by_two([4, 3, 0]), rows_per_slide=3, iterations=iterations, seed=seed)


@pytest.mark.parametrize("seed", [0, pytest.param(4242, marks=pytest.mark.slow)])
def test_binary_2x2_d16_matches_croma(seed):
    x, c, y = cohort(dim=16, seed=seed + 1)
    check(x, c, y, schedule=two_by_two([4, 2, 1]), rows_per_slide=3, iterations=2, seed=seed)


def test_probe_sweep_is_the_in_domain_matrix_of_croma():
    x, c, y = cohort(seed=3)
    kwargs = dict(schedule=two_by_two([4, 1]), rows_per_slide=3, iterations=2, seed=5)
    with warnings.catch_warnings(), threadpool_limits(limits=1):
        warnings.simplefilter("ignore", ConvergenceWarning)
        theirs = croma.probe_sweep(x, c, y, **kwargs)
    ours = probe_sweep(x, c, y, **kwargs)
    assert isinstance(ours, np.ndarray) and np.array_equal(ours, theirs)


def test_tcga_like_4x4_multinomial_matches_croma():
    x, c, y = cohort(n_conf=4, n_cls=4, slides=12, rps=5, dim=16, seed=2)
    check(x, c, y, schedule=pathorob_schedule("tcga", rows_per_slide=5, n_splits=3),
          rows_per_slide=5, iterations=2, seed=7)  # fmt: skip


@pytest.mark.parametrize("vf", [0.1, 0.25])
def test_slide_level_sweep_with_validation_fraction_matches_croma(vf):
    x, c, y = cohort(slides=30, rps=1, dim=8, seed=4)
    check(x, c, y, schedule=pathorob_schedule("camelyon", rows_per_slide=1, n_splits=3),
          rows_per_slide=1, iterations=2, seed=1000, validation_fraction=vf)  # fmt: skip


def test_ragged_cell_recut_by_position_matches_croma():
    # two extra rows in cell (0, 0) at rps 4: the short chunk moves mid-list and the next
    # replicate re-chunks across original slides (spec §3.5 step 6)
    x, c, y = cohort(rps=4, extra={(0, 0): 2}, seed=5)
    check(x, c, y, schedule=two_by_two([4, 2], rps=4), rows_per_slide=4, iterations=3, seed=9)


def test_extra_test_sets_match_croma():
    x, c, y = cohort(seed=6)
    unseen_x, _, unseen_y = cohort(n_conf=1, slides=4, seed=60)
    unseen_x = unseen_x + np.array([0, 4.0, 0, 0])  # a confounder the probe never saw
    one_class = (unseen_x[unseen_y == 1][:5], unseen_y[unseen_y == 1][:5])
    tests = {"unseen_confounder": (unseen_x, unseen_y), "tumour_only": one_class}
    ours = check(x, c, y, schedule=two_by_two([4, 0]), test_sets=tests, rows_per_slide=3,
                 iterations=2, seed=11)  # fmt: skip
    assert list(ours) == [IN_DOMAIN, "unseen_confounder", "tumour_only"]
    plain = probe_sweep(x, c, y, schedule=two_by_two([4, 0]), rows_per_slide=3, iterations=2, seed=11)
    assert np.array_equal(plain, ours[IN_DOMAIN])


def copy_and_shuffle(cells, rng):
    return [[rng.sample(list(cell), len(cell)) for cell in row] for row in cells]


def reverse_then_draw(cells, rng):
    out = []
    for row in cells:
        out.append([])
        for cell in row:
            cell = list(reversed(cell))
            if len(cell) > 2 and rng.random() < 0.5:
                cell.append(cell.pop(0))
            out[-1].append(cell)
    return out


def case_split_like_tolkach(cells, rng):
    # draw first (before any shuffle), then shuffle, then push chosen "cases" to the tail
    picks = [rng.randint(0, 3) for _ in cells]
    for row, pick in zip(cells, picks):
        for cell in row:
            rng.shuffle(cell)
            for case in sorted({pick, (pick + 1) % 4}):
                first = next((k for k, slide in enumerate(cell) if slide[0] % 4 == case), None)
                if first is not None:
                    cell.append(cell.pop(first))
    return cells


@pytest.mark.parametrize("hook", [copy_and_shuffle, reverse_then_draw, case_split_like_tolkach])
def test_custom_arrangements_match_croma(hook):
    x, c, y = cohort(seed=8)
    check(x, c, y, schedule=two_by_two([4, 2]), rows_per_slide=3, iterations=2, seed=13,
          arrange_slides=hook)  # fmt: skip


def test_an_arrangement_that_shuffles_like_the_default_gives_the_default_matrix():
    def shuffle_each(cells, rng):
        out = [[list(cell) for cell in row] for row in cells]
        for row in out:
            for cell in row:
                rng.shuffle(cell)
        return out

    x, c, y = cohort(seed=9)
    kwargs = dict(schedule=two_by_two([4, 1]), rows_per_slide=3, iterations=3, seed=21)
    default = probe_sweep_over_test_sets(x, c, y, **kwargs)
    hooked = probe_sweep_over_test_sets(x, c, y, arrange_slides=shuffle_each, **kwargs)
    assert_same(hooked, default)


@pytest.mark.parametrize(
    ("dataset", "n_conf", "n_cls", "slides", "rps", "n_splits"),
    [("camelyon", 2, 2, 17, 2, 3), ("tcga", 4, 4, 12, 5, 2), ("tolkach_esca", 2, 6, 9, 2, 2)],
)
def test_pathorob_schedules_at_small_rows_per_slide_match_croma(dataset, n_conf, n_cls, slides, rps, n_splits):
    x, c, y = cohort(n_conf=n_conf, n_cls=n_cls, slides=slides, rps=rps, dim=8, seed=10)
    check(x, c, y, schedule=pathorob_schedule(dataset, rows_per_slide=rps, n_splits=n_splits),
          rows_per_slide=rps, iterations=2, seed=1000)  # fmt: skip


def test_float32_and_unsigned_inputs_match_croma():
    x, c, y = cohort(seed=12, dtype=np.float32)
    check(x, c.astype(np.uint8), y.astype(np.uint16), schedule=two_by_two([4, 2]),
          rows_per_slide=3, iterations=2, seed=3)  # fmt: skip


def test_cells_need_not_be_contiguous_in_the_input():
    x, c, y = cohort(seed=13)
    # interleave the cells slide by slide, keeping each cell's internal row order
    cell = c * 2 + y
    position = np.empty(len(x), dtype=np.int64)
    for k in range(4):
        position[cell == k] = np.arange(np.sum(cell == k))
    order = np.lexsort((cell, position // 3))
    assert not np.array_equal(order, np.arange(len(x)))
    check(x[order], c[order], y[order], schedule=two_by_two([4, 2]), rows_per_slide=3,
          iterations=2, seed=17)  # fmt: skip


# ------------------------------------------------------------------------------------ outcomes


def test_sweep_outcomes_agree_with_scikit_learn_directly():
    x, c, y = cohort(seed=14)
    unseen_x, _, unseen_y = cohort(n_conf=1, slides=3, seed=140)
    schedule = two_by_two([4, 2])
    run = sweep_outcomes(x, c, y, schedule=schedule, rows_per_slide=3, iterations=2, seed=19,
                         test_sets={"ood": (unseen_x, unseen_y)}, keep_predictions=True)  # fmt: skip
    assert run.replicate_seeds == random.Random(19).sample(range(10000), 2)
    assert [(o.replicate, o.split) for o in run.outcomes] == [(r, s) for r in range(2) for s in range(2)]
    for o in run.outcomes:
        assert o.seed == run.replicate_seeds[o.replicate]
        assert o.val_scores.shape == (15,) and o.best_C == C_GRID[np.argmax(o.val_scores)]
        for rows in (o.train_rows, o.val_rows, o.test_rows):
            assert rows.dtype == np.int64
        assert not set(o.train_rows) & set(o.test_rows) and not set(o.val_rows) & set(o.test_rows)
        slides_of = lambda rows: {(int(c[r]), int(y[r]), int(np.flatnonzero((c == c[r]) & (y == y[r])).tolist().index(r)) // 3) for r in rows}  # noqa: E731
        assert not slides_of(o.train_rows) & slides_of(o.test_rows)  # slides are never split
        # the oracle: scikit-learn on the rows the outcome names, in that order
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            model = LogisticRegression(C=o.best_C).fit(x[o.train_rows], y[o.train_rows])
            k = int(np.argmax(o.val_scores))
            grid_model = LogisticRegression(C=C_GRID[k], random_state=0).fit(x[o.train_rows], y[o.train_rows])
        assert o.val_scores[k] == balanced_accuracy_score(y[o.val_rows], grid_model.predict(x[o.val_rows]))
        assert o.scores[IN_DOMAIN] == balanced_accuracy_score(y[o.test_rows], model.predict(x[o.test_rows]))
        assert o.scores["ood"] == balanced_accuracy_score(unseen_y, model.predict(unseen_x))
        assert run.matrices[IN_DOMAIN][o.split, o.replicate] == o.scores[IN_DOMAIN]
        assert run.matrices["ood"][o.split, o.replicate] == o.scores["ood"]
        # predictions: binary decision expanded to [0, z]; softmax reproduces predict_proba
        assert np.array_equal(o.classes, model.classes_)
        for dec, xs, ys in ((o.val_decision, x[o.val_rows], o.val_labels),
                            (o.test_decision[IN_DOMAIN], x[o.test_rows], o.test_labels[IN_DOMAIN]),
                            (o.test_decision["ood"], unseen_x, o.test_labels["ood"])):  # fmt: skip
            assert dec.shape == (len(xs), 2) and np.all(dec[:, 0] == 0)
            proba = np.exp(dec - dec.max(axis=1, keepdims=True))
            proba /= proba.sum(axis=1, keepdims=True)
            np.testing.assert_allclose(proba, model.predict_proba(xs), rtol=1e-10, atol=1e-12)
            assert ys is not None and len(ys) == len(xs)
    # the in-domain test set is the same at every split of a replicate
    for r in range(2):
        tests = [o.test_rows for o in run.outcomes if o.replicate == r]
        assert all(np.array_equal(tests[0], t) for t in tests[1:])
    assert not any(o.val_decision is not None for o in sweep_outcomes(
        x, c, y, schedule=schedule, rows_per_slide=3, iterations=1, seed=19).outcomes)  # fmt: skip


def test_multinomial_predictions_are_softmax_of_the_decision():
    x, c, y = cohort(n_conf=4, n_cls=4, slides=12, rps=5, dim=8, seed=15)
    run = sweep_outcomes(x, c, y, schedule=pathorob_schedule("tcga", rows_per_slide=5, n_splits=2),
                         rows_per_slide=5, iterations=1, keep_predictions=True)  # fmt: skip
    for o in run.outcomes:
        assert o.val_decision.shape == (len(o.val_rows), 4)
        assert o.test_decision[IN_DOMAIN].shape == (len(o.test_rows), 4)
        pred = o.classes[np.argmax(o.test_decision[IN_DOMAIN], axis=1)]
        assert o.scores[IN_DOMAIN] == balanced_accuracy_score(o.test_labels[IN_DOMAIN], pred)


@pytest.mark.filterwarnings("ignore:y_pred contains classes not in y_true")
@pytest.mark.filterwarnings("ignore:A single label was found")
def test_balanced_accuracy_equals_scikit_learn_bitwise():
    rng = np.random.default_rng(0)
    for trial in range(500):
        k = int(rng.integers(2, 7))
        n = int(rng.integers(1, 60))
        y_true = rng.integers(0, k, size=n)
        y_pred = rng.integers(0, k + 1, size=n)  # may predict a class absent from y_true
        assert balanced_accuracy(y_true, y_pred) == balanced_accuracy_score(y_true, y_pred)
    with pytest.raises(ValueError):  # non-integer labels go to scikit-learn and its errors
        balanced_accuracy(np.array(["a", "b"]), np.array([0, 1]))


# ------------------------------------------------------------------------------------ errors

BASE_X, BASE_C, BASE_Y = cohort(seed=0)
BASE = dict(schedule=two_by_two([4, 2]), rows_per_slide=3, iterations=1, seed=1)


def _cut_cell00():
    keep = np.ones(len(BASE_X), bool)
    keep[np.flatnonzero((BASE_C == 0) & (BASE_Y == 0))[12:]] = False
    return BASE_X[keep], BASE_C[keep], BASE_Y[keep]


def _nan_x():
    x = BASE_X.copy()
    x[5, 2] = np.nan
    return x


def _with(**overrides):
    args = [BASE_X, BASE_C, BASE_Y]
    kwargs = dict(BASE)
    for k, v in overrides.items():
        if k in ("x", "c", "y"):
            args["xcy".index(k)] = v
        elif k == "rows":
            args = list(v)
        else:
            kwargs[k] = v
    return args, kwargs


ERROR_CASES = {
    "1-D embeddings": (_with(x=BASE_X[:, 0]), "2-D"),
    "3-D embeddings": (_with(x=BASE_X[:, :, None]), "2-D"),
    "NaN embedding": (_with(x=_nan_x()), "finite"),
    "inf embedding": (_with(x=np.where(np.arange(BASE_X.size).reshape(BASE_X.shape) == 7, np.inf, BASE_X)), "finite"),
    "short confounders": (_with(c=BASE_C[:-1]), "one entry per embedding row"),
    "2-D labels": (_with(y=BASE_Y[:, None]), "one entry per embedding row"),
    "string confounders": (_with(c=np.array(["a"] * len(BASE_C))), "integer indices"),
    "float labels": (_with(y=BASE_Y.astype(float)), "integer indices"),
    "bool labels": (_with(y=BASE_Y.astype(bool)), "integer indices"),
    "negative confounder": (_with(c=BASE_C - 1), "non-negative"),
    "no rows": (_with(rows=(np.empty((0, 4)), np.empty(0, int), np.empty(0, int))), "at least one row"),
    "test set named in_domain": (_with(test_sets={"in_domain": (BASE_X[:4], BASE_Y[:4])}), "in_domain"),
    "test set wrong width": (_with(test_sets={"t": (BASE_X[:4, :3], BASE_Y[:4])}), "4 features"),
    "test set 1-D": (_with(test_sets={"t": (BASE_X[0], BASE_Y[:4])}), "2-D matrix"),
    "test set label count": (_with(test_sets={"t": (BASE_X[:4], BASE_Y[:3])}), "one label per row"),
    "empty test set": (_with(test_sets={"t": (BASE_X[:0], BASE_Y[:0])}), "at least one row"),
    "rows_per_slide 0": (_with(rows_per_slide=0), "rows_per_slide must be at least 1"),
    "validation_fraction 1": (_with(validation_fraction=1.0), r"validation_fraction must lie in \[0, 1\)"),
    "validation_fraction negative": (_with(validation_fraction=-0.1), "validation_fraction must lie"),
    "validation_fraction NaN": (_with(validation_fraction=float("nan")), "validation_fraction must lie"),
    "one split": (_with(schedule=two_by_two([4])), "confounded split"),
    "mts 0": (_with(schedule=[two_by_two([4])[0], ([(0, 0, 3)], 0)]), "max_train_slides must be at least 1"),
    "cell out of grid": (_with(schedule=[two_by_two([4])[0], ([(0, 0, 3), (2, 0, 3)], 8)]), r"cell \(2, 0\)"),
    "negative take": (_with(schedule=[two_by_two([4])[0], ([(0, 1, -3)], 8)]), r"cell \(0, 1\) asks for -3 rows"),
    "schedule for another rps": (_with(rows_per_slide=1), "max_train_slides"),
    "cell too small": (_with(rows=_cut_cell00()), r"cell \(0, 0\) holds 12 rows"),
    "no test rows": (_with(schedule=two_by_two([9, 8], mts=18, total=18)), "no test rows"),
    "no validation rows": (_with(schedule=two_by_two([4, 2], rps=1), rows_per_slide=1), "no validation rows"),
    "no training rows": (_with(schedule=[([(0, 0, 0)], 8), ([(0, 0, 3)], 8)]), "no training rows"),
    "iterations 0": (_with(iterations=0), "iterations must be at least 1"),
    "iterations 10001": (_with(iterations=10001), "iterations must be at most 10000"),
    # several faults: the first in croma's order wins
    "NaN and bad labels": (_with(x=_nan_x(), y=BASE_Y.astype(float)), "finite"),
    "bad labels and bad test set": (_with(y=BASE_Y - 1, test_sets={"in_domain": (BASE_X, BASE_Y)}), "non-negative"),
    "bad test set and bad schedule": (_with(test_sets={"t": (BASE_X[:2], BASE_Y[:3])}, rows_per_slide=0), "one label per row"),
    "bad rps and bad vf": (_with(rows_per_slide=0, validation_fraction=2.0), "rows_per_slide"),
    "bad schedule and bad iterations": (_with(schedule=two_by_two([4]), iterations=0), "confounded split"),
    "range before negative take": (_with(schedule=[two_by_two([4])[0], ([(0, 0, -1), (5, 5, 3)], 8)]), "asks for -1 rows"),
    "no validation before no test": (_with(schedule=two_by_two([4, 2], rps=1, mts=40), rows_per_slide=1), "no validation rows"),
}


@pytest.mark.parametrize("case", list(ERROR_CASES), ids=list(ERROR_CASES))
def test_errors_match_croma(case):
    (args, kwargs), fragment = ERROR_CASES[case]
    with pytest.raises(ValueError, match=fragment):
        croma_over_test_sets(*args, **kwargs)
    with pytest.raises(ValueError, match=fragment):
        probe_sweep_over_test_sets(*args, **kwargs)


def drop_a_slide(cells, rng):
    cells[0][0].pop()
    return cells


def drop_a_slide_from_a_copy(cells, rng):
    out = [[list(cell) for cell in row] for row in cells]
    out[1][1] = out[1][1][1:]
    return out


def split_slides(cells, rng):
    return [[[[r] for slide in cell for r in slide] for cell in row] for row in cells]


def drop_a_confounder(cells, rng):
    return cells[:1]


def drop_a_class(cells, rng):
    return [cells[0], cells[1][:1]]


def misbehave_at_second_replicate(cells, rng):
    if rng.random() < 0.6:  # seed-dependent; with seed 1 the second replicate misbehaves
        cells[0][1] = cells[0][1][:-1]
    return cells


@pytest.mark.parametrize(
    ("hook", "fragment"),
    [
        (drop_a_slide, "same slides"),
        (drop_a_slide_from_a_copy, "same slides"),
        (split_slides, "same slides"),
        (drop_a_confounder, "got 1 confounder"),
        (drop_a_class, "got 1 class"),
        (misbehave_at_second_replicate, "same slides"),
    ],
)
def test_arrangement_must_be_a_rearrangement(hook, fragment):
    kwargs = dict(BASE, iterations=2, arrange_slides=hook)
    with pytest.raises(ValueError, match=fragment):
        croma_over_test_sets(BASE_X, BASE_C, BASE_Y, **kwargs)
    with pytest.raises(ValueError, match=fragment):
        probe_sweep_over_test_sets(BASE_X, BASE_C, BASE_Y, **kwargs)


def test_sklearn_errors_surface_unchanged():
    bad = BASE_X[:4].copy()
    bad[0, 0] = np.nan
    kwargs = dict(BASE, test_sets={"t": (bad, BASE_Y[:4])})
    with pytest.raises(ValueError, match="NaN"):
        croma_over_test_sets(BASE_X, BASE_C, BASE_Y, **kwargs)
    with pytest.raises(ValueError, match="NaN"):
        probe_sweep_over_test_sets(BASE_X, BASE_C, BASE_Y, **kwargs)


# ------------------------------------------------------------------------------------ slow


@pytest.mark.slow
def test_full_camelyon_schedule_matches_croma_at_default_threads():
    x, c, y = cohort(slides=17, rps=3, dim=8, seed=16)
    schedule = pathorob_schedule("camelyon", rows_per_slide=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        theirs = croma.probe_sweep(x, c, y, schedule=schedule, rows_per_slide=3, iterations=2)
    ours = probe_sweep(x, c, y, schedule=schedule, rows_per_slide=3, iterations=2)
    assert ours.shape == (8, 2) and np.array_equal(ours, theirs)
