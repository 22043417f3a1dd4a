"""The neighbour-engine protocol: what every search engine provides to the metrics.

The metrics (``RI.compute_with``, ``MaRI.compute_with``, ``CRoMa.compute_with``) never branch on
the engine: they call a :class:`Searcher`'s two search methods and read back its measured recall.
An engine must provide

``cross(u, groups, kmax) -> (idx, dist)``
    For each of the ``n`` rows of ``u`` (``(n, d)`` L2-normalised float32/float64, or an
    ``(n, 0)`` placeholder for engines that read the rows themselves), its ``kmax`` nearest rows
    in *other* groups (``groups``: ``(n,)`` int codes): ``idx`` ``(n, kmax)`` int64 and ``dist``
    ``(n, kmax)`` float64 cosine distances, sorted by ``(distance, index)`` (ADR-0001), padded
    with ``(-1, +inf)``. Same-group rows are never returned.
``typed(u, labels, confounders, groups, m) -> (so_dist, os_dist)``
    Per row, the ``m`` smallest distances to SO rows (same label, other confounder) and to OS rows
    (other label, same confounder), other groups only: two ``(n, m)`` float64 arrays, ascending,
    ``+inf`` padded.
``recall``
    float: the worst tie-robust recall measured over every call (:mod:`.recall`), NaN for an
    engine that is exact by construction.
``details``
    list of JSON-safe dicts, one per search call (sizes, probe fraction, timings), stored with the
    result as ``neighbour_search``; may be empty.

``scope=`` (keyword)
    The scope reference: the name of the metric's scope (``manifest.Scope.subset``). An engine
    that finds a scope's rows itself (out of core: it never sees the vectors) marks its two
    methods :func:`scope_aware`, and the metrics then call them with ``scope=`` (through
    :func:`call_search`) instead of the engine re-identifying the scope from its codes; engines
    that search the rows they are given take no scope, nor do croma-contract callables.

Both methods may be called several times per unit (once per scope, and RI/MaRI may ask again);
they raise ``ValueError`` for data they cannot search and
:class:`~.recall.RecallTargetError` (a ``RuntimeError``) when a recall target is not met.

The engines (chosen by :mod:`.registry`, the planner's one entry point):

* **exact, in memory** — :func:`.exact.cross_group_knn` / :func:`.typed.typed_knn` (blocked GEMMs);
  the metrics' own ``compute`` path, which also counts CRoMa's schedule diagnostics;
* **ANN, in memory** — :class:`.ann.AnnSearch`: a calibrated spherical k-means IVF, or a
  pynndescent graph (``method="graph"``), exact distances on the candidates, measured recall;
* **out of core** — :class:`.large_scope.LargeScopeSearch`: the IVF engine over row chunks read
  by Dask tasks from the cache (ADR-0007), exact or calibrated;
* **distributed exact** — :func:`.blocked.make_search`: the in-memory exact kernels fanned out
  over query row blocks on Dask workers (for callers holding the rows, e.g. notebooks).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

__all__ = ["Searcher", "scope_aware", "call_search"]


def scope_aware(method):
    """Mark an engine's ``cross`` / ``typed`` as taking the scope reference ``scope=`` (see the
    module docstring); returns ``method``."""
    method.takes_scope = True
    return method


def call_search(search, *args, scope: str):
    """``search(*args)`` for the metric's scope named ``scope``: the name is passed (``scope=``)
    to a :func:`scope_aware` engine method only, never to a plain search callable."""
    if getattr(search, "takes_scope", False):
        return search(*args, scope=scope)
    return search(*args)


@runtime_checkable
class Searcher(Protocol):
    """A neighbour engine as the metrics use it (see the module docstring for the contract)."""

    def cross(self, u: np.ndarray, groups: np.ndarray, kmax: int) -> tuple[np.ndarray, np.ndarray]: ...

    def typed(self, u: np.ndarray, labels: np.ndarray, confounders: np.ndarray, groups: np.ndarray,
              m: int) -> tuple[np.ndarray, np.ndarray]: ...

    @property
    def recall(self) -> float: ...

    @property
    def details(self) -> list: ...
