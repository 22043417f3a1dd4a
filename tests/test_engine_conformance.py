"""One conformance suite for every neighbour engine (issue 23; scikit-learn ``check_estimator`` style).

Each engine of the registry — in-memory exact (:class:`ExactSearch`), in-memory ANN
(:class:`AnnSearch`, recall target 1) and out of core (:class:`LargeScopeSearch` over rows read
from a cache by Dask tasks, exact probing) — is built by a factory from the same rows and must:
give the brute-force neighbours (a float64 NumPy reference computed here) for ``cross`` and the
typed SO / OS distances for ``typed``; never return a same-group row; order ties by index;
report a recall (NaN for exact engines, measured for ANN); refuse non-finite rows.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest

from blas_equality import assert_same_distances, assert_same_neighbours
from cachescore.cache import Cache, write_embeddings, write_view
from cachescore.cache.writer import write_tileset
from cachescore.neighbors import large_scope as ls
from cachescore.neighbors.ann import AnnSearch
from cachescore.neighbors.base import Searcher, call_search, scope_aware
from cachescore.neighbors.exact_search import ExactSearch
from cachescore.neighbors.normalize import normalize_rows
from cachescore.neighbors.recall import distance_tol
from cachescore.neighbors.registry import ENGINE_NAMES, OUT_OF_CORE, in_memory_searcher, searcher_for

N, D, K, M = 420, 12, 9, 4

pytestmark = [
    # distributed's client side sometimes leaves an unbound TCP socket (laddr 0.0.0.0:0) to the
    # garbage collector (as in test_large_scope.py); this module creates no socket itself
    pytest.mark.filterwarnings("ignore:unclosed <socket.socket:ResourceWarning"),
    pytest.mark.filterwarnings("ignore:Exception ignored in. <socket.socket:pytest.PytestUnraisableExceptionWarning"),
]


def _rows(seed=0, nan_row=None):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, D)).astype(np.float32)
    x[1::7] = x[0::7][: len(x[1::7])]  # exact duplicates: ties between rows of different groups
    if nan_row is not None:
        x[nan_row, 3] = np.nan
    groups = np.repeat(np.arange(N // 6), 6)
    labels = (np.arange(N) // 3) % 2
    confs = (np.arange(N) // 2) % 3
    return x, groups.astype(np.int64), labels.astype(np.int64), confs.astype(np.int64)


def _brute_cross(u, groups, k):
    u64 = u.astype(np.float64)
    d = 1.0 - u64 @ u64.T
    d[groups[:, None] == groups[None, :]] = np.inf
    order = np.lexsort((np.broadcast_to(np.arange(len(u)), d.shape), d), axis=1)[:, :k]
    dist = np.take_along_axis(d, order, 1)
    return np.where(np.isfinite(dist), order, -1), dist


def _brute_typed(u, labels, confs, groups, m):
    u64 = u.astype(np.float64)
    d = 1.0 - u64 @ u64.T
    other = groups[:, None] != groups[None, :]
    same_y, same_c = labels[:, None] == labels[None, :], confs[:, None] == confs[None, :]
    out = []
    for mask in (other & same_y & ~same_c, other & ~same_y & same_c):
        t = np.sort(np.where(mask, d, np.inf), axis=1)[:, :m]
        out.append(t)
    return out


def _write_cache(root, x, groups, labels, confs):
    tiles = pd.DataFrame({"sample_id": [f"t{i}" for i in range(N)], "image_path": [f"t{i}.png" for i in range(N)], "slide_id": [f"s{g}" for g in groups],
                          "label": labels.astype(str), "group_id": [f"s{g}" for g in groups],
                          "centre": [f"C{c}" for c in confs]})
    write_tileset(root, "ts", tiles)
    write_embeddings(root, "enc", "ts", x)
    write_view(root, "all", tiles[["sample_id", "label", "group_id", "centre"]], tileset="ts",
               confounder_column="centre", design="all")


@pytest.fixture(scope="module")
def client():
    from distributed import Client, LocalCluster

    import gc

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as c:
        yield c
    # collect distributed's stray socket here, where this module ignores its ResourceWarning, not in
    # whichever later test the collector would next run (as tests/test_probe_unit.py does)
    gc.collect()


def _exact(tmp_path, client, x, groups, labels, confs):
    return searcher_for({"backend": "exact"}), normalize_rows(x)


def _ann(tmp_path, client, x, groups, labels, confs):
    return searcher_for({"backend": "ann", "seed": 0, "recall_target": 1.0, "recall_sample": 1000}), normalize_rows(x)


def _out_of_core(tmp_path, client, x, groups, labels, confs):
    root = tmp_path / "cache"
    _write_cache(root, x, groups, labels, confs)
    view = Cache(root).read_view("all")
    rows = ls.ScopeRows(embeddings=Cache(root).row_source("enc", "ts"), tile_rows=view["row"].to_numpy(),
                        groups=groups, labels=labels, confounders=confs, source="conformance")
    searcher = searcher_for({"backend": "exact", "engine": OUT_OF_CORE, "seed": 0}, client=client, scopes={"s0": rows},
                            scratch=tmp_path / "scratch")
    return searcher, np.zeros((N, 0), np.float32)


#: Builders of every engine the registry makes, each through ``registry.searcher_for``.
ENGINES = {"exact": _exact, "ann": _ann, "out_of_core": _out_of_core}


def test_the_suite_covers_every_engine_of_the_registry():
    assert sorted(ENGINES) == sorted(ENGINE_NAMES)


def test_searcher_for_builds_each_engine_with_one_set_of_defaults(tmp_path):
    assert type(searcher_for({"backend": "exact"})) is ExactSearch
    assert type(searcher_for({"backend": "ann", "seed": 0, "recall_target": 0.9, "recall_sample": 10})) is AnnSearch
    fake_client = object()  # the out-of-core engine only stores it until a search runs
    exact = searcher_for({"backend": "exact", "engine": OUT_OF_CORE, "seed": 4}, client=fake_client, scopes={},
                         scratch=tmp_path)
    assert isinstance(exact, ls.LargeScopeSearch) and exact.exact and exact.seed == 4 and exact.target == 1.0
    ann = searcher_for({"backend": "ann", "engine": OUT_OF_CORE, "seed": 1, "recall_target": 0.95,
                        "recall_sample": 300}, client=fake_client, scopes={}, scratch=tmp_path)
    assert not ann.exact and ann.target == 0.95 and ann.n_recall_queries == 300 and ann.seed == 1
    with pytest.raises(ValueError, match="needs the run's client, its scopes and a scratch folder"):
        searcher_for({"backend": "exact", "engine": OUT_OF_CORE, "seed": 0})
    with pytest.raises(ValueError, match="unknown neighbour backend 'nope'"):
        searcher_for({"backend": "nope", "engine": OUT_OF_CORE, "seed": 0}, client=fake_client, scopes={},
                     scratch=tmp_path)


def test_the_metrics_pass_the_scope_reference_to_a_scope_aware_engine_only():
    seen = []

    @scope_aware
    def aware(u, groups, k, *, scope):
        seen.append(scope)
        return "aware"

    def plain(u, groups, k):  # croma's contract: no scope keyword
        return "plain"

    assert call_search(aware, None, None, 3, scope="centre_A") == "aware" and seen == ["centre_A"]
    assert call_search(plain, None, None, 3, scope="centre_A") == "plain"


@pytest.fixture(params=sorted(ENGINES))
def engine(request, tmp_path):
    client = request.getfixturevalue("client") if request.param == "out_of_core" else None

    def build(**kw):
        x, groups, labels, confs = _rows(**kw)
        searcher, u = ENGINES[request.param](tmp_path, client, x, groups, labels, confs)
        return request.param, searcher, u, normalize_rows(np.nan_to_num(x)), groups, labels, confs

    return build


def test_registry_builds_the_in_memory_engines():
    assert isinstance(in_memory_searcher({"backend": "exact"}), ExactSearch)
    assert isinstance(in_memory_searcher({"backend": "ann", "seed": 0, "recall_target": 1.0, "recall_sample": 10}),
                      AnnSearch)
    with pytest.raises(ValueError, match="unknown neighbour backend 'nope'"):
        in_memory_searcher({"backend": "nope"})


def test_cross_equals_brute_force_excludes_groups_and_orders_ties(engine):
    name, searcher, u, ref_u, groups, labels, confs = engine()
    assert isinstance(searcher, Searcher)
    idx, dist = searcher.cross(u, groups, K)
    assert idx.shape == (N, K) and idx.dtype == np.int64 and dist.dtype == np.float64
    ref_idx, ref_dist = _brute_cross(ref_u, groups, K)
    assert_same_neighbours(idx, dist, ref_idx, ref_dist, distance_tol(np.float32, D))
    assert not (groups[idx] == groups[:, None]).any()  # same-group rows never returned
    assert (np.diff(dist, axis=1) >= 0).all()
    ties = (np.diff(dist, axis=1) == 0) & (idx[:, 1:] >= 0)
    assert (idx[:, 1:][ties] > idx[:, :-1][ties]).all()  # equal distances: ascending index
    assert ties.any()  # the duplicated rows do make ties
    if name == "exact":
        assert np.isnan(searcher.recall)  # exact by construction: nothing measured
    else:  # measured (ANN at target 1) or probed exhaustively (out of core): complete
        assert searcher.recall == 1.0


def test_typed_cells_equal_brute_force(engine):
    name, searcher, u, ref_u, groups, labels, confs = engine()
    so, os_ = searcher.typed(u, labels, confs, groups, M)
    ref_so, ref_os = _brute_typed(ref_u, labels, confs, groups, M)
    assert so.shape == os_.shape == (N, M) and so.dtype == os_.dtype == np.float64
    # the oracle computes in float64 (_brute_typed): spec §12.3's float32 tolerance on every BLAS
    assert_same_distances(so, ref_so, ref_u, float64_reference=True)
    assert_same_distances(os_, ref_os, ref_u, float64_reference=True)


def test_non_finite_rows_are_refused(engine):
    """A NaN row is refused with its row named: by the engine's searches (in memory) or, out of
    core, by the cache that holds the rows the engine would read (they cannot be written)."""
    named = r"NaN or infinite values at rows \[17\]"
    try:
        name, searcher, u, ref_u, groups, labels, confs = engine(nan_row=17)
    except ValueError as exc:
        assert re.search(named, str(exc)) and "embeddings of encoder 'enc'" in str(exc)
        return
    assert name != "out_of_core"
    with pytest.raises(ValueError, match=named):
        searcher.cross(u, groups, K)
    with pytest.raises(ValueError, match=named):
        searcher.typed(u, labels, confs, groups, M)
