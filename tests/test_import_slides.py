"""Real cache layouts in: TRIDENT / CLAM per-slide ``.h5`` folders imported from a slide table,
encoders added later, atomic imports, and the names and files bad input gets (issue 15)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

h5py = pytest.importorskip("h5py")

from cachescore.cache import Cache  # noqa: E402
from cachescore.cache.importer import import_cache  # noqa: E402
from cachescore.cli import main  # noqa: E402

N_SLIDES = 24
DIM = 8


def _features(encoder: int, slide: int, n: int) -> np.ndarray:
    rng = np.random.default_rng([encoder, slide])
    return rng.standard_normal((n, DIM + 4 * encoder)).astype(np.float32)


def _trident(root: Path, encoders=(0, 1, 2)) -> tuple[Path, dict, dict]:
    """A TRIDENT-style folder per encoder (``<slide>.h5``: ``features``, ``coords``), slides of
    different tile counts, and a slide CSV (slide_id, label as int, centre, patient)."""
    counts = {f"S{i:02d}": 5 + 3 * i for i in range(N_SLIDES)}
    folders = {}
    for e in encoders:
        folder = root / f"feats_enc{e}"
        folder.mkdir(parents=True)
        for k, (slide, n) in enumerate(counts.items()):
            with h5py.File(folder / f"{slide}.h5", "w") as fh:
                fh["features"] = _features(e, k, n)
                fh["coords"] = np.stack([np.arange(n) * 256, np.full(n, 512 * k)], axis=1).astype(np.int64)
        folders[f"enc{e}"] = folder
    slides = pd.DataFrame({"slide_id": list(counts), "label": [i % 2 for i in range(N_SLIDES)],
                           "centre": ["A", "B", "C"] * (N_SLIDES // 3), "patient": [f"P{i // 2}" for i in range(N_SLIDES)]})
    slides.to_csv(root / "slides.csv", index=False)
    return root / "slides.csv", folders, counts


def _tree(root: Path) -> dict:
    """Every file under ``root`` with its sha256 (the cache's state, byte for byte)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _import_args(cache, csv, folders, names):
    args = ["import", str(cache), "--tileset", "tiles", "--layout", "per_slide", "--manifest", str(csv),
            "--slide-column", "slide_id"]
    for name in names:
        args += ["--encoder", f"{name}={folders[name]}"]
    return args


def test_slide_table_import_then_add_an_encoder(tmp_path, capsys):
    csv, folders, counts = _trident(tmp_path / "src")
    cache = tmp_path / "cache"
    assert main(_import_args(cache, csv, folders, ["enc0", "enc1"])) == 0
    c = Cache(cache)
    tiles = c.read_tileset("tiles")
    assert len(tiles) == sum(counts.values())
    assert tiles["x"].dtype == np.int64 and tiles["y"].dtype == np.int64 and tiles["label"].dtype == np.int64
    assert tiles["tile_index"].dtype == np.int64
    first = tiles[tiles["slide_id"] == "S03"]
    assert first["sample_id"].iloc[1] == "S03:256_1536" and first["centre"].unique().tolist() == ["A"]
    assert first["image_path"].iloc[1] == "S03#1"  # no encoder's file: the manifest is encoder-independent
    for e in (0, 1):
        emb = c.load_rows(f"enc{e}", "tiles", np.arange(len(tiles)))
        expected = np.concatenate([_features(e, k, n) for k, n in enumerate(counts.values())])
        np.testing.assert_array_equal(emb, expected)
    before = _tree(cache)
    # a third encoder lands: added without --overwrite, the first two stay byte-identical
    assert main(_import_args(cache, csv, folders, ["enc2"])) == 0
    after = _tree(cache)
    assert {k: v for k, v in after.items() if k in before} == before
    assert any(k.startswith("embeddings/enc2/") for k in after)
    assert sorted(Cache(cache).encoders()) == ["enc0", "enc1", "enc2"]
    # re-importing identical bytes is a no-op (no flag needed)
    assert main(_import_args(cache, csv, folders, ["enc0", "enc2"])) == 0
    assert _tree(cache) == after


def test_a_different_manifest_or_different_arrays_are_refused(tmp_path):
    csv, folders, _ = _trident(tmp_path / "src", encoders=(0, 1))
    cache = tmp_path / "cache"
    assert main(_import_args(cache, csv, folders, ["enc0"])) == 0
    state = _tree(cache)
    edited = pd.read_csv(csv)
    edited.loc[2, "centre"] = "Z"
    edited.to_csv(tmp_path / "edited.csv", index=False)
    with pytest.raises(Exception, match=r"tileset 'tiles' already exists .* different tile manifest \(column 'centre' "
                                        r"differs first at row \d+"):
        import_cache(cache, tileset="tiles", manifest=tmp_path / "edited.csv", layout="per_slide",
                     slide_column="slide_id", encoders={"enc1": folders["enc1"]})
    # enc0 under enc1's files: different arrays need --overwrite, which replaces only enc0
    with pytest.raises(FileExistsError, match="encoder 'enc0' already has different embeddings .* pass --overwrite"):
        import_cache(cache, tileset="tiles", manifest=csv, layout="per_slide", slide_column="slide_id",
                     encoders={"enc0": folders["enc1"]})
    assert _tree(cache) == state
    assert main(_import_args(cache, csv, folders, ["enc1"])) == 0
    enc1 = {k: v for k, v in _tree(cache).items() if k.startswith("embeddings/enc1/")}
    assert main(_import_args(cache, csv, {"enc0": folders["enc1"]}, ["enc0"]) + ["--overwrite"]) == 0
    now = _tree(cache)
    assert {k: v for k, v in now.items() if k.startswith("embeddings/enc1/")} == enc1
    np.testing.assert_array_equal(Cache(cache).load_rows("enc0", "tiles", np.arange(5)),
                                  Cache(cache).load_rows("enc1", "tiles", np.arange(5)))


def test_nan_in_the_second_of_three_encoders_leaves_the_cache_unchanged(tmp_path):
    csv, folders, _ = _trident(tmp_path / "src")
    cache = tmp_path / "cache"
    bad = folders["enc1"] / "S04.h5"
    with h5py.File(bad, "r+") as fh:
        data = fh["features"][...]
        data[3, 1] = np.nan
        fh["features"][...] = data
    with pytest.raises(ValueError, match=r"encoder 'enc1' \(rows are the tiles of .*slides\.csv's slides\): NaN or "
                                         r"infinite values at rows \[\d+\] \(slide 'S04' tile 3\)"):
        import_cache(cache, tileset="tiles", manifest=csv, layout="per_slide", slide_column="slide_id",
                     encoders={k: folders[k] for k in ("enc0", "enc1", "enc2")})
    assert not cache.exists() or _tree(cache) == {}, _tree(cache)
    assert not cache.exists() or not any(cache.rglob("enc*")), "an empty encoder folder was left"
    assert not any(cache.rglob("*.partial")) if cache.exists() else True
    # an existing cache stays exactly as it was
    assert main(_import_args(cache, csv, folders, ["enc0"])) == 0
    state = _tree(cache)
    with pytest.raises(ValueError, match="encoder 'enc1'"):
        import_cache(cache, tileset="tiles", manifest=csv, layout="per_slide", slide_column="slide_id",
                     encoders={k: folders[k] for k in ("enc2", "enc1")})
    assert _tree(cache) == state and not list(cache.rglob("*.partial"))
    with h5py.File(bad, "r+") as fh:  # fixed: the retry needs no flag
        data[3, 1] = 0.0
        fh["features"][...] = data
    assert main(_import_args(cache, csv, folders, ["enc1", "enc2"])) == 0
    assert sorted(Cache(cache).encoders()) == ["enc0", "enc1", "enc2"]


def test_slides_that_disagree_across_encoders_are_named(tmp_path):
    csv, folders, counts = _trident(tmp_path / "src", encoders=(0, 1))
    with h5py.File(folders["enc1"] / "S05.h5", "r+") as fh:
        coords = fh["coords"][...]
        coords[2] = [9, 9]
        fh["coords"][...] = coords
    with pytest.raises(ValueError, match=r"slide 'S05': encoder 'enc1' .* coords \[9, 9\] at tile 2"):
        import_cache(tmp_path / "c1", tileset="t", manifest=csv, layout="per_slide", slide_column="slide_id",
                     encoders=folders)
    (folders["enc1"] / "S07.h5").unlink()
    with h5py.File(folders["enc1"] / "S07.h5", "w") as fh:
        fh["features"] = _features(1, 7, counts["S07"] - 1)
    with pytest.raises(ValueError, match=r"slide 'S05'|slide 'S07': encoder 'enc1' has \d+ tiles"):
        import_cache(tmp_path / "c2", tileset="t", manifest=csv, layout="per_slide", slide_column="slide_id",
                     encoders=folders)
    (folders["enc1"] / "S09.h5").unlink()
    with pytest.raises(FileNotFoundError, match=r"encoder 'enc1', slide 'S09'"):
        import_cache(tmp_path / "c3", tileset="t", manifest=csv, layout="per_slide", slide_column="slide_id",
                     encoders=folders)


def test_bad_names_files_and_views_get_clear_errors(tmp_path, capsys):
    csv, folders, _ = _trident(tmp_path / "src", encoders=(0,))
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"invalid encoder name 'enc\\n'"):
        import_cache(cache, tileset="t", manifest=csv, layout="per_slide", slide_column="slide_id",
                     encoders={"enc\n": folders["enc0"]})
    # a per-slide folder without --layout per_slide: with a slide table, and with a tile manifest
    assert main(["import", str(cache), "--tileset", "t", "--manifest", str(csv), "--encoder",
                 f"enc0={folders['enc0']}"]) == 2
    err = capsys.readouterr().err
    assert "missing required columns ['sample_id', 'image_path'] (a slide table needs --layout per_slide" in err
    pd.DataFrame({"sample_id": ["a", "b"], "image_path": ["a.png", "b.png"], "group_id": ["S00", "S00"]}).to_csv(
        tmp_path / "tiles.csv", index=False)
    assert main(["import", str(cache), "--tileset", "t", "--manifest", str(tmp_path / "tiles.csv"), "--encoder",
                 f"enc0={folders['enc0']}"]) == 2
    err = capsys.readouterr().err
    assert "is a folder" in err and "--layout per_slide" in err and "file not found" not in err
    # a view whose label is blank on some slides: refused before anything is written
    slides = pd.read_csv(csv)
    slides["label"] = slides["label"].astype(object)
    slides.loc[[1, 4], "label"] = ""
    slides.to_csv(tmp_path / "blank.csv", index=False)
    with pytest.raises(ValueError, match=r"view 'v': column 'label' .* blank or null at \d+ row\(s\)"):
        import_cache(cache, tileset="t", manifest=tmp_path / "blank.csv", layout="per_slide", slide_column="slide_id",
                     encoders=folders, views={"v": {"confounder_column": "centre"}})
    assert not cache.exists() or _tree(cache) == {}
    # a job file that is not UTF-8
    job = tmp_path / "job.toml"
    job.write_bytes(b"[job]\nname = \"caf\xe9\"\n")
    assert main(["status", str(job)]) == 2
    err = capsys.readouterr().err
    assert str(job) in err and "not UTF-8" in err


def test_view_from_the_cli_subsamples_reproducibly_and_the_probe_sweep_runs_on_it(tmp_path, capsys):
    import io

    from cachescore.jobs import parse_job
    from cachescore.pipeline import run_job

    csv, folders, counts = _trident(tmp_path / "src", encoders=(0, 1))
    cache = tmp_path / "cache"
    assert main(_import_args(cache, csv, folders, ["enc0", "enc1"])) == 0
    capsys.readouterr()
    view = ["view", str(cache), "--tileset", "tiles", "--confounder", "centre", "--group", "slide_id"]
    assert main(view + ["--name", "v8", "--rows-per-slide", "8", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    small = sorted(s for s, n in counts.items() if n < 8)
    assert f"dropped {len(small)} slide(s) with fewer than 8 tiles: {small[0]} ({counts[small[0]]})" in out
    v8 = Cache(cache).read_view("v8")
    per_slide = v8.groupby("group_id").size()
    assert set(per_slide) == {8} and sorted(per_slide.index) == sorted(s for s, n in counts.items() if n >= 8)
    assert main(view + ["--name", "v8", "--rows-per-slide", "8", "--seed", "3", "--overwrite"]) == 0
    pd.testing.assert_frame_equal(Cache(cache).read_view("v8"), v8)  # same seed, same view
    assert main(view + ["--name", "v8b", "--rows-per-slide", "8", "--seed", "4"]) == 0
    assert set(Cache(cache).read_view("v8b")["sample_id"]) != set(v8["sample_id"])
    assert main(view + ["--name", "vmin", "--rows-per-slide", "8", "--min-rows", "5"]) == 0
    kept = Cache(cache).read_view("vmin").groupby("group_id").size()
    assert len(kept) == N_SLIDES and kept[small[0]] == counts[small[0]] and kept.max() == 8
    assert main(view + ["--name", "vab", "--where", "centre=A", "--where", "centre=B"]) == 0
    assert set(Cache(cache).read_view("vab")["centre"]) == {"A", "B"}
    assert main(view + ["--name", "bad", "--label", "nope"]) == 2
    assert "no column 'nope'" in capsys.readouterr().err
    # the probe sweep on a rows-per-slide view: exactly N rows per slide, as the sweep needs
    assert main(view + ["--name", "probe5", "--rows-per-slide", "5"]) == 0
    doc = {"schema_version": 1,
           "job": {"cache": str(cache), "store": str(tmp_path / "store"), "views": ["probe5"],
                   "probe_views": ["probe5"]},
           "metrics": {"families": ["ri"], "ri": {"k_candidates": [3]}},
           "probe": {"rows_per_slide": 5, "iterations": 2, "id_filter": {"column": "centre", "values": ["A", "B"]},
                     "test_sets": {"centre_C": {"column": "centre", "value": "C"}},
                     "schedule": [{"split_map": [[0, 0, 5], [0, 1, 5], [1, 0, 5], [1, 1, 5]], "max_train_slides": 1},
                                  {"split_map": [[0, 0, 5], [1, 1, 5]], "max_train_slides": 1}]},
           "execution": {"n_workers": 1, "dashboard": False, "performance_report": False}}
    summary = run_job(parse_job(doc, path=tmp_path / "job.toml"), processes=False, out=io.StringIO())
    assert summary.ok, summary.failures
    probe = pd.read_parquet(tmp_path / "store" / "probe.parquet")
    assert set(probe["encoder"]) == {"enc0", "enc1"} and len(probe) > 0



def _probe_job_file(tmp_path, cache, view, *, rows_per_slide=5, schedule=None, test_value="C",
                    max_train=(1, 1)) -> Path:
    """A job file scoring RI and the probe sweep on ``view`` (TOML written by hand: no writer dependency)."""
    schedule = schedule or [("[[0, 0, 5], [0, 1, 5], [1, 0, 5], [1, 1, 5]]", max_train[0]),
                            ("[[0, 0, 5], [1, 1, 5]]", max_train[1])]
    splits = "".join(f"\n[[probe.schedule]]\nsplit_map = {sm}\nmax_train_slides = {m}\n" for sm, m in schedule)
    text = f"""schema_version = 1
[job]
cache = "{cache}"
store = "{tmp_path / 'store'}"
views = ["{view}"]
probe_views = ["{view}"]
[metrics]
families = ["ri"]
[metrics.ri]
k_candidates = [3]
[probe]
rows_per_slide = {rows_per_slide}
iterations = 2
id_filter = {{ column = "centre", values = ["A", "B"] }}
[probe.test_sets.centre_C]
column = "centre"
value = "{test_value}"
{splits}
[execution]
n_workers = 1
dashboard = false
performance_report = false
"""
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_validate_catches_schedule_mistakes_with_counts_before_any_cluster(tmp_path, capsys):
    csv, folders, _ = _trident(tmp_path / "src", encoders=(0, 1))
    cache = tmp_path / "cache"
    assert main(_import_args(cache, csv, folders, ["enc0", "enc1"])) == 0
    assert main(["view", str(cache), "--tileset", "tiles", "--confounder", "centre", "--group", "slide_id",
                 "--name", "p5", "--rows-per-slide", "5"]) == 0
    capsys.readouterr()
    good = _probe_job_file(tmp_path, cache, "p5")
    assert main(["validate", str(good)]) == 0
    out = capsys.readouterr().out
    assert "probe view p5: ok (slides per confounder/class cell: {'A/0': 4, 'A/1': 4, 'B/0': 4, 'B/1': 4}" in out
    assert "4 unit(s) to run, 0 up to date, 0 invalid" in out
    assert not (tmp_path / "store").exists()  # validate writes nothing
    cases = {
        "rows_per_slide": (dict(rows_per_slide=10, schedule=[("[[0, 0, 10], [0, 1, 10], [1, 0, 10], [1, 1, 10]]", 1),
                                                             ("[[0, 0, 10], [1, 1, 10]]", 1)]), "rows_per_slide=10"),
        "empty test set": (dict(test_value="Z"), "selects no row"),
        "unequal max_train_slides": (dict(max_train=(1, 2)), "different max_train_slides [1, 2]"),
        "too many train slides": (dict(max_train=(4, 4)), "leaves no test rows -- the cells are too small for the "
                                                          "row counts and held-out tail it asks for [slides per "
                                                          "(confounder/class) cell: {'A/0': 4"),
    }
    for name, (kw, expected) in cases.items():
        path = _probe_job_file(tmp_path, cache, "p5", **kw)
        assert main(["validate", str(path)]) == 2, name
        out = capsys.readouterr().out
        assert "INVALID" in out and expected in out, (name, out[-1500:])
    # run makes the same checks first: the probe units are refused at once, the metric units still run
    path = _probe_job_file(tmp_path, cache, "p5", max_train=(1, 2))
    assert main(["run", str(path), "-q"]) == 1
    cap = capsys.readouterr()
    assert "executed 2," in cap.out and "different max_train_slides" in cap.err


def test_npy_slide_folders_and_blank_view_values(tmp_path, capsys):
    """``.npy`` per slide (no coords): tiles are ``<slide>:<tile_index>``; a view over a column with
    blank values is refused naming the rows."""
    folder = tmp_path / "npy"
    folder.mkdir()
    counts = {"a": 3, "b": 4}
    for k, (slide, n) in enumerate(counts.items()):
        np.save(folder / f"{slide}.npy", _features(0, k, n))
    pd.DataFrame({"slide": ["a", "b"], "label": [0, 1], "centre": ["X", ""]}).to_csv(tmp_path / "s.csv", index=False)
    cache = tmp_path / "cache"
    assert main(["import", str(cache), "--tileset", "t", "--layout", "per_slide", "--manifest",
                 str(tmp_path / "s.csv"), "--slide-column", "slide", "--encoder", f"e={folder}"]) == 0
    tiles = Cache(cache).read_tileset("t")
    assert tiles["sample_id"].tolist() == ["a:0", "a:1", "a:2", "b:0", "b:1", "b:2", "b:3"]
    assert "x" not in tiles.columns and tiles["tile_index"].tolist() == [0, 1, 2, 0, 1, 2, 3]
    capsys.readouterr()
    assert main(["view", str(cache), "--tileset", "t", "--name", "v", "--confounder", "centre", "--group", "slide"]) == 2
    err = capsys.readouterr().err
    assert "confounder column 'centre' is blank or null at 4 tile(s): tileset rows [3, 4, 5, 6]" in err


def test_a_view_is_deleted_by_name_and_nothing_else_is_touched(tmp_path, capsys):
    csv, folders, _ = _trident(tmp_path / "src", encoders=(0,))
    cache = tmp_path / "cache"
    assert main(_import_args(cache, csv, folders, ["enc0"])) == 0
    view = ["view", str(cache), "--tileset", "tiles", "--confounder", "centre", "--group", "slide_id"]
    assert main(view + ["--name", "keep"]) == 0 and main(view + ["--name", "scratch"]) == 0
    capsys.readouterr()
    before = {k: v for k, v in _tree(cache).items() if "scratch" not in k}
    assert main(["view", str(cache), "--delete", "scratch"]) == 0
    assert "view scratch deleted" in capsys.readouterr().out
    assert Cache(cache).views() == ["keep"] and _tree(cache) == before
    assert main(["view", str(cache), "--delete", "scratch"]) == 2  # gone: named, with what there is
    err = capsys.readouterr().err
    assert "no view 'scratch' in cache" in err and "(views: keep)" in err
    assert main(["view", str(cache), "--name", "x"]) == 2
    assert "--tileset, --confounder required to write a view" in capsys.readouterr().err


def test_an_imports_view_of_every_tile_is_published_from_the_tilesets_bytes(tmp_path):
    """The import's view of every manifest row is the tileset's table: it is published from the
    bytes tiles.parquet was written with (one encoding, not two), and those are exactly the bytes
    write_view encodes for the same rows on its own; a view of other rows is encoded for itself."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from cachescore.cache.writer import StoredTable, parquet_bytes, write_view

    csv, folders, counts = _trident(tmp_path / "src", encoders=(0,))
    slides = pd.read_csv(csv)
    slides.assign(group_id=slides["patient"]).to_csv(csv, index=False)
    cache = tmp_path / "cache"
    assert main(_import_args(cache, csv, folders, ["enc0"]) + ["--link", "--view", "v=centre:all"]) == 0
    tiles_file, view_file = cache / "tilesets/tiles/tiles.parquet", cache / "views/v.parquet"
    assert view_file.read_bytes() == tiles_file.read_bytes()
    sidecar = json.loads((cache / "views/v.json").read_text())
    assert sidecar["table_sha256"] == hashlib.sha256(view_file.read_bytes()).hexdigest()
    # the same rows written through the public path (no tileset table given): the same bytes, the same frame
    c = Cache(cache, mode="a")
    stored = c.read_tileset("tiles").drop(columns=["row"], errors="ignore")
    write_view(c, "w", stored, tileset="tiles", confounder_column="centre", design="all")
    assert (cache / "views/w.parquet").read_bytes() == tiles_file.read_bytes()
    pd.testing.assert_frame_equal(Cache(cache).read_view("v"), Cache(cache).read_view("w"))
    assert len(Cache(cache).read_view("v")) == sum(counts.values())
    # a table that differs from the tileset's is encoded on its own, never given the tileset's bytes
    like = StoredTable(pq.read_table(tiles_file), pa.py_buffer(tiles_file.read_bytes()))
    reversed_rows = stored.iloc[::-1].reset_index(drop=True)
    out = parquet_bytes(reversed_rows, string_columns=("sample_id", "image_path"), source="t", like=like)
    assert out.data.to_pybytes() != like.data.to_pybytes()
    back = pq.read_table(pa.BufferReader(out.data)).to_pandas()
    assert back["sample_id"].tolist() == reversed_rows["sample_id"].tolist()
