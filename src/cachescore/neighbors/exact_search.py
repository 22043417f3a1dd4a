"""The in-memory exact engine as a :class:`~.base.Searcher` (the registry's ``exact`` backend).

Its ``cross`` and ``typed`` *are* the blocked-GEMM kernels :func:`.exact.cross_group_knn` and
:func:`.typed.typed_knn` (instance attributes, not wrappers), so a metric given this engine runs
exactly what its own ``compute`` runs: ``RI.compute_with(ExactSearch().cross, ...)`` is
``RI.compute(...)``, and CRoMa recognises its own kernel and fuses the schedule count into the
typed search (``schedule_diagnostics`` is True: exact engines afford croma's counting pass).
"""

from __future__ import annotations

from .exact import cross_group_knn
from .typed import typed_knn

__all__ = ["ExactSearch"]


class ExactSearch:
    """Exact cross-group and typed neighbours in memory; ``recall`` NaN (exact by construction),
    ``details`` empty (nothing to report per call)."""

    #: CRoMa may run its exact schedule counting pass with this engine.
    schedule_diagnostics = True

    def __init__(self):
        self.cross = cross_group_knn
        self.typed = typed_knn
        self.details: list = []

    @property
    def recall(self) -> float:
        return float("nan")
