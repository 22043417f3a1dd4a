"""The ``cachescore`` command line (cachescore.cli.main).

Pins: ``run`` on the shipped demo job synthesises the cache, scores RI/MaRI/CRoMa on both views on
a LocalCluster and ranks the encoders in the order the demo cache was built with (its
``cache.json``); a second ``run`` executes nothing; ``status`` reports missing / done / failed /
stale (naming what changed) and, with ``--verify``, the cache's problems; ``watch`` scores exactly
the units of a new encoder written into a scored cache and names why units are pending; a unit failure gives exit code 1 and a failure table, a job-level error exit code 2;
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


@pytest.mark.slow  # ~30 s: the whole shipped demo (28 units incl. 4 probe sweeps) on a LocalCluster
def test_demo_job_ranks_encoders_as_constructed(tmp_path, capsys, monkeypatch):
    import cachescore.pipeline.run as run_mod

    (tmp_path / "jobs").mkdir()
    job_path = tmp_path / "jobs" / "demo.toml"
    shutil.copy(REPO / "jobs" / "demo.toml", job_path)
    plans = []
    real_plan = run_mod.plan_job
    monkeypatch.setattr(run_mod, "plan_job", lambda job, **kw: plans.append(job.name) or real_plan(job, **kw))
    assert main(["run", str(job_path)]) == 0
    assert plans == ["demo"]  # `run` plans the job once: the run's plan also serves the leaderboard
    cap = capsys.readouterr()
    assert re.search(r"dashboard: http://127\.0\.0\.1:\d+/status", cap.err)
    assert "executed 28" in cap.out and "failed 0" in cap.out  # 4 encoders x (2 views x 3 families + 1 probe)
    assert "APD [in_domain]" in cap.out and "nIPD [centre_C]" in cap.out  # probe records in the leaderboard
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
    assert len(scores) == 24 + 4 * 2 * 2  # + per encoder: (in_domain, centre_C) x (apd, nipd)
    probe = scores[scores["design"] == "probe"]
    assert sorted(set(probe["scope"])) == ["centre_C", "in_domain"] and probe["value"].notna().all()
    assert (job.bundles / "enc0" / "centre_all").is_dir()
    scores = scores[scores["design"] != "probe"]  # the construction orders RI/MaRI/CRoMa, not the probe
    for (view, metric), part in scores.groupby(["view", "metric"]):
        by_value = part.sort_values("value", ascending=False)["encoder"].tolist()
        assert by_value == ranking, (view, metric, part[["encoder", "value"]].to_dict("records"))

    assert main(["run", str(job_path), "-q"]) == 0
    assert "executed 0, skipped 28" in capsys.readouterr().out
    assert main(["status", str(job_path)]) == 0
    out = capsys.readouterr().out
    assert out.strip().endswith("40 done")  # probe units are listed per record
    assert sum(line.startswith("enc2 ") and " probe " in line and " done " in line for line in out.splitlines()) == 4
    assert main(["status", str(job_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["counts"] == {"done": 40} and len(doc["units"]) == 40
    metric_units = [u for u in doc["units"] if u["design"] != "probe"]
    assert all(u["ci_low"] <= u["value"] <= u["ci_high"] and u["defined"] and u["rank"] for u in metric_units)
    published = pd.read_parquet(job.store / "scores.parquet")
    for fmt in ("parquet", "csv", "json"):
        out = tmp_path / "export" / f"scores.{fmt}"
        assert main(["export", str(job_path), "--format", fmt, "-o", str(out)]) == 0
        assert f"wrote {out}" in capsys.readouterr().out and out.with_name(f"scores.probe.{fmt}").is_file()
    exported = pd.read_parquet(tmp_path / "export" / "scores.parquet")
    pd.testing.assert_frame_equal(exported, published)
    assert len(pd.read_csv(tmp_path / "export" / "scores.csv")) == 40
    assert len(json.loads((tmp_path / "export" / "scores.json").read_text())) == 40
    assert main(["prune", str(job_path)]) == 0
    assert "would remove 0 stale record(s) and 0 abandoned failure(s)" in capsys.readouterr().out
    assert main(["report", str(job_path)]) == 0
    html_text = (job.store / "report.html").read_text(encoding="utf-8")
    assert "APD · view centre_all · design probe · matrix centre_C" in html_text
    assert "nIPD · view centre_all · design probe · matrix in_domain" in html_text


def test_status_failures_and_stale(tmp_path, capsys):
    cache_root = make_demo_cache(tmp_path / "cache", n_slides_per_cell=2, tiles_per_slide=4, dim=8, encoders=2)
    job_path = tmp_path / "job.toml"
    job_path.write_text(
        'schema_version = 1\n[job]\ncache = "cache"\nstore = "store"\nviews = ["centre_all"]\n'
        '[metrics]\nfamilies = ["ri", "croma"]\n[execution]\nn_workers = 1\nretries = 0\ndashboard = false\n'
        "performance_report = false\n", encoding="utf-8")
    assert main(["status", str(job_path), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "4 missing" in out and "healthy" in out
    assert sum("new encoder" in line for line in out.splitlines()) == 4

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
    assert sum(" failed " in line and "ShardError" in line for line in out.splitlines()) == 2
    # --verify adds the cache health check: the damaged shard is named, exit code 1
    assert main(["status", str(job_path), "--verify"]) == 1
    out = capsys.readouterr().out
    problems = out.split("problem(s)", 1)[1].splitlines()
    assert any(line.startswith(("checksum", "non_finite")) and "enc1" in line for line in problems)
    assert not any("enc0" in line for line in problems)

    assert main(["report", str(job_path), "--out", str(tmp_path / "r.html")]) == 0
    assert "report: " in capsys.readouterr().out
    html_text = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert "enc0" in html_text and "ShardError" in html_text

    # new embeddings for enc0: its results are stale (kept, never reused)
    x = Cache(cache_root).load_rows("enc0", "demo")
    write_embeddings(cache_root, "enc0", "demo", (x[::-1] * 2).copy(), overwrite=True)
    assert main(["status", str(job_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum(" stale " in line and line.startswith("enc0") and "embeddings changed" in line for line in lines) == 2


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


def test_watch_scores_exactly_the_new_encoder(tmp_path, capsys):
    """A new encoder written into a scored cache: one ``watch`` poll finds exactly its units
    (reason "new encoder"), runs them and nothing else; the next poll is up to date. A rewritten
    shard, a changed view and changed parameters are named as such by the poll."""
    from cachescore.cache import write_view
    from cachescore.pipeline import plan_job, poll_job

    cache_root = make_demo_cache(tmp_path / "cache", n_slides_per_cell=2, tiles_per_slide=4, dim=8, encoders=2)
    job_path = tmp_path / "job.toml"
    job_path.write_text(
        'schema_version = 1\n[job]\ncache = "cache"\nstore = "store"\nviews = ["centre_all"]\n'
        '[metrics]\nfamilies = ["ri", "croma"]\n[execution]\nn_workers = 1\nretries = 0\ndashboard = false\n'
        "performance_report = false\n", encoding="utf-8")
    assert main(["run", str(job_path), "-q"]) == 0
    capsys.readouterr()
    job = load_job(job_path)
    before = ResultsStore(job.store).fingerprints()
    assert len(before) == 4

    x = Cache(cache_root).load_rows("enc0", "demo")
    write_embeddings(cache_root, "enc9", "demo", (x * 3.0 + 1.0).astype(np.float32))
    assert main(["watch", str(job_path), "--interval", "0", "--max-runs", "2", "-q"]) == 0
    cap = capsys.readouterr()
    assert "poll 1: 2 unit(s) to score (2 new encoder)" in cap.err
    assert "new encoder: enc9/centre_all/all/ri" in cap.err and "poll 2: up to date" in cap.err
    assert "2 poll(s), 1 run(s), executed 2, failed 0" in cap.out
    store = ResultsStore(job.store)
    new_fps = {u.fingerprint for u in plan_job(job, store=store).units if u.encoder == "enc9"}
    assert len(new_fps) == 2 and store.fingerprints() == before | new_fps
    (run_id,) = [r for r in store.runs() if store.read_provenance(r)["units"]["executed"] == 2]
    assert set(store.read_provenance(run_id)["executed_fingerprints"]) == new_fps

    # what a poll reports for a changed shard, a changed view and changed params (nothing is run)
    write_embeddings(cache_root, "enc0", "demo", (x[::-1] * 2).copy(), overwrite=True)
    frame = Cache(cache_root).read_view("centre_all")
    write_view(cache_root, "centre_all", frame.drop(columns=["row"]).iloc[::-1], tileset="demo",
               confounder_column=Cache(cache_root).view_spec("centre_all").confounder_column,
               design=Cache(cache_root).view_spec("centre_all").design, overwrite=True)
    new, known = poll_job(load_job(job_path))
    reasons = {r["label"]: r["reason"] for r in new}
    assert not known and len(reasons) == 6
    assert reasons["enc0/centre_all/all/ri"] == "embeddings changed, view changed"
    assert reasons["enc1/centre_all/all/croma[m=5]"] == "view changed"
    job_path.write_text(job_path.read_text().replace('families = ["ri", "croma"]',
                                                     'families = ["ri", "croma"]\n[metrics.ri]\nk_candidates = [3, 5]'))
    new, _ = poll_job(load_job(job_path))
    assert {r["label"]: r["reason"] for r in new}["enc1/centre_all/all/ri"] == "params changed"


def test_the_run_table_states_direction_and_verdicts_and_explains_each_warning_once():
    """Issue 24: the same support warning on most rows, cut mid-word, invited warning fatigue; the
    table now marks each score W<n> and explains each kind of warning once, with its count."""
    import pandas as pd

    from cachescore.cli import _leaderboard

    base = {"view": "v", "design": "all", "metric": "ri", "m": None, "scope": None, "ci_level": 0.95,
            "support": 0.97, "k": 5, "defined": True, "low_support": False, "rank_low": 1, "rank_high": 2}
    rows = [dict(base, encoder="a", value=0.8, ci_low=0.7, ci_high=0.9, rank=1, verdict="best",
                 warnings="RuntimeWarning: dataset: RI/MaRI support is 96.8% across subset occurrences."),
            dict(base, encoder="b", value=0.6, ci_low=0.5, ci_high=0.7, rank=2, verdict="worse than a",
                 delta_ci_low=-0.3, delta_ci_high=-0.1,
                 warnings="RuntimeWarning: dataset: RI/MaRI support is 98.6% across subset occurrences."),
            dict(base, encoder="c", value=0.79, ci_low=0.7, ci_high=0.88, rank=1, verdict="no detectable difference from a",
                 delta_ci_low=-0.05, delta_ci_high=0.03, warnings="")]
    text = _leaderboard(pd.DataFrame(rows))
    assert "value (higher = more robust)" in text and "vs best" in text
    lines = text.splitlines()
    assert "W1" in lines[2] and "W1" in lines[3] and "W1" not in lines[4]
    assert "worse ([-0.3000, -0.1000])" in lines[3] and "≈ best" in lines[4]
    assert lines[-1] == ("W1: 2 score(s), e.g. RuntimeWarning: dataset: RI/MaRI support is 96.8% across subset "
                         "occurrences.")


def test_commands_start_without_the_heavy_libraries_and_a_locked_store_is_refused_at_once(demo):
    """Issue 25: every command imported dask, distributed, matplotlib and scikit-learn before doing
    anything. ``import cachescore.cli`` loads none of scikit-learn, scipy, distributed or
    matplotlib, and ``run`` on a store another run holds is refused before importing distributed."""
    import fcntl
    import os
    import subprocess
    import sys

    probe = ("import sys; from cachescore.cli import main; rc = main(sys.argv[1:]); "
             "print(rc, sorted(m for m in ('sklearn', 'scipy', 'distributed', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", "import sys, cachescore.cli; print(sorted(m for m in ('sklearn', "
                          "'scipy', 'distributed', 'matplotlib') if m in sys.modules))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
    fd = os.open(demo.store / "run.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another run holds the store
    try:
        done = subprocess.run([sys.executable, "-c", probe, "run", str(demo.path)], capture_output=True, text=True)
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    assert done.stdout.strip().splitlines()[-1] == "2 []", done.stdout + done.stderr
    assert "is in use by" in done.stderr and "only one run per store at a time" in done.stderr
    assert "[Errno" not in done.stderr
