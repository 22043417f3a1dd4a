"""Pins APD, nIPD and sweep_nipd against croma 1.0.1 and PathoROB's published values (spec §5).

- ``apd`` reproduces every value of the frozen PathoROB fixture with ``==`` and equals
  ``croma.apd`` bit for bit on many random matrices (several shapes, C and Fortran layout).
- ``nipd`` equals ``croma.nipd`` bit for bit on random C-contiguous matrices and irregular V grids;
  croma's documented worked examples hold; every ValueError (#27-#35) matches croma's class,
  order and key phrase.
"""

from __future__ import annotations

import json
from pathlib import Path

import croma
import numpy as np
import pytest

from cachescore.downstream import apd as ds_apd
from cachescore.downstream import nipd as ds_nipd
from cachescore.probe.reductions import apd, cramers_v, nipd, sweep_nipd
from cachescore.probe.schedule import pathorob_schedule


def _fixture(name: str) -> dict:
    for base in (Path(__file__).resolve().parents[2] / "shared" / "fixtures", Path("/work/shared/fixtures")):
        if (base / name).is_file():
            return json.loads((base / name).read_text())
    pytest.fail(f"fixture {name} not found next to the repository nor in /work/shared/fixtures")


APD_FIXTURE = _fixture("pathorob_apd_parity.json")


def test_downstream_namespace_reexports_the_same_functions():
    assert ds_apd is apd and ds_nipd is nipd


@pytest.mark.parametrize("case", APD_FIXTURE["cases"], ids=lambda c: c["name"])
def test_apd_reproduces_pathorobs_published_value_exactly(case):
    value = apd(case["accuracies"])
    assert type(value) is float
    assert value == case["apd"]


def test_apd_fixture_covers_several_split_counts():
    assert len({len(c["accuracies"]) for c in APD_FIXTURE["cases"]}) > 1


@pytest.mark.parametrize("shape", [(2, 1), (4, 20), (7, 20), (8, 20), (11, 5)])
def test_apd_equals_croma_bitwise_on_random_matrices(shape):
    rng = np.random.default_rng(shape[0] * 100 + shape[1])
    for _ in range(200):
        acc = rng.uniform(0.3, 1.0, size=shape)
        expected = croma.apd(acc)
        assert apd(acc) == expected
        assert apd(acc.tolist()) == expected
        # layout is kept, as croma keeps it (it can move the last bit for taller matrices)
        fortran = np.asfortranarray(acc)
        assert apd(fortran) == croma.apd(fortran)


@pytest.mark.parametrize("shape", [(2, 1), (4, 20), (7, 20), (8, 20), (11, 5)])
def test_nipd_equals_croma_bitwise_on_random_matrices(shape):
    rng = np.random.default_rng(7 + shape[0] * 100 + shape[1])
    for _ in range(200):
        acc = rng.uniform(0.55, 1.0, size=shape)
        inner = np.sort(rng.uniform(0.01, 0.99, size=shape[0] - 2))
        v = np.concatenate([[0.0], inner, [1.0]])
        chance = float(rng.choice([0.0, 0.25, 0.5, 1 / 6]))
        assert nipd(acc, v, chance) == croma.nipd(acc, v, chance)


def test_apd_documented_examples():
    assert apd([[0.9] * 3, [0.9] * 3]) == 0.0
    assert apd([[0.9], [0.72]]) == pytest.approx(-0.2, abs=1e-15)
    # ratio per replicate first, then the mean (ratio of means would give -1/22)
    assert apd([[0.2, 0.9], [0.3, 0.75]]) == pytest.approx(1 / 6, abs=1e-15)


def test_nipd_documented_examples():
    assert nipd([[0.9, 0.9], [0.82, 0.82], [0.5, 0.5]], [0, 0.2, 1], 0.5) == pytest.approx(-0.5)
    assert nipd([[0.9] * 2, [0.5] * 2], [0, 1], 0.5) == pytest.approx(-0.5)
    assert nipd([[0.9, 0.51], [0.82, 0.5]], [0, 1], 0.5) == pytest.approx(-9 / 82)


BAD_MATRICES = [
    ([0.9, 0.8], "2-D"),
    ([[0.9, 0.8]], "confounded split"),
    (np.empty((3, 0)), "replicate"),
    ([[0.9, np.nan], [0.8, 0.7]], "finite"),
    ([[0.9, np.inf], [0.8, 0.7]], "finite"),
]


@pytest.mark.parametrize(("acc", "fragment"), BAD_MATRICES)
def test_shared_matrix_errors_match_croma(acc, fragment):
    for ours, theirs in ((apd, croma.apd), (lambda a: nipd(a, [0, 1], 0.5), lambda a: croma.nipd(a, [0, 1], 0.5))):
        with pytest.raises(ValueError, match=fragment):
            ours(acc)
        with pytest.raises(ValueError, match=fragment):
            theirs(acc)


@pytest.mark.parametrize("baseline", [0.0, -0.1])
def test_apd_rejects_a_non_positive_baseline(baseline):
    acc = [[0.8, baseline], [0.7, 0.6]]
    with pytest.raises(ValueError, match="baseline"):
        apd(acc)
    with pytest.raises(ValueError, match="baseline"):
        croma.apd(acc)


GOOD = [[0.9, 0.9], [0.8, 0.8], [0.7, 0.7]]


@pytest.mark.parametrize(
    ("acc", "v", "chance", "fragment"),
    [
        (GOOD, [0, 1], 0.5, "one Cramér's-V value per accuracy row"),
        (GOOD, [[0, 0.5, 1]], 0.5, "one Cramér's-V value per accuracy row"),
        (GOOD, [0, np.nan, 1], 0.5, "finite, strictly increasing, and span"),
        (GOOD, [0, 0.6, 0.5], 0.5, "finite, strictly increasing, and span"),
        (GOOD, [0, 0, 1], 0.5, "finite, strictly increasing, and span"),
        (GOOD, [0.1, 0.5, 1], 0.5, "finite, strictly increasing, and span"),
        (GOOD, [0, 0.5, 0.9], 0.5, "finite, strictly increasing, and span"),
        (GOOD, [0, 0.5, 1], 1.0, r"chance must lie in \[0, 1\)"),
        (GOOD, [0, 0.5, 1], -0.1, r"chance must lie in \[0, 1\)"),
        (GOOD, [0, 0.5, 1], float("nan"), r"chance must lie in \[0, 1\)"),
        ([[0.5, 0.5], [0.4, 0.4]], [0, 1], 0.5, "above chance"),
        ([[0.4, 0.4], [0.4, 0.4]], [0, 1], 0.5, "above chance"),
        # order: V checked before chance, chance before skill
        (GOOD, [0, 1], 2.0, "one Cramér's-V value per accuracy row"),
        ([[0.4, 0.4], [0.3, 0.3]], [0, 1], 1.5, "chance must lie"),
    ],
)
def test_nipd_errors_match_croma(acc, v, chance, fragment):
    with pytest.raises(ValueError, match=fragment):
        nipd(acc, v, chance)
    with pytest.raises(ValueError, match=fragment):
        croma.nipd(acc, v, chance)


@pytest.mark.parametrize(("dataset", "n_classes"), [("camelyon", 2), ("tcga", 4), ("tolkach_esca", 6)])
def test_sweep_nipd_is_nipd_at_the_schedules_cramers_v(dataset, n_classes):
    schedule = pathorob_schedule(dataset, rows_per_slide=30)
    rng = np.random.default_rng(3)
    acc = rng.uniform(0.6, 0.95, size=(len(schedule), 20))
    v = cramers_v(schedule, rows_per_slide=30)
    expected = croma.nipd(acc, v, 1 / n_classes)
    assert sweep_nipd(acc, schedule, n_classes, rows_per_slide=30) == expected
    # a Fortran-ordered copy is made C-contiguous first (spec §5.2's layout trap)
    assert sweep_nipd(np.asfortranarray(acc), schedule, n_classes, rows_per_slide=30) == expected
