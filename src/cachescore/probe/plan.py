"""The probe sweep's split plan, built and hashed on the client BEFORE any probe is fitted.

Spec: ``spec/evaluation.md`` C.3 (plan built once from metadata, audited on the client, hashed),
C.4 (split report), ``spec/downstream.md`` §3 (the sweep's arrangement replay).

:func:`build_probe_plan` runs exactly the validation and the driver-side replay of
:func:`cachescore.probe.sweep.sweep_outcomes` (same checks in the same order, same replicate
seeds, same arrangement carry-over), but stops before fitting: it returns, for every
(replicate, split), the row indices of the roles ``train``, ``val`` and ``test_id`` (the sweep's
in-domain tail; each extra test set is a ``test_ood`` role whose rows are the whole set).

The plan does not depend on the encoder: it is a function of the confounders, labels, schedule,
seeds, ``rows_per_slide``, ``validation_fraction``, the arrangement hook and the names / sizes of
the extra test sets. :func:`plan_sha256` hashes a canonical serialisation of it:

* a header: canonical JSON (sorted keys, ``(",", ":")`` separators, UTF-8) of
  ``{"format": "cachescore.probe-plan/1", "n_rows", "replicate_seeds", "test_sets": [[name, n],
  ...]}``; then, for each job in ``(replicate, split)`` order and each role in ``train, val,
  test_id`` order: the role name in ASCII, the row count as 8 little-endian bytes and the rows as
  little-endian int64 (training rows in the order the probe sees them -- order matters bitwise).

Two plans hash equal exactly when they assign the same rows, in the same order, to the same roles.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import sweep as sw

__all__ = ["PLAN_FORMAT", "ProbePlan", "build_probe_plan", "plan_sha256"]

#: Identifier of the canonical plan serialisation hashed by :func:`plan_sha256`.
PLAN_FORMAT = "cachescore.probe-plan/1"

#: Role names of a job's in-domain row sets, in hash / report order.
PLAN_ROLES = ("train", "val", "test_id")


@dataclass(frozen=True, kw_only=True, eq=False)
class ProbePlan:
    """Every (replicate, split) row assignment of one sweep, with its hash.

    Attributes
    ----------
    jobs : tuple of ``cachescore.probe.fit.ProbeTask`` in ``(replicate, split)`` order;
        ``train_rows``, ``val_rows``, ``test_rows`` (role ``test_id``) are int64 indices into the
        embeddings.
    replicate_seeds : tuple[int, ...]
    n_rows : int
    n_splits : int
    test_set_sizes : dict[str, int], ``test_ood`` sets in the order given.
    sha256 : str, :func:`plan_sha256` of the above.
    """

    jobs: tuple
    replicate_seeds: tuple[int, ...]
    n_rows: int
    n_splits: int
    test_set_sizes: dict[str, int]
    sha256: str


def plan_sha256(jobs: Sequence[Any], *, n_rows: int, replicate_seeds: Sequence[int],
                test_set_sizes: Mapping[str, int]) -> str:
    """sha256 (hex) of the canonical serialisation described in the module docstring."""
    header = {
        "format": PLAN_FORMAT,
        "n_rows": int(n_rows),
        "replicate_seeds": [int(s) for s in replicate_seeds],
        "test_sets": [[str(k), int(v)] for k, v in test_set_sizes.items()],
    }
    h = hashlib.sha256(json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8"))
    for job in sorted(jobs, key=lambda j: (int(j.replicate), int(j.split))):
        h.update(f"|{int(job.replicate)}|{int(job.split)}|{int(job.seed)}|".encode("ascii"))
        for role, rows in zip(PLAN_ROLES, (job.train_rows, job.val_rows, job.test_rows)):
            arr = np.ascontiguousarray(rows, dtype="<i8")
            h.update(role.encode("ascii"))
            h.update(int(arr.size).to_bytes(8, "little"))
            h.update(arr.tobytes())
    return h.hexdigest()


def _prepare(embeddings, confounders, labels, *, schedule, test_sets, rows_per_slide, iterations,
             seed, validation_fraction, arrange_slides):
    """Validate (croma's order) and replay; return ``(plan, features, labels, named_tests)``."""

    features = sw._as_features(embeddings)
    n_rows = features.shape[0]
    conf = sw._as_indices("confounders", confounders, n_rows)
    lab = sw._as_indices("labels", labels, n_rows)
    if not n_rows:
        raise ValueError("embeddings must hold at least one row")
    named_tests = sw._validated_test_sets(test_sets, features.shape[1])
    cells = sw._cell_grid(conf, lab)
    plans = sw._validated_plans(schedule, cells, rows_per_slide, validation_fraction)
    if iterations < 1:
        raise ValueError(f"iterations must be at least 1, got {iterations}")
    if iterations > sw.SEED_POOL:
        raise ValueError(f"iterations must be at most {sw.SEED_POOL}, got {iterations}")
    replicate_seeds = random.Random(seed).sample(range(0, sw.SEED_POOL), iterations)
    jobs = sw._replay(cells, plans, replicate_seeds, rows_per_slide, arrange_slides)
    jobs = sorted(jobs, key=lambda j: (j.replicate, j.split))
    sizes = {name: int(x.shape[0]) for name, (x, _) in named_tests.items()}
    plan = ProbePlan(
        jobs=tuple(jobs), replicate_seeds=tuple(int(s) for s in replicate_seeds), n_rows=int(n_rows),
        n_splits=len(plans), test_set_sizes=sizes,
        sha256=plan_sha256(jobs, n_rows=n_rows, replicate_seeds=replicate_seeds, test_set_sizes=sizes),
    )
    return plan, features, lab, named_tests


def build_probe_plan(
    embeddings,
    confounders,
    labels,
    *,
    schedule: Sequence,
    test_sets: Mapping[str, tuple[Any, Any]] | None = None,
    rows_per_slide: int = 1,
    iterations: int = 20,
    seed: int = 1000,
    validation_fraction: float | None = None,
    arrange_slides=None,
) -> ProbePlan:
    """The sweep's split plan (no probe is fitted).

    Parameters are those of :func:`cachescore.probe.sweep.sweep_outcomes`; ``embeddings`` is
    only validated (shape, finiteness) -- the plan never depends on its values.

    Returns
    -------
    ProbePlan

    Raises
    ------
    ValueError
        The sweep's validation catalogue (spec downstream §6), in croma's order.
    """
    plan, _, _, _ = _prepare(
        embeddings, confounders, labels, schedule=schedule, test_sets=test_sets,
        rows_per_slide=rows_per_slide, iterations=iterations, seed=seed,
        validation_fraction=validation_fraction, arrange_slides=arrange_slides,
    )
    return plan
