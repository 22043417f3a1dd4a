"""Out-of-core, distributed search of large scopes (cachescore.neighbors.large_scope).

Pins: with every cluster probed (the ``exact`` backend) the tables equal the in-memory exact
engines (cross-group: identical indices and bits; typed: within spec §12.3's float32 distance
tolerance, since the typed engine converts similarities while this one computes distances); with
``ann`` on clustered data the calibrated probe fraction prunes (< 1) and the measured recall reaches
the target; paired scopes are matched to their own tables; through the pipeline, a unit planned
with ``engine = "distributed"`` never loads the view into one task (every read is at most one
chunk), gives the in-memory API's values, records its recall, fails cleanly on NaN rows while the
other encoder finishes, leaves no scratch behind, and a second run executes nothing.

The partition constants are shrunk (monkeypatch) so that a few thousand rows make many chunks,
clusters, batches and target pieces; the cluster is in-process (the real scheduler + worker
processes test is in ``test_cluster_cli.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import threading
import warnings

import numpy as np
import pandas as pd
import pytest

from cachescore.cache import Cache, RowSource, write_embeddings, write_view
from cachescore.cache.writer import write_tileset
from cachescore.jobs import parse_job
from cachescore.manifest import prepare
from cachescore.neighbors.exact import cross_group_knn
from cachescore.neighbors.normalize import normalize_rows
from cachescore.neighbors.recall import recall_counts
from cachescore.neighbors.typed import typed_knn
from cachescore.neighbors import large_scope as ls
from cachescore.neighbors import topk
from cachescore.pipeline import plan_job, run_job
from cachescore.pipeline import batch as batch_mod
from cachescore.pipeline import large_unit as large_mod
from cachescore.pipeline import unit as unit_mod
from cachescore.store import ResultsStore
from blas_equality import assert_same_distances, assert_same_search

pytestmark = [
    # distributed's client side sometimes leaves an unbound TCP socket (laddr 0.0.0.0:0) to the
    # garbage collector (see test_blocked_search.py); this module creates no socket itself
    pytest.mark.filterwarnings("ignore:unclosed <socket.socket:ResourceWarning"),
    pytest.mark.filterwarnings("ignore:Exception ignored in. <socket.socket:pytest.PytestUnraisableExceptionWarning"),
]

#: spec §12.3: float32 distances of two kernels agree to ~4e-7 absolute
F32_DIST_TOL = 4e-7


@pytest.fixture(autouse=True)
def _small_partition(monkeypatch):
    monkeypatch.setattr(ls.files, "CHUNK_BYTES", 900 * 32 * 4)  # 900-row chunks at d = 32
    monkeypatch.setattr(ls.files, "ROWS_PER_CLUSTER", 150)
    monkeypatch.setattr(ls.files, "KMEANS_MIN_SAMPLE", 500)
    monkeypatch.setattr(ls.files, "KMEANS_MAX_SAMPLE", 800)
    monkeypatch.setattr(ls.files, "BATCH_ROWS", 600)
    monkeypatch.setattr(ls.files, "PIECE_ROWS", 1200)
    monkeypatch.setattr(ls.files, "CALIBRATION_QUERIES", 600)


def clustered_rows(n, d, *, seed, n_labels=2, n_conf=3, n_morph=10, slide=20):
    """Tiles of ``n_morph`` shared morphologies + label, confounder and slide effects + noise."""
    rng = np.random.default_rng(seed)
    g = np.arange(n) // slide
    ng = int(g.max()) + 1
    lab = rng.integers(0, n_labels, ng)[g]
    conf = rng.integers(0, n_conf, ng)[g]
    morph = rng.integers(0, n_morph, n)
    x = (3.0 * rng.standard_normal((n_morph, d))[morph] + 0.6 * rng.standard_normal((n_labels, d))[lab]
         + 0.8 * rng.standard_normal((n_conf, d))[conf] + 0.3 * rng.standard_normal((ng, d))[g]
         + rng.standard_normal((n, d)))
    tiles = pd.DataFrame({"sample_id": [f"t{i}" for i in range(n)], "image_path": [f"img/{i}.png" for i in range(n)],
                          "group_id": [f"slide{k}" for k in g], "label": [f"L{k}" for k in lab],
                          "centre": [f"C{k}" for k in conf]})
    return x.astype(np.float32), tiles


def write_cache(root, n=3600, d=32, encoders=("enc0", "enc1"), seed=0, paired=False):
    x, tiles = clustered_rows(n, d, seed=seed)
    write_tileset(root, "ts", tiles)
    arrays = {}
    for i, enc in enumerate(encoders):
        arrays[enc] = x + np.float32(0.1 * i) * np.random.default_rng(100 + i).standard_normal(x.shape, dtype=np.float32)
        write_embeddings(root, enc, "ts", arrays[enc])
    view = tiles[["sample_id", "label", "group_id", "centre"]]
    write_view(root, "all", view, tileset="ts", confounder_column="centre", design="all")
    if paired:
        parts = []
        for a, b in (("C0", "C1"), ("C0", "C2"), ("C1", "C2")):
            part = view[view["centre"].isin([a, b])].copy()
            part["subset"] = f"{a}+{b}"
            parts.append(part)
        write_view(root, "paired", pd.concat(parts, ignore_index=True), tileset="ts", confounder_column="centre",
                   design="paired_2x2")
    return arrays


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("large") / "cache"
    arrays = write_cache(root, paired=True)
    return root, arrays


@pytest.fixture(scope="module")
def client():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as c:
        yield c


def scope_rows(root, view, design, encoder="enc0"):
    frame = Cache(root).read_view(view)
    prepared = prepare(frame, confounder_column="centre", evaluation_design=design)
    tile_rows = frame["row"].to_numpy()
    return prepared, {
        f"s{i}": ls.ScopeRows(embeddings=RowSource(str(root), encoder, "ts"), tile_rows=tile_rows[sc.rows],
                              groups=sc.groups, labels=sc.labels, confounders=sc.confounders, source=f"{view}/{sc.subset}",
                              name=sc.subset)
        for i, sc in enumerate(prepared.scopes)
    }, tile_rows


def test_probing_every_cluster_equals_the_exact_engines(cache_root, client, tmp_path):
    root, arrays = cache_root
    prepared, scopes, tile_rows = scope_rows(root, "all", "all")
    sc = prepared.scopes[0]
    search = ls.LargeScopeSearch(client, scopes, tmp_path / "scratch", exact=True)
    idx, dist = search.cross(None, sc.groups, 25)
    so, os_ = search.typed(None, sc.labels, sc.confounders, sc.groups, 7)
    u = normalize_rows(arrays["enc0"][tile_rows[sc.rows]])
    e_idx, e_dist = cross_group_knn(u, sc.groups, 25)
    assert_same_search((idx, dist), (e_idx, e_dist), u)  # bit-identical on a shape-invariant BLAS
    e_so, e_os = typed_knn(u, sc.labels, sc.confounders, sc.groups, 7)
    np.testing.assert_allclose(np.asarray(so), e_so, rtol=0, atol=F32_DIST_TOL)
    np.testing.assert_allclose(np.asarray(os_), e_os, rtol=0, atol=F32_DIST_TOL)
    assert [d["exact"] for d in search.details] == [True, True] and search.recall == 1.0
    # the recorded work is what an exact search computes: every pair cross-group; typed, each
    # query against its SO pool (same label, other confounder) and OS pool (the reverse)
    cross_info, typed_info = search.details
    n = sc.groups.size
    same_l = sc.labels[:, None] == sc.labels[None, :]
    same_c = sc.confounders[:, None] == sc.confounders[None, :]
    assert cross_info["search_pairs"] == n * n and cross_info["probe_fraction"] == 1.0
    assert typed_info["search_pairs"] == int((same_l != same_c).sum()) and typed_info["probe_fraction"] == 1.0
    assert cross_info["search_task_seconds"] > 0
    # several chunks, clusters and batches were involved
    part = tmp_path / "scratch" / "s0" / "partition"
    assert len(list(part.glob("chunk-?????.npy"))) == len(list(part.glob("chunk-?????.meta.npy"))) == 4


def test_ann_prunes_on_clustered_data_and_meets_the_recall_target(cache_root, client, tmp_path):
    root, arrays = cache_root
    prepared, scopes, tile_rows = scope_rows(root, "all", "all")
    sc = prepared.scopes[0]
    search = ls.LargeScopeSearch(client, scopes, tmp_path / "scratch", recall_target=0.99, n_recall_queries=400,
                                 random_state=3)
    idx, dist = search.cross(None, sc.groups, 25)
    so, os_ = search.typed(None, sc.labels, sc.confounders, sc.groups, 7)
    cross_info, typed_info = search.details
    assert cross_info["probe_fraction"] < 1 and typed_info["probe_fraction"] < 1, search.details
    assert cross_info["recall"] >= 0.99 and typed_info["recall"] >= 0.99
    assert cross_info["n_recall_queries"] == 400
    # against the exact tables over every row (not just the audit sample)
    u = normalize_rows(arrays["enc0"][tile_rows[sc.rows]])
    e_idx, e_dist = cross_group_knn(u, sc.groups, 25)
    hits = np.mean([np.isin(a, b).mean() for a, b in zip(np.asarray(idx), e_idx)])
    assert hits >= 0.99
    # every returned neighbour is valid: other group, exact distance, sorted
    idx = np.asarray(idx)
    assert (sc.groups[idx] != sc.groups[:, None]).all()
    recomputed = np.clip(1 - np.einsum("ij,ikj->ik", u, u[idx]), 0, 2)
    np.testing.assert_allclose(np.asarray(dist), recomputed, rtol=0, atol=F32_DIST_TOL)
    assert (np.diff(np.asarray(dist), axis=1) >= 0).all()
    e_so, e_os = typed_knn(u, sc.labels, sc.confounders, sc.groups, 7)
    assert (np.asarray(so) >= e_so - F32_DIST_TOL).all() and (np.asarray(os_) >= e_os - F32_DIST_TOL).all()
    # the recall contract over every row (not just the audit sample), per typed table: a found
    # distance within tolerance of the row's m-th exact one is a hit (tie-robust)
    for found, exact in ((so, e_so), (os_, e_os)):
        hits, total = recall_counts(np.asarray(found), exact, F32_DIST_TOL)
        assert hits / total >= 0.99, (hits / total, search.details)


def test_paired_scopes_are_searched_separately(cache_root, client, tmp_path):
    root, arrays = cache_root
    prepared, scopes, tile_rows = scope_rows(root, "paired", "paired_2x2")
    assert len(prepared.scopes) == 3
    search = ls.LargeScopeSearch(client, scopes, tmp_path / "scratch", exact=True)
    for sc in reversed(prepared.scopes):  # a scope is found by its reference, in any order
        u = normalize_rows(arrays["enc0"][tile_rows[sc.rows]])
        idx, dist = search.cross(None, sc.groups, 10, scope=sc.subset)
        np.testing.assert_array_equal(np.asarray(idx), cross_group_knn(u, sc.groups, 10)[0])
    again = prepared.scopes[0]  # asked again (RI/MaRI may): the same scope, its tables reused
    np.testing.assert_array_equal(np.asarray(search.cross(None, again.groups, 10, scope=again.subset)[0]),
                                  cross_group_knn(normalize_rows(arrays["enc0"][tile_rows[again.rows]]), again.groups,
                                                  10)[0])
    with pytest.raises(LookupError, match="no large scope named 'nowhere'"):
        search.cross(None, np.zeros(5, dtype=np.int64), 3, scope="nowhere")
    with pytest.raises(LookupError, match="no large scope named None"):  # several scopes: a reference is needed
        search.cross(None, again.groups, 3)
    with pytest.raises(ValueError, match="passes 5 rows' codes"):
        search.cross(None, np.zeros(5, dtype=np.int64), 3, scope=again.subset)


@pytest.mark.parametrize("sorted_queries", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_one_pass_over_cross_and_typed_targets_equals_two(monkeypatch, seed, sorted_queries):
    """:meth:`Targets.search` with the cross-group and typed tables at once (random probe plans,
    duplicated rows for ties, tiles of 10 x 33 so pairs meet in tiles of every shape) gives each
    table bit for bit as a search of that table alone, and so does the all-rows form. Queries
    in scattered order take the gathered typed merges; ordered by (cluster, label, confounder), as
    the search tasks order them, the typed sets are runs, all merged from views of the tiles."""
    from cachescore.neighbors import partition
    from cachescore.neighbors.large_scope import tasks

    monkeypatch.setattr(tasks, "topk_tiles", functools.partial(partition.topk_tiles, tq=10, tt=33))
    views = []

    def merge(bi, bd, sim, *args):
        views.append(sim.base is not None and bi.base is not None)
        return topk.merge_similarity_tile(bi, bd, sim, *args)

    monkeypatch.setattr(tasks, "merge_similarity_tile", merge)
    rng = np.random.default_rng(seed)
    n, d, n_conf, n_lab, c, nq = 700, 96, 3, 2, 9, 300
    v = rng.standard_normal((n, d)).astype(np.float32)
    v[rng.integers(0, n, 100)] = v[rng.integers(0, n, 100)]
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    meta = np.stack([rng.permutation(n), rng.integers(0, 40, n), rng.integers(0, n_lab, n),
                     rng.integers(0, n_conf, n)], 1).astype(np.int64)
    cl = rng.integers(0, c, n).astype(np.int32)
    t = tasks.Targets(n_conf, v, meta, cl)
    by = np.lexsort((meta[:nq, 3], meta[:nq, 2], cl[:nq])) if sorted_queries else np.arange(nq)
    qv, q_codes, qcl = v[:nq][by], (meta[:nq, 1][by], meta[:nq, 2][by], meta[:nq, 3][by]), cl[:nq][by]

    def tables(widths):
        return {kind: (np.full((nq, k), -1, np.int64), np.full((nq, k), np.inf)) for kind, k in widths.items()}

    def some(size):
        return np.sort(rng.choice(c, size, replace=False))

    plans = {a: {"cross": some(rng.integers(1, c + 1)),
                 "cells": {tc: some(rng.integers(1, c + 1)) for tc in range(n_lab * n_conf) if rng.random() < 0.8}}
             for a in range(c)}
    for everything in (False, True):
        both, cross, typed = tables({"cross": 7, "so": 3, "os": 3}), tables({"cross": 7}), tables({"so": 3, "os": 3})
        for a in ([None] if everything else range(c)):
            qs = np.arange(nq) if everything else np.flatnonzero(qcl == a)
            plan = None if everything else plans[a]
            for res in (both, cross, typed):
                t.search(qv, q_codes, qs, res, plan)
        assert (typed["so"][0] >= 0).sum() > nq  # something was found
        if not everything:  # one cluster's queries: all typed merges from views when ordered
            assert all(views) == sorted_queries
        views.clear()
        assert_same_search(both["cross"], cross["cross"], v)  # bit for bit on a shape-invariant BLAS
        for kind in ("so", "os"):
            assert_same_search(both[kind], typed[kind], v)


@pytest.mark.parametrize("exact", [True, False])
def test_expected_tables_are_searched_in_one_pass_with_the_same_results(cache_root, client, tmp_path, exact):
    """With the job's tables expected, asking for the cross-group table also completes the typed
    tables of the scope in the same search tasks (ADR-0024), and both equal what two separate
    searches give, bit for bit, with the same probe rules and recall; an expected table nobody
    asks for costs time only."""
    root, _ = cache_root
    prepared, scopes, _ = scope_rows(root, "all", "all")
    sc = prepared.scopes[0]
    opts = dict(exact=exact, recall_target=0.99, n_recall_queries=400, random_state=3)
    alone = ls.LargeScopeSearch(client, scopes, tmp_path / "alone", **opts)
    want_cross = alone.cross(None, sc.groups, 25)
    want_typed = alone.typed(None, sc.labels, sc.confounders, sc.groups, 7)
    asked = []

    def expected(ref):
        asked.append(ref.n)
        return [(("cross",), 25), (("so", "os"), 7), (("cross",), 11)]

    both = ls.LargeScopeSearch(client, scopes, tmp_path / "both", expected=expected, **opts)
    got_cross = both.cross(None, sc.groups, 25)
    assert asked == [sc.groups.size]
    folder = both._folder("s0", ("so", "os"), 7)
    assert (folder / "done.json").is_file()  # searched with the cross-group table
    assert not (both._folder("s0", ("cross",), 11) / "done.json").exists()  # one table per kind in a pass
    got_typed = both.typed(None, sc.labels, sc.confounders, sc.groups, 7)
    u = np.zeros((1, 32), np.float32)  # the dtype and width the blas_equality helpers need
    assert_same_search(tuple(map(np.asarray, got_cross)), tuple(map(np.asarray, want_cross)), u)
    for g, w in zip(got_typed, want_typed):
        assert_same_distances(np.asarray(g), np.asarray(w), u)
    (c_alone, t_alone), (c_both, t_both) = alone.details, both.details
    assert c_both["searched_with"] == ["so/os"] and t_both["searched_with"] == ["cross"]
    for a, b in ((c_alone, c_both), (t_alone, t_both)):
        for key in ("recall", "probe_radius", "probe_min_rows", "probe_fraction", "search_pairs", "rounds"):
            assert a[key] == b[key], key
    # one pass computes fewer pairs than the two (typed pairs inside the cross-group probe are shared)
    assert c_both["search_gemm_pairs"] < c_alone["search_gemm_pairs"] + t_alone["search_gemm_pairs"]
    assert c_both["search_gemm_pairs"] == t_both["search_gemm_pairs"] >= c_alone["search_gemm_pairs"]
    assert asked == [sc.groups.size]  # the typed call found its tables complete


class _SpyClient:
    """A client whose ``submit`` / ``scatter`` record the largest row count of any array they ship."""

    def __init__(self, client):
        self._client, self.rows = client, []

    def __getattr__(self, name):
        return getattr(self._client, name)

    def _measure(self, obj) -> int:
        if isinstance(obj, np.ndarray):
            return int(obj.shape[0]) if obj.ndim else 1
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return max([0] + [self._measure(getattr(obj, f.name)) for f in dataclasses.fields(obj)])
        if isinstance(obj, dict):
            return max([0] + [self._measure(v) for v in obj.values()] + [self._measure(k) for k in obj])
        if isinstance(obj, (list, tuple, set)):
            return max([0] + [self._measure(v) for v in obj]) if not all(isinstance(v, int) for v in obj) else len(obj)
        return 0

    def submit(self, fn, *args, **kwargs):
        self.rows.append((fn.__name__, self._measure(args)))
        return self._client.submit(fn, *args, **kwargs)

    def scatter(self, data, **kwargs):
        self.rows.append(("scatter", self._measure(data)))
        return self._client.scatter(data, **kwargs)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "ann"])
def test_no_task_receives_an_argument_that_grows_with_the_scope(cache_root, client, tmp_path, exact):
    """Worker memory bounded by chunk size: tasks read rows, codes and positions from scratch files;
    what they are sent is bounded by the k-means sample, the calibration sample, a batch's probe plan
    or the chunks × clusters bounds, never by the scope's 3,600 rows."""
    root, _ = cache_root
    prepared, scopes, _ = scope_rows(root, "all", "all")
    sc = prepared.scopes[0]
    spy = _SpyClient(client)
    search = ls.LargeScopeSearch(spy, scopes, tmp_path / "scratch", exact=exact, recall_target=0.99,
                                 n_recall_queries=300)
    search.cross(None, sc.groups, 15)
    search.typed(None, sc.labels, sc.confounders, sc.groups, 5)
    names = {name for name, _ in spy.rows}
    assert {"centroid_task", "chunk_task", "search_task"} <= names and ("brute_task" in names) != exact
    bound = max(ls.files.KMEANS_MAX_SAMPLE, ls.files.CALIBRATION_QUERIES + 300, math.ceil(3600 / ls.files.ROWS_PER_CLUSTER) + 1)
    assert bound < sc.n == 3600
    assert max(rows for _, rows in spy.rows) <= bound, sorted(spy.rows, key=lambda r: -r[1])[:5]


def test_large_units_are_driven_from_the_client_and_retried(cache_root, client, tmp_path, monkeypatch):
    """No large unit runs as a task (its O(n) state would sit on a worker): each is driven on a
    client thread; a transient error is retried, a persistent one is recorded and the rest finish."""
    from cachescore.pipeline.execute import execute_plan

    root, _ = cache_root
    job = _job(tmp_path, root, "exact")
    threads, calls = {}, {}
    real = large_mod.score_large_unit

    def flaky(unit, cl, companions=()):
        threads[unit.label] = threading.current_thread().name
        calls[unit.label] = calls.get(unit.label, 0) + 1
        if unit.encoder == "enc1" and unit.metric == "ri":
            raise OSError("scheduler connection reset")  # never heals
        if unit.encoder == "enc0" and unit.metric == "croma" and calls[unit.label] == 1:
            raise OSError("worker lost")  # heals on the retry
        return real(unit, cl, companions)

    monkeypatch.setattr(large_mod, "score_large_unit", flaky)
    plan = plan_job(job)
    ok, failures = execute_plan(plan, client, out=None, retries=1, large_unit_drivers=2)
    assert ok == len(plan.pending) - 1 and [f["label"].split("/")[0] for f in failures] == ["enc1"]
    assert "OSError: scheduler connection reset" in failures[0]["error"]
    assert all(name.startswith("cachescore-large") for name in threads.values()), threads
    assert calls["enc1/all/all/ri"] == calls["enc0/all/all/croma[m=5]"] == 2  # one retry each
    assert sum(calls.values()) == len(plan.pending) + 2
    failed = ResultsStore(tmp_path / "store-exact").failures()
    assert len(failed) == 1 and "scheduler connection reset" in failed.iloc[0]["error"]
    with pytest.raises(ValueError, match="driven from the client"):
        batch_mod.run_unit(plan.pending[0])


def _job(tmp_path, root, backend, views=("all",), **neighbors):
    doc = {
        "schema_version": 1,
        "job": {"cache": str(root), "store": str(tmp_path / f"store-{backend}"), "views": list(views)},
        "metrics": {"families": ["ri", "mari", "croma"], "ri": {"k_candidates": [5, 15]},
                    "mari": {"k_candidates": [5, 15]}, "croma": {"m": [5]}},
        "neighbors": dict({"backend": backend, "large_scope_rows": 1000, "recall_sample": 300}, **neighbors),
        "execution": {"n_workers": 2, "retries": 0, "dashboard": False, "performance_report": False},
    }
    return parse_job(doc)


def _records(store_root):
    df = ResultsStore(store_root).scores()
    return {(r.encoder, r.metric): r for r in df.itertuples()}


@pytest.fixture(autouse=True)
def _pinned_code_version(monkeypatch):
    monkeypatch.setenv("CACHESCORE_CODE_VERSION", "test-pinned")


def test_pipeline_large_units_match_the_in_memory_api(cache_root, client, tmp_path, monkeypatch):
    root, arrays = cache_root
    job = _job(tmp_path, root, "exact")
    plan = plan_job(job)
    assert {u.params.get("engine") for u in plan.pending} == {"distributed"}
    chunk_rows = ls.files.CHUNK_BYTES // (32 * 4)
    reads = []
    real_read = ls.read_scope_rows

    def spy(embeddings, tile_rows, positions, source):
        reads.append(len(tile_rows))
        return real_read(embeddings, tile_rows, positions, source)

    def no_whole_view(unit):
        raise AssertionError("a large unit loaded its whole view")

    monkeypatch.setattr(ls.tasks, "read_scope_rows", spy)
    monkeypatch.setattr(batch_mod, "load_unit_inputs", no_whole_view)
    ok, failures = _run(job, client)
    assert failures == [] and ok == len(plan.pending)
    # every read of embeddings is one k-means sample or one chunk, never the 3,600-row view
    assert reads and max(reads) <= chunk_rows == 900
    assert sum(r for r in reads if r != ls.files.KMEANS_MAX_SAMPLE) >= 2 * 3600  # both encoders partitioned
    assert not (tmp_path / "store-exact" / "scratch" / "large").exists() or not any(
        (tmp_path / "store-exact" / "scratch" / "large").iterdir())
    recs = _records(tmp_path / "store-exact")
    for enc in ("enc0", "enc1"):
        frame = Cache(root).read_view("all")
        x = arrays[enc][frame["row"].to_numpy()]
        for u in plan.pending:
            if u.encoder != enc:
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # support notes: recorded by the pipeline, not under test
                ref, _ = unit_mod.score_unit(_local(u), x, frame)
            got = recs[(enc, u.metric)]
            if u.metric == "ri":
                assert got.value == ref["value"] and got.k == ref["k"]
            else:  # typed / MaRI distances: same float32 tolerance as spec §12.3
                assert got.value == pytest.approx(ref["value"], rel=1e-6, abs=1e-7), u.metric
    # warnings land in the record of the unit that raised them (units share worker threads)
    notes = {m: json.loads(recs[("enc0", m)].extra).get("warnings", "") for m in ("ri", "croma")}
    assert "support" in notes["ri"] and "support" not in notes["croma"], notes
    # a second run executes nothing
    assert plan_job(job).pending == ()


def _local(unit):
    params = {k: v for k, v in unit.params.items() if k != "engine"}
    return dataclasses.replace(unit, params=params)


def _run(job, client):
    from cachescore.pipeline.execute import execute_plan

    plan = plan_job(job)
    return execute_plan(plan, client, out=None, retries=0)


def test_pipeline_large_ann_units_record_recall(cache_root, client, tmp_path):
    root, arrays = cache_root
    job = _job(tmp_path, root, "ann", recall_target=0.99)
    ok, failures = _run(job, client)
    assert failures == []
    recs = _records(tmp_path / "store-ann")
    frame = Cache(root).read_view("all")
    for u in plan_job(job).done:
        r = recs[(u.encoder, u.metric)]
        assert r.recall >= 0.99 and r.backend == "ann", u.label
        search = json.loads(r.extra)["neighbour_search"]
        assert len(search) == 1, search  # one table per unit of this one-scope view, listed once
        assert all(d["probe_fraction"] < 1 for d in search), search  # it pruned
        # the encoder's cross-group and typed tables were searched in one pass (ADR-0024)
        assert search[0]["searched_with"] == (["so/os"] if u.metric in ("ri", "mari") else ["cross"]), search
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exact, _ = unit_mod.score_unit(_local(dataclasses.replace(u, params=dict(u.params, backend="exact"))),
                                           arrays[u.encoder][frame["row"].to_numpy()], frame)
        # stated tolerance: at recall >= 0.99 a metric moves by at most 0.01 (a missed neighbour is
        # replaced by the next-nearest one); with every sampled neighbour found, values are equal
        tol = 1e-6 if r.recall == 1.0 else 0.01
        assert abs(r.value - exact["value"]) <= tol, (u.label, r.value, exact["value"], r.recall)


def test_nan_rows_fail_their_encoder_only(tmp_path, client):
    root = tmp_path / "cache"
    arrays = write_cache(root, n=1800, encoders=("good", "bad"))
    x = arrays["bad"].copy()
    x[[7, 1500]] = np.nan
    write_embeddings(root, "bad", "ts", x, overwrite=True, check_finite=False)
    job = _job(tmp_path, root, "exact")
    ok, failures = _run(job, client)
    bad = [f for f in failures if f["label"].startswith("bad/")]
    assert len(bad) == 3 and len(failures) == 3 and ok == 3
    assert all("NaN" in f["error"] or "nan" in f["error"].lower() for f in bad)
    assert all("1500" in f["error"] or "7" in f["error"] for f in bad)


def test_a_shard_failing_its_check_beside_the_partition_keeps_no_partition(tmp_path, client, monkeypatch):
    """The shards' checks run beside the k-means and the partition (large_unit.ShardChecks): a
    failing one is the error the units report (its shard named), and the partition built meanwhile
    is never marked complete (the engine's gate), so no later run reuses rows that failed."""
    from cachescore.pipeline import execute

    monkeypatch.setattr(execute, "remove_scratch", lambda folders: None)  # the run's end keeps them here
    root = tmp_path / "cache"
    write_cache(root, n=1800, encoders=("good", "bad"))
    # finite values off the shard's checksum: the partition's tasks read them without complaint
    shard = sorted((root / "embeddings" / "bad" / "ts").glob("*.npy"))[-1]
    raw = bytearray(shard.read_bytes())
    raw[-8:] = np.array([0.5, -0.25], np.float32).tobytes()
    shard.write_bytes(bytes(raw))
    plan = plan_job(_job(tmp_path, root, "exact"))
    scratch = {u.encoder: unit_mod.unit_scratch(u) for u in plan.pending}
    ok, failures = execute.execute_plan(plan, client, out=None, retries=0)
    assert ok == 3 and len(failures) == 3 and all(f["label"].startswith("bad/") for f in failures)
    assert all(shard.name in f["error"] and "sha256" in f["error"] for f in failures), failures
    assert (scratch["bad"] / "scopes.pending.json").is_file()  # its scopes were written and used
    assert list(scratch["bad"].glob("*/partition/layout.npz"))  # its partition was built meanwhile...
    assert not list(scratch["bad"].glob("*/partition/done.json"))  # ...and never marked complete
    assert not (scratch["bad"] / "scopes.json").exists()
    assert (scratch["good"] / "scopes.json").is_file() and list(scratch["good"].glob("*/partition/done.json"))


def test_capped_scope_is_refused_with_a_clear_error(tmp_path, client):
    """The reference's fetch cap (spec §3.2) needs every row's farthest row; this engine refuses."""
    root = tmp_path / "cache"
    write_cache(root, n=150, encoders=("enc0",))
    prepared, scopes, _ = scope_rows(root, "all", "all")
    search = ls.LargeScopeSearch(client, scopes, tmp_path / "scratch", exact=True)
    with pytest.raises(ValueError, match="fetch cap for k = 100"):
        search.cross(None, prepared.scopes[0].groups, 100)


def test_captured_warnings_are_per_thread_and_restore_the_filters():
    """Large units run concurrently on threads of one worker process: each unit's record must get
    its own warnings only, and leaving must restore the filters (here pytest's ``error``)."""
    import threading

    from cachescore._warncapture import captured_warnings

    inside, release = threading.Barrier(2), threading.Event()
    sinks = {}

    def unit(name, delay_exit):
        with captured_warnings() as caught:
            inside.wait(timeout=10)
            warnings.warn(f"note from {name}", RuntimeWarning)
            if delay_exit:
                release.wait(timeout=10)
            else:
                release.set()
        sinks[name] = [str(w.message) for w in caught]

    threads = [threading.Thread(target=unit, args=("a", False)), threading.Thread(target=unit, args=("b", True))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert sinks == {"a": ["note from a"], "b": ["note from b"]}
    with pytest.raises(RuntimeWarning):  # pytest's filterwarnings=error is back
        warnings.warn("outside", RuntimeWarning)


def test_large_units_keep_entries_from_the_views_columns_equal_to_the_publications(cache_root, client, tmp_path):
    """A large unit's score entry (interval, replicates) is computed by a task from the view's own
    ``group_id`` / label / confounder columns (not the joined frame) and kept; a table from the
    kept entries equals one computed from the per-unit tables and ``read_view``."""
    from cachescore.pipeline.execute import execute_plan
    from cachescore.results import score_table
    from cachescore.results.memo import EntryMemo, entry_token
    from cachescore.jobs.sections import as_dict
    from cachescore.results.scores import BOOTSTRAP_DEFAULTS

    root, _ = cache_root
    job = _job(tmp_path, root, "exact")
    plan = plan_job(job)
    ok, failures = execute_plan(plan, client, out=None, retries=0)
    assert failures == [] and ok == len(plan.pending)
    store = ResultsStore(tmp_path / "store-exact")
    fps = [u.fingerprint for u in plan.pending]
    bootstrap = dict(BOOTSTRAP_DEFAULTS, **as_dict(job.metrics.bootstrap))
    support = float(job.report.min_support)
    kept = EntryMemo(tmp_path / "store-exact", writable=False)
    assert all(kept.get(entry_token(fp, bootstrap, support)) is not None for fp in fps)
    computed = score_table(store, Cache(root), fps, bootstrap=bootstrap, min_support=support)
    from_kept = score_table(store, Cache(root), fps, bootstrap=bootstrap, min_support=support, entries=kept)
    pd.testing.assert_frame_equal(computed, from_kept)
    assert computed["ci_low"].notna().all()


def test_a_large_view_the_tileset_does_not_know_fails_its_units_by_name(tmp_path, client):
    """Planning reads a large view's code columns only (no tileset join); a sample id the tileset
    lacks is then found by the units' scope task on a worker: every unit of that view fails with
    the view's file and the unknown id named, and the other view is scored."""
    root = tmp_path / "cache"
    write_cache(root, n=1800, encoders=("enc0",))
    frame = Cache(root).read_view("all")[["sample_id", "label", "group_id", "centre"]].copy()
    write_view(root, "broken", frame, tileset="ts", confounder_column="centre", design="all")
    frame.loc[5, "sample_id"] = "no-such-tile"  # edited outside cachescore (the writer refuses it)
    frame.to_parquet(root / "views" / "broken.parquet", index=False)
    side = root / "views" / "broken.json"
    side.write_text(json.dumps({k: v for k, v in json.loads(side.read_text()).items() if not k.startswith("table_")}))
    job = _job(tmp_path, root, "exact", views=["all", "broken"])
    plan = plan_job(job)
    assert {u.view for u in plan.pending} == {"all", "broken"}  # planned without the join
    ok, failures = _run(job, client)
    assert ok == 3 and len(failures) == 3 and all(f["label"].startswith("enc0/broken/") for f in failures)
    assert all("no-such-tile" in f["error"] and "broken.parquet" in f["error"] for f in failures), failures


def test_ann_units_run_with_a_client_that_is_not_the_default(cache_root, tmp_path, monkeypatch):
    """``cachescore run --scheduler`` connects a client that is not the process default: nothing in
    a large unit may look for a default client (an ANN unit's calibration merges its answers as
    they finish). Other tests' clients live in this process, so looking one up raises here."""
    import distributed.client
    from distributed import Client, LocalCluster

    def no_default(*args, **kwargs):
        raise ValueError("No clients found (a large unit looked for a default client)")

    monkeypatch.setattr(distributed.client, "default_client", no_default)
    root, _ = cache_root
    job = _job(tmp_path, root, "ann", recall_target=0.99)
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None) as cluster, \
            Client(cluster, set_as_default=False) as c:
        ok, failures = _run(job, c)
    assert failures == [] and ok == 6  # two encoders x RI, MaRI, CRoMa
