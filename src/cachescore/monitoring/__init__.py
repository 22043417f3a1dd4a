"""Watching a run: the scheduler plugin, its Prometheus collectors and the live status page.

* :mod:`.board` – :class:`RunBoard`, the units of the current run and their states;
* :mod:`.plugin` – :class:`CachescorePlugin` (on the scheduler) and :class:`RunMonitor` (the
  client's handle), task annotation :data:`ANNOTATION`;
* :mod:`.metrics` – the ``cachescore_*`` Prometheus families on the scheduler's ``/metrics``;
* :mod:`.page` – ``<dashboard>/cachescore``, the live table of units;
* :mod:`.progress` – the terminal progress bar (tqdm).

Task keys that say what a task is (``<phase>.<encoder>.<view>.<metric>-…``) are built by
:mod:`cachescore._taskkeys` from the unit annotation the pipeline sets.
"""

from .board import UNIT_STATES, RunBoard, unit_entry
from .plugin import ANNOTATION, CachescorePlugin, RunMonitor, page_url

__all__ = ["RunBoard", "UNIT_STATES", "unit_entry", "CachescorePlugin", "RunMonitor", "ANNOTATION", "page_url"]
