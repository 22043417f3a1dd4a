"""Monitoring parts without a cluster: task keys, the run board, its Prometheus families, the store
lock and the results-store verifier (the real-process behaviour is in test_runtime_faults.py)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import dask
import pytest
from dask.utils import key_split
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cachescore._taskkeys import ANNOTATION, task_key, unit_prefix
from cachescore.cli import main
from cachescore.monitoring.board import UNIT_STATES, RunBoard
from cachescore.monitoring.metrics import BoardCollector
from cachescore.monitoring.page import _row
from cachescore.store import ResultsStore
from cachescore.store.lock import LOCK_NAME, StoreLock, StoreLockedError
from cachescore.store.verify import verify_store


def test_task_keys_group_by_phase_and_unit():
    ann = {"unit": "ab" * 32, "encoder": "uni-2h", "view": "centre all", "metric": "ri"}
    with dask.annotate(**{ANNOTATION: ann}):
        k1, k2 = task_key("search", "batch00001"), task_key("search", "batch00002")
    assert k1 != k2  # fresh keys: a resubmission never reuses a held key
    assert key_split(k1) == key_split(k2) == "search.uni_2h.centre_all.ri" == unit_prefix("search", "uni-2h",
                                                                                          "centre all", "ri")
    assert key_split(task_key("partition", "sample")) == "partition"  # no unit annotation: the bare phase
    with dask.annotate(**{ANNOTATION: ann}):  # a group of its own within the phase and unit
        assert key_split(task_key("calibrate", "queries", group="sam-ple")) == "calibrate.uni_2h.centre_all.ri.sam_ple"
    with pytest.raises(ValueError, match="unknown task phase 'reduce-x'"):
        task_key("reduce-x")


def _unit(fp, enc, state="pending", metric="ri"):
    return {"fingerprint": fp, "label": f"{enc}/v/all/{metric}", "encoder": enc, "view": "v", "design": "all",
            "metric": metric, "kind": "score", "state": state, "started": None, "seconds": None, "value": None,
            "recall": None, "rows": None, "bytes_read": None, "error": None}


def _samples(board) -> dict:
    reg = CollectorRegistry()
    reg.register(BoardCollector(lambda: board))
    out = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_size_does_not_grow_with_views_and_metrics():
    """Issue 25: ``cachescore_units`` carried encoder × view × metric × state (5,760 series for 960
    units); now by state and encoder only, so /metrics stays the same size as views and metrics grow."""
    def exposition(n_views: int) -> tuple[int, int]:
        board = RunBoard()
        units = [dict(_unit(f"{e}-{v}-{m}", f"enc{e}", metric=m), view=f"v{v}")
                 for e in range(3) for v in range(n_views) for m in ("ri", "mari", "croma")]
        board.start({"run_id": "r", "job": "j", "store": "/s", "started": 1.0}, units)
        reg = CollectorRegistry()
        reg.register(BoardCollector(lambda: board))
        text = generate_latest(reg).decode()
        return sum(1 for line in text.splitlines() if line.startswith("cachescore_units{")), len(text)

    (series_1, size_1), (series_8, size_8) = exposition(1), exposition(8)
    assert series_1 == series_8 == 3 * len(UNIT_STATES)
    assert size_8 - size_1 <= 3 * len(UNIT_STATES)  # only the counts' digits grow (3 -> 24 units per state)


def test_board_states_and_prometheus_families():
    board = RunBoard()
    board.start({"run_id": "r1", "job": "demo", "store": "/s", "started": 1000.0},
                [_unit("a", "enc0"), _unit("b", "enc0"), _unit("c", "enc1", "skipped")])
    board.mark_running("a")
    board.mark_running("c")  # skipped stays skipped
    s = _samples(board)

    def units(state, enc):
        return s[("cachescore_units", (("encoder", enc), ("state", state)))]

    assert units("running", "enc0") == 1 and units("pending", "enc0") == 1 and units("skipped", "enc1") == 1
    assert all(("cachescore_units", (("encoder", "enc0"), ("state", st))) in s
               for st in UNIT_STATES)  # zeros included
    board.finish_unit("a", {"status": "done", "seconds": 2.0, "value": 0.5, "recall": 0.97, "rows": 100,
                            "bytes_read": 6400})
    board.finish_unit("b", {"status": "failed", "seconds": 20.0, "error": "ValueError: bad"})
    s = _samples(board)
    assert units("done", "enc0") == 1 and units("failed", "enc0") == 1 and units("running", "enc0") == 0
    assert s[("cachescore_rows_scored_total", ())] == 100 and s[("cachescore_cache_bytes_read_total", ())] == 6400
    assert s[("cachescore_ann_recall", (("encoder", "enc0"), ("metric", "ri"), ("view", "v")))] == 0.97
    assert s[("cachescore_unit_duration_seconds_count", (("metric", "ri"),))] == 2
    assert s[("cachescore_unit_duration_seconds_bucket", (("le", "5.0"), ("metric", "ri")))] == 1
    assert s[("cachescore_unit_duration_seconds_sum", (("metric", "ri"),))] == 22.0
    assert s[("cachescore_run_start_time_seconds", ())] == 1000.0
    assert s[("cachescore_last_progress_time_seconds", ())] > 1000.0
    assert s[("cachescore_run_info", (("job", "demo"), ("run_id", "r1"), ("state", "running"), ("store", "/s")))] == 1
    board.end("aborted", "lost the scheduler")
    snap = board.snapshot()
    assert snap["run"]["state"] == "aborted" and snap["counts"]["not_run"] == 0  # a and b ended, c skipped
    assert "<td class=\"\">&lt;b&gt;</td>" in _row(dict(_unit("x", "<b>")))  # page cells are escaped


def test_a_batch_task_marks_each_of_its_units_running_and_ends_them_in_one_call():
    """A score batch's task carries every unit's fingerprint under ``units`` (ADR-0018): its start
    marks each running; the client ends them with one board call (``finish_units``)."""
    from types import SimpleNamespace

    from cachescore.monitoring.plugin import CachescorePlugin

    plugin = CachescorePlugin()
    plugin.board = RunBoard()
    plugin.board.start({"run_id": "r", "job": "j", "store": "/s", "started": 1.0},
                       [_unit("a", "enc0"), _unit("b", "enc0"), _unit("c", "enc0")])
    ann = {"cachescore": {"unit": "a", "units": ["a", "b"], "encoder": "enc0", "view": "v", "metric": "ri+mari"}}
    plugin.scheduler = SimpleNamespace(tasks={"k": SimpleNamespace(annotations=ann)})
    plugin.transition("k", "waiting", "processing")
    states = {u["fingerprint"]: u["state"] for u in plugin.board.snapshot()["units"]}
    assert states == {"a": "running", "b": "running", "c": "pending"}
    plugin.board.finish_units([("a", {"status": "done", "rows": 10}), ("b", {"status": "failed", "error": "E: x"})])
    states = {u["fingerprint"]: u["state"] for u in plugin.board.snapshot()["units"]}
    assert states == {"a": "done", "b": "failed", "c": "pending"} and plugin.board.rows_scored == 10


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_store_lock_refuses_a_live_holder_and_takes_over_stale_ones(tmp_path):
    with StoreLock(tmp_path, "run-a") as a:
        holder, _ = a.holder()
        assert holder["run_id"] == "run-a" and holder["pid"] == os.getpid()
        with pytest.raises(StoreLockedError, match=rf"in use by run run-a \(host {socket.gethostname()}, pid "
                                                   rf"{os.getpid()}"):
            StoreLock(tmp_path, "run-b").acquire()
    assert (tmp_path / LOCK_NAME).read_text() == ""  # released: empty, the file stays
    # a holder on this host whose process is gone (SIGKILL): taken over, with its description
    lock_file = tmp_path / LOCK_NAME
    lock_file.write_text(json.dumps({"run_id": "run-dead", "host": socket.gethostname(), "pid": _dead_pid(),
                                     "started_at": "2026-12-01T00:00:00+00:00"}))
    with StoreLock(tmp_path, "run-c") as c:
        assert "run run-dead" in c.taken_over and "its process is gone" in c.taken_over
    # another host with a fresh heartbeat is honoured; an old heartbeat is taken over
    lock_file.write_text(json.dumps({"run_id": "run-far", "host": "elsewhere.example", "pid": 1}))
    with pytest.raises(StoreLockedError, match="run-far .*another host.*stale after 600 s"):
        StoreLock(tmp_path, "run-d").acquire()
    old = time.time() - 3600
    os.utime(lock_file, (old, old))
    with StoreLock(tmp_path, "run-e", stale_after_s=600) as e:
        assert "no heartbeat for 3600 s" in e.taken_over


def test_mark_stale_runs_only_touches_dead_processes(tmp_path):
    store = ResultsStore(tmp_path / "s")
    store.write_provenance("r-dead", {"state": "running", "process": {"host": socket.gethostname(), "pid": _dead_pid()}})
    store.write_provenance("r-live", {"state": "running", "process": {"host": socket.gethostname(), "pid": os.getpid()}})
    store.write_provenance("r-far", {"state": "running", "process": {"host": "elsewhere.example", "pid": 1}})
    store.write_provenance("r-done", {"state": "finished"})
    assert store.mark_stale_runs() == ["r-dead"]
    assert store.read_provenance("r-dead")["state"] == "interrupted"
    assert "ended without finishing" in store.read_provenance("r-dead")["reason"]
    assert [store.read_provenance(r)["state"] for r in ("r-live", "r-far", "r-done")] == ["running", "running",
                                                                                         "finished"]


def test_status_verify_finds_corrupt_and_orphan_files(demo, tmp_path, capsys):
    root = tmp_path / "copy"
    shutil.copytree(demo.path.parent, root)
    job = root / "demo.toml"
    text = job.read_text().replace(str(demo.path.parent), str(root))
    job.write_text(text)
    store = root / "store"
    assert verify_store(store) == []
    assert main(["status", str(job), "--verify"]) == 0
    assert "results store" in capsys.readouterr().out
    table = sorted((store / "units").glob("*/.*.parquet"))[0]
    data = bytearray(table.read_bytes())
    data[len(data) // 2] ^= 0xFF
    table.write_bytes(bytes(data))
    orphan = table.with_name(".00ffee.orphan.parquet")
    orphan.write_bytes(b"x")
    leftover = store / "units" / ".half.json.123-abc.partial"
    leftover.write_bytes(b"{")
    kinds = {(p.kind, os.path.basename(p.path)) for p in verify_store(store)}
    env = [p for p in verify_store(store) if p.kind == "corrupt"]
    assert len(env) == 1 and "does not match its sha256 checksum" in env[0].message
    assert ("orphan", orphan.name) in kinds and ("orphan", leftover.name) in kinds
    assert main(["status", str(job), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "3 problem(s)" in out and orphan.name in out and "corrupt" in out


def test_monitoring_examples_use_only_exported_series():
    """deploy/monitoring's alert rules and Grafana dashboard name only series the collector emits."""
    import re
    from pathlib import Path

    import yaml

    board = RunBoard()
    board.start({"run_id": "r", "job": "j", "store": "/s", "started": 1.0}, [_unit("a", "enc0")])
    board.finish_unit("a", {"status": "done", "seconds": 1.0, "recall": 0.9, "rows": 1, "bytes_read": 1})
    emitted = {name for name, _ in _samples(board)}
    root = Path(__file__).resolve().parents[1] / "deploy" / "monitoring"
    rules = yaml.safe_load((root / "alerts.yaml").read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    assert {r["alert"] for g in rules["groups"] for r in g["rules"]} >= {"CachescoreRunAborted", "CachescoreNoProgress"}
    dash = json.loads((root / "grafana-dashboard.json").read_text())
    exprs += [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\bcachescore_[a-z_]+", e)}
    assert used and used <= emitted, used - emitted
    labels = {lab for e in exprs if "cachescore_units" in e for group in re.findall(r"by \(([^)]*)\)", e)
              for lab in (x.strip() for x in group.split(","))}
    assert labels and labels <= {"state", "encoder"}, labels  # only the labels the series carries
    scrape = yaml.safe_load((root / "prometheus.yml").read_text())
    assert scrape["scrape_configs"][0]["metrics_path"] == "/metrics" and scrape["rule_files"] == ["alerts.yaml"]


def test_run_sweeps_provably_abandoned_leftovers(demo, tmp_path):
    """Under the store lock, ``run`` deletes old ``*.partial`` files and old per-unit tables no
    envelope references; young ones (a writer may still be at work) and referenced ones stay."""
    import io

    from cachescore.jobs import load_job
    from cachescore.pipeline import run_job

    root = tmp_path / "copy"
    shutil.copytree(demo.path.parent, root)
    (root / "demo.toml").write_text((root / "demo.toml").read_text().replace(str(demo.path.parent), str(root)))
    store = root / "store"
    folder = sorted((store / "units").glob("*/"))[0]
    old_partial, old_orphan = folder / ".x.json.1-a.partial", folder / ".abcdef.1234.parquet"
    young_partial = folder / ".y.json.2-b.partial"
    for f in (old_partial, old_orphan, young_partial):
        f.write_bytes(b"x")
    hour_ago = time.time() - 3600
    for f in (old_partial, old_orphan):
        os.utime(f, (hour_ago, hour_ago))
    referenced = len(list((store / "units").glob("*/.*.parquet"))) - 1
    out = io.StringIO()
    summary = run_job(load_job(root / "demo.toml"), processes=False, out=out)
    assert summary.executed == 0 and "swept 2 leftover file(s)" in out.getvalue()
    assert not old_partial.exists() and not old_orphan.exists() and young_partial.exists()
    assert len(list((store / "units").glob("*/.*.parquet"))) == referenced
    assert ResultsStore(store).read_provenance(summary.run_id)["state"] == "finished"


def test_held_capture_survives_a_foreign_catch_warnings_on_another_thread():
    """The CI flake this fixes: a library's ``catch_warnings`` block on another thread (sklearn in a
    probe task) that starts before a unit's capture and ends during it restored pytest's ``error``
    filter under the capturing unit, so its RuntimeWarning raised. With the hold in place (as on
    every worker and in-process cluster) the warning is captured instead."""
    import threading
    import warnings

    from cachescore._warncapture import captured_warnings, hold_capture

    def straddle(entered, release):
        with warnings.catch_warnings():  # saves the filters in effect now
            entered.set()
            release.wait(5)
        # leaving restores them, while the other thread captures

    def unit(capturing, restored, out):
        with captured_warnings() as caught:
            capturing.set()
            restored.wait(5)
            warnings.warn("support is 97%", RuntimeWarning)
        out.extend(caught)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as under pytest
        with hold_capture():
            entered, capturing, release = threading.Event(), threading.Event(), threading.Event()
            caught: list = []
            a = threading.Thread(target=straddle, args=(entered, release))
            a.start()
            entered.wait(5)
            b = threading.Thread(target=unit, args=(capturing, release, caught))
            b.start()
            capturing.wait(5)
            release.set()
            a.join(5)
            b.join(5)
        assert [str(w.message) for w in caught] == ["support is 97%"]
