"""Out-of-core reductions (cachescore.metrics.large): the per-row work of RI, MaRI and CRoMa runs on
the workers over the engine's scratch tables, and the driver gathers reductions only.

Pins: on many random datasets (both designs; RI, MaRI with automatic, pinned and log-space
temperatures, CRoMa) every record field and the whole per-unit table equal, **bit for bit**, what
the metric API computes in one process over the same neighbour tables (the path the driver took
before issue 26); the pairwise-sum tree reproduces numpy's ``sum`` exactly; the distributed
selection returns ``np.sort``'s order statistics, and the tail statistics, medians and F(0) taken
from the per-unit fragments equal numpy's on the whole column; ranges are cut small (many leaves, many tasks)
so the recombination is exercised.
"""

from __future__ import annotations

import json

import warnings

import numpy as np
import pandas as pd
import pytest

from cachescore.cache import Cache
from cachescore.metrics import families
from cachescore.metrics import large
from cachescore.neighbors import large_scope as ls
from cachescore.neighbors.registry import searcher_for
from cachescore.cache import write_embeddings
from cachescore.cache.errors import NonFiniteError, ShardError
from cachescore.pipeline.large_unit import large_record, large_scopes, scope_task, shard_groups
from cachescore.pipeline.plan import WorkUnit
from cachescore.pipeline.unit import result_record
from test_large_scope import _small_partition, write_cache  # noqa: F401 - a fixture, used by _small

pytestmark = [
    pytest.mark.filterwarnings("ignore:unclosed <socket.socket:ResourceWarning"),
    pytest.mark.filterwarnings("ignore:Exception ignored in. <socket.socket:pytest.PytestUnraisableExceptionWarning"),
]


@pytest.fixture(autouse=True)
def _small(monkeypatch, _small_partition):  # test_large_scope's partition constants, plus:
    monkeypatch.setattr(large, "LEAF_ROWS", 256)  # a 2,000-row scope: 8+ leaves, one task each
    monkeypatch.setattr(large, "GATHER_LIMIT", 64)  # the selection takes several histogram rounds


@pytest.fixture(scope="module")
def client():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as c:
        yield c


# -- the building blocks ------------------------------------------------------------------------


def test_pairwise_tree_reproduces_numpys_sum_bit_for_bit():
    rng = np.random.default_rng(0)
    for trial in range(200):
        n = int(rng.integers(1, 200_000)) if trial % 2 else int(rng.integers(1, 3000))
        a = rng.standard_normal(n) * np.exp(3 * rng.standard_normal(n))
        for leaf in (128, 1000, 65536):
            sums = {(lo, hi): np.add.reduce(a[lo:hi]) for lo, hi in large.pairwise_leaves(n, leaf)}
            assert large.pairwise_total(n, sums, leaf) == float(a.sum()), (n, leaf)
            assert sum(hi - lo for lo, hi in sums) == n


def test_distributed_selection_returns_the_sorted_order_statistics():
    rng = np.random.default_rng(1)
    for trial in range(30):
        parts = [rng.standard_normal(int(rng.integers(0, 400))) * 10.0 ** rng.integers(-3, 3) for _ in range(5)]
        if trial % 3 == 0:  # ties and signed zeros
            parts = [np.round(p, 1) for p in parts] + [np.array([0.0, -0.0, 0.0])]
        allv = np.sort(np.concatenate(parts))
        keys = [large._sortable(p) for p in parts]

        def run(reqs):
            answers = [large.key_requests(k, reqs) for k in keys]
            return [sum(a[i] for a in answers) if r[0] == "hist" else np.concatenate([a[i] for a in answers])
                    for i, r in enumerate(reqs)]

        ranks = sorted({0, allv.size // 2, allv.size - 1, int(rng.integers(0, allv.size))})
        got = large.select_ranks(run, ranks, limit=8)
        for r in ranks:
            assert got[r] == allv[r], (trial, r)
        assert large.exact_median(run, allv.size) == float(np.median(allv))


def test_the_percentile_from_order_statistics_is_numpys_bit_for_bit():
    rng = np.random.default_rng(3)
    for trial in range(400):
        n = int(rng.integers(1, 50)) if trial % 4 == 0 else int(rng.integers(1, 30_000))
        v = rng.standard_normal(n) * np.exp(2 * rng.standard_normal(n))
        if trial % 5 == 0:
            v = np.round(v, 1)  # ties at the neighbouring ranks
        ordered = np.sort(v)
        for percent in (0.0, 10.0, 0.1 * 100, 25.0, 50.0, 99.9, 100.0, float(rng.uniform(0, 100))):
            got = large.linear_percentile(lambda ranks: {r: ordered[r] for r in ranks}, n, percent)
            assert got == float(np.percentile(v, percent)), (trial, n, percent)
    assert np.isnan(large.linear_percentile(lambda ranks: {}, 0, 10.0))
    with pytest.raises(ValueError, match="range"):
        large.linear_percentile(lambda ranks: {}, 3, 101.0)


def test_tails_medians_and_counts_from_fragments_equal_numpy_on_the_whole_column(tmp_path, client):
    """The driver takes a unit's tail statistics, scope medians and F(0) counts from the per-unit
    fragments on the workers; they equal numpy's over the concatenated column, NaN units, ties and
    infinities included."""
    from types import SimpleNamespace

    import pyarrow as pa
    import pyarrow.parquet as pq

    from cachescore.metrics.tail import compute_tail_metrics, confounder_dominant_fraction

    ctx = SimpleNamespace(client=client)
    rng = np.random.default_rng(2)
    for trial in range(24):
        n = int(rng.integers(1, 3000))
        v = rng.standard_normal(n) * np.exp(rng.standard_normal(n))
        if trial % 3 == 0:
            v[rng.integers(0, n, n // 5)] = np.nan  # undefined units
        if trial % 5 == 0:
            v = np.round(v, 1)  # ties at the percentile
        if trial % 7 == 0:
            v[rng.integers(0, n, 3)] = np.inf
        cuts = np.sort(rng.integers(0, n, int(rng.integers(0, 6))))
        paths = []
        for i, part in enumerate(np.split(v, cuts)):
            paths.append(str(tmp_path / f"t{trial}-{i}.parquet"))
            pq.write_table(pa.Table.from_pandas(pd.DataFrame({"unit": np.arange(part.size), "value": part}),
                                                preserve_index=False), paths[-1])
        for alpha in (0.0, 0.1, 0.25, 1.0):
            want = compute_tail_metrics(v, alpha=alpha)
            got, counts = large._fragments_tail(ctx, paths, alpha)
            np.testing.assert_array_equal([got.q_alpha, got.ltm_alpha, got.n_tail_samples],
                                          [want.q_alpha, want.ltm_alpha, want.n_tail_samples])
        finite = int(counts[:, 0].sum())
        assert finite == int(np.isfinite(v).sum()) and int(counts[:, 2].sum()) == int(np.isnan(v).sum())
        f0 = float(np.float64(counts[:, 1].sum()) / finite) if finite else float("nan")
        assert f0 == confounder_dominant_fraction(v) or (np.isnan(f0) and np.isnan(confounder_dominant_fraction(v)))
        median = large._fragments_median(ctx, paths, n, int(counts[:, 2].sum()))
        assert median == float(np.median(v)) or (np.isnan(median) and np.isnan(np.median(v))), trial


def _fails_on_three(i):
    if i == 3:
        raise ValueError("range 3 is broken")
    return i * i


def test_task_answers_are_folded_as_they_arrive_and_a_failure_is_raised(client):
    """``_fold`` gives every answer with its index (in whatever order tasks finish) and raises a
    failing task's error, cancelling the rest."""
    from types import SimpleNamespace

    ctx = SimpleNamespace(client=client)
    got = {}
    large._fold(ctx, [(_fails_on_three, (i,)) for i in range(6) if i != 3], lambda i, r: got.setdefault(i, r), "t")
    assert got == {0: 0, 1: 1, 2: 4, 3: 16, 4: 25}  # indexes of the calls, not of the inputs
    with pytest.raises(ValueError, match="range 3 is broken"):
        large._fold(ctx, [(_fails_on_three, (i,)) for i in range(6)], lambda i, r: None, "t")


# -- the metrics, against the metric API over the same tables ------------------------------------


def _unit(metric: str, params: dict, design: str, view: str) -> WorkUnit:
    return WorkUnit(cache_root="", store_root="", encoder="enc0", view=view, tileset="ts", design=design,
                    confounder_column="centre", metric=metric, params=dict(params, backend="exact", seed=0), fingerprint="f" * 64,
                    inputs={}, code_version="test")


CASES = [
    ("ri", {"k_candidates": [5, 15, 40]}),
    ("mari", {"k_candidates": [5, 15], "tau": "auto", "warn_tau": False}),
    ("mari", {"k_candidates": [7, 20], "tau": 0.02, "warn_tau": True}),
    ("mari", {"k_candidates": [5, 11], "tau": 1e-5, "warn_tau": True}),  # weights underflow: log space
    ("croma", {"m": 5, "alpha": 0.1, "start_k": 200, "k_growth_factor": 2.0}),
    ("croma", {"m": 2, "alpha": 0.25, "start_k": 200, "k_growth_factor": 2.0}),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("design", ["all", "paired_2x2"])
def test_reductions_equal_the_metric_api_over_the_same_tables(tmp_path, client, seed, design):
    root = tmp_path / "cache"
    n = (2100, 1700, 2500)[seed]
    write_cache(root, n=n, seed=seed, encoders=("enc0",), paired=True)
    view = "all" if design == "all" else "paired"
    scratch = tmp_path / "scratch"
    client.submit(scope_task, str(root), "enc0", "ts", view, "centre", design, str(scratch), pure=False).result()
    refs = ls.read_refs(scratch / "scopes.json", Cache(root).row_source("enc0", "ts"))
    frame = Cache(root).read_view(view)
    features = np.zeros((len(frame), 0), dtype=np.float32)
    for metric, params in CASES:
        unit = _unit(metric, params, design, view)
        fam = families.get(metric)
        # the reference: the metric API in this process over the engine's memory-mapped tables
        engine = searcher_for(unit.params | {"engine": "distributed"}, client=client, scopes=refs, scratch=scratch)
        with warnings.catch_warnings(record=True) as ref_warn:
            warnings.simplefilter("always")
            result = fam.compute(unit.params, features, frame, confounder_column="centre", design=design,
                                 searcher=engine)
        want, want_table = result_record(unit, result)
        # the reductions on the workers, over the same (reused) tables
        engine = searcher_for(unit.params | {"engine": "distributed"}, client=client, scopes=refs, scratch=scratch)
        ctx = large.OutOfCore(engine=engine, scopes=list(refs.values()), dataset="dataset", design=design,
                              folder=tmp_path / f"units-{metric}-{len(params)}-{params.get('tau', params.get('m'))}")
        with warnings.catch_warnings(record=True) as got_warn:
            warnings.simplefilter("always")
            out = fam.reduce(unit.params, ctx)
        got = large_record(unit, out)
        label = (metric, params, design, seed)
        for key, value in want.items():
            if isinstance(value, float) and np.isnan(value):
                assert np.isnan(got[key]), (label, key, got[key])
            else:
                assert got[key] == value, (label, key, got[key], value)
        assert set(got) == set(want), label
        table = pd.read_parquet(out.per_unit)
        pd.testing.assert_frame_equal(table, want_table, check_exact=True)
        assert [str(w.message) for w in got_warn] == [str(w.message) for w in ref_warn], label


def test_incomplete_paired_subsets_are_refused_by_the_scope_task(tmp_path, client):
    root = tmp_path / "cache"
    write_cache(root, n=1200, encoders=("enc0",), paired=False)
    frame = Cache(root).read_view("all")
    bad = frame[["sample_id", "label", "group_id", "centre"]].copy()
    bad["subset"] = "s1"
    bad = bad[bad["centre"] != "C2"]
    bad = bad[~((bad["centre"] == "C1") & (bad["label"] == "L0"))]  # s1 lacks one cell of its 2x2
    from cachescore.cache import write_view

    write_view(root, "broken", bad, tileset="ts", confounder_column="centre", design="paired_2x2")
    with pytest.raises(ValueError, match="s1"):
        client.submit(scope_task, str(root), "enc0", "ts", "broken", "centre", "paired_2x2",
                      str(tmp_path / "scratch"), pure=False).result()


# -- the scopes and the parallel shard checks ----------------------------------------------------


def test_shard_groups_are_consecutive_balanced_and_cover_every_shard():
    rng = np.random.default_rng(3)
    for _ in range(200):
        rows = rng.integers(0, 50_000, size=int(rng.integers(1, 40)))
        parts = int(rng.integers(1, 12))
        groups = shard_groups(rows, parts)
        assert groups[0][0] == 0 and groups[-1][1] == rows.size
        assert all(a < b for a, b in groups) and all(b == c for (_, b), (c, _) in zip(groups, groups[1:]))
        assert len(groups) <= min(parts, rows.size)
        if rows.min() > 0 and rows.max() <= 2 * rows.min():  # near-even shards: near-even groups
            per = [rows[a:b].sum() for a, b in groups]
            assert max(per) <= rows.sum() / len(groups) + 2 * rows.max()
    assert shard_groups([10] * 8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert shard_groups([5], 4) == [(0, 1)] and shard_groups([], 3) == []


def _scoped_unit(root, view="all"):
    return WorkUnit(cache_root=str(root), store_root="", encoder="enc0", view=view, tileset="ts", design="all",
                    confounder_column="centre", metric="ri", params={"backend": "ann", "seed": 0},
                    fingerprint="f" * 64, inputs={}, code_version="test")


def test_large_scopes_checks_every_shard_in_parallel_and_writes_the_marker_last(tmp_path, client):
    """large_scopes returns once the scopes are written; the shard checks run on and their
    ShardChecks writes scopes.json only once every check passed. A failed check raises (its shard
    named) from wait(), to every caller, and leaves no marker, so the next run checks again."""
    root = tmp_path / "cache"
    x = write_cache(root, n=1500, encoders=("enc0",))["enc0"]
    write_embeddings(root, "enc0", "ts", x, shard_rows=200, overwrite=True)  # 8 shards, several groups
    scratch = tmp_path / "scratch"
    refs, info, checks = large_scopes(_scoped_unit(root), client, scratch)
    assert sum(r.n for r in refs.values()) == 1500 and info["design"] == "all"
    assert len(checks.futures) > 1  # shard groups checked in parallel
    checks.wait()
    checks.wait()  # idempotent
    assert (scratch / "scopes.json").is_file()
    assert json.loads((scratch / "scopes.json").read_text()) == json.loads((scratch / "scopes.pending.json").read_text())
    again = large_scopes(_scoped_unit(root), client, scratch)  # checked before: nothing to wait for
    assert again[2] is None and {k: r.n for k, r in again[0].items()} == {k: r.n for k, r in refs.items()}
    # one shard's bytes changed: its group fails naming it, and no marker lets the next run skip the check
    shard = sorted((root / "embeddings" / "enc0" / "ts").glob("*.npy"))[5]
    raw = bytearray(shard.read_bytes())
    raw[-8:] = np.full(2, np.nan, np.float32).tobytes()
    shard.write_bytes(bytes(raw))
    scratch2 = tmp_path / "scratch2"
    refs2, _, checks2 = large_scopes(_scoped_unit(root), client, scratch2)
    assert sum(r.n for r in refs2.values()) == 1500  # the scopes do not wait for the checks
    for _ in range(2):  # every caller gets the check's error
        with pytest.raises(ShardError, match=f"{shard.name}.*rows 1000:1200.*sha256"):
            checks2.wait()
    assert not (scratch2 / "scopes.json").exists()
    # the same NaN written with a matching checksum: the value check names the tileset row
    bad = x.copy()
    bad[1199, -1] = np.nan
    write_embeddings(root, "enc0", "ts", bad, shard_rows=200, overwrite=True, check_finite=False)
    _, _, checks3 = large_scopes(_scoped_unit(root), client, scratch2)  # a new check, not the failed one
    assert checks3 is not checks2
    with pytest.raises(NonFiniteError, match="rows 1000:1200.*1199"):
        checks3.wait()
    assert not (scratch2 / "scopes.json").exists()
    with pytest.raises(IndexError, match="shards 3:99"):
        Cache(root).validate_shards("enc0", "ts", 3, 99)
