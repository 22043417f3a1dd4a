"""Planning's scopes as combination counts: the same counts as the rows give, batch by batch or
whole, and CRoMa's candidate counts equal to a row-by-row count."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from cachescore.cache import Cache, write_view
from cachescore.cache import reader as reader_mod
from cachescore.cache.writer import write_tileset
from cachescore.metrics import families
from cachescore.metrics.scope_counts import frame_combinations, scopes_from_combinations


def _frame(seed: int, n: int = 500) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    groups = rng.integers(0, 23, n)
    return pd.DataFrame({
        "sample_id": [f"t{i}" for i in range(n)], "image_path": [f"t{i}.png" for i in range(n)],
        "group_id": [f"g{k}" for k in groups],
        "label": rng.choice(["tumour", " tumour", "normal ", "stroma"], n),
        "centre": rng.choice(["A", "B ", "C", " B"], n),
        "subset": rng.choice(["s2", "s1"], n),
    })


def _brute_force(frame: pd.DataFrame, m_rows: np.ndarray):
    """SO / OS candidates outside the row's group, one row at a time."""
    y = frame["label"].str.strip().to_numpy()
    c = frame["centre"].str.strip().to_numpy()
    g = frame["group_id"].to_numpy()
    so = np.array([np.sum((y == y[i]) & (c != c[i]) & (g != g[i])) for i in m_rows])
    os_ = np.array([np.sum((y != y[i]) & (c == c[i]) & (g != g[i])) for i in m_rows])
    return so, os_


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_croma_candidate_counts_equal_a_row_by_row_count(seed):
    frame = _frame(seed)
    (name, scope), = scopes_from_combinations(
        *frame_combinations(frame, ["label", "centre", "group_id"], strip=("label", "centre")), subset=False)
    assert name == "dataset" and scope.n_rows == len(frame)
    so, os_ = families._typed_counts(scope)
    want_so, want_os = _brute_force(frame, scope.first)  # each combination's first row stands for it
    np.testing.assert_array_equal(so, want_so)
    np.testing.assert_array_equal(os_, want_os)
    # every row of a combination has that combination's counts, and the counts add up to the rows
    key = frame["group_id"] + "|" + frame["label"].str.strip() + "|" + frame["centre"].str.strip()
    assert sorted(key.value_counts().to_numpy().tolist()) == sorted(scope.rows.tolist())


@pytest.mark.parametrize("batch", [7, 64, 1 << 16])
def test_a_view_read_in_batches_gives_the_frames_combinations(tmp_path, monkeypatch, batch):
    frame = _frame(3)
    write_tileset(tmp_path, "ts", frame[["sample_id", "image_path"]])
    write_view(tmp_path, "v", frame.drop(columns=["image_path"]), tileset="ts", confounder_column="centre",
               design="paired_2x2")
    monkeypatch.setattr(reader_mod, "VIEW_CODE_BATCH", batch)
    columns = ["label", "centre", "group_id", "subset"]
    strip = ("label", "centre", "subset")
    lean = Cache(tmp_path).view_combinations("v", columns, strip=strip)
    whole = frame_combinations(frame, columns, strip=strip)
    assert lean[0] == whole[0] == [sorted({v.strip() for v in frame["label"]}), sorted({v.strip() for v in frame["centre"]}),
                                   sorted(set(frame["group_id"])), ["s1", "s2"]]

    def as_set(combos):
        codes, rows, first = combos
        return {(tuple(c), int(r), int(f)) for c, r, f in zip(codes.tolist(), rows, first)}

    assert as_set(lean[1]) == as_set(whole[1])
    scopes = scopes_from_combinations(*lean, subset=True)
    assert [name for name, _ in scopes] == ["s1", "s2"]
    assert [part.n_rows for _, part in scopes] == [int((frame["subset"] == s).sum()) for s in ("s1", "s2")]
    for name, part in scopes:  # each combination's first row is a row of that combination, and the first one
        rows = frame[frame["subset"] == name]
        for g, y, c, f in zip(part.group, part.label, part.confounder, part.first):
            hit = rows[(rows["group_id"] == g) & (rows["label"].str.strip() == y) & (rows["centre"].str.strip() == c)]
            assert hit.index[0] == f


def test_a_croma_refusal_names_the_first_view_row_with_the_fewest_candidates():
    frame = pd.DataFrame({"group_id": ["g0", "g0", "g1", "g1", "g2", "g2"],
                          "label": ["a", "b", "a", "b", "a", "a"],
                          "centre": ["x", "y", "y", "x", "x", "y"]})
    scopes = scopes_from_combinations(
        *frame_combinations(frame, ["label", "centre", "group_id"], strip=("label", "centre")), subset=False)
    so, _ = _brute_force(frame, np.arange(len(frame)))
    msg = families.get("croma").scope_problem(scopes, "centre", {"m": 5}, "v", "all")
    worst = int(min(so.min(), _brute_force(frame, np.arange(len(frame)))[1].min()))
    assert f"has only {worst} " in msg and "(6 rows)" in msg
    row = int(np.flatnonzero(so == so.min())[0])
    assert f"row {row} of the view (group {frame['group_id'][row]!r}" in msg
