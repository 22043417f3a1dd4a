"""Embedding alignment and manifest loading (spec/metrics.md §9, §1.2; §11 tests 55–60).

Pins ``cachescore.alignment`` against ``croma.alignment`` / ``croma.metrics.pairs.load_manifest``
on random manifests with repeated rows (same outputs, same error classes and messages' key
facts), and the group_id identity rule.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from croma import alignment as ref_alignment
from croma.metrics.pairs import load_manifest as ref_load_manifest

from cachescore.alignment import build_embedding_source_manifest, expand_features_to_manifest, load_manifest


def _manifest(seed, n=60):
    rng = np.random.default_rng(seed)
    tiles = rng.integers(0, n // 3, n)
    return pd.DataFrame(
        {
            "sample_id": [f" s{t}" for t in tiles],  # stripped during key normalisation
            "image_path": [f"/t/{t}.png" for t in tiles],
            "label": [int(t % 2) for t in tiles],
            "confounder": [f"c{t % 3}" for t in tiles],
            "group_id": [f"g{t // 4}" for t in tiles],
            "subset": [f"p{v}" for v in rng.integers(0, 5, n)],
        }
    )


@pytest.mark.parametrize("seed", range(5))
def test_dedup_and_expand_match_croma(seed):
    df = _manifest(seed)
    emb, row_to_source = build_embedding_source_manifest(df)
    ref_emb, ref_rows = ref_alignment.build_embedding_source_manifest(df)
    pd.testing.assert_frame_equal(emb, ref_emb)
    np.testing.assert_array_equal(row_to_source, ref_rows)
    assert row_to_source.dtype == ref_rows.dtype
    features = np.random.default_rng(seed).standard_normal((len(emb), 4)).astype(np.float32)
    out = expand_features_to_manifest(features=features, manifest=df, embedding_manifest=emb)
    np.testing.assert_array_equal(out, ref_alignment.expand_features_to_manifest(features=features, manifest=df, embedding_manifest=emb))
    np.testing.assert_array_equal(out, features[row_to_source])
    assert out.dtype == np.float32 and out.base is not features
    # a shuffled embedding manifest still maps by key, not by position
    perm = np.random.default_rng(seed + 1).permutation(len(emb))
    shuffled = emb.iloc[perm].reset_index(drop=True)
    np.testing.assert_array_equal(expand_features_to_manifest(features=features[perm], manifest=df, embedding_manifest=shuffled), out)


def test_features_accepts_lists():
    df = _manifest(0, 9)
    emb, rows = build_embedding_source_manifest(df)
    out = expand_features_to_manifest(features=[[float(i)] for i in range(len(emb))], manifest=df, embedding_manifest=emb)
    np.testing.assert_array_equal(out[:, 0], rows.astype(float))


def test_group_id_is_part_of_the_identity_key():
    df = _manifest(1, 6).iloc[[0, 0]].reset_index(drop=True)
    df.loc[1, "group_id"] = "other"
    emb, rows = build_embedding_source_manifest(df)
    assert len(emb) == 2 and rows.tolist() == [0, 1]


def test_errors_in_order():
    df = _manifest(2, 12)
    emb, _ = build_embedding_source_manifest(df)
    x = np.zeros((len(emb), 2))
    with pytest.raises(ValueError, match="embeddings rows must match embedding manifest rows"):
        expand_features_to_manifest(features=x[:-1], manifest=df.drop(columns="label"), embedding_manifest=emb)
    with pytest.raises(ValueError, match=r"evaluation manifest is missing .*\['label'\]"):
        expand_features_to_manifest(features=x, manifest=df.drop(columns="label"), embedding_manifest=emb.drop(columns="group_id"))
    with pytest.raises(ValueError, match=r"embedding manifest is missing .*\['group_id'\]"):
        expand_features_to_manifest(features=x, manifest=df, embedding_manifest=emb.drop(columns="group_id"))
    dup = pd.concat([emb, emb.iloc[:1]], ignore_index=True)
    with pytest.raises(ValueError, match="duplicate source rows"):
        expand_features_to_manifest(features=np.zeros((len(dup), 2)), manifest=df, embedding_manifest=dup)
    missing = df.copy()
    missing.loc[7, "image_path"] = "/elsewhere.png"
    with pytest.raises(ValueError, match="evaluation manifest row 7 is missing from embedding manifest"):
        expand_features_to_manifest(features=x, manifest=missing, embedding_manifest=emb)
    with pytest.raises(ValueError, match="confounder"):
        build_embedding_source_manifest(df.rename(columns={"confounder": "center"}))


def test_load_manifest_matches_croma(tmp_path):
    df = _manifest(3, 20).rename(columns={"confounder": "center"})
    df["slide_id"] = "ignored"
    df.loc[4, "label"] = None
    path = tmp_path / "my-view.csv"
    df.to_csv(path, index=False)
    ours = load_manifest(path, confounder_column="center")
    ref = ref_load_manifest(str(path), confounder_column="center")
    assert list(ours.columns) == list(ref.columns)
    for col in ref.columns:
        assert ours[col].astype(str).tolist() == ref[col].astype(str).tolist(), col
    assert (ours["dataset"] == "my-view").all() and ours.loc[4, "label"] == "nan"


def test_load_manifest_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_manifest(tmp_path / "absent.csv", confounder_column="center")
    df = _manifest(4, 6).rename(columns={"confounder": "center", "group_id": "slide_id"})
    path = tmp_path / "m.csv"
    df.to_csv(path, index=False)
    with pytest.raises(ValueError) as err:
        load_manifest(path, confounder_column="center")
    assert "group_id" in str(err.value) and "slide_id" in str(err.value) and str(path) in str(err.value)
    blank = _manifest(4, 6).rename(columns={"confounder": "center"})
    blank.loc[3, "group_id"] = ""
    blank.to_csv(path, index=False)
    with pytest.raises(ValueError, match=r"rows \[3\]"):
        load_manifest(path, confounder_column="center")
