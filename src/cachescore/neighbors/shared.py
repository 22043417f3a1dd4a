"""One exact engine for several metric units over the same rows: each cross-group search once.

RI and MaRI of one (encoder, view, design) ask the exact engine for the same cross-group tables
(same normalised rows, same group codes, same ``kmax``: measured on the demo views, every call
repeats). :class:`SharedSearch` answers a repeated ``cross`` call from the first call's result
instead of searching again. It is keyed by the call's *content* (the bytes of ``u`` and
``groups``, ``kmax``), not by object identity, so a unit that normalises its own copy of the rows
still finds the table, and a call with other rows, codes or ``kmax`` is searched afresh. Only an
engine that is a pure function of its arguments may be shared (exact: no recall to measure, no
per-call details); :func:`shareable` says which.

``typed`` is the inner engine's kernel itself (not a wrapper), so CRoMa still recognises the exact
kernel and fuses its schedule count into the typed search (:mod:`cachescore.neighbors.exact_search`).
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["SharedSearch", "shareable"]


def shareable(params: dict) -> bool:
    """Whether units with these engine parameters may share one engine: in-memory ``exact``
    (its answers depend on the arguments only; an ANN engine measures recall per unit)."""
    return params.get("backend", "exact") == "exact" and "engine" not in params


def _digest(a: np.ndarray) -> bytes:
    a = np.ascontiguousarray(a)
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{a.dtype.str}{a.shape}".encode())
    h.update(memoryview(a).cast("B"))
    return h.digest()


class SharedSearch:
    """An exact :class:`~.base.Searcher` whose ``cross`` results are kept for the next identical call.

    ``inner`` is an exact engine (:class:`~.exact_search.ExactSearch`). ``cross`` returns copies
    (a caller may write into its table without changing the next caller's); ``hits`` counts the
    calls answered from the memo. The memo lives as long as this object: one batch of units.
    """

    def __init__(self, inner):
        self.inner = inner
        self.typed = inner.typed
        self.schedule_diagnostics = bool(getattr(inner, "schedule_diagnostics", False))
        self._memo: dict = {}
        self.hits = 0

    def cross(self, u: np.ndarray, groups: np.ndarray, kmax: int) -> tuple[np.ndarray, np.ndarray]:
        key = (_digest(u), _digest(np.asarray(groups)), int(kmax))
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = self.inner.cross(u, groups, kmax)
        else:
            self.hits += 1
        idx, dist = found
        return idx.copy(), dist.copy()

    @property
    def recall(self) -> float:
        return self.inner.recall

    @property
    def details(self) -> list:
        return self.inner.details
