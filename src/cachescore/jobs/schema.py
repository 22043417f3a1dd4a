"""Job files: a versioned, validated TOML schema (read with the stdlib :mod:`tomllib`).

A job names a cache, a results store and what to score in it. Every key is declared once, in
:data:`SCHEMA`, with its type, default and one-line description; :func:`load_job` checks a file
against it and returns a frozen :class:`Job` whose tables are typed sections (frozen dataclasses
built from the same keys, :mod:`.sections`; ``[probe]`` is :class:`~cachescore.probe.params.ProbeParams`). Unknown keys, wrong types and out-of-range values
are errors (:class:`JobError`, a ``ValueError``) that name the file and the dotted key.

Layout of a job file (``schema_version = 1``)::

    schema_version = 1
    [job]        name, cache, store, encoders, views, design, probe_views, bundles
    [demo]       synthesise, seed, n_slides_per_cell, tiles_per_slide, dim   (optional)
    [metrics]    families
    [metrics.ri]     k_candidates
    [metrics.mari]   k_candidates, tau, warn_tau
    [metrics.croma]  m, alpha, start_k, kgrowth_factor
    [neighbors]  backend, auto_threshold, recall_target, recall_sample, seed
    [execution]  n_workers, memory_limit, retries, large_unit_drivers, dashboard, performance_report,
                 scheduler
    [probe]      optional PathoROB probe sweep per encoder × probe view; its keys are
                 :data:`cachescore.probe.params.PROBE_KEYS`, validated by ``ProbeParams``

Relative paths (``job.cache``, ``job.store``) are resolved against the folder the job file is
named in (a symbolic link's own folder, not its target's), so a job file can travel with its cache. ``print(describe_schema())`` lists every key.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._keys import (
    NUM,
    Key,
    half_open_unit,
    non_empty,
    non_negative_int,
    one_of,
    open_unit,
    positive_int,
    positive_number,
    str_list,
)
from ..metrics import families
from ..neighbors.registry import DEFAULT_AUTO_THRESHOLD
from ..probe.params import PROBE_KEYS, ProbeParams
from ..store import default_bundles
from .sections import as_dict, section_class

__all__ = [
    "SCHEMA_VERSION",
    "SCHEMA",
    "BACKENDS",
    "JobError",
    "Key",
    "Job",
    "load_job",
    "parse_job",
    "describe_schema",
    "Metrics",
    "Demo",
    "Bootstrap",
    "Report",
    "Neighbors",
    "Execution",
    "Cluster",
    "Slurm",
    "Pbs",
    "Kubernetes",
    "as_dict",
]

#: The only job-file schema version this release reads.
SCHEMA_VERSION = 1

#: Neighbour backends: exact blocked search, approximate (pynndescent + exact refine), or chosen by cost.
BACKENDS = ("exact", "ann", "auto")

#: Designs a job may force; ``auto`` uses each view's design hint (``all`` when it has none).
JOB_DESIGNS = ("auto", "all", "paired_2x2")


def _check_apart(cache: Path, store: Path, src: str) -> None:
    """The results store and the cache must be separate folders, neither inside the other (a store
    written into a cache would be read as cache content, and ``prune`` could delete cache files)."""
    a, b = Path(os.path.realpath(cache)), Path(os.path.realpath(store))
    if a == b or a in b.parents or b in a.parents:
        rel = "the same folder" if a == b else ("inside the cache" if a in b.parents else "around the cache")
        raise JobError(f"{src}: job.store {store} is {rel} ({cache}); the results store and the cache must be "
                       "separate folders, neither inside the other")


class JobError(ValueError):
    """A job file is unreadable or does not follow the schema. The message names file and key."""


def _families(v):
    known = families.names(families.NEIGHBOUR)
    err = str_list(v)
    if err or not v:
        return "a non-empty list drawn from " + ", ".join(known)
    bad = [x for x in v if x not in known]
    return f"a list drawn from {', '.join(known)} (got {', '.join(bad)})" if bad else None



#: ``[cluster] kind`` values.
CLUSTER_KINDS = ("local", "slurm", "pbs", "kubernetes")


def _batch_keys(system: str, *, queue_doc: str, directive: str) -> dict:
    """The keys a batch-system section shares (they map onto dask-jobqueue's cluster arguments)."""
    return {
        "queue": Key((str,), "", queue_doc),
        "account": Key((str,), "", f"{system} account / project to charge; empty = none."),
        "cores": Key((int,), 1, "Cores per worker job (one thread per worker process).", positive_int),
        "processes": Key((int,), 1, "Dask worker processes per job (each gets cores / processes threads; keep them "
                                    "equal for one thread per process).", positive_int),
        "memory": Key((str,), "4GiB", "Memory per worker job, e.g. '16GiB'.", non_empty),
        "walltime": Key((str,), "01:00:00", "Walltime per worker job (HH:MM:SS); adaptive scaling replaces ended jobs.",
                        non_empty),
        "job_extra_directives": Key((list,), [], f"Extra {directive} lines of the worker job script, e.g. "
                                                 "['--exclusive'].", str_list),
        "worker_extra_args": Key((list,), [], "Extra arguments of the dask worker command.", str_list),
        "local_directory": Key((str,), "", "Worker scratch folder on the compute nodes; empty = the job's default."),
        "interface": Key((str,), "", "Network interface the workers and the scheduler use (e.g. 'ib0'); empty = the "
                                     "scheduler binds to scheduler_host."),
        "scheduler_host": Key((str,), "", "Address the compute nodes reach the scheduler at; empty = this host's name."),
        "python": Key((str,), "", "Python of the workers; empty = the interpreter running cachescore."),
        "log_directory": Key((str,), "", "Folder for the worker jobs' stdout/stderr; empty = the job's working folder."),
    }

#: The keys of schema version 1 besides the metric families' own sections: section -> key ->
#: :class:`Key`. Nested sections use dotted names. :func:`sections` adds ``[metrics.<family>]``.
_CORE: dict[str, dict[str, Key]] = {
    "job": {
        "name": Key((str,), "job", "Job name, recorded in provenance.", non_empty),
        "cache": Key((str,), None, "Cache folder (required); relative to the job file's folder, or an fsspec URL "
                     "(s3://bucket/prefix, gs://, az://; credentials from the environment, never the job).", non_empty),
        "store": Key((str,), None, "Results store folder (required); relative to the job file's folder.", non_empty),
        "encoders": Key((list,), [], "Encoders to score; empty = every encoder in the cache.", str_list),
        "views": Key((list,), [], "Views to score; empty = every view in the cache.", str_list),
        "design": Key((str,), "auto", "Evaluation design: 'auto' (the view's hint, else 'all'), 'all' or 'paired_2x2'.",
                      one_of(JOB_DESIGNS)),
        "probe_views": Key((list,), [], "Views the probe sweep runs on (only with a [probe] table); empty = every "
                                        "view of the job.", str_list),
        "bundles": Key((str,), "", "Folder of probe evaluation bundles; empty = <store>/bundles; relative to the "
                                   "job file's folder."),
    },
    "demo": {
        "synthesise": Key((bool,), False, "Synthesise the demo cache at job.cache when that folder does not exist."),
        "seed": Key((int,), 0, "Seed of the synthetic demo cache.", non_negative_int),
        "n_slides_per_cell": Key((int,), 3, "Slides per (label, confounder) cell of the demo cache.", positive_int),
        "tiles_per_slide": Key((int,), 20, "Tiles per slide of the demo cache.", positive_int),
        "dim": Key((int,), 32, "Embedding width of the demo cache.", positive_int),
    },
    "metrics": {
        "families": Key((list,), list(families.names(families.NEIGHBOUR)), "Metric families to score, in table order "
                        "(cachescore.metrics.families): any of " + ", ".join(repr(n) for n in families.names(
                            families.NEIGHBOUR)) + ".", _families),
    },
    "metrics.bootstrap": {
        "n_boot": Key((int,), 2000, "Cluster-bootstrap replicates of every stored score's CI and rank interval "
                                    "(resampling unit: group_id; computed from the stored per-unit values).",
                      positive_int),
        "level": Key(NUM, 0.95, "Confidence level of the percentile intervals.", open_unit),
        "seed": Key((int,), 0, "Seed of the bootstrap draws (PCG64; one shared draw per view).", non_negative_int),
    },
    "report": {
        "min_support": Key(NUM, 0.5, "RI/MaRI scores whose support (share of units with a typed neighbour) is "
                                      "below this are ranked but flagged low_support.", half_open_unit),
    },
    "neighbors": {
        "backend": Key((str,), "auto", "Neighbour search: 'exact', 'ann' or 'auto' (exact below auto_threshold).",
                       one_of(BACKENDS)),
        "auto_threshold": Key(NUM, DEFAULT_AUTO_THRESHOLD, "Scope cost n*n*d above which 'auto' switches to ANN.", positive_number),
        "recall_target": Key(NUM, 0.99, "ANN: widen the candidate set until the measured recall reaches this.",
                             half_open_unit),
        "recall_sample": Key((int,), 1000, "Queries sampled to measure ANN recall against exact search.", positive_int),
        "seed": Key((int,), 0, "Seed of the ANN graph and of the recall sample.", non_negative_int),
        "large_scope_rows": Key((int,), 100_000, "Scopes of at least this many rows are searched out of core by "
                                "distributed tasks over row chunks (worker memory bounded by chunk size); smaller "
                                "scopes are searched inside their work unit.", positive_int),
    },
    "cluster": {
        "kind": Key((str,), "local", "Where workers run: 'local' (a LocalCluster on 127.0.0.1, [execution] n_workers), "
                                     "'slurm' / 'pbs' (worker jobs via dask-jobqueue) or 'kubernetes' (the "
                                     "dask-kubernetes operator). The CLI's --cluster overrides it.", one_of(CLUSTER_KINDS)),
        "minimum_jobs": Key((int,), 0, "Adaptive scaling: fewest worker jobs (pods) kept while the run lasts.",
                            non_negative_int),
        "maximum_jobs": Key((int,), 0, "Adaptive scaling: most worker jobs (pods); 0 = derived from the plan's "
                                       "parallelism (its pending tasks / processes per job, at most 32).",
                            non_negative_int),
    },
    "cluster.slurm": _batch_keys("SLURM", queue_doc="Partition (#SBATCH -p); empty = the site's default.",
                                 directive="#SBATCH"),
    "cluster.pbs": {
        **_batch_keys("PBS", queue_doc="Queue (#PBS -q); empty = the site's default.", directive="#PBS"),
        "resource_spec": Key((str,), "", "PBS resource request (#PBS -l), e.g. 'select=1:ncpus=4:mem=16GB'; empty = "
                                         "derived from cores and memory."),
    },
    "cluster.kubernetes": {
        "image": Key((str,), "", "Worker and scheduler image (required for kind = 'kubernetes'), e.g. "
                                 "'ghcr.io/org/cachescore:0.1.0' built from deploy/docker/Dockerfile."),
        "namespace": Key((str,), "default", "Namespace of the DaskCluster resource."),
        "name": Key((str,), "cachescore", "Name of the DaskCluster resource."),
        "resources": Key((dict,), {}, "Container resources, e.g. {limits = {cpu = '1', memory = '4Gi'}}."),
        "env": Key((dict,), {}, "Extra environment of the worker containers (the single-thread BLAS and "
                                "NUMBA_CACHE_DIR settings are always set)."),
        "data_claim": Key((str,), "", "PersistentVolumeClaim holding cache and store, mounted in the scheduler and "
                                      "worker pods at data_mount; empty = none."),
        "data_mount": Key((str,), "/data", "Mount path of data_claim (the job's cache and store paths live under it)."),
    },
    "execution": {
        "scheduler": Key((str,), "", "Dask scheduler address (tcp://host:port); empty = a LocalCluster. "
                                     "The CLI's --scheduler overrides it."),
        "n_workers": Key((int,), 2, "LocalCluster worker processes (one thread each).", positive_int),
        "memory_limit": Key((str,), "auto", "LocalCluster memory limit per worker ('auto' or e.g. '4GiB').", non_empty),
        "retries": Key((int,), 2, "Retries of a work unit after a transient (non-data) failure.", non_negative_int),
        "large_unit_drivers": Key((int,), 3, "Large-scope units (see [neighbors] large_scope_rows) driven at once "
                                             "from the client process (their searches and reductions run on the "
                                             "workers; a driver holds no per-row state but the float64 values of "
                                             "the units in a lower tail while their mean is taken).",
                                  positive_int),
        "dashboard": Key((bool,), True, "Serve the LocalCluster dashboard on 127.0.0.1 (a free port) and print its URL."),
        "performance_report": Key((bool,), True, "Save a Dask performance report (HTML) in the store's run folder."),
        "no_workers_timeout": Key((int, float), 300.0, "Seconds a run waits while the scheduler has no worker (the "
                                                       "progress says 'waiting for workers'); then the remaining units "
                                                       "are recorded as not run and the run exits 2.", positive_number),
        "stale_lock_age": Key((int, float), 600.0, "Seconds without a heartbeat after which the store lock of a run "
                                                   "on another host counts as abandoned and is taken over (a lock of "
                                                   "this host is taken over as soon as its process is gone).",
                              positive_number),
    },
}


def sections() -> dict[str, dict[str, Key]]:
    """Every section of schema version 1: the core keys with, after ``[metrics]``, one
    ``[metrics.<name>]`` section per neighbour family of :data:`cachescore.metrics.families.FAMILIES`
    (its ``keys``; a family registered at run time included)."""
    out: dict[str, dict[str, Key]] = {}
    for name, keys in _CORE.items():
        out[name] = keys
        if name == "metrics":
            out.update({f"metrics.{f}": dict(families.get(f).keys) for f in families.names(families.NEIGHBOUR)})
    return out


#: Every key of schema version 1 with the built-in families (see :func:`sections`).
SCHEMA: dict[str, dict[str, Key]] = sections()


def _section(name: str, table: str, **kw) -> type:
    return section_class(name, table, _CORE[table], module=__name__, **kw)


#: The typed sections (frozen dataclasses whose fields carry their :class:`Key`; :mod:`.sections`).
Demo = _section("Demo", "demo")
Bootstrap = _section("Bootstrap", "metrics.bootstrap")
Report = _section("Report", "report")
Neighbors = _section("Neighbors", "neighbors")
Execution = _section("Execution", "execution")
Slurm = _section("Slurm", "cluster.slurm")
Pbs = _section("Pbs", "cluster.pbs")
Kubernetes = _section("Kubernetes", "cluster.kubernetes")
Cluster = _section("Cluster", "cluster", extra=(
    ("slurm", Slurm, field(default_factory=Slurm)), ("pbs", Pbs, field(default_factory=Pbs)),
    ("kubernetes", Kubernetes, field(default_factory=Kubernetes))))


@dataclass(frozen=True)
class Metrics:
    """The ``[metrics]`` table: the ``families`` to score (table order), their cluster
    ``bootstrap`` settings and each neighbour family's validated ``[metrics.<name>]`` table,
    which the family itself reads (:meth:`family`; a family's keys live in its table entry,
    :data:`cachescore.metrics.families.FAMILIES`)."""

    families: tuple = ()
    bootstrap: Any = field(default_factory=Bootstrap)
    tables: dict = field(default_factory=dict)

    def family(self, name: str) -> dict:
        """A copy of family ``name``'s validated table (every key of its section, defaults filled);
        ``LookupError`` for a family the schema does not know."""
        if name not in self.tables:
            raise LookupError(f"no [metrics.{name}] table: known families {sorted(self.tables)}")
        return dict(self.tables[name])


@dataclass(frozen=True)
class Job:
    """A validated job. ``store`` is an absolute path, ``cache`` one too or, for a cache in object
    storage, a ``UPath`` of its URL (:func:`cachescore.cache.location.cache_root`); each table is a typed,
    frozen section (``job.execution.retries``, ``job.cluster.slurm.cores``,
    ``job.metrics.bootstrap.n_boot``) with every key of :data:`SCHEMA` present (defaults filled
    in); :func:`~.sections.as_dict` gives a section's plain table."""

    path: Path | None
    name: str
    cache: Any  # Path, or a UPath for a URL
    store: Path
    encoders: tuple[str, ...]
    views: tuple[str, ...]
    design: str
    demo: Any = field(default_factory=Demo)
    metrics: Metrics = field(default_factory=Metrics)
    neighbors: Any = field(default_factory=Neighbors)
    execution: Any = field(default_factory=Execution)
    #: ``[cluster]``: ``kind``, ``minimum_jobs``, ``maximum_jobs`` and the per-kind sections
    #: (``slurm``, ``pbs``, ``kubernetes``).
    cluster: Any = field(default_factory=Cluster)
    #: ``[report]``: how stored scores are flagged (``min_support``).
    report: Any = field(default_factory=Report)
    #: The normalised document (all keys, defaults filled), as recorded in provenance.
    document: dict = field(default_factory=dict)
    #: Probe-sweep parameters (:class:`cachescore.probe.params.ProbeParams`) from the
    #: optional ``[probe]`` table; None when the job runs no probe sweep.
    probe: Any = None
    #: Where probe evaluation bundles go (absolute).
    bundles: Path | None = None
    #: Views the probe sweep runs on (empty = every view of the job).
    probe_views: tuple[str, ...] = ()


def describe_schema() -> str:
    """Human-readable list of every key with its default and meaning."""
    lines = [f"schema_version = {SCHEMA_VERSION}"]
    for section, keys in sections().items():
        lines.append(f"[{section}]")
        for name, key in keys.items():
            default = "(required)" if key.default is None else repr(key.default)
            lines.append(f"  {name} = {default}  # {key.doc}")
    lines.append("[probe]  (optional; '*' = required when the table is present)")
    for name, doc in PROBE_KEYS.items():
        lines.append(f"  {name}  # {doc}")
    return "\n".join(lines)


def _type_name(types: tuple) -> str:
    names = {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "a list"}
    return " or ".join(dict.fromkeys(names.get(t, t.__name__) for t in types))


def _check_value(src: str, dotted: str, key: Key, value) -> Any:
    if isinstance(value, bool) and bool not in key.type:
        raise JobError(f"{src}: key '{dotted}' must be {_type_name(key.type)}, got {value!r}")
    if not isinstance(value, key.type):
        raise JobError(f"{src}: key '{dotted}' must be {_type_name(key.type)}, got {value!r}")
    if key.check is not None:
        expected = key.check(value)
        if expected is not None:
            raise JobError(f"{src}: key '{dotted}' must be {expected}, got {value!r}")
    return list(value) if isinstance(value, list) else value


def parse_job(doc: dict, *, path: str | Path | None = None) -> Job:
    """Validate a parsed TOML document and build a :class:`Job`.

    Parameters
    ----------
    doc : dict
        The document as returned by :func:`tomllib.loads`.
    path : path-like, optional
        The job file; relative ``job.cache``/``job.store`` resolve against its folder (else the
        current directory) and every error message starts with it.

    Raises
    ------
    JobError
        Missing or unsupported ``schema_version``, an unknown section or key (named with its
        dotted path), a wrong type or value, or a missing required key.
    """
    src = str(path) if path is not None else "<job>"
    if not isinstance(doc, dict):
        raise JobError(f"{src}: a job must be a TOML table")
    if "schema_version" not in doc:
        raise JobError(f"{src}: missing key 'schema_version' (this release reads schema_version = {SCHEMA_VERSION})")
    version = doc["schema_version"]
    if version != SCHEMA_VERSION or isinstance(version, bool):
        raise JobError(f"{src}: unsupported schema_version {version!r}; this release reads {SCHEMA_VERSION}")

    out: dict[str, dict] = {}
    schema = sections()

    def walk(table: dict, prefix: str) -> None:
        for name, value in table.items():
            dotted = f"{prefix}.{name}" if prefix else name
            if not prefix and name in ("schema_version", "probe"):
                continue  # [probe] is validated by ProbeParams.from_dict below
            if dotted in schema:
                if not isinstance(value, dict):
                    raise JobError(f"{src}: '{dotted}' must be a table ([{dotted}]), got {value!r}")
                walk(value, dotted)
            elif prefix in schema and name in schema[prefix]:
                out.setdefault(prefix, {})[name] = _check_value(src, dotted, schema[prefix][name], value)
            else:
                where = f"section [{prefix}]" if prefix else "the top level"
                known = sorted(schema[prefix]) if prefix in schema else sorted(
                    ["schema_version"] + [s for s in schema if "." not in s])
                known += sorted(s[len(prefix) + 1:] for s in schema if prefix and s.startswith(prefix + "."))
                raise JobError(f"{src}: unknown key '{dotted}' in {where} (known: {', '.join(known)})")

    walk(doc, "")
    full: dict[str, dict] = {}
    for section, keys in schema.items():
        given = out.get(section, {})
        values = {}
        for name, key in keys.items():
            if name in given:
                values[name] = given[name]
            elif key.default is None:
                raise JobError(f"{src}: missing required key '{section}.{name}'")
            else:
                values[name] = list(key.default) if isinstance(key.default, list) else key.default
        full[section] = values

    # the folder the job file is named in, not where a symbolic link to it points (jobs/demo.toml)
    base = Path(os.path.abspath(path)).parent if path is not None else Path.cwd()
    jobs = full["job"]

    def resolve(p: str) -> Path:
        q = Path(p).expanduser()
        return q if q.is_absolute() else (base / q).resolve()

    def resolve_cache(p: str):
        """A folder as :func:`resolve`; a URL (``s3://bucket/prefix``) as a remote cache root."""
        if "://" not in p or p.startswith("file://"):
            return resolve(p.removeprefix("file://"))
        from ..cache.location import cache_root  # deferred: only a remote cache needs it

        try:
            return cache_root(p)
        except ValueError as exc:
            raise JobError(f"{src}: job.cache: {exc}") from None

    metrics = Metrics(families=tuple(full["metrics"]["families"]), bootstrap=Bootstrap(**full["metrics.bootstrap"]),
                      tables={name: dict(full[f"metrics.{name}"]) for name in families.names(families.NEIGHBOUR)})
    document = {"schema_version": SCHEMA_VERSION, **full}
    probe = None
    if "probe" in doc:
        try:
            probe = ProbeParams.from_dict(doc["probe"], source=src, prefix="probe")
        except ValueError as exc:
            raise JobError(str(exc)) from None
        document["probe"] = probe.to_dict()
    if "://" in jobs["store"]:
        raise JobError(f"{src}: job.store {jobs['store']!r}: the results store is a local or shared folder, not a URL "
                       "(the cache may be one)")
    store = resolve(jobs["store"])
    cache = resolve_cache(jobs["cache"])
    if isinstance(cache, Path):
        _check_apart(cache, store, src)
    return Job(
        path=Path(path).resolve() if path is not None else None,
        name=jobs["name"],
        cache=cache,
        store=store,
        encoders=tuple(jobs["encoders"]),
        views=tuple(jobs["views"]),
        design=jobs["design"],
        demo=Demo(**full["demo"]),
        metrics=metrics,
        neighbors=Neighbors(**full["neighbors"]),
        execution=Execution(**full["execution"]),
        report=Report(**full["report"]),
        cluster=Cluster(**full["cluster"], slurm=Slurm(**full["cluster.slurm"]), pbs=Pbs(**full["cluster.pbs"]),
                        kubernetes=Kubernetes(**full["cluster.kubernetes"])),
        document=document,
        probe=probe,
        bundles=resolve(jobs["bundles"]) if jobs["bundles"] else default_bundles(store),
        probe_views=tuple(jobs["probe_views"]),
    )


def load_job(path: str | Path) -> Job:
    """Read and validate a job file.

    Raises
    ------
    FileNotFoundError
        The file does not exist (the message names it).
    JobError
        The file is not valid TOML (line and column from :mod:`tomllib`) or breaks the schema.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"job file not found: {p}")
    try:
        doc = tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise JobError(f"{p}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise JobError(f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start}); job files are UTF-8 TOML") from None
    return parse_job(doc, path=p)
