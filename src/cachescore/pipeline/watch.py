"""Automatic re-scoring: poll a job's cache and run the job whenever there is new work.

:func:`watch_job` is what ``cachescore watch JOB`` runs. Each poll plans the job
(:func:`~.plan.plan_job`: every fingerprint is recomputed from the cache's current encoders,
tilesets, views and their content fingerprints, and from the job's parameters), so a new encoder
(with ``encoders = []`` in the job), a rewritten shard, a changed view or changed parameters all
show up as pending units. When some pending unit is *new work* -- its fingerprint has not already
failed in an earlier run -- it prints what it found (grouped by reason, see
:func:`~.status.pending_reasons`) and runs the job (:func:`~.run.run_job`, which also retries
the units that failed before). Pending units that only repeat a known failure do not trigger a
run: their inputs did not change, so running them again would fail the same way (``cachescore
run`` retries them on request).

Re-reading the job file on every poll is deliberate: an edited ``[metrics]`` table is a params
change. For scheduled re-scoring without a long-running process, see ``deploy/cron.md``
(``cachescore rescore`` from cron or a systemd timer).
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TextIO

from ..errors import RunAborted
from ..jobs import load_job
from ..store import ResultsStore
from ..store.lock import StoreLockedError
from .messages import say
from .run import ensure_demo_cache, require_cache, run_job
from .plan import plan_job
from .status import pending_reasons

__all__ = ["WatchPoll", "poll_job", "watch_job"]


@dataclass
class WatchPoll:
    """One poll: ``new`` (pending units that are new work, each ``{"label", "fingerprint",
    "reason"}``), ``known_failures`` (pending units whose fingerprint already failed) and the
    :class:`~.run.RunSummary` of the run it started (None when it started none); ``error``
    says why a run could not happen (the store locked by another run or not writable, the cluster lost;
    the next poll tries again)."""

    poll: int
    new: list = field(default_factory=list)
    known_failures: list = field(default_factory=list)
    summary: object = None
    error: str | None = None


def poll_job(job) -> tuple[list, list]:
    """Plan ``job`` and split its pending units into ``(new, known_failures)`` (see module
    docstring). Raises what :func:`~.plan.plan_job` raises (missing cache, unknown encoder/view)."""
    store = ResultsStore(job.store)
    plan = plan_job(job, store=store)
    reasons = pending_reasons(plan, store=store)
    new = [r for r in reasons if not r["reason"].startswith("failed before")]
    known = [r for r in reasons if r["reason"].startswith("failed before")]
    return new, known


def watch_job(job_or_path, *, interval: float = 300.0, max_runs: int | None = None, scheduler: str | None = None,
              cluster: str | None = None,
              out: TextIO | None = sys.stderr, progress: bool = True, run: Callable | None = None,
              sleep: Callable[[float], None] = time.sleep, **run_kwargs) -> list[WatchPoll]:
    """Poll the job's cache every ``interval`` seconds and run the job when there is new work.

    Parameters
    ----------
    job_or_path : Job or path of a job file
        A path is re-read on every poll (edited parameters are picked up); a ``Job`` is used as is.
    interval : float
        Seconds between the end of one poll (or of the run it started) and the next poll.
    max_runs : int, optional
        Stop after this many polls (each poll runs the job at most once); None: forever.
    scheduler : str, optional
        Dask scheduler address for the runs (default: the job's, else a LocalCluster per run).
    cluster : str, optional
        ``[cluster] kind`` override for the runs (exclusive with ``scheduler``).
    out, progress : where the poll lines go; ``progress`` also sends each run's progress bar there.
    run : callable, optional
        Replaces :func:`~.run.run_job` (same signature); ``run_kwargs`` are passed to it.

    Returns the list of :class:`WatchPoll` (one per poll). Job-level errors (unreadable job file,
    missing cache) raise; failed units do not (they are in each poll's summary and the store).
    """
    if max_runs is not None and int(max_runs) < 1:
        raise ValueError(f"max_runs must be >= 1 or None, got {max_runs!r}")
    if float(interval) < 0:
        raise ValueError(f"interval must be >= 0 seconds, got {interval!r}")
    run = run_job if run is None else run
    polls: list[WatchPoll] = []
    n = 0
    while max_runs is None or n < int(max_runs):
        n += 1
        job = load_job(job_or_path) if isinstance(job_or_path, (str, Path)) else job_or_path
        polls.append(_poll_once(job, n, run, out=out, run_out=out if progress else None,
                                run_kwargs=dict(run_kwargs, scheduler=scheduler, cluster=cluster)))
        if max_runs is None or n < int(max_runs):
            sleep(float(interval))
    return polls


def _poll_once(job, n: int, run: Callable, *, out, run_out, run_kwargs: dict) -> WatchPoll:
    """Poll ``job`` once (poll number ``n``) and run it when there is new work; says each step on
    ``out``. Store and cluster troubles end the poll with ``error`` (the next poll tries again);
    a missing cache raises."""
    ensure_demo_cache(job, out)
    require_cache(job)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:
        new, known = poll_job(job)
    except OSError as exc:  # the store cannot be read or written now (disk full, a mount gone)
        say(out, f"[{stamp}] poll {n}: not run: {exc}; trying again at the next poll")
        return WatchPoll(poll=n, new=[], known_failures=[], error=str(exc))
    poll = WatchPoll(poll=n, new=new, known_failures=known)
    if not new:
        extra = f" ({len(known)} known failure(s) not retried)" if known else ""
        say(out, f"[{stamp}] poll {n}: up to date{extra}")
        return poll
    by_reason = Counter(r["reason"] for r in new)
    say(out, f"[{stamp}] poll {n}: {len(new)} unit(s) to score ("
             + ", ".join(f"{c} {reason}" for reason, c in sorted(by_reason.items())) + ")")
    for r in new:
        say(out, f"  {r['reason']}: {r['label']}")
    try:
        poll.summary = run(job, out=run_out, **run_kwargs)
    except (StoreLockedError, RunAborted, OSError) as exc:  # store locked or unwritable, cluster gone
        poll.error = str(exc)
        say(out, f"[{stamp}] poll {n}: not run: {exc}; trying again at the next poll")
        return poll
    s = poll.summary
    say(out, f"[{stamp}] poll {n}: run {s.run_id} executed {s.executed}, succeeded {s.succeeded}, "
             f"failed {len(s.failures)}")
    return poll
