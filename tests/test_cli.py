"""The ``cachescore`` command line (cachescore.cli.main).

Pins: ``run`` on the shipped demo job synthesises the cache, scores RI/MaRI/CRoMa on both views on
a LocalCluster and ranks the encoders in the order the demo cache was built with (its
``cache.json``); a second ``run`` executes nothing; ``status`` reports missing / done / failed /
stale; a unit failure gives exit code 1 and a failure table, a job-level error exit code 2;
``import`` builds a cache from a ``.npy`` and a manifest; ``schema`` lists the keys.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from cachescore.cache import Cache, make_demo_cache, write_embeddings
from cachescore.cli import main
from cachescore.jobs import load_job
from cachescore.store import ResultsStore

REPO = Path(__file__).resolve().parents[1]



@pytest.fixture(autouse=True)
def _pinned_code_version(monkeypatch):
    """Pin the code version: other people edit metrics/ and neighbors/ while these tests run, and
    an edit between two runs would (correctly) change every fingerprint."""
    monkeypatch.setenv("CACHESCORE_CODE_VERSION", "test-pinned")



def test_schema_command(capsys):
    assert main(["schema"]) == 0
    out = capsys.readouterr().out
    assert "[metrics.croma]" in out and "auto_threshold" in out and "k_candidates" in out


def test_job_errors_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('schema_version = 1\n[job]\ncache = "c"\nstore = "s"\nfoo = 1\n', encoding="utf-8")
    assert main(["run", str(bad)]) == 2
    assert "unknown key 'job.foo'" in capsys.readouterr().err
    assert main(["status", str(tmp_path / "missing.toml")]) == 2
    assert "job file not found" in capsys.readouterr().err
    good = tmp_path / "good.toml"
    good.write_text('schema_version = 1\n[job]\ncache = "nocache"\nstore = "s"\n', encoding="utf-8")
    assert main(["run", str(good), "-q"]) == 2
    assert "cache folder not found" in capsys.readouterr().err


def test_demo_job_ranks_encoders_as_constructed(tmp_path, capsys):
    (tmp_path / "jobs").mkdir()
    job_path = tmp_path / "jobs" / "demo.toml"
    shutil.copy(REPO / "jobs" / "demo.toml", job_path)
    assert main(["run", str(job_path)]) == 0
    cap = capsys.readouterr()
    assert re.search(r"dashboard: http://127\.0\.0\.1:\d+/status", cap.err)
    assert "executed 24" in cap.out and "failed 0" in cap.out
    job = load_job(job_path)
    report = re.search(r"performance report: (\S+)", cap.out).group(1)
    assert Path(report).is_file() and Path(report).parent.parent == job.store / "runs"

    store = ResultsStore(job.store)
    (run_id,) = store.runs()
    hw = store.read_provenance(run_id)["hardware"]
    assert hw["scheduler"].startswith("tcp://127.0.0.1:") and len(hw["workers"]) == 2
    assert all(w["address"].startswith("tcp://127.0.0.1:") and w["nthreads"] == 1 for w in hw["workers"])

    ranking = json.loads((job.cache / "cache.json").read_text())["intended_confounder_ranking"]
    assert ranking == ["enc0", "enc1", "enc2", "enc3"]
    scores = ResultsStore(job.store).scores()
    assert len(scores) == 24
    for (view, metric), part in scores.groupby(["view", "metric"]):
        by_value = part.sort_values("value", ascending=False)["encoder"].tolist()
        assert by_value == ranking, (view, metric, part[["encoder", "value"]].to_dict("records"))

    assert main(["run", str(job_path), "-q"]) == 0
    assert "executed 0, skipped 24" in capsys.readouterr().out
    assert main(["status", str(job_path)]) == 0
    out = capsys.readouterr().out
    assert out.strip().endswith("24 done")


def test_status_failures_and_stale(tmp_path, capsys):
    cache_root = make_demo_cache(tmp_path / "cache", n_slides_per_cell=2, tiles_per_slide=4, dim=8, encoders=2)
    job_path = tmp_path / "job.toml"
    job_path.write_text(
        'schema_version = 1\n[job]\ncache = "cache"\nstore = "store"\nviews = ["centre_all"]\n'
        '[metrics]\nfamilies = ["ri", "croma"]\n[execution]\nn_workers = 1\nretries = 0\ndashboard = false\n'
        "performance_report = false\n", encoding="utf-8")
    assert main(["status", str(job_path)]) == 0
    assert capsys.readouterr().out.strip().endswith("4 missing")

    shard = sorted((cache_root / "embeddings" / "enc1" / "demo").glob("*.npy"))[0]
    data = bytearray(shard.read_bytes())
    data[-4:] = b"\x00\x00\xc0\x7f"  # a NaN in the last value; the checksum no longer matches
    shard.write_bytes(bytes(data))
    assert main(["run", str(job_path), "-q"]) == 1
    cap = capsys.readouterr()
    assert "succeeded 2, failed 2" in cap.out
    assert "2 unit(s) failed" in cap.err and "enc1/centre_all/all/ri" in cap.err and "ShardError" in cap.err

    assert main(["status", str(job_path)]) == 0
    out = capsys.readouterr().out
    assert out.strip().endswith("2 done, 2 failed")
    assert all("enc1" in line for line in out.splitlines() if " failed " in line and "ShardError" in line)

    assert main(["report", str(job_path), "--out", str(tmp_path / "r.html")]) == 0
    assert "report: " in capsys.readouterr().out
    html_text = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert "enc0" in html_text and "ShardError" in html_text

    # new embeddings for enc0: its results are stale (kept, never reused)
    x = Cache(cache_root).load_rows("enc0", "demo")
    write_embeddings(cache_root, "enc0", "demo", (x[::-1] * 2).copy(), overwrite=True)
    assert main(["status", str(job_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum(" stale " in line and line.startswith("enc0") for line in lines) == 2


def test_import_command(tmp_path, capsys):
    rng = np.random.default_rng(0)
    n = 12
    manifest = pd.DataFrame({"sample_id": [f"t{i}" for i in range(n)], "image_path": [f"img/{i}.png" for i in range(n)],
                             "label": ["a", "b"] * 6, "group_id": [f"g{i // 2}" for i in range(n)],
                             "centre": ["x"] * 6 + ["y"] * 6})
    manifest.to_csv(tmp_path / "tiles.csv", index=False)
    np.save(tmp_path / "enc.npy", rng.standard_normal((n, 4)).astype(np.float32))
    rc = main(["import", str(tmp_path / "cache"), "--tileset", "tiles", "--manifest", str(tmp_path / "tiles.csv"),
               "--encoder", f"encA={tmp_path / 'enc.npy'}", "--view", "v=centre:all"])
    assert rc == 0, capsys.readouterr().err
    assert "imported encA" in capsys.readouterr().out
    cache = Cache(tmp_path / "cache")
    assert cache.encoders() == ["encA"] and cache.views() == ["v"]
    np.testing.assert_array_equal(cache.load_rows("encA", "tiles"), np.load(tmp_path / "enc.npy"))
    assert main(["import", str(tmp_path / "cache2"), "--tileset", "t", "--manifest", "x.csv"]) == 2
    assert "--encoder" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["bogus"]])
def test_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
