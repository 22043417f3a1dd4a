"""Cache-scale benchmark: score a large synthetic view (RI, MaRI, CRoMa) through the product with
the ``exact`` and the ``ann`` neighbour backends, and measure wall time, peak memory per worker,
recall and the speed ratio.

``--mode pipeline`` (default)
-----------------------------
1. Builds (or reuses, under ``--workdir``) a cache of realistic structure with
   :func:`cachescore.cache.synthetic.make_scale_cache`: ``--rows`` × ``--dim`` float32, slides of
   ``--slide-min``..``--slide-max`` tiles, ``--labels`` × ``--confounders`` cells, tiles drawn
   from ``--morphologies`` prototypes shared across slides with ``--intrinsic-dim``-dimensional
   within-morphology variation (strongly clustered, like foundation-model embeddings of tiles).
   The cache is streamed to disk (memory bounded by ``--chunk-rows``); a cache already in the
   work folder with the same parameters is reused.
2. Per backend (``--backends exact ann``): writes a job TOML (view ``scale_all``, metrics ri,
   mari, croma; ``[neighbors] backend``, ``recall_target``, ``recall_sample``), starts its own
   ``distributed.LocalCluster`` (``--workers`` single-threaded worker processes, BLAS pinned to
   one thread, no dashboard; its HTTP server on a free port of 127.0.0.1) and runs ``cachescore run JOB --scheduler ADDR`` in-process
   (:func:`cachescore.cli.main`), each backend into a fresh results store. One cluster per
   backend, so each backend's per-worker peaks are its own.
3. While the job runs a sampler thread polls every worker's ``/proc/<pid>/status`` (pids from
   ``client.run(os.getpid)``) every ``--sample-interval`` seconds: max ``VmRSS`` and max
   ``RssAnon`` (RSS without the memory-mapped cache shards), and ``VmHWM`` just before the
   cluster closes; and the same maxima of this process, which runs ``cachescore run`` and so
   drives the large-scope units (their O(n) state lives here, not on the workers). Linux only for
   the memory figures (they are ``null`` elsewhere).
4. Prints per backend: wall time of the run, per-worker peaks, the unit records from the results
   store (:class:`cachescore.store.ResultsStore`: value, k, tau, m, recall, seconds), each
   out-of-core neighbour table (probe rule, recall, phase seconds, computed pairs and the search
   tasks' GFLOP/s against the float32 GEMM throughput measured on every worker at once before the
   job), then the exact/ann speed ratio and ``|ann - exact|`` per metric against the
   recall-implied tolerance ``1 - recall``. ``--json`` writes everything.
5. With several ``--rows`` sizes (one cache each, in turn): the exponent ``e`` of ``time ~ n^e``
   between consecutive sizes, of the wall time, the search phases and the computed pairs.

``--mode search``
-----------------
The earlier in-process raw neighbour-search timing (no pipeline), kept to reproduce old figures:
``neighbors.exact.cross_group_knn`` / ``typed_knn`` against ``neighbors.ann``'s searches with their
measured recall, peak RSS of this process per phase. ``--structure isotropic`` (default, the old
data: label centre + confounder shift + slide offset + isotropic noise) or ``realistic`` (the
scale cache above, normalised into one ``.npy``). ``--exact sample`` extrapolates exact timings
quadratically from ``--exact-rows`` rows.

Examples::

    python benchmarks/cache_scale.py --rows 20000                               # quick check, both backends
    python benchmarks/cache_scale.py --rows 200000 --workdir /data/bench --json b200k.json
    python benchmarks/cache_scale.py --rows 1000000 --backends ann --workdir /data/bench
    python benchmarks/cache_scale.py --rows 200000 400000 --backends ann      # growth exponent, one run
    python benchmarks/cache_scale.py --mode search --rows 200000 --exact sample  # old raw-search figures
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

#: Environment of the benchmark's worker processes: one BLAS/OpenMP/numba thread each.
WORKER_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "NUMBA_NUM_THREADS": "1"}
#: Columns of the results store printed per unit record (those present are shown).
RECORD_COLUMNS = ("encoder", "view", "scope", "family", "metric", "m", "value", "k", "tau", "recall",
                  "n_units", "seconds", "seconds_load", "backend")
#: Keys of a record's ``extra`` JSON shown when present (ANN diagnostics, if the pipeline records them).
EXTRA_KEYS = ("seconds_load", "probe_fraction", "ann_method", "ann_exact", "exact_path", "n_clusters", "rounds")
#: Keys that identify one scored quantity across backends.
MATCH_KEYS = ("encoder", "view", "scope", "design", "family", "metric", "m")


# --------------------------------------------------------------------------------------------
# memory sampling (Linux /proc)


def proc_status(pid: int) -> dict[str, int]:
    """``VmRSS``, ``RssAnon``, ``VmHWM`` of ``pid`` in bytes (keys missing when unreadable)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in ("VmRSS", "RssAnon", "VmHWM"):
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


class WorkerMemorySampler(threading.Thread):
    """Polls ``/proc/<pid>/status`` of every worker pid every ``interval`` seconds and keeps the
    maxima of ``VmRSS`` and ``RssAnon`` per worker; :meth:`finish` stops it and adds ``VmHWM``."""

    def __init__(self, pids: dict[str, int], interval: float = 0.25):
        super().__init__(daemon=True)
        self.pids, self.interval = dict(pids), float(interval)
        self.peaks = {w: {"pid": int(p), "max_vmrss": 0, "max_rssanon": 0, "vmhwm": None, "samples": 0}
                      for w, p in self.pids.items()}
        self._stop_event = threading.Event()

    def _sample(self) -> None:
        for w, pid in self.pids.items():
            st = proc_status(pid)
            peak = self.peaks[w]
            if st:
                peak["samples"] += 1
                peak["max_vmrss"] = max(peak["max_vmrss"], st.get("VmRSS", 0))
                peak["max_rssanon"] = max(peak["max_rssanon"], st.get("RssAnon", 0))

    def run(self) -> None:
        while not self._stop_event.is_set():
            self._sample()
            self._stop_event.wait(self.interval)

    def finish(self) -> dict:
        self._stop_event.set()
        self.join()
        self._sample()
        for w, pid in self.pids.items():
            self.peaks[w]["vmhwm"] = proc_status(pid).get("VmHWM")
        return self.peaks


def _mib(v) -> float | None:
    return None if v is None else round(v / 2**20, 1)


# --------------------------------------------------------------------------------------------
# pipeline mode


def cache_folder(a) -> Path:
    return Path(a.workdir) / (f"scale-cache-{a.rows}x{a.dim}-s{a.seed}-e{a.encoders}-L{a.labels}C{a.confounders}"
                              f"-M{a.morphologies}r{a.intrinsic_dim}-sl{a.slide_min}_{a.slide_max}")


def build_or_reuse_cache(a) -> tuple[Path, dict]:
    """The scale cache for these arguments (reused when complete: ``cache.json`` present)."""
    from cachescore.cache.synthetic import make_scale_cache

    root = cache_folder(a)
    info = {"path": str(root), "rows": a.rows, "dim": a.dim, "data_mib": round(a.rows * a.dim * 4 / 2**20, 1)}
    if (root / "cache.json").is_file():
        info.update(reused=True, build_s=0.0)
        print(f"cache: reusing {root}", flush=True)
        return root, info
    print(f"cache: writing {a.rows} x {a.dim} float32 ({info['data_mib']} MiB) to {root} ...", flush=True)
    t0 = time.perf_counter()
    make_scale_cache(root, rows=a.rows, dim=a.dim, encoders=[f"enc{i}" for i in range(a.encoders)],
                     n_labels=a.labels, n_confounders=a.confounders, slide_min=a.slide_min,
                     slide_max=a.slide_max, n_morphologies=a.morphologies, intrinsic_dim=a.intrinsic_dim,
                     seed=a.seed, paired_view=a.paired, chunk_rows=a.chunk_rows, overwrite=True)
    info.update(reused=False, build_s=round(time.perf_counter() - t0, 2))
    print(f"cache: written in {info['build_s']} s", flush=True)
    return root, info


def _toml_list(values) -> str:
    return "[" + ", ".join(json.dumps(v) for v in values) + "]"


def write_job(path: Path, *, cache: Path, store: Path, backend: str, a) -> Path:
    """Job file for one backend (schema: ``cachescore schema``)."""
    views = ["scale_all"] + (["paired_2x2"] if a.paired else [])
    lines = [
        "# written by benchmarks/cache_scale.py",
        "schema_version = 1",
        "",
        "[job]",
        f'name = "cache-scale-{backend}"',
        f"cache = {json.dumps(str(cache))}",
        f"store = {json.dumps(str(store))}",
        "encoders = []",
        f"views = {_toml_list(views)}",
        'design = "auto"',
        "",
        "[metrics]",
        'families = ["ri", "mari", "croma"]',
        "",
        "[metrics.ri]",
        f"k_candidates = {_toml_list(a.k_candidates)}",
        "",
        "[metrics.mari]",
        f"k_candidates = {_toml_list(a.k_candidates)}",
        'tau = "auto"',
        "",
        "[metrics.croma]",
        f"m = {_toml_list(a.m or [5])}",
        "",
        "[neighbors]",
        f'backend = "{backend}"',
        f"recall_target = {a.recall_target!r}",
        f"recall_sample = {int(a.recall_queries)}",
        f"seed = {int(a.seed)}",
    ]
    if a.large_scope_rows is not None:
        lines.append(f"large_scope_rows = {int(a.large_scope_rows)}")
    lines += ["", "[execution]", f"n_workers = {int(max(a.workers))}", "retries = 0", "dashboard = false",
              f"performance_report = {'true' if a.performance_report else 'false'}", ""]
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def read_records(store_path: Path):
    """(records DataFrame with :data:`RECORD_COLUMNS` present, failures DataFrame) of a store."""
    from cachescore.store import ResultsStore

    store = ResultsStore(store_path)
    scores = store.scores()
    if "extra" in scores.columns:
        extra = [json.loads(e) if isinstance(e, str) and e else {} for e in scores["extra"]]
        for key in EXTRA_KEYS:
            if key not in scores.columns and any(key in e for e in extra):
                scores[key] = [e.get(key) for e in extra]
    cols = [c for c in dict.fromkeys((*RECORD_COLUMNS, *EXTRA_KEYS, "design")) if c in scores.columns]
    return scores[cols].sort_values([c for c in ("encoder", "view", "scope", "family", "metric", "m") if c in cols],
                                    kind="stable").reset_index(drop=True), store.failures()


def worker_gemm_gflops(dim: int, reps: int = 5) -> float:
    """float32 GEMM GFLOP/s of this process on one BLAS thread: (2048, dim) x (dim, 8192), the
    shape of the out-of-core kernel's tiles (run on every worker at once: per-core throughput
    while the other cores are busy too, the condition the search tasks run in)."""
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    q = rng.standard_normal((2048, dim), dtype=np.float32)
    t = rng.standard_normal((8192, dim), dtype=np.float32)
    with threadpool_limits(1):
        q @ t.T
        t0 = time.perf_counter()
        for _ in range(reps):
            q @ t.T
        sec = (time.perf_counter() - t0) / reps
    return 2 * 2048 * 8192 * dim / sec / 1e9


def search_tables(store_path: Path, dim: int, gemm_gflops: float) -> list[dict]:
    """One entry per out-of-core neighbour table the units used (deduplicated: RI and MaRI share
    one): probe rule, recall, phase seconds, computed pairs and the search tasks' throughput
    (``2 · dim · pairs / task seconds``) against the workers' measured GEMM throughput."""
    from cachescore.store import ResultsStore

    scores = ResultsStore(store_path).scores()
    seen, out = set(), []
    for e in scores.get("extra", []):
        for d in (json.loads(e).get("neighbour_search", []) if isinstance(e, str) and e else []):
            key = (d.get("scope"), tuple(d.get("kinds", ())), d.get("k"))
            if key in seen:
                continue
            seen.add(key)
            row = {k: d.get(k) for k in ("scope", "kinds", "k", "n", "n_clusters", "probe_fraction", "probe_radius",
                                         "probe_min_rows", "recall", "rounds", "seconds_partition",
                                         "seconds_calibration", "seconds_search", "search_pairs",
                                         "search_gemm_pairs", "search_task_seconds", "searched_with")}
            # the pairs the tasks computed: with another table searched in the same pass (ADR-0024)
            # its task-seconds and GEMM pairs are the pass's, shared by both tables
            computed = d.get("search_gemm_pairs") or d.get("search_pairs")
            if computed and d.get("search_task_seconds"):
                gf = 2 * dim * computed / d["search_task_seconds"] / 1e9
                row.update(task_gflops=round(gf, 1), share_of_gemm=round(gf / gemm_gflops, 3))
            out.append(row)
    return out


def _driver_hwm_mib(path: Path) -> float | None:
    """The driver's VmHWM (peak RSS) in MiB, as it wrote it at exit; None if it could not."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith("VmHWM"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def _phase_of(key) -> str:
    """The phase of a cachescore task key (``search.enc0.view.ri-...`` -> ``search``)."""
    head = str(key[0] if isinstance(key, tuple) else key).split("-", 1)[0]
    return head.split(".", 1)[0]


def worker_idle(stream: list, t_start: float, t_stop: float, min_gap: float = 0.5) -> dict:
    """Per worker, from the Dask task stream (``compute`` intervals, epoch seconds) of a run that
    lasted ``t_start..t_stop``: ``busy_s``, ``idle_s`` (wall minus busy: what a worker waited for,
    the run's serial share as this worker saw it) and its ``gaps`` of at least ``min_gap`` s as
    ``[offset from start, seconds, the phase of the task the worker ran next]`` ("end" after its
    last task): the start gap is the driver's start-up, later gaps name the step that ran alone.
    Busy time is the union of the intervals inside ``t_start..t_stop`` (an interval recorded twice,
    or begun before the start stamp, is not counted twice or outside the wall), so
    ``busy_s + idle_s`` is the wall and ``idle_s >= 0``."""
    spans: dict = {}
    for t in stream:
        for ss in t.get("startstops", ()):
            if ss.get("action") == "compute":
                spans.setdefault(t.get("worker", "?"), []).append((float(ss["start"]), float(ss["stop"]),
                                                                   _phase_of(t["key"])))
    out = {}
    for w, sp in sorted(spans.items()):
        sp.sort()
        gaps, busy, at = [], 0.0, t_start
        for start, stop, ph in sp:
            start, stop = max(start, t_start), min(stop, t_stop)  # inside the run's wall only
            if start - at >= min_gap:
                gaps.append([round(at - t_start, 2), round(start - at, 2), ph])
            busy += max(0.0, stop - max(start, at))  # the union of the intervals: an overlap counts once
            at = max(at, stop)
        if t_stop - at >= min_gap:
            gaps.append([round(at - t_start, 2), round(t_stop - at, 2), "end"])
        out[w] = {"busy_s": round(busy, 2), "idle_s": round(t_stop - t_start - busy, 2), "gaps": gaps}
    return out


def run_backend(a, backend: str, cache: Path, workers: int | None = None) -> dict:
    """Run the job for ``backend`` on a fresh LocalCluster of ``workers`` (default ``--workers``)
    single-threaded worker processes, with ``cachescore run`` in a **subprocess** (the driver:
    its peak RSS is the VmHWM it writes at exit, its CPU seconds (``wait4``) are the run's serial
    share); wall time, worker peaks, task-seconds per phase (the Dask task stream), records."""
    from distributed import Client, LocalCluster, get_task_stream

    workers = int(a.workers if workers is None else workers)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    store = Path(a.workdir) / f"store-{backend}-w{workers}-{stamp}-{os.getpid()}"
    job = write_job(Path(a.workdir) / f"job-{backend}.toml", cache=cache, store=store, backend=backend, a=a)
    env = dict(WORKER_ENV)
    env["NUMBA_CACHE_DIR"] = os.environ["NUMBA_CACHE_DIR"]
    out: dict = {"backend": backend, "job": str(job), "store": str(store), "n_workers": workers}
    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address="127.0.0.1:0", scheduler_kwargs={"dashboard": False},
                      memory_limit=a.memory_limit, env=env) as cluster, \
            Client(cluster, set_as_default=False) as client:
        pids = client.run(os.getpid)
        # the reference for the kernel's throughput: float32 GEMM on every worker at once
        gemm = client.run(worker_gemm_gflops, a.dim)
        argv = ["run", str(job), "--scheduler", cluster.scheduler_address] + ([] if a.progress else ["--quiet"])
        hwm_file = Path(a.workdir) / f"driver-hwm-{os.getpid()}-{workers}.txt"
        # the driver writes its own VmHWM at exit: ru_maxrss of a forked child also counts the
        # benchmark process's pages before exec, so it is not the driver's figure
        code = ("import atexit, sys\n"
                "def _hwm(path=sys.argv[1]):\n"
                "    with open('/proc/self/status') as f, open(path, 'w') as out:\n"
                "        out.write(''.join(l for l in f if l.startswith(('VmHWM', 'VmRSS', 'RssAnon'))))\n"
                "atexit.register(_hwm)\n"
                "from cachescore import cli; sys.exit(cli.main(sys.argv[2:]))")
        with get_task_stream(client) as stream:
            t0, e0 = time.perf_counter(), time.time()
            proc = subprocess.Popen([sys.executable, "-c", code, str(hwm_file), *argv])
            sampler = WorkerMemorySampler(dict(pids, client=proc.pid), a.sample_interval)
            sampler.start()
            try:
                _, status, usage = os.wait4(proc.pid, 0)
            finally:
                wall = time.perf_counter() - t0
                peaks = sampler.finish()
        rc = os.waitstatus_to_exitcode(status)
        phases: dict = {}
        for t in stream.data:
            for ss in t.get("startstops", ()):
                if ss.get("action") == "compute":
                    ph = _phase_of(t["key"])
                    phases[ph] = phases.get(ph, 0.0) + float(ss["stop"] - ss["start"])
    out.update(rc=int(rc), wall_s=round(wall, 2), gemm_gflops={w: round(g, 1) for w, g in gemm.items()})
    out["task_seconds_by_phase"] = {k: round(v, 2) for k, v in sorted(phases.items())}
    out["worker_idle"] = worker_idle(stream.data, e0, e0 + wall)
    # the timeline itself, compact: [worker, phase, task key prefix, start, stop] (s from the start)
    out["task_timeline"] = sorted([t.get("worker", "?"), _phase_of(t["key"]), str(t["key"])[:40],
                                   round(ss["start"] - e0, 3), round(ss["stop"] - e0, 3)]
                                  for t in stream.data for ss in t.get("startstops", ())
                                  if ss.get("action") == "compute")
    out["client_cpu_s"] = round(usage.ru_utime + usage.ru_stime, 2)
    out["client_peak_mib"] = _driver_hwm_mib(hwm_file)
    client_peak = peaks.pop("client")
    out["workers"] = {w: {"pid": p["pid"], "max_vmrss_mib": _mib(p["max_vmrss"] or None),
                          "max_rssanon_mib": _mib(p["max_rssanon"] or None), "vmhwm_mib": _mib(p["vmhwm"]),
                          "samples": p["samples"]} for w, p in peaks.items()}
    out["client_max_vmrss_mib"] = _mib(client_peak["max_vmrss"] or None)
    out["client_max_rssanon_mib"] = _mib(client_peak["max_rssanon"] or None)
    out["client_vmhwm_mib"] = out["client_peak_mib"]
    records, failures = read_records(store)
    out["searches"] = search_tables(store, a.dim, float(np.mean(list(gemm.values()))))
    out["records"] = json.loads(records.to_json(orient="records", date_format="iso"))
    out["failures"] = json.loads(failures.to_json(orient="records", date_format="iso"))
    return out


def _fmt(v, nd=4) -> str:
    if v is None or (isinstance(v, float) and not np.isfinite(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def print_backend(res: dict) -> None:
    print(f"\n== backend {res['backend']}: wall {res['wall_s']:.1f} s, exit code {res['rc']}, store {res['store']}")
    for w, p in sorted(res["workers"].items()):
        print(f"   worker {w} (pid {p['pid']}): peak VmRSS {_fmt(p['max_vmrss_mib'], 1)} MiB, "
              f"peak RssAnon {_fmt(p['max_rssanon_mib'], 1)} MiB, VmHWM {_fmt(p['vmhwm_mib'], 1)} MiB "
              f"({p['samples']} samples)")
    print(f"   driver (the `cachescore run` process): peak RSS {_fmt(res.get('client_peak_mib'), 1)} MiB "
          f"(its VmHWM), peak RssAnon {_fmt(res.get('client_max_rssanon_mib'), 1)} MiB, "
          f"CPU {_fmt(res.get('client_cpu_s'), 1)} s (the run's serial share) of {res['wall_s']:.1f} s wall")
    tasks = res.get("task_seconds_by_phase") or {}
    total = sum(tasks.values())
    if total:
        print("   worker task-seconds by phase: " + ", ".join(
            f"{k} {v:.1f} s ({100 * v / total:.0f}%)" for k, v in tasks.items()) + f"; total {total:.1f} s")
    for w, idle in sorted((res.get("worker_idle") or {}).items()):
        print(f"   worker {w}: busy {idle['busy_s']:.1f} s, idle {idle['idle_s']:.1f} s; gaps >= 0.5 s "
              "(at s, for s, before phase): " + (", ".join(f"{at:.1f}+{d:.1f} {ph}" for at, d, ph in idle["gaps"])
                                                 or "none"))
    cols = [c for c in dict.fromkeys((*RECORD_COLUMNS, *EXTRA_KEYS)) if res["records"] and c in res["records"][0]]
    if res["records"]:
        print("   " + "  ".join(f"{c:>10}" for c in cols))
        for r in res["records"]:
            print("   " + "  ".join(f"{_fmt(r.get(c)):>10}" for c in cols))
    for f in res["failures"]:
        print(f"   FAILED: {f}")
    if res.get("gemm_gflops"):
        print("   float32 GEMM per worker (1 thread, all workers at once): "
              + ", ".join(f"{g:.1f}" for g in res["gemm_gflops"].values()) + " GFLOP/s")
    for t in res.get("searches", []):
        print(f"   table {'/'.join(t['kinds'])} k={t['k']} ({t['scope']}, n={t['n']}, {t['n_clusters']} clusters): "
              f"probe fraction {_fmt(t['probe_fraction'])}, radius {_fmt(t['probe_radius'])}, "
              f"floor {t['probe_min_rows']} rows, recall {_fmt(t['recall'])}, rounds {t['rounds']}; partition "
              f"{_fmt(t['seconds_partition'], 1)} s, calibration {_fmt(t['seconds_calibration'], 1)} s, search "
              f"{_fmt(t['seconds_search'], 1)} s; {_fmt(t['search_pairs'])} pairs probed"
              + (f", searched with {', '.join(t['searched_with'])} in one pass: {_fmt(t.get('search_gemm_pairs'))} "
                 "pairs computed for both" if t.get("searched_with") else "")
              + f" in {_fmt(t['search_task_seconds'], 1)} task-s = {_fmt(t.get('task_gflops'), 1)} GFLOP/s per task "
              f"({_fmt(100 * t['share_of_gemm'] if t.get('share_of_gemm') else None, 0)}% of GEMM)")


def compare(results: dict) -> dict:
    """Speed ratio exact/ann and |ann - exact| per matched record."""
    ex, an = results.get("exact"), results.get("ann")
    if not ex or not an:
        return {}
    out = {"speed_ratio_wall": round(ex["wall_s"] / an["wall_s"], 3) if an["wall_s"] > 0 else None, "metrics": []}

    def key(r):
        return tuple(r.get(k) for k in MATCH_KEYS)

    ann_by = {key(r): r for r in an["records"]}
    for r in ex["records"]:
        s = ann_by.get(key(r))
        if s is None:
            continue
        diff = None if r.get("value") is None or s.get("value") is None else abs(s["value"] - r["value"])
        ratio = (r["seconds"] / s["seconds"]) if r.get("seconds") and s.get("seconds") else None
        # a missed neighbour (share 1 - recall) is replaced by the next nearest: it moves one unit's
        # evidence, so a pooled score moves by at most about that share
        tol = None if s.get("recall") is None else 1.0 - float(s["recall"])
        within = None if diff is None or tol is None else bool(diff <= tol + 1e-9)
        out["metrics"].append({**{k: r.get(k) for k in MATCH_KEYS if k in r}, "exact": r.get("value"),
                               "ann": s.get("value"), "abs_diff": diff, "recall": s.get("recall"),
                               "tolerance": tol, "within_tolerance": within,
                               "k_exact": r.get("k"), "k_ann": s.get("k"), "tau_exact": r.get("tau"),
                               "tau_ann": s.get("tau"), "unit_speed_ratio": ratio})
    return out


def run_pipeline(a) -> int:
    """Every size of ``--rows`` in turn (one cache each), then the growth exponents between sizes."""
    os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(tempfile.gettempdir(), "cachescore-numba-cache"))
    Path(os.environ["NUMBA_CACHE_DIR"]).mkdir(parents=True, exist_ok=True)
    temp = a.workdir is None
    a.workdir = a.workdir or tempfile.mkdtemp(prefix="cachescore-scale-")
    Path(a.workdir).mkdir(parents=True, exist_ok=True)
    sizes = list(a.rows)
    print(f"cache_scale (pipeline): rows={sizes} dim={a.dim} backends={a.backends} workers={a.workers} "
          f"recall_target={a.recall_target} cpus={os.cpu_count()} workdir={a.workdir}", flush=True)
    reports = []
    try:
        for n in sizes:
            a.rows = n
            reports.append(run_size(a))
        a.rows = sizes
        scaling = growth(reports, a.backends)
        for g in scaling:
            print(f"\n== growth {g['backend']} {g['from_rows']} -> {g['to_rows']} rows: wall x{g['wall_ratio']:.2f}, "
                  f"exponent {g['wall_exponent']:.2f} (time ~ n^e); search phases exponent "
                  f"{_fmt(g.get('search_exponent'), 2)}; computed pairs exponent {_fmt(g.get('pairs_exponent'), 2)}; "
                  f"driver peak {g['client_peak_mib'][0]:.0f} -> {g['client_peak_mib'][1]:.0f} MiB "
                  f"(x{g['client_peak_ratio']:.2f})")
        if len(scaling) > 1:  # first size to last
            r0 = reports[0]["results"][a.backends[0]]
            r1 = reports[-1]["results"][a.backends[0]]
            print(f"== driver peak {reports[0]['args']['rows']} -> {reports[-1]['args']['rows']} rows: "
                  f"{r0['client_peak_mib']:.0f} -> {r1['client_peak_mib']:.0f} MiB "
                  f"(x{r1['client_peak_mib'] / r0['client_peak_mib']:.2f})")
        if a.json:
            out = reports[0] if len(reports) == 1 else {"mode": "pipeline", "sizes": reports, "growth": scaling}
            with open(a.json, "w") as f:
                json.dump(out, f, indent=2, default=str)
            print(f"figures written to {a.json}")
        failed = [b for r in reports for b, res in r["results"].items() if res["rc"] != 0]
        return 1 if failed else 0
    finally:
        if temp and not a.keep:
            shutil.rmtree(a.workdir, ignore_errors=True)


def run_size(a) -> dict:
    """Build or reuse the cache of ``a.rows`` rows and score it with every backend."""
    print(f"\n===== {a.rows} rows", flush=True)
    report: dict = {"mode": "pipeline", "args": vars(a).copy()}
    cache, report["cache"] = build_or_reuse_cache(a)
    report["results"] = {}
    counts = list(a.workers)
    for backend in a.backends:
        runs = {}
        for w in counts:
            res = run_backend(a, backend, cache, w)
            runs[w] = res
            print_backend(res)
        report["results"][backend] = runs[counts[-1]]
        if len(counts) > 1:
            report.setdefault("scaling", {})[backend] = scaling = strong_scaling(runs)
            print_scaling(backend, scaling)
    report["comparison"] = cmp_ = compare(report["results"])
    if cmp_:
        print(f"\n== exact vs ann: speed ratio (wall) x{_fmt(cmp_['speed_ratio_wall'], 2)}")
        for m in cmp_["metrics"]:
            print(f"   {m.get('family')}/{m.get('metric')} m={_fmt(m.get('m'))} view={m.get('view')} "
                  f"scope={m.get('scope')}: exact {_fmt(m['exact'])} ann {_fmt(m['ann'])} "
                  f"|diff| {_fmt(m['abs_diff'], 6)} recall {_fmt(m['recall'])} "
                  f"tolerance 1-recall {_fmt(m['tolerance'], 6)} within: {m['within_tolerance']} "
                  f"unit speed ratio x{_fmt(m['unit_speed_ratio'], 2)}")
    return report


def strong_scaling(runs: dict) -> dict:
    """Speed-up of each worker count over the first, the driver's serial CPU seconds, and each
    phase's worker task-seconds (a phase's parallel work; the same total at every count when it
    scales)."""
    counts = sorted(runs)
    base = runs[counts[0]]
    return {"workers": counts, "wall_s": [runs[w]["wall_s"] for w in counts],
            "speedup": [base["wall_s"] / runs[w]["wall_s"] for w in counts],
            "client_cpu_s": [runs[w]["client_cpu_s"] for w in counts],
            "serial_share": [runs[w]["client_cpu_s"] / runs[w]["wall_s"] for w in counts],
            "task_seconds_by_phase": {w: runs[w]["task_seconds_by_phase"] for w in counts},
            "client_peak_mib": [runs[w]["client_peak_mib"] for w in counts]}


def print_scaling(backend: str, sc: dict) -> None:
    print(f"\n== strong scaling ({backend}): " + "; ".join(
        f"{w} worker(s) {t:.1f} s, speed-up x{s:.2f}, driver CPU {c:.1f} s ({100 * f:.1f}% of wall), "
        f"driver peak {p:.0f} MiB"
        for w, t, s, c, f, p in zip(sc["workers"], sc["wall_s"], sc["speedup"], sc["client_cpu_s"],
                                    sc["serial_share"], sc["client_peak_mib"])))


def growth(reports: list[dict], backends) -> list[dict]:
    """Exponent ``e`` of ``time ~ n^e`` between consecutive sizes, per backend: of the wall time,
    of the summed search phases and of the computed (query, target) pairs."""
    out = []
    for backend in backends:
        for lo, hi in zip(reports, reports[1:]):
            r0, r1 = lo["results"].get(backend), hi["results"].get(backend)
            if not r0 or not r1:
                continue
            n0, n1 = lo["args"]["rows"], hi["args"]["rows"]
            g = {"backend": backend, "from_rows": n0, "to_rows": n1, "wall_ratio": r1["wall_s"] / r0["wall_s"],
                 "wall_exponent": math.log(r1["wall_s"] / r0["wall_s"]) / math.log(n1 / n0),
                 "client_peak_ratio": r1["client_peak_mib"] / r0["client_peak_mib"],
                 "client_peak_mib": [r0["client_peak_mib"], r1["client_peak_mib"]]}
            for key, field in (("search_exponent", "seconds_search"), ("pairs_exponent", "search_pairs")):
                v0 = sum(t.get(field) or 0 for t in r0.get("searches", []))
                v1 = sum(t.get(field) or 0 for t in r1.get("searches", []))
                if v0 > 0 and v1 > 0:
                    g[key] = math.log(v1 / v0) / math.log(n1 / n0)
            out.append(g)
    return out


# --------------------------------------------------------------------------------------------
# search mode (the earlier in-process raw-search benchmark)


def _peak_rss_reset() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    hwm = proc_status(os.getpid()).get("VmHWM")
    if hwm is not None:
        return hwm
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


@contextmanager
def phase(name: str, results: dict):
    resettable = _peak_rss_reset()
    t0 = time.perf_counter()
    entry: dict = {}
    yield entry
    entry["wall_s"] = time.perf_counter() - t0
    entry["peak_rss_mib"] = _peak_rss_bytes() / 2**20
    entry["peak_rss_scope"] = "phase" if resettable else "process"
    results[name] = entry
    extra = " ".join(f"{k}={v}" for k, v in entry.items() if k not in ("wall_s", "peak_rss_mib", "peak_rss_scope"))
    print(
        f"[{name:<22}] wall {entry['wall_s']:9.2f} s   peak RSS {entry['peak_rss_mib']:9.1f} MiB "
        f"({entry['peak_rss_scope']})   {extra}",
        flush=True,
    )


def synthesise(path: str, n: int, d: int, *, n_labels: int, n_conf: int, smin: int, smax: int,
               seed: int, chunk_rows: int):
    """Isotropic data (the old benchmark's): write the normalised float32 view (n, d) to ``path``
    (.npy memmap) chunk by chunk. Returns (memmap, labels, confounders, groups) (int64 codes)."""
    from cachescore.neighbors.normalize import normalize_rows

    rng = np.random.default_rng(seed)
    sizes = rng.integers(smin, smax + 1, size=n // smin + 1)
    ends = np.cumsum(sizes)
    n_groups = int(np.searchsorted(ends, n) + 1)
    sizes = sizes[:n_groups]
    sizes[-1] -= int(ends[n_groups - 1] - n)
    groups = np.repeat(np.arange(n_groups), sizes)
    g_label = rng.integers(0, n_labels, n_groups)
    g_conf = rng.integers(0, n_conf, n_groups)
    labels, conf = g_label[groups], g_conf[groups]
    centres = rng.standard_normal((n_labels, d)).astype(np.float32)
    shifts = 0.8 * rng.standard_normal((n_conf, d)).astype(np.float32)
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n, d))
    for s in range(0, n, chunk_rows):
        e = min(n, s + chunk_rows)
        g = groups[s:e]
        # per-slide offsets drawn from a slide-seeded stream: independent of the chunking
        offs = np.stack([np.random.default_rng([seed, int(k)]).standard_normal(d) for k in np.unique(g)])
        offs = offs.astype(np.float32)[np.searchsorted(np.unique(g), g)]
        noise = np.random.default_rng([seed, 10**9 + s]).standard_normal((e - s, d), dtype=np.float32)
        x = centres[labels[s:e]] + shifts[conf[s:e]] + 0.7 * offs + noise
        out[s:e] = normalize_rows(x)
    out.flush()
    del out
    return np.load(path, mmap_mode="r"), labels, conf, groups


def realistic_view(path: str, a):
    """The scale cache's ``scale_all`` view (encoder ``enc0``), normalised into one float32 ``.npy``
    (memmap) chunk by chunk. Returns (memmap, labels, confounders, groups) (int64 codes)."""
    import pandas as pd

    from cachescore.cache import Cache
    from cachescore.neighbors.normalize import normalize_rows

    root, _ = build_or_reuse_cache(a)
    c = Cache(root)
    view = c.read_view("scale_all")
    x = c.view_embeddings("enc0", "scale_all")
    n, d = x.shape
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n, d))
    for s in range(0, n, a.chunk_rows):
        out[s : s + a.chunk_rows] = normalize_rows(np.asarray(x[s : s + a.chunk_rows].compute(), dtype=np.float32))
    out.flush()
    del out

    def codes(col):
        return pd.factorize(view[col], sort=True)[0].astype(np.int64)

    return np.load(path, mmap_mode="r"), codes("label"), codes("centre"), codes("group_id")


def run_search(a) -> int:
    from threadpoolctl import threadpool_info

    from cachescore.neighbors import ann
    from cachescore.neighbors.numba_env import configure, warm_up

    configure()
    results: dict = {}
    n, d = a.rows, a.dim
    kmax = a.kmax
    m = (a.m or [20])[0]
    print(f"cache_scale (search): n={n} d={d} structure={a.structure} cells={a.labels}x{a.confounders} "
          f"slides {a.slide_min}-{a.slide_max} kmax={kmax} m={m} exact={a.exact} cpus={os.cpu_count()} "
          f"blas={[(i.get('internal_api'), i.get('num_threads')) for i in threadpool_info()]}", flush=True)
    temp = a.workdir is None
    a.workdir = a.workdir or tempfile.mkdtemp(prefix="cachescore-bench-")
    Path(a.workdir).mkdir(parents=True, exist_ok=True)
    path = os.path.join(a.workdir, f"view_{a.structure}_{n}x{d}.npy")

    with phase("synthesise", results) as e:
        if a.structure == "realistic":
            u, labels, conf, groups = realistic_view(path, a)
        else:
            u, labels, conf, groups = synthesise(
                path, n, d, n_labels=a.labels, n_conf=a.confounders, smin=a.slide_min,
                smax=a.slide_max, seed=a.seed, chunk_rows=a.chunk_rows,
            )
        e["data_mib"] = round(n * d * 4 / 2**20, 1)
        e["groups"] = int(groups.max() + 1)

    if a.method == "graph":
        with phase("warm_up (numba JIT)", results):
            warm_up()

    if a.exact != "skip":
        from cachescore.neighbors.exact import cross_group_knn
        from cachescore.neighbors.typed import typed_knn

        ne = n if a.exact == "full" else min(n, a.exact_rows)
        ue = u if ne == n else np.ascontiguousarray(u[:ne])
        scale = (n / ne) ** 2
        with phase("exact cross_group_knn", results) as e:
            cross_group_knn(ue, groups[:ne], kmax)
            e["rows"] = ne
        results["exact cross_group_knn"]["est_full_s"] = results["exact cross_group_knn"]["wall_s"] * scale
        if not a.skip_typed:
            with phase("exact typed_knn", results) as e:
                typed_knn(ue, labels[:ne], conf[:ne], groups[:ne], m)
                e["rows"] = ne
            results["exact typed_knn"]["est_full_s"] = results["exact typed_knn"]["wall_s"] * scale
        if ne < n:
            print(f"  exact timings measured on the first {ne} rows; est_full_s = measured × (n/{ne})² "
                  f"= ×{scale:.1f} (cost ∝ n²·d)", flush=True)
        del ue

    with phase("ann cross_group_knn", results) as e:
        r = ann.cross_group_knn_ann_with_recall(
            u, groups, kmax, recall_target=a.recall_target, random_state=a.seed,
            n_recall_queries=a.recall_queries, n_jobs=a.n_jobs, proxy_dim=a.proxy_dim, method=a.method,
        )
        e.update(recall=round(r.recall, 5), rounds=r.rounds, method=r.method, probe_fraction=r.probe_fraction,
                 clusters=r.n_clusters, exact_path=r.exact)
        del r
    if not a.skip_typed:
        with phase("ann typed_knn", results) as e:
            t = ann.typed_knn_ann_with_recall(
                u, labels, conf, groups, m, recall_target=a.recall_target, random_state=a.seed,
                n_recall_queries=a.recall_queries, n_jobs=a.n_jobs, proxy_dim=a.proxy_dim, method=a.method,
            )
            e.update(recall=round(t.recall, 5), rounds=t.rounds, method=t.method, probe_fraction=t.probe_fraction,
                     exact_cells=t.exact_cells, cells=t.n_cells)
            del t

    print("summary:")
    for kind in ("cross_group_knn", "typed_knn"):
        ex, an = results.get(f"exact {kind}"), results.get(f"ann {kind}")
        if ex and an:
            est = ex.get("est_full_s", ex["wall_s"])
            label = "measured" if ex.get("rows") == n else f"extrapolated from {ex.get('rows')} rows"
            print(f"  {kind}: exact {est:.1f} s ({label}) vs ann {an['wall_s']:.1f} s "
                  f"→ speed ratio ×{est / an['wall_s']:.2f}; ann recall {an['recall']}")
        elif an:
            print(f"  {kind}: ann {an['wall_s']:.1f} s, recall {an['recall']}, peak RSS "
                  f"{an['peak_rss_mib']:.0f} MiB (data {results['synthesise']['data_mib']} MiB)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"mode": "search", "args": vars(a), "results": results}, f, indent=2, default=str)
    del u
    if temp and not a.keep:
        shutil.rmtree(a.workdir, ignore_errors=True)
    else:
        os.remove(path)
    return 0


# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("pipeline", "search"), default="pipeline",
                   help="pipeline: score the view through the product (default); search: raw in-process searches")
    g = p.add_argument_group("data")
    g.add_argument("--rows", type=int, nargs="+", default=[200_000],
                   help="rows; several sizes run in turn and print the growth exponent between them")
    g.add_argument("--dim", type=int, default=768)
    g.add_argument("--labels", type=int, default=2)
    g.add_argument("--confounders", type=int, default=4)
    g.add_argument("--slide-min", type=int, default=20)
    g.add_argument("--slide-max", type=int, default=100)
    g.add_argument("--morphologies", type=int, default=64, help="morphology prototypes (scale cache)")
    g.add_argument("--intrinsic-dim", type=int, default=24, help="within-morphology dimension (scale cache)")
    g.add_argument("--encoders", type=int, default=1, help="encoders in the scale cache (enc0, enc1, ...)")
    g.add_argument("--paired", action="store_true", help="also write and score the paired_2x2 view")
    g.add_argument("--chunk-rows", type=int, default=32768, help="rows per shard / synthesis chunk")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--workdir", default=None,
                   help="cache, job files and stores go here (reused across runs); default: a temp dir, removed")
    g.add_argument("--keep", action="store_true", help="keep the temporary work folder")
    g = p.add_argument_group("pipeline mode")
    g.add_argument("--backends", nargs="+", choices=("exact", "ann", "auto"), default=["exact", "ann"])
    g.add_argument("--workers", type=int, nargs="+", default=[2],
                   help="LocalCluster worker processes (1 thread each); several counts: the same job on each "
                        "(strong scaling: speed-up, the driver's serial seconds, each phase's share)")
    g.add_argument("--memory-limit", default="auto", help="LocalCluster memory limit per worker")
    g.add_argument("--k-candidates", type=int, nargs="+", default=[5, 11, 21], help="RI/MaRI windows")
    g.add_argument("--m", type=int, nargs="+", default=None,
                   help="CRoMa m (pipeline: list, default 5; search: typed neighbours, default 20)")
    g.add_argument("--large-scope-rows", type=int, default=None,
                   help="[neighbors] large_scope_rows of the job (default: the schema's)")
    g.add_argument("--sample-interval", type=float, default=0.25, help="seconds between /proc samples")
    g.add_argument("--performance-report", action="store_true", help="save Dask performance reports")
    g.add_argument("--progress", action="store_true", help="show the CLI's progress bar and leaderboard")
    g = p.add_argument_group("both modes")
    g.add_argument("--recall-target", type=float, default=0.99)
    g.add_argument("--recall-queries", type=int, default=1000, help="ANN recall sample (job: recall_sample)")
    g.add_argument("--json", default=None, help="also write the figures to this JSON file")
    g = p.add_argument_group("search mode")
    g.add_argument("--structure", choices=("isotropic", "realistic"), default="isotropic",
                   help="isotropic: the old data; realistic: the scale cache")
    g.add_argument("--kmax", type=int, default=100, help="cross-group window (RI/MaRI)")
    g.add_argument("--exact", choices=("full", "sample", "skip"), default="sample")
    g.add_argument("--exact-rows", type=int, default=20_000, help="rows for --exact sample")
    g.add_argument("--n-jobs", type=int, default=1, help="numba threads for pynndescent")
    g.add_argument("--proxy-dim", type=int, default=None, help="ANN graph on a projection (see ann.project_rows)")
    g.add_argument("--method", choices=("ivf", "graph"), default="ivf", help="ANN method (see neighbors.ann)")
    g.add_argument("--skip-typed", action="store_true", help="only the cross-group search")
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.mode == "search":
        if len(a.rows) != 1:
            raise SystemExit("--mode search takes one --rows value")
        a.rows = a.rows[0]
        return run_search(a)
    return run_pipeline(a)


if __name__ == "__main__":
    sys.exit(main())
