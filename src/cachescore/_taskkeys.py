"""Task keys that say what a task is, for the dashboard: ``<phase>.<encoder>.<view>.<metric>-<detail>``.

Dask groups tasks by the key's prefix (``dask.utils.key_split``: everything before the first
``-``), so that prefix names the phase and the unit's identity, joined by ``.`` — a ``-`` inside
it would cut the group short, so ``-`` in names becomes ``_`` — and the progress and task-stream
panels show per-encoder, per-phase bars (``score.enc0.centre_all.ri``,
``search.enc2.centre_all.mari``, ``probe_replicate.enc1.centre_all.probe``).

The unit's identity comes from the current Dask annotation :data:`ANNOTATION`
(``dask.annotate(cachescore={"unit": fingerprint, "encoder", "view", "metric"})``, set by the
pipeline around a unit's work), so the engines below (large-scope search, probe sweep) name their
tasks without knowing about units; without that annotation the key is ``<phase>-<detail>``.
"""

from __future__ import annotations

import uuid

import dask

__all__ = ["ANNOTATION", "PHASES", "unit_prefix", "task_key", "current_unit"]

#: The annotation key the pipeline sets for a unit's tasks (read by the scheduler plugin too).
ANNOTATION = "cachescore"

#: Phases of the work (the first word of every cachescore task key).
PHASES = ("score", "probe", "probe_replicate", "probe_evaluate", "partition", "calibrate", "search", "reduce")


def _word(text) -> str:
    return str(text).replace("-", "_").replace(" ", "_") or "_"


def unit_prefix(phase: str, encoder: str, view: str, metric: str) -> str:
    """``<phase>.<encoder>.<view>.<metric>`` with ``-`` and spaces as ``_`` (one key group)."""
    if phase not in PHASES:
        raise ValueError(f"unknown task phase {phase!r} (known: {', '.join(PHASES)})")
    return ".".join(_word(w) for w in (phase, encoder, view, metric))


def current_unit() -> dict | None:
    """The unit annotation in effect (``{"unit", "encoder", "view", "metric", ...}``) or None."""
    ann = dask.get_annotations().get(ANNOTATION)
    return ann if isinstance(ann, dict) and ann.get("unit") else None


def task_key(phase: str, *detail, group: str | None = None) -> str:
    """A fresh key for one task of ``phase``: the current unit's prefix (or the bare phase), an
    8-hex random word (where ``key_split`` stops), the ``detail`` words and 12 more random hex
    characters (keys must not collide across resubmissions). ``group`` (a word) ends the prefix
    (``calibrate.enc0.all.ri.sample``): a task group of its own within the phase, so the
    scheduler does not estimate the phase's other tasks from this one's duration."""
    if phase not in PHASES:
        raise ValueError(f"unknown task phase {phase!r} (known: {', '.join(PHASES)})")
    unit = current_unit()
    head = unit_prefix(phase, unit["encoder"], unit["view"], unit["metric"]) if unit else _word(phase)
    if group is not None:
        head = f"{head}.{_word(group)}"
    rand = uuid.uuid4().hex
    # an 8-hex word right after the prefix ends key_split's group there (alphabetic details would extend it)
    return "-".join([head, rand[:8], *(_word(d) for d in detail), rand[8:20]])
