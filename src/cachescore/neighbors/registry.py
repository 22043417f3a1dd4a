"""The one way an engine is picked: neighbour backends by name, and the engine of a planned unit.

Backends: ``"exact"`` (blocked GEMM), ``"ann"`` (:mod:`~cachescore.neighbors.ann`: IVF partition
or pynndescent graph, exact distances, measured recall) and ``"auto"`` (chosen per scope from its
size by :func:`choose_backend`). Scopes of at least ``[neighbors] large_scope_rows`` rows are
searched out of core (:mod:`cachescore.neighbors.large_scope`) with the resolved backend's
exactness. The planner calls :func:`engine_params` (what a unit's fingerprinted parameters say
about its engine); the runner calls :func:`is_out_of_core` and :func:`searcher_for`, which builds
every engine from a unit's parameters with one set of defaults.

Every engine is a :class:`~.base.Searcher` (``cross`` / ``typed`` with the same return contracts,
``recall``, ``details``), so the metrics never branch on the engine; ``tests/test_engine_conformance.py``
runs one suite over all of them.

Backend modules are imported on first use, so importing the registry is cheap and does not pull in
numba.
"""

from __future__ import annotations

import importlib

__all__ = [
    "BACKEND_NAMES",
    "DEFAULT_AUTO_THRESHOLD",
    "choose_backend",
    "OUT_OF_CORE",
    "engine_params",
    "is_out_of_core",
    "in_memory_searcher",
    "searcher_for",
    "ENGINE_NAMES",
]

#: ``params["engine"]`` of a unit searched out of core (a stored parameter: never rename it).
OUT_OF_CORE = "distributed"

#: Names accepted by :func:`resolve_backend` (``"auto"`` resolves to one of the others).
BACKEND_NAMES = ("exact", "ann", "auto")

#: ``auto`` switches to ``ann`` when a scope's exact search costs more than this many
#: multiply-adds (``n² · d``): 40,000 rows at d = 768. Measured on the 2-core development box,
#: cross-group kNN, k = 21, make_scale_cache rows (``benchmarks/peers.py``, 2026-12-02): exact
#: 1.4 s at 20k and 32.3 s at 100k × 768 (~ n²·d / 2.3e11 s: each pair once, both cores); ann
#: (ivf) 2.9 s at 20k and 14.7 s at 100k (~1.5e-4 s per row: k-means, calibration and the recall
#: audit included). The two cross near 44,000 rows at d = 768 (1.5e12 multiply-adds); the
#: threshold stays at 1.2e12, inside that figure's noise, because below it exact results are worth
#: more than a small gain. (An earlier comment here extrapolated ~150 s for exact at 100k; measured
#: 32–44 s.)
DEFAULT_AUTO_THRESHOLD = 1.2e12

#: The in-memory engines by resolved backend name: (module, class), relative to this package; each
#: class is built from a unit's parameters (``ExactSearch()`` takes none).
_ENGINES = {"exact": ("exact_search", "ExactSearch"), "ann": ("ann", "AnnSearch")}

#: Every engine :func:`searcher_for` builds (``tests/test_engine_conformance.py`` runs its suite
#: over each): the in-memory ones by backend, and the out-of-core engine.
ENGINE_NAMES = (*_ENGINES, "out_of_core")


def _load(module: str, attr: str):
    return getattr(importlib.import_module(f"{__package__}.{module}"), attr)


def choose_backend(n: int, d: int, threshold: float = DEFAULT_AUTO_THRESHOLD) -> str:
    """``"exact"`` if an exact search over ``n`` rows of width ``d`` costs at most ``threshold``
    multiply-adds (``n² · d``), else ``"ann"``.

    Raises
    ------
    ValueError
        Negative ``n`` or ``d``, or a non-positive ``threshold``.
    """
    n, d, threshold = int(n), int(d), float(threshold)
    if n < 0 or d < 0:
        raise ValueError(f"n and d must be >= 0, got n={n}, d={d}")
    if not threshold > 0:
        raise ValueError(f"threshold must be > 0, got {threshold}")
    return "exact" if float(n) * float(n) * float(d) <= threshold else "ann"


def engine_params(backend: str, *, scope_rows: int, dim: int, neighbors: dict) -> dict:
    """The engine part of a work unit's parameters (they enter its fingerprint and its record).

    ``backend`` is the job's ``[neighbors] backend`` (``auto`` resolved here from the largest
    scope's ``scope_rows`` and the embedding ``dim`` against ``neighbors["auto_threshold"]``);
    ``neighbors`` the job's validated ``[neighbors]`` table. Returns ``{"backend": "exact"|"ann"}``
    plus, for ``ann``, ``recall_target``, ``recall_sample`` and ``seed``, plus, for a scope of at
    least ``large_scope_rows`` rows, ``engine = OUT_OF_CORE`` and ``seed``.
    """
    if backend not in BACKEND_NAMES:
        raise ValueError(f"unknown neighbour backend {backend!r}; expected one of {list(BACKEND_NAMES)}")
    resolved = choose_backend(scope_rows, dim, float(neighbors["auto_threshold"])) if backend == "auto" else backend
    params: dict = {"backend": resolved}
    if resolved == "ann":
        params.update(recall_target=float(neighbors["recall_target"]), recall_sample=int(neighbors["recall_sample"]),
                      seed=int(neighbors["seed"]))
    if scope_rows >= int(neighbors["large_scope_rows"]):
        params.update(engine=OUT_OF_CORE, seed=int(neighbors["seed"]))
    return params


def is_out_of_core(params: dict) -> bool:
    """Whether a unit with these parameters is searched out of core (driven from the client)."""
    return params.get("engine") == OUT_OF_CORE


def in_memory_searcher(params: dict):
    """The in-memory :class:`~.base.Searcher` for a unit's parameters: :class:`~.ann.AnnSearch` for
    ``backend = "ann"``, :class:`~.exact_search.ExactSearch` for ``exact`` (the metrics' own exact
    kernels, CRoMa's schedule diagnostics included). Raises ``ValueError`` for an unknown backend."""
    backend = params.get("backend", "exact")
    if backend not in _ENGINES:
        raise ValueError(f"unknown neighbour backend {backend!r} in unit parameters; expected one of {sorted(_ENGINES)}")
    engine = _load(*_ENGINES[backend])
    return engine() if backend == "exact" else engine(params)


#: The out-of-core engine's settings a unit's parameters may leave out (an exact unit carries no
#: recall target; every out-of-core unit carries its ``seed``, :func:`engine_params`).
_OUT_OF_CORE_DEFAULTS = {"recall_target": 1.0, "recall_sample": 1000}


def searcher_for(params: dict, *, client=None, scopes: dict | None = None, scratch=None, expected=None, gate=None):
    """The :class:`~.base.Searcher` of a unit with these parameters: out of core
    (:class:`~.large_scope.LargeScopeSearch` on ``client``'s workers over ``scopes``,
    ``{key: ScopeRows}`` each named by its metric scope, with artefacts under ``scratch``;
    exact unless ``backend = "ann"``; ``expected``: the tables the job will ask of each scope,
    ``gate``: called before a partition is marked complete, both as in
    :class:`~.large_scope.LargeScopeSearch`) when :func:`is_out_of_core`, else
    :func:`in_memory_searcher`. Raises ``ValueError`` for an unknown backend or an out-of-core
    unit without ``client``, ``scopes`` and ``scratch``."""
    if not is_out_of_core(params):
        return in_memory_searcher(params)
    if client is None or scopes is None or scratch is None:
        raise ValueError("an out-of-core unit's engine needs the run's client, its scopes and a scratch folder")
    backend = params.get("backend", "exact")
    if backend not in _ENGINES:
        raise ValueError(f"unknown neighbour backend {backend!r} in unit parameters; expected one of {sorted(_ENGINES)}")
    settings = {**_OUT_OF_CORE_DEFAULTS, **params}
    engine = _load("large_scope", "LargeScopeSearch")
    return engine(client, scopes, scratch, exact=backend != "ann", recall_target=float(settings["recall_target"]),
                  n_recall_queries=int(settings["recall_sample"]), random_state=int(params["seed"]), expected=expected,
                  gate=gate)
