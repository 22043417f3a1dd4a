"""``docs/probe-schedules.md``: its worked custom cohort is a schedule ``validate`` accepts on a
cohort of the shape it describes (2 in-domain centres + 1 unseen, 2 classes, 6 slides per cell,
12 tiles per slide), with the slide counts and test rows it states; and the same schedule with a
``take`` that is not whole slides, or a cell too small, is refused by name before any fit."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from cachescore.cache import Cache, make_demo_cache
from cachescore.pipeline.validate import check_probe_view
from cachescore.probe.params import ProbeParams

DOC = Path(__file__).resolve().parents[1] / "docs" / "probe-schedules.md"


def _worked_probe() -> dict:
    blocks = re.findall(r"```toml\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    worked = next(b for b in blocks if "[[probe.schedule]]" in b)
    return tomllib.loads(worked)["probe"]


@pytest.fixture(scope="module")
def cohort(tmp_path_factory):
    root = tmp_path_factory.mktemp("cohort") / "cache"
    make_demo_cache(root, n_slides_per_cell=6, tiles_per_slide=12, dim=8, seed=0)
    return Cache(root)


def test_the_worked_schedule_passes_validate_with_the_counts_the_doc_states(cohort):
    probe = _worked_probe()
    params = ProbeParams.from_dict(probe, source=str(DOC))
    assert params.rows_per_slide == 12 and len(params.resolved_schedule()) == 3
    check = check_probe_view(cohort, "centre_all", params)
    assert check.error is None, check.error
    assert set(check.counts["cells"].values()) == {6}  # 6 slides in each (centre, class) cell of A and B
    assert check.counts["test_rows"] == {"centre_C": 2 * 6 * 12}  # centre C: 2 classes x 6 slides x 12 tiles
    totals = [sum(take for _, _, take in split) for split, _ in params.resolved_schedule()]
    assert totals == [96, 96, 72]  # the training rows per split the doc gives


def test_a_take_that_is_not_whole_slides_or_a_cell_too_small_is_refused_by_name(cohort):
    probe = _worked_probe()
    partial = dict(probe, schedule=[dict(probe["schedule"][0], split_map=[[0, 0, 18], [0, 1, 24], [1, 0, 24],
                                                                          [1, 1, 24]])] + probe["schedule"][1:])
    with pytest.raises(ValueError, match=r"takes 18 training rows, not a multiple of rows_per_slide=12"):
        ProbeParams.from_dict(partial, source=str(DOC))
    greedy = dict(probe, schedule=[dict(s, max_train_slides=6) for s in probe["schedule"]])
    check = check_probe_view(cohort, "centre_all", ProbeParams.from_dict(greedy, source=str(DOC)))
    assert "leaves no test rows -- the cells are too small" in check.error and "'A/normal': 6" in check.error
