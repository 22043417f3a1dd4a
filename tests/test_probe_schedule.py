"""Pins cachescore's PathoROB schedules and Cramér's V grids (spec downstream §2).

- ``pathorob_schedule`` reproduces PathoROB's published split mapping (frozen fixture, exact
  equality), the croma oracle for other rows-per-slide, the spec's SHA-256 fingerprints, the
  prefix property and croma's four ValueErrors (same class, same order, key phrases).
- ``cramers_v`` gives exactly the floats listed in spec §2.5 (``==`` on Python floats).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from croma.downstream import pathorob_schedule as croma_schedule

from cachescore.probe.reductions import cramers_v
from cachescore.probe.schedule import PATHOROB_SPLITS, pathorob_schedule


def _fixture(name: str) -> dict:
    for base in (Path(__file__).resolve().parents[2] / "shared" / "fixtures", Path("/work/shared/fixtures")):
        if (base / name).is_file():
            return json.loads((base / name).read_text())
    pytest.fail(f"fixture {name} not found next to the repository nor in /work/shared/fixtures")


SCHEDULE_FIXTURE = _fixture("pathorob_schedule_parity.json")


@pytest.mark.parametrize("case", SCHEDULE_FIXTURE["cases"], ids=lambda c: c["name"])
def test_schedule_reproduces_pathorobs_published_split_mapping(case):
    ours = pathorob_schedule(case["dataset"], rows_per_slide=case["num_patches_per_slide"])
    assert len(ours) == case["num_splits"] == PATHOROB_SPLITS[case["dataset"]]
    expected = [
        ([tuple(entry) for entry in split["split_map"]], split["max_train_slides"])
        for split in case["splits"]
    ]
    assert [s["split"] for s in case["splits"]] == list(range(case["num_splits"]))
    assert ours == expected


@pytest.mark.parametrize("dataset", sorted(PATHOROB_SPLITS))
@pytest.mark.parametrize("rps", [1, 2, 7, 30, 100, 300])
def test_schedule_equals_croma_at_any_rows_per_slide(dataset, rps):
    theirs = croma_schedule(dataset, rows_per_slide=rps)
    ours = pathorob_schedule(dataset, rows_per_slide=rps)
    assert [(list(map(tuple, m)), t) for m, t in theirs] == ours
    for split_map, _ in ours:  # sorted (i, j): this is the training-row order
        assert [e[:2] for e in split_map] == sorted(e[:2] for e in split_map)


@pytest.mark.parametrize(
    ("dataset", "rps", "digest"),
    [
        ("camelyon", 300, "606db33a1ef93966816262a282c5a02ab4d86157e4a6def104602a36bbd6df75"),
        ("tcga", 30, "090e1f123b644614b8f18d082aef6bfa35aeaac361ac15af715c21cd4ad69793"),
        ("tolkach_esca", 100, "db0d9648e884a5be748e7b6fa58d0effb13d5a6d193de9901016079ec155c7d5"),
    ],
)
def test_schedule_fingerprint_matches_the_published_record(dataset, rps, digest):
    schedule = pathorob_schedule(dataset, rows_per_slide=rps)
    text = json.dumps(
        [[[list(e) for e in m], mts] for m, mts in schedule], sort_keys=True, separators=(",", ":")
    )
    assert hashlib.sha256(text.encode()).hexdigest() == digest


@pytest.mark.parametrize("dataset", sorted(PATHOROB_SPLITS))
def test_shorter_walk_is_a_prefix(dataset):
    full = pathorob_schedule(dataset, rows_per_slide=3)
    for n in range(1, PATHOROB_SPLITS[dataset] + 1):
        assert pathorob_schedule(dataset, rows_per_slide=3, n_splits=n) == full[:n]


@pytest.mark.parametrize(
    ("args", "kwargs", "fragment"),
    [
        (("prostate",), {"rows_per_slide": 1}, r"no schedule for 'prostate'.*camelyon.*tcga.*tolkach_esca"),
        (("camelyon",), {"rows_per_slide": 0}, "rows_per_slide must be at least 1, got 0"),
        (("tcga",), {"rows_per_slide": 1, "n_splits": 0}, "n_splits must be at least 1, got 0"),
        (("camelyon",), {"rows_per_slide": 1, "n_splits": 9}, "8 splits"),
        (("tolkach_esca",), {"rows_per_slide": 1, "n_splits": 5}, "4 splits"),
        # two faults: the dataset is checked first, then rows_per_slide, then n_splits
        (("nope",), {"rows_per_slide": 0, "n_splits": 0}, "no schedule for 'nope'"),
        (("tcga",), {"rows_per_slide": 0, "n_splits": 99}, "rows_per_slide"),
    ],
)
def test_schedule_errors_match_croma(args, kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        pathorob_schedule(*args, **kwargs)
    with pytest.raises(ValueError):
        croma_schedule(*args, **kwargs)


# spec §2.5, Python repr of every value
CRAMERS_V = {
    "camelyon": [0.0, 0.14285714285714285, 0.2857142857142857, 0.4285714285714286,
                 0.5714285714285714, 0.7142857142857143, 0.8571428571428572, 1.0],
    "tcga": [0.0, 0.2041241452319315, 0.3535533905932738, 0.5, 0.67700320038633,
             0.8416254115301732, 1.0],
    "tolkach_esca": [0.0, 0.3333333333333333, 0.6666666666666666, 1.0],
}  # fmt: skip


@pytest.mark.parametrize("dataset", sorted(CRAMERS_V))
@pytest.mark.parametrize("rps", [1, 30, 300])
def test_cramers_v_exact_values(dataset, rps):
    v = cramers_v(pathorob_schedule(dataset, rows_per_slide=rps), rows_per_slide=rps)
    assert v.dtype == np.float64 and v.shape == (PATHOROB_SPLITS[dataset],)
    assert v.tolist() == CRAMERS_V[dataset]


def test_cramers_v_from_row_counts_is_not_the_published_grid():
    # why rows_per_slide matters: camelyon row counts at rps 300 differ in the last bit (split 5)
    rows = cramers_v(pathorob_schedule("camelyon", rows_per_slide=300), rows_per_slide=1)
    assert rows.tolist() != CRAMERS_V["camelyon"]
    assert np.allclose(rows, CRAMERS_V["camelyon"], rtol=1e-15, atol=0)


def test_cramers_v_does_not_use_closed_forms():
    v = cramers_v(pathorob_schedule("camelyon", rows_per_slide=1))
    assert v[3] != 3 / 7  # 0.42857142857142855: the closed form differs in the last bit


@pytest.mark.parametrize(
    ("schedule", "kwargs", "fragment"),
    [
        ([], {}, "at least one split"),
        ([([(0, 0, 3), (1, 1, 3)], 2)], {"rows_per_slide": 2}, "multiple of rows_per_slide=2"),
        ([([(0, 0, 3), (0, 1, 3)], 2)], {}, "2x2 grid|empty row"),
        ([([(0, 0, 1), (2, 1, 1)], 2)], {"shape": (2, 2)}, r"cell \(2, 1\) lies outside"),
        ([([(0, 0, 1), (1, 1, 1)], 2)], {"rows_per_slide": 0}, "rows_per_slide"),
    ],
)
def test_cramers_v_rejects_tables_it_cannot_score(schedule, kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        cramers_v(schedule, **kwargs)
