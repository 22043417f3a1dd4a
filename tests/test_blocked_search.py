"""Distributed exact searches over query row blocks (``cachescore.neighbors.blocked``).

Pins: on a real 2-process LocalCluster (127.0.0.1, no dashboard), ``distributed_typed_knn`` and
``distributed_count_within`` return arrays *identical* (``assert_array_equal``, no tolerance) to
the single-process ``typed_knn`` / ``count_within`` for random scopes, block sizes that cut cells
and groups, groups spanning cells, float32 and float64; ``CRoMa.compute_with`` driven by
``make_search(client, ...)`` returns a result identical in every field to ``CRoMa.compute`` (which
the parity suite ties to croma); ``distributed_cross_group_knn`` equals the whole-scope
``cross_group_knn`` table when that function supports query-row ranges. Exact equality holds
because workers run the same blocks (same GEMM shapes, BLAS pinned to one thread — the reference
is computed under the same pin) and partials are merged by order-independent reductions.
"""

from __future__ import annotations

import inspect

import distributed
import numpy as np
import pandas as pd
import pytest
from threadpoolctl import threadpool_limits

from cachescore.metrics.croma import CRoMa
from cachescore.neighbors.normalize import normalize_rows
from cachescore.neighbors.typed import count_within, typed_knn
from cachescore.neighbors.blocked import (
    SEARCH_KINDS,
    distributed_count_within,
    distributed_cross_group_knn,
    distributed_typed_knn,
    make_search,
)
from blas_equality import assert_same_search

pytestmark = [
    pytest.mark.cluster,
    # On some runs distributed's client side leaves an unbound TCP socket (laddr 0.0.0.0:0) to the
    # garbage collector; this module creates no socket itself. Only that warning is silenced.
    pytest.mark.filterwarnings("ignore:unclosed <socket.socket:ResourceWarning"),
]


@pytest.fixture(scope="module")
def client():
    with distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None, host="127.0.0.1"
    ) as cluster, distributed.Client(cluster, set_as_default=False) as c:
        yield c


def _scope(seed, n, dtype, n_labels=2, n_conf=3):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, n_labels, n)
    confs = rng.integers(0, n_conf, n)
    groups = rng.integers(0, max(1, n // 4), n)  # groups span cells: masks are needed
    x = rng.standard_normal((n, 9)) + 0.8 * np.eye(9)[labels] + 0.8 * np.eye(9)[3 + confs]
    return normalize_rows(x.astype(dtype)), labels, confs, groups


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seed", range(3))
def test_typed_knn_identical_to_single_process(client, seed, dtype):
    u, labels, confs, groups = _scope(seed, 150 + 40 * seed, dtype)
    for block in (None, 16, 37):
        with threadpool_limits(limits=1):
            want = typed_knn(u, labels, confs, groups, 4, block_rows=block)
        got = distributed_typed_knn(client, u, labels, confs, groups, 4, block_rows=block)
        for g, w in zip(got, want):
            assert g.dtype == np.float64 and g.shape == w.shape
            np.testing.assert_array_equal(g, w)
    assert np.isfinite(want[0]).all() and np.isfinite(want[1]).all()  # the pools were non-trivial


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_count_within_identical_to_single_process(client, dtype):
    u, _, _, groups = _scope(7, 230, dtype)
    rng = np.random.default_rng(1)
    radius = rng.uniform(0, 1.4, 230)
    radius[:3] = [np.inf, 0.0, 2.0]
    for block in (None, 9, 64):
        with threadpool_limits(limits=1):
            want = count_within(u, groups, radius, block_rows=block)
        got = distributed_count_within(client, u, groups, radius, block_rows=block)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, want)
    others = 230 - np.bincount(groups)[groups]  # radius inf and 2.0 count every other-group row
    assert want[0] == others[0] and want[2] == others[2] and want[1] == 0 and np.unique(want).size > 20


def _manifest(labels, confs, groups, subset=None):
    n = len(labels)
    df = pd.DataFrame(
        {
            "sample_id": [f"s{i}" for i in range(n)],
            "image_path": [f"/t/{i}.png" for i in range(n)],
            "label": [f"L{v}" for v in labels],
            "center": [f"C{v}" for v in confs],
            "group_id": [f"g{v}" for v in groups],
            "dataset": "blocked",
        }
    )
    if subset is not None:
        df["subset"] = subset
    return df


@pytest.mark.parametrize("design", ["all", "paired_2x2"])
def test_croma_compute_with_distributed_search_equals_compute(client, design):
    rng = np.random.default_rng(3)
    n = 320
    labels, confs = rng.integers(0, 2, n), rng.integers(0, 2, n)
    groups = rng.integers(0, 60, n)
    x = (rng.standard_normal((n, 12)) + np.eye(12)[labels] + np.eye(12)[2 + confs]).astype(np.float32)
    df = _manifest(labels, confs, groups, subset=np.where(np.arange(n) % 2, "p1", "p0"))
    kw = dict(confounder_column="center", m=[3, 1], start_k=5, evaluation_design=design)
    with threadpool_limits(limits=1):
        want = CRoMa.compute(x, df, **kw)
    got = CRoMa.compute_with(
        make_search(client, "typed", block_rows=50), x, df, count_search=make_search(client, "count", block_rows=50), **kw
    )
    with threadpool_limits(limits=1):
        local_blocks = CRoMa.compute_with(lambda *a: typed_knn(*a, block_rows=50), x, df, **kw)
    for key in want:
        assert want[key].k_final > want[key].k_start  # the counting pass ran (distributed)
        for name in ("value", "std", "q_alpha", "ltm_alpha", "f0", "k_start", "k_final", "retries", "n_pairs"):
            assert getattr(got[key], name) == getattr(local_blocks[key], name), name
            # other tile shapes than the default may move a distance by an ulp: compare to 1e-6
            assert getattr(got[key], name) == pytest.approx(getattr(want[key], name), abs=1e-6), name
        np.testing.assert_array_equal(got[key].sample_values, local_blocks[key].sample_values)
    # default blocks: identical to compute itself
    got_default = CRoMa.compute_with(make_search(client, "typed"), x, df, count_search=make_search(client, "count"), **kw)
    for key in want:
        for name in ("value", "std", "q_alpha", "ltm_alpha", "f0", "k_start", "k_final", "retries"):
            assert getattr(got_default[key], name) == getattr(want[key], name), name
        np.testing.assert_array_equal(got_default[key].sample_values, want[key].sample_values)
        np.testing.assert_array_equal(got_default[key].pair_values, want[key].pair_values)


def test_cross_group_knn_blocks_equal_whole_scope(client):
    from cachescore.neighbors import exact

    u, _, _, groups = _scope(11, 260, np.float32)
    with threadpool_limits(limits=1):
        want = exact.cross_group_knn(u, groups, 12)
    got = distributed_cross_group_knn(client, u, groups, 12, block_rows=70)
    assert_same_search(got, want, u)  # bit-identical on a shape-invariant BLAS (tests/blas_equality.py)
    # RI end to end through make_search equals the single-process RI
    from cachescore.metrics.ri import RI

    rng = np.random.default_rng(4)
    labels, confs = rng.integers(0, 2, 200), rng.integers(0, 2, 200)
    x = (rng.standard_normal((200, 8)) + np.eye(8)[labels] + np.eye(8)[2 + confs]).astype(np.float32)
    df = _manifest(labels, confs, rng.integers(0, 50, 200))
    kw = dict(confounder_column="center", k_candidates=[3, 7, 15])
    with threadpool_limits(limits=1):
        ri_want = RI.compute(x, df, **kw)
    ri_got = RI.compute_with(make_search(client, "cross_group", block_rows=45), x, df, **kw)
    assert ri_got.value == ri_want.value and ri_got.k == ri_want.k
    np.testing.assert_array_equal(ri_got.sample_values, ri_want.sample_values)


def test_make_search_signatures_and_errors(client):
    params = {k: list(inspect.signature(make_search(client, k)).parameters) for k in SEARCH_KINDS}
    assert params == {
        "typed": ["u", "labels", "confounders", "groups", "m"],
        "count": ["u", "groups", "radius"],
        "cross_group": ["u", "groups", "kmax"],
    }
    with pytest.raises(ValueError, match="unknown search 'ann'"):
        make_search(client, "ann")
    u, labels, confs, groups = _scope(0, 20, np.float64)
    with pytest.raises(ValueError, match="m must be >= 1"):
        distributed_typed_knn(client, u, labels, confs, groups, 0)
    with pytest.raises(ValueError, match="labels must have shape"):
        distributed_typed_knn(client, u, labels[:3], confs, groups, 1)
    with pytest.raises(ValueError, match="radius"):
        distributed_count_within(client, u, groups, np.zeros(3))
    # degenerate scopes need no workers and match the kernel
    one = distributed_typed_knn(client, u[:1], labels[:1], confs[:1], groups[:1], 2)
    np.testing.assert_array_equal(one[0], typed_knn(u[:1], labels[:1], confs[:1], groups[:1], 2)[0])
    single_cell = distributed_typed_knn(client, u, np.zeros(20, int), np.zeros(20, int), groups, 2)
    assert np.isinf(single_cell[0]).all() and np.isinf(single_cell[1]).all()


def test_scope_is_scattered_once_and_one_task_per_block(client, monkeypatch):
    """The arrays travel once per call (broadcast), never inside the task graph."""
    from cachescore.neighbors.typed import typed_layout

    scatters, submits = [], []
    real_scatter, real_submit = client.scatter, client.submit

    def spy_scatter(data, **kwargs):
        scatters.append((type(data).__name__, kwargs.get("broadcast")))
        return real_scatter(data, **kwargs)

    def spy_submit(fn, *args, **kwargs):
        submits.append(fn.__name__)
        assert not any(isinstance(a, np.ndarray) and a.size > 64 for a in args), "array shipped in the graph"
        return real_submit(fn, *args, **kwargs)

    monkeypatch.setattr(client, "scatter", spy_scatter)
    monkeypatch.setattr(client, "submit", spy_submit)
    u, labels, confs, groups = _scope(5, 300, np.float32)
    distributed_typed_knn(client, u, labels, confs, groups, 3, block_rows=40)
    n_blocks = len(typed_layout(labels, confs, groups, block_rows=40)[0].blocks)
    assert scatters == [("ndarray", True), ("ndarray", True), ("TypedLayout", True)]
    assert submits == ["_typed_task"] * n_blocks and n_blocks > 5
    scatters.clear(), submits.clear()
    distributed_count_within(client, u, groups, np.full(300, 0.5), block_rows=40)
    assert scatters == [("ndarray", True)] * 3 and submits == ["_count_task"] * 8
