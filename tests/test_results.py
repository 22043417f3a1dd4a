"""Pins cachescore.results: the tidy score table's intervals, flags and ranks (ADR-0009).

The demo job is run once (in-process cluster); its ``<store>/scores.parquet`` must read with
``pd.read_parquet`` and carry the documented columns. CRoMa intervals and rank intervals equal
croma 1.0.1's ``bootstrap_pooled_median`` / ``paired_rank_stability`` on the stored per-unit
values; the RI / MaRI pooled-ratio bootstrap equals a plain per-replicate reference (croma's draw
rule, rows concatenated per replicate); a single-confounder view is ``defined = false`` and
unranked; APD intervals are percentiles over the probe replicates.
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from croma.metrics import bootstrap as ref

from cachescore.cache import Cache, make_demo_cache, write_view
from cachescore.jobs import parse_job
from cachescore.jobs.sections import as_dict
from cachescore.metrics import bootstrap as ours
from cachescore.pipeline import plan_job, run_job
from cachescore.results import SCORE_COLUMNS, compare_encoders, score_table
from cachescore.store import ResultsStore

REPO = Path(__file__).resolve().parents[1]
REQUIRED = {"encoder", "view", "design", "metric", "m", "value", "ci_low", "ci_high", "ci_level", "support",
            "defined", "low_support", "rank", "rank_low", "rank_high", "recall", "n_units", "warnings",
            "fingerprint", "code_version", "finished_at"}


def _groups(job, view, per_unit):
    frame = Cache(job.cache).read_view(view)
    return frame["group_id"].astype(str).to_numpy()[per_unit["source_index"].to_numpy()]


def test_scores_parquet_reads_with_pandas_and_has_the_columns(demo):
    df = pd.read_parquet(demo.store / "scores.parquet")
    assert REQUIRED <= set(df.columns) and list(df.columns) == list(SCORE_COLUMNS)
    assert len(df) == 40 and df["defined"].all()
    metric = df[df["metric"].isin(["ri", "mari", "croma"])]
    assert (metric["ci_low"] <= metric["value"]).all() and (metric["value"] <= metric["ci_high"]).all()
    assert (metric["n_boot"] == 2000).all() and (metric["ci_level"] == 0.95).all()
    assert df["rank"].notna().all() and (df["rank_low"].dropna() <= df["rank"][df["rank_low"].notna()]).all()
    probe = pd.read_parquet(demo.store / "probe.parquet")
    assert len(probe) == 4 * 2 * 2 * 5  # encoders x matrices x splits x replicates
    assert set(probe["test_set"]) == {"in_domain", "centre_C"} and probe["accuracy"].between(0, 1).all()


def test_croma_intervals_and_ranks_equal_croma_bootstrap(demo):
    store = ResultsStore(demo.store)
    df = pd.read_parquet(demo.store / "scores.parquet")
    rows = df[(df["metric"] == "croma") & (df["design"] == "all")]
    values, groups = {}, None
    for r in rows.itertuples():
        pu = store.per_unit(r.fingerprint)
        groups = _groups(demo, r.view, pu)
        values[r.encoder] = pu["value"].to_numpy()
        ci = ref.bootstrap_pooled_median(values[r.encoder], groups, n_boot=2000, level=0.95, seed=0)
        assert (r.value, r.ci_low, r.ci_high) == (ci.point, ci.lo, ci.hi)
    rs = ref.paired_rank_stability(values, groups, n_boot=2000, level=0.95, seed=0)
    for r in rows.itertuples():
        assert (r.rank, r.rank_low, r.rank_high) == (rs.point_rank[r.encoder], rs.rank_lo[r.encoder],
                                                      rs.rank_hi[r.encoder])
        assert r.mean_rank == pytest.approx(rs.mean_rank[r.encoder], abs=0)
        wins = __import__("json").loads(r.win_fractions)
        assert wins == {b: rs.pairwise_win[(r.encoder, b)] for b in values if b != r.encoder}


def _reference_ratio_ci(so, os_, groups, n_boot, level, seed, point):
    """croma's draw rule with rows concatenated per replicate (no vectorisation)."""
    ids = np.unique(groups)
    rows = [np.flatnonzero(groups == g) for g in ids]
    rng = np.random.default_rng(seed)
    boot = []
    for _ in range(n_boot):
        pick = rng.integers(0, len(ids), len(ids))
        sel = np.concatenate([rows[p] for p in pick])
        s, o = so[sel].sum(), os_[sel].sum()
        boot.append(s / (s + o) if s + o > 0 else np.nan)
    return ours.percentile_ci(np.asarray(boot), point, level, n_boot)  # pinned against croma in test_bootstrap


@pytest.mark.parametrize("metric", ["ri", "mari"])
@pytest.mark.parametrize("design", ["all", "paired_2x2"])
def test_pooled_ratio_intervals_equal_a_plain_reference(demo, metric, design):
    store = ResultsStore(demo.store)
    df = pd.read_parquet(demo.store / "scores.parquet")
    rows = df[(df["metric"] == metric) & (df["design"] == design)]
    assert len(rows) == 4
    for r in rows.itertuples():
        pu = store.per_unit(r.fingerprint)
        so, os_ = pu["so"].to_numpy(), pu["os"].to_numpy()
        assert so.sum() / (so.sum() + os_.sum()) == pytest.approx(r.value, rel=1e-12)  # the stored pooled value
        want = _reference_ratio_ci(so, os_, _groups(demo, r.view, pu), 2000, 0.95, 0, r.value)
        assert r.ci_low == pytest.approx(want.lo, rel=1e-12) and r.ci_high == pytest.approx(want.hi, rel=1e-12)


def test_paired_croma_interval_is_the_balanced_median_bootstrap(demo):
    store = ResultsStore(demo.store)
    df = pd.read_parquet(demo.store / "scores.parquet")
    r = df[(df["metric"] == "croma") & (df["design"] == "paired_2x2") & (df["encoder"] == "enc1")].iloc[0]
    pu = store.per_unit(r["fingerprint"])
    groups, subsets, values = _groups(demo, r["view"], pu), pu["subset"].to_numpy(), pu["value"].to_numpy()
    ids = np.unique(groups)
    members = [np.flatnonzero(groups == g) for g in ids]
    rng = np.random.default_rng(0)
    boot = []
    for _ in range(2000):
        sel = np.concatenate([members[p] for p in rng.integers(0, len(ids), len(ids))])
        boot.append(np.median([np.median(values[sel][subsets[sel] == s]) for s in np.unique(subsets[sel])]))
    want = ours.percentile_ci(np.asarray(boot), r["value"], 0.95, 2000)
    assert r["value"] == np.median([np.median(values[subsets == s]) for s in np.unique(subsets)])
    assert (r["ci_low"], r["ci_high"]) == pytest.approx((want.lo, want.hi), rel=1e-12)


def test_apd_interval_is_over_probe_replicates(demo):
    df = pd.read_parquet(demo.store / "scores.parquet")
    store = ResultsStore(demo.store)
    r = df[(df["metric"] == "apd") & (df["scope"] == "in_domain") & (df["encoder"] == "enc0")].iloc[0]
    acc = np.asarray(store.record(r["fingerprint"])["matrix"])
    drops = (acc[1:] / acc[0]).mean(axis=0) - 1
    assert r["value"] == pytest.approx(drops.mean(), abs=1e-15)
    assert (r["ci_low"], r["ci_high"]) == pytest.approx(tuple(np.percentile(drops, [2.5, 97.5])), abs=1e-15)
    assert r["ci_method"] == "percentile over probe replicates" and r["n_boot"] == acc.shape[1]


def test_a_single_confounder_view_is_refused_at_plan_time(tmp_path):
    root = tmp_path / "cache"
    make_demo_cache(root, n_slides_per_cell=2, tiles_per_slide=4, dim=8, encoders=2, seed=3)
    frame = Cache(root).read_view("centre_all")
    one = frame[frame["centre"] == frame["centre"].iloc[0]]
    write_view(root, "one_centre", one[[c for c in one.columns if c != "row"]], tileset="demo",
               confounder_column="centre", design="all")
    job = parse_job({"schema_version": 1, "job": {"cache": str(root), "store": str(tmp_path / "store"),
                                                  "views": ["one_centre", "centre_all"]},
                     "metrics": {"families": ["ri", "croma"]},
                     "execution": {"n_workers": 1, "dashboard": False, "performance_report": False}},
                    path=tmp_path / "job.toml")
    plan = plan_job(job)
    assert len(plan.invalid) == 4 and {u.view for u in plan.pending} == {"centre_all"}
    assert all(i.error.startswith("view 'one_centre': column 'centre' has a single value") for i in plan.invalid)
    summary = run_job(job, processes=False, out=io.StringIO())
    assert len(summary.failures) == 4 and summary.succeeded == 4
    df = pd.read_parquet(job.store / "scores.parquet")
    assert set(df["view"]) == {"centre_all"} and df["defined"].all()


def test_a_support_zero_score_is_undefined_and_unranked(tmp_path):
    """Four tight cells far apart, k = 3 within each cell's other slides: every window holds only
    same-label-same-confounder rows, so support is 0 and RI/MaRI are croma's 0.5 fallback."""
    root = tmp_path / "cache"
    rng = np.random.default_rng(0)
    rows = []
    for c, (lab, centre) in enumerate([(0, "A"), (0, "B"), (1, "A"), (1, "B")]):
        for s in range(3):
            for t in range(4):
                rows.append({"sample_id": f"c{c}s{s}t{t}", "image_path": f"c{c}s{s}t{t}.png", "label": lab,
                             "centre": centre, "group_id": f"c{c}s{s}"})
    tiles = pd.DataFrame(rows)
    x = (np.repeat(np.eye(8)[:4] * 10, 12, axis=0) + rng.normal(0, 0.01, (48, 8))).astype(np.float32)
    from cachescore.cache import write_embeddings, write_tileset

    write_tileset(root, "ts", tiles)
    for enc in ("e0", "e1"):
        noise = np.zeros_like(x) if enc == "e0" else rng.normal(0, 0.01, x.shape).astype(np.float32)
        write_embeddings(root, enc, "ts", x + noise)
    write_view(root, "v", tiles[["sample_id"]], tileset="ts", confounder_column="centre", design="all")
    job = parse_job({"schema_version": 1, "job": {"cache": str(root), "store": str(tmp_path / "store")},
                     "metrics": {"families": ["ri", "mari"], "ri": {"k_candidates": [3]}, "mari": {"k_candidates": [3]}},
                     "execution": {"n_workers": 1, "dashboard": False, "performance_report": False}},
                    path=tmp_path / "job.toml")
    summary = run_job(job, processes=False, out=io.StringIO())
    assert summary.ok
    df = pd.read_parquet(job.store / "scores.parquet")
    assert len(df) == 4 and (df["support"] == 0).all() and (df["value"] == 0.5).all()
    assert not df["defined"].any() and df["rank"].isna().all() and df["ci_low"].isna().all()
    assert all(r.startswith("support 0") for r in df["undefined_reason"])


def test_low_support_is_flagged_but_ranked(demo):
    store = ResultsStore(demo.store)
    plan = plan_job(demo, store=store)
    strict = score_table(store, Cache(demo.cache), plan.record_fingerprints(), min_support=0.99)
    ri = strict[strict["metric"] == "ri"]
    flagged = ri[ri["support"] < 0.99]
    assert len(flagged) and flagged["low_support"].all() and flagged["rank"].notna().all()
    assert not ri[ri["support"] >= 0.99]["low_support"].any()


@pytest.mark.parametrize("design", ["all", "paired_2x2"])
def test_compare_croma_equals_croma_paired_delta(demo, design):
    from cachescore.results import compare_encoders

    store = ResultsStore(demo.store)
    plan = plan_job(demo, store=store)
    rows = compare_encoders(store, Cache(demo.cache), plan.record_fingerprints(), "enc1", "enc2", metric="croma")
    (row,) = [r for r in rows if r["design"] == design]
    df = pd.read_parquet(demo.store / "scores.parquet")
    pick = df[(df["metric"] == "croma") & (df["design"] == design)].set_index("encoder")
    pa_, pb = store.per_unit(pick.loc["enc1", "fingerprint"]), store.per_unit(pick.loc["enc2", "fingerprint"])
    kw = {"subset_ids": pa_["subset"].to_numpy()} if design == "paired_2x2" else {}
    want = ref.paired_cluster_bootstrap_delta(pa_["value"].to_numpy(), pb["value"].to_numpy(),
                                              _groups(demo, pick.loc["enc1", "view"], pa_), n_boot=2000, level=0.95,
                                              seed=0, **kw)
    assert (row["delta"], row["ci_low"], row["ci_high"]) == pytest.approx((want.point, want.lo, want.hi), abs=1e-15)
    assert row["verdict"] in ("enc1 more robust", "enc2 more robust", "no detectable difference")
    if row["ci_high"] < 0:
        assert row["verdict"] == "enc1 more robust" and row["win_fraction"] < 0.05


def test_compare_cli(demo, capsys):
    from cachescore.cli import main

    assert main(["compare", str(demo.path), "enc0", "enc3", "--view", "centre_all"]) == 0
    out = capsys.readouterr().out
    assert "enc0 more robust" in out and "delta = enc3 - enc0" in out
    assert main(["compare", str(demo.path), "enc0", "enc3", "--metric", "ri", "--json"]) == 0
    rows = __import__("json").loads(capsys.readouterr().out)
    assert {r["design"] for r in rows} == {"all", "paired_2x2"} and all(r["delta"] < 0 for r in rows)
    assert main(["compare", str(demo.path), "enc0", "nope"]) == 2
    assert "no stored score of encoder(s) nope" in capsys.readouterr().err


def test_nipd_interval_is_over_per_replicate_nipd_and_centres_are_tabled(demo):
    from cachescore.probe.reductions import nipd
    from cachescore.results.bundles import bundle_facts

    store = ResultsStore(demo.store)
    df = pd.read_parquet(demo.store / "scores.parquet")
    r = df[(df["metric"] == "nipd") & (df["scope"] == "centre_C") & (df["encoder"] == "enc2")].iloc[0]
    record = store.record(r["fingerprint"])
    facts = bundle_facts(record["bundle"])
    assert facts.cramers_v == [0.0, 1.0] and facts.chance == 0.5
    acc = np.asarray(record["matrix"])
    per_rep = [nipd(np.ascontiguousarray(acc[:, [j]]), facts.cramers_v, facts.chance) for j in range(acc.shape[1])]
    assert (r["ci_low"], r["ci_high"]) == pytest.approx(tuple(np.percentile(per_rep, [2.5, 97.5])), abs=1e-15)
    assert r["ci_method"].startswith("percentile over probe replicates")
    centres = pd.read_parquet(demo.store / "probe_centres.parquet")
    assert set(centres["encoder"]) == {"enc0", "enc1", "enc2", "enc3"} and set(centres["role"]) >= {"in_domain",
                                                                                                   "centre_C"}
    assert centres["balanced_accuracy"].between(0, 1).all()


def test_smallest_c_warning(tmp_path):
    from cachescore.results.bundles import BundleFacts

    assert BundleFacts(smallest_c_share=0.5, smallest_c=1e-8).smallest_c_warning == ""
    warn = BundleFacts(smallest_c_share=0.7, smallest_c=1e-8).smallest_c_warning
    assert warn.startswith("in 70% of the probes the validation-selected C was the grid's smallest (1e-08)")
    # advice a user can follow (issue 24): the grid is the protocol's, not a job key
    assert "widen the C grid" not in warn and "fixed by the PathoROB protocol" in warn
    assert "cachescore status JOB --verify" in warn and "[probe] schedule" in warn


def test_identical_encoders_share_their_rank_and_span_both_positions(demo, tmp_path):
    """Issue 24: two byte-identical encoders were ranked 2 and 3 with intervals [2, 2] and [3, 3]
    (a tie broken by name reported as a certainty). Now both take the best rank they span and
    an interval covering both positions; the others keep croma's ranks (no tie there)."""
    import shutil

    shutil.copytree(demo.store, tmp_path / "store")
    store = ResultsStore(tmp_path / "store")
    job = plan_job(demo, store=store)
    fps = job.record_fingerprints()
    df = score_table(store, Cache(demo.cache), fps, bootstrap=as_dict(demo.metrics.bootstrap))
    row = df[(df["metric"] == "croma") & (df["design"] == "all") & (df["encoder"] == "enc1")].iloc[0]
    twin = "f" * 64
    record = dict(store.record(row["fingerprint"]), encoder="enc1twin")
    store.write_unit(twin, record=record, per_unit=store.per_unit(row["fingerprint"]))
    tied = score_table(store, Cache(demo.cache), fps + [twin], bootstrap=as_dict(demo.metrics.bootstrap))
    part = tied[(tied["metric"] == "croma") & (tied["design"] == "all") & (tied["view"] == row["view"])]
    part = part.set_index("encoder")
    assert part.loc["enc1", "rank"] == part.loc["enc1twin", "rank"] == row["rank"]
    for enc in ("enc1", "enc1twin"):
        assert part.loc[enc, "rank_low"] <= row["rank"] and part.loc[enc, "rank_high"] >= row["rank"] + 1
    assert __import__("json").loads(part.loc["enc1", "win_fractions"])["enc1twin"] == 0.0
    before = df[(df["metric"] == "croma") & (df["design"] == "all") & (df["view"] == row["view"])].set_index("encoder")
    higher = [e for e in before.index if before.loc[e, "rank"] < row["rank"]]
    assert all(part.loc[e, "rank"] == before.loc[e, "rank"] for e in higher)  # those above are unmoved
    # the twins' verdicts against the best agree with compare's (same paired draw) and never differ
    best = part.index[part["verdict"] == "best"].tolist()
    assert len(best) == 1 and part.loc[best[0], "rank"] == 1 and part.loc[best[0], "delta_vs_best"] == 0.0
    assert part.loc["enc1", "verdict"] == part.loc["enc1twin", "verdict"]
    assert part.loc["enc1", "delta_ci_low"] == part.loc["enc1twin", "delta_ci_low"]
    for enc in part.index.drop(best):
        rows = compare_encoders(store, Cache(demo.cache), fps + [twin], best[0], enc, view=row["view"], metric="croma",
                                bootstrap=as_dict(demo.metrics.bootstrap))
        [cmp] = [r for r in rows if r["design"] == "all"]
        assert (cmp["ci_low"], cmp["ci_high"]) == (part.loc[enc, "delta_ci_low"], part.loc[enc, "delta_ci_high"])
        assert part.loc[enc, "verdict"] == (f"worse than {best[0]}" if cmp["verdict"] == f"{best[0]} more robust"
                                           else f"no detectable difference from {best[0]}")


def test_a_clearly_better_encoder_is_best_and_the_others_are_worse_than_it(demo):
    """The demo's encoders are built with growing confounder strength: on RI, enc0 is best and every
    other encoder's paired interval against it excludes 0 (verdict "worse than enc0")."""
    store = ResultsStore.open(demo.store)
    df = score_table(store, Cache(demo.cache), plan_job(demo, store=store).record_fingerprints(),
                     bootstrap=as_dict(demo.metrics.bootstrap))
    ri = df[(df["metric"] == "ri") & (df["view"] == "centre_all")].set_index("encoder")
    assert ri.loc["enc0", "verdict"] == "best" and ri.loc["enc0", "best_encoder"] == "enc0"
    for enc in ("enc1", "enc2", "enc3"):
        assert ri.loc[enc, "verdict"] == "worse than enc0", ri.loc[enc, ["delta_ci_low", "delta_ci_high"]]
        assert ri.loc[enc, "delta_vs_best"] < 0 and ri.loc[enc, "delta_ci_high"] < 0
    assert df.loc[~df["defined"], "verdict"].eq("").all()


def test_span_ranks_equal_ordered_ranks_without_ties_and_cover_ties():
    rng = np.random.default_rng(3)
    reps = rng.standard_normal((500, 4))
    names = ["a", "b", "c", "d"]
    points = dict(zip(names, reps.mean(axis=0)))
    a = ours.rank_summary(names, points, reps, ties="ordered")
    b = ours.rank_summary(names, points, reps, ties="span")
    assert a["point_rank"] == b["point_rank"] and a["rank_lo"] == b["rank_lo"] and a["rank_hi"] == b["rank_hi"]
    assert a["mean_rank"] == pytest.approx(b["mean_rank"], abs=1e-12)
    tied = np.column_stack([reps[:, 0], reps[:, 0], reps[:, 2]])
    s = ours.rank_summary(["x", "y", "z"], {"x": 1.0, "y": 1.0, "z": 0.0}, tied, ties="span")
    assert s["point_rank"] == {"x": 1, "y": 1, "z": 3}
    assert s["rank_lo"]["x"] == s["rank_lo"]["y"] and s["rank_hi"]["x"] == s["rank_hi"]["y"] >= 2
    assert s["pairwise_win"][("x", "y")] == 0.0
    with pytest.raises(ValueError, match="ties must be"):
        ours.rank_summary(["x"], {"x": 1.0}, np.zeros((1, 1)), ties="name")


def test_the_readme_recipe_keeps_every_score_apart_and_the_report_states_the_direction(demo, tmp_path):
    """Issue 24: the README's pandas recipe averaged probe test sets (and m values) together, and
    nothing said which end of a score is better."""
    import re

    from cachescore.report import DIRECTION, build_report

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```python\n(import pandas as pd\nscores = .*?)```", readme, re.S).group(1)
    head, last = block.replace("results/demo/scores.parquet", str(demo.store / "scores.parquet")).rstrip().rsplit("\n", 1)
    scope = {}
    exec(f"{head}\nresult = {last}", scope)  # the recipe as written, its last expression kept
    table, scores = scope["result"], scope["scores"]
    assert table.size == int(scores["defined"].sum()) == table.notna().sum().sum()  # one cell per score
    probe = scores[(scores["metric"] == "apd") & (scores["encoder"] == "enc0")]
    assert len(probe) == 2 and set(probe["scope"]) == {"in_domain", "centre_C"}  # two test sets, two cells
    page = build_report(demo.store, tmp_path / "r.html").read_text(encoding="utf-8")
    assert "Higher is more robust, for every metric" in DIRECTION and DIRECTION.split(":")[0] in page
    assert "higher is more robust" in readme.lower()


def test_probe_centres_are_named_and_the_report_shows_the_run_that_produced_the_scores(demo, tmp_path):
    """Issue 24: ``probe_centres.parquet`` gave centres as codes 0-3, and the report's provenance
    showed the latest (no-op) run, not the one that wrote the scores."""
    import io
    import shutil

    from cachescore.pipeline import run_job
    from cachescore.report import build_report

    centres = pd.read_parquet(demo.store / "probe_centres.parquet")
    assert set(centres["centre"]) == {"A", "B", "C"} and set(centres["confounder_column"]) == {"centre"}
    assert set(centres.loc[centres["role"] == "centre_C", "centre"]) == {"C"}
    shutil.copytree(demo.store, tmp_path / "store")
    job = dataclasses.replace(demo, store=tmp_path / "store")
    producing = ResultsStore.open(job.store).scores()["run_id"].dropna().unique().tolist()
    noop = run_job(job, processes=False, out=io.StringIO())
    assert noop.executed == 0 and noop.run_id not in producing
    page = build_report(job.store, tmp_path / "r.html").read_text(encoding="utf-8")
    section = page[page.index('<h2 id="provenance">Provenance of the run that produced the latest scores'):]
    assert f"<td>{producing[0]}</td>" in section.split("<h3>")[0] and len(producing) == 1


def test_a_publication_with_nothing_new_reads_no_per_unit_table_and_one_new_record_recomputes_its_group(
        demo, tmp_path, monkeypatch):
    """Issue 25: every run recomputed every score's CI (a no-op re-score took 47 s). Groups whose
    records, settings and code are unchanged come from ``<store>/table-cache``; rows are identical."""
    import shutil

    from cachescore.results import publish_results
    from cachescore.results import scores as scores_mod
    from cachescore.store import TABLE_CACHE_DIR

    shutil.copytree(demo.store, tmp_path / "store")
    shutil.rmtree(tmp_path / "store" / TABLE_CACHE_DIR, ignore_errors=True)
    store = ResultsStore(tmp_path / "store")
    fps = plan_job(dataclasses.replace(demo, store=tmp_path / "store"), store=store).record_fingerprints()
    kw = dict(bootstrap=as_dict(demo.metrics.bootstrap), min_support=0.5)
    calls = []
    real = scores_mod._metric_entry
    monkeypatch.setattr(scores_mod, "_metric_entry", lambda fp, *a, **k: calls.append(fp) or real(fp, *a, **k))
    publish_results(store, demo.cache, fps, **kw)
    first, n_first = pd.read_parquet(tmp_path / "store" / "scores.parquet"), len(calls)
    assert n_first == int((first["design"] != "probe").sum()) > 0
    kept = sorted((tmp_path / "store" / TABLE_CACHE_DIR).glob("*.parquet"))
    assert len(kept) == first.groupby(["view", "design", "scope", "metric", "m"], dropna=False).ngroups
    publish_results(store, demo.cache, fps, **kw)  # nothing new: no entry is recomputed
    second = pd.read_parquet(tmp_path / "store" / "scores.parquet")
    assert len(calls) == n_first
    pd.testing.assert_frame_equal(first, second)
    # one more record in one group (a twin encoder's RI on centre_all): that group only
    row = first[(first["metric"] == "ri") & (first["view"] == "centre_all")].iloc[0]
    twin = "e" * 64
    store.write_unit(twin, record=dict(store.record(row["fingerprint"]), encoder="enc9"),
                     per_unit=store.per_unit(row["fingerprint"]))
    publish_results(store, demo.cache, fps + [twin], **kw)
    third = pd.read_parquet(tmp_path / "store" / "scores.parquet")
    group = first[(first["metric"] == "ri") & (first["view"] == "centre_all") & (first["design"] == row["design"])]
    assert len(calls) - n_first == 1 and len(group) > 1  # the new record only: its group's others are kept entries
    assert len(third) == len(first) + 1 and "enc9" in set(third["encoder"])
    others = lambda df: df[~((df["metric"] == "ri") & (df["view"] == "centre_all"))].reset_index(drop=True)  # noqa: E731
    pd.testing.assert_frame_equal(others(first), others(third))
    assert len(list((tmp_path / "store" / TABLE_CACHE_DIR).glob("*.parquet"))) == len(kept)  # superseded removed


def test_unit_tasks_keep_their_entries_and_a_table_from_them_is_the_same(demo, monkeypatch):
    """Issue 25: the unit tasks compute their records' score entries (interval, replicates) on the
    worker and keep them in ``<store>/table-cache/entries``; a table built from the kept entries
    draws no replicate and equals one computed from the per-unit tables."""
    from cachescore.results import scores as scores_mod
    from cachescore.results.memo import EntryMemo, entry_token

    store = ResultsStore(demo.store)
    fps = list(plan_job(demo, store=store).record_fingerprints())
    bootstrap = dict(scores_mod.BOOTSTRAP_DEFAULTS, **as_dict(demo.metrics.bootstrap))
    metric_fps = [fp for fp in fps if store.record(fp)["design"] != "probe"]
    kept = EntryMemo(demo.store, writable=False)
    assert metric_fps and all(kept.get(entry_token(fp, bootstrap, demo.report.min_support)) is not None
                              for fp in metric_fps)
    computed = score_table(store, Cache(demo.cache), fps, bootstrap=bootstrap, min_support=demo.report.min_support)
    calls = []
    real = scores_mod._metric_entry
    monkeypatch.setattr(scores_mod, "_metric_entry", lambda fp, *a, **k: calls.append(fp) or real(fp, *a, **k))
    from_kept = score_table(store, Cache(demo.cache), fps, bootstrap=bootstrap, min_support=demo.report.min_support,
                            entries=kept)
    assert calls == []
    pd.testing.assert_frame_equal(computed, from_kept)


def test_a_runs_entries_are_computed_by_its_unit_tasks_not_by_its_publication(demo, tmp_path, monkeypatch):
    """The worker keeps each stored unit's entry (:func:`cachescore.results.scores.keep_entries`),
    so the publication after the run computes none (in-process cluster: tasks run on worker threads)."""
    import threading

    from cachescore.results import scores as scores_mod

    job = parse_job({"schema_version": 1,
                     "job": {"cache": str(demo.cache), "store": str(tmp_path / "store"), "encoders": ["enc0", "enc1"],
                             "views": ["centre_all", "centre_paired"]},
                     "metrics": {"families": ["ri", "croma"]},
                     "execution": {"n_workers": 1, "dashboard": False, "performance_report": False}},
                    path=tmp_path / "job.toml")
    threads = []
    real = scores_mod._metric_entry
    monkeypatch.setattr(scores_mod, "_metric_entry",
                        lambda fp, *a, **k: threads.append(threading.current_thread().name) or real(fp, *a, **k))
    summary = run_job(job, processes=False, out=io.StringIO())
    assert summary.ok and summary.succeeded == 8
    assert len(threads) == 8 and threading.main_thread().name not in threads, threads
    assert len(pd.read_parquet(tmp_path / "store" / "scores.parquet")) == 8


def test_a_kept_entry_reads_back_as_written_and_a_damaged_one_is_a_miss(tmp_path):
    from cachescore.results.memo import EntryMemo

    memo = EntryMemo(tmp_path, writable=True)
    reps = np.array([0.25, np.nan, 1e-300, -0.0])
    entry = {"encoder": "enc0", "value": float("nan"), "m": None, "defined": True, "warnings": "a\nb", "_reps": reps}
    memo.put("t1", entry)
    memo.put("t2", dict(entry, _reps=None))
    got = memo.get("t1")
    np.testing.assert_array_equal(got.pop("_reps"), reps)
    assert got["warnings"] == "a\nb" and got["m"] is None and got["value"] != got["value"]
    assert memo.get("t2")["_reps"] is None
    path = memo.folder / "t1.entry"
    path.write_bytes(path.read_bytes()[:-3])  # truncated
    assert memo.get("t1") is None and memo.get("absent") is None
    EntryMemo(tmp_path, writable=False).put("t3", entry)  # read-only: writes nothing
    assert sorted(p.name for p in memo.folder.iterdir()) == ["t1.entry", "t2.entry"]
    assert memo.keep_only(["t2"]) == 1 and memo.get("t2") is not None
