"""Store and import safety under hostile and transient conditions (issue 22), case by case.

The cases and what each pins are listed in ``docs/fault-injection.md`` (with the older runtime
cases of ``tests/test_runtime_faults.py``). One scored store is built once per module (a small
demo cache, 2 encoders x 2 views x RI / MaRI / CRoMa = 12 units, a real LocalCluster); every test
damages its own copy and drives the real command line (``cachescore.cli.main`` in this process,
or ``python -m cachescore.cli`` where another process must hold something). A command that let
an exception escape would fail the test, so "no traceback" is asserted by every call.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from cachescore.cache import Cache, make_demo_cache
from cachescore.cache.layout import check_name, meta_path, view_sidecar_path
from cachescore.cli import format_table, main
from cachescore.jobs import load_job
from cachescore.pipeline import plan_job
from cachescore.pipeline.watch import watch_job
from cachescore.store import ResultsStore
from cachescore.store.lock import LOCK_NAME, LockFileError, StoreLock
from cachescore.store.verify import verify_store
from cluster_utils import tmpfs

N_UNITS = 12


def write_job(folder: Path, cache: Path, store: Path, *, encoders=(), name="safety", k=(5, 11), m=(5,)) -> Path:
    """A job over ``cache`` into ``store`` (RI, MaRI, CRoMa on both demo views, no probe)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.toml"
    path.write_text(textwrap.dedent(f"""\
        schema_version = 1
        [job]
        name = "{name}"
        cache = {json.dumps(str(cache))}
        store = {json.dumps(str(store))}
        encoders = {json.dumps(list(encoders))}
        views = ["centre_all", "centre_paired"]
        [metrics]
        families = ["ri", "mari", "croma"]
        [metrics.ri]
        k_candidates = {json.dumps(list(k))}
        [metrics.mari]
        k_candidates = {json.dumps(list(k))}
        warn_tau = false
        [metrics.croma]
        m = {json.dumps(list(m))}
        [neighbors]
        backend = "exact"
        [execution]
        n_workers = 1
        retries = 0
        dashboard = false
        performance_report = false
        """), encoding="utf-8")
    return path


@pytest.fixture(autouse=True)
def _pinned_code_version(monkeypatch):
    monkeypatch.setenv("CACHESCORE_CODE_VERSION", "test-pinned")


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    """``(cache, store)``: the demo cache and a store holding all 12 units (built once)."""
    root = tmp_path_factory.mktemp("safety")
    cache = root / "cache"
    make_demo_cache(cache, n_slides_per_cell=2, tiles_per_slide=6, dim=8, encoders=2, seed=0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CACHESCORE_CODE_VERSION", "test-pinned")
        job = write_job(root, cache, root / "store")
        assert main(["run", str(job), "-q"]) == 0
    return cache, root / "store"


@pytest.fixture
def copy(scored, tmp_path):
    """``(job path, cache, store)`` over a private copy of the scored store (and of the cache)."""
    cache, store = scored
    shutil.copytree(cache, tmp_path / "cache", symlinks=True)
    shutil.copytree(store, tmp_path / "store", symlinks=True)
    return write_job(tmp_path, tmp_path / "cache", tmp_path / "store"), tmp_path / "cache", tmp_path / "store"


def cli(capsys, *args) -> tuple[int, str, str]:
    """``cachescore ARGS`` in this process: ``(exit code, stdout, stderr)``; never a traceback."""
    rc = main([str(a) for a in args])
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err + cap.out, cap.err
    return rc, cap.out, cap.err


def per_unit_tables(store: Path) -> list[Path]:
    return sorted((store / "units").glob("*/.*.parquet"))


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def pending_fps(job) -> set[str]:
    plan = plan_job(job, store=ResultsStore(job.store))
    return {u.fingerprint for u in plan.pending}


def corrupt_fps(store: Path) -> set[str]:
    return {Path(p.path).stem for p in verify_store(store) if p.kind == "corrupt"}


# -- finding 1: the run lock ----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["symlink", "hardlink", "fifo"])
def test_a_lock_file_that_is_not_a_plain_file_of_its_own_is_refused_and_never_written(copy, tmp_path, capsys, kind):
    job, _, store = copy
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    lock = store / LOCK_NAME
    lock.unlink(missing_ok=True)
    if kind == "symlink":
        lock.symlink_to(outside)
    elif kind == "hardlink":
        os.link(outside, lock)
    else:
        os.mkfifo(lock)
    rc, out, err = cli(capsys, "run", job, "-q")
    assert rc == 2 and f"lock file {lock}" in err and "[Errno" not in err
    assert {"symlink": "symbolic link", "hardlink": "2 hard links", "fifo": "is a FIFO"}[kind] in err
    assert outside.read_text() == "precious\n"  # never followed, never truncated
    rc, out, _ = cli(capsys, "status", job, "--verify")
    assert rc == 1 and "lock" in out and "refuses it" in out and "healthy" not in out.split("cache")[-1]
    assert [p.kind for p in verify_store(store)] == ["lock"]
    rc, _, err = cli(capsys, "prune", job, "--apply")  # prune takes the same lock: refused alike
    assert rc == 2 and f"lock file {lock}" in err
    lock.unlink()
    assert cli(capsys, "run", job, "-q")[0] == 0 and lock.is_file() and not lock.is_symlink()


def test_a_lock_write_failure_names_the_store_and_releases_the_descriptor(tmp_path, monkeypatch):
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    lock = StoreLock(tmp_path, "run-x")
    with pytest.raises(LockFileError, match=rf"results store {tmp_path}: cannot write lock file .*No space left"):
        lock.acquire()
    monkeypatch.undo()
    fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
           if os.path.exists(f"/proc/self/fd/{fd}")]
    assert str(tmp_path / LOCK_NAME) not in fds  # the descriptor (and its flock) were released
    with StoreLock(tmp_path, "run-y"):  # the next holder gets it at once
        pass


def test_a_store_already_full_when_run_starts_is_named(copy, tmp_path, capsys):
    job, cache, store = copy
    with tmpfs("2m", prefix="cachescore-full-") as disk:
        full_store = disk / "store"
        shutil.copytree(store, full_store)
        (full_store / LOCK_NAME).unlink(missing_ok=True)
        (full_store / "units" / next(iter(os.listdir(full_store / "units")))).rename(disk / "moved")  # work to do
        filler = disk / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        full_job = write_job(tmp_path / "full-job", cache, full_store)
        rc, out, err = cli(capsys, "run", full_job, "-q")
        assert rc in (1, 2) and str(full_store) in err and "No space left" in err, err
        assert "[Errno 28] No space left on device\n" not in err  # never the bare errno line
        fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}")]
        assert str(full_store / LOCK_NAME) not in fds
        filler.unlink()
        rc, out, err = cli(capsys, "run", full_job, "-q")
        assert rc == 0, err


def test_status_names_a_dead_holder_as_left_over_and_a_live_unlocked_pid_is_taken_over_for_that_reason(copy, capsys):
    job, _, store = copy
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    info = {"run_id": "run-dead", "host": os.uname().nodename, "pid": int(dead.stdout), "pid_started": 1.0,
            "started_at": "2026-01-01T00:00:00+00:00", "heartbeat_at": "2026-01-01T00:00:00+00:00"}
    (store / LOCK_NAME).write_text(json.dumps(info))
    rc, out, _ = cli(capsys, "status", job)
    assert rc == 0 and "lock file left by run run-dead" in out and "process gone" in out and "in use by" not in out
    from cachescore.store.lock import this_process
    (store / LOCK_NAME).write_text(json.dumps(dict(info, run_id="run-alive", **this_process())))
    with StoreLock(store, "run-new") as lock:  # our own pid: alive, but it holds no flock on the file
        assert "is alive but does not hold the lock" in lock.taken_over and "no heartbeat" not in lock.taken_over


# -- finding 2 and 3: prune ---------------------------------------------------------------------------

def test_prune_keeps_the_records_of_an_encoder_whose_folder_is_moved_away(copy, capsys):
    job, cache, store = copy
    before = ResultsStore(store).stored_fingerprints()
    (cache / "embeddings" / "enc1").rename(cache / "enc1-away")
    rc, out, _ = cli(capsys, "prune", job)
    assert rc == 0 and "would remove 0 stale record(s)" in out and "kept 6 record(s)" in out and "--all-jobs" in out
    assert cli(capsys, "prune", job, "--apply")[0] == 0
    assert ResultsStore(store).stored_fingerprints() == before  # nothing of enc1 deleted
    (cache / "enc1-away").rename(cache / "embeddings" / "enc1")
    assert cli(capsys, "run", job, "-q")[1].count("executed 0,") == 1  # enc1's results are all still current


@pytest.mark.parametrize("damage", ["truncated meta.json", "view sidecar checksum"])
def test_prune_refuses_while_an_input_cannot_be_read_or_verified(copy, capsys, damage):
    job, cache, store = copy
    before = ResultsStore(store).stored_fingerprints()
    if damage == "truncated meta.json":
        meta = meta_path(cache, "enc0", Cache(cache).view_spec("centre_all").tileset)
        meta.write_bytes(meta.read_bytes()[:20])
    else:
        side = view_sidecar_path(cache, "centre_paired")
        doc = json.loads(side.read_text())
        key = next(k for k in doc if "sha256" in k)
        doc[key] = "0" * 64
        side.write_text(json.dumps(doc))
    for args in (["prune", job], ["prune", job, "--apply"], ["prune", job, "--apply", "--all-jobs"]):
        rc, out, err = cli(capsys, *args)
        assert rc == 2 and "prune refused" in err and "cannot be read or verified" in err and "nothing was deleted" in err
    assert ResultsStore(store).stored_fingerprints() == before


def test_two_jobs_sharing_a_store_do_not_prune_each_other(copy, tmp_path, capsys):
    job, cache, store = copy
    other = write_job(tmp_path / "other", cache, store, encoders=["enc0"], name="other", k=(5,))
    # enc0 with k=[5]: 4 more records (RI, MaRI x 2 views); its CRoMa units are the first job's (same fingerprints)
    rc, out, _ = cli(capsys, "run", other, "-q")
    assert rc == 0 and "executed 4," in out
    before = ResultsStore(store).stored_fingerprints()
    assert len(before) == 16
    rc, out, _ = cli(capsys, "prune", other, "--apply")
    assert rc == 0 and "scope: job 'other'" in out and "removed 0 stale record(s)" in out and "kept 10 record(s)" in out
    rc, out, _ = cli(capsys, "prune", job, "--apply")
    assert rc == 0 and "removed 0 stale record(s)" in out and "kept 4 record(s)" in out
    assert ResultsStore(store).stored_fingerprints() == before
    rc, out, _ = cli(capsys, "prune", other, "--all-jobs")  # explicit: everything job 'other' does not name
    assert rc == 0 and "would remove 10 stale record(s)" in out and "all-jobs" in out


def test_prune_apply_waits_for_no_one_while_a_run_holds_the_lock(copy, capsys):
    job, _, store = copy
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""\
        import sys, time
        from cachescore.store.lock import StoreLock
        with StoreLock({str(store)!r}, "run-holding"):
            print("held", flush=True)
            time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        store_obj = ResultsStore(store)
        stale = "ab" * 32
        store_obj.write_unit(stale, record={"encoder": "enc0", "view": "centre_all", "design": "all", "metric": "ri",
                                            "params": {"k_candidates": [1]}, "value": 0.5})
        before = store_obj.stored_fingerprints()
        rc, _, err = cli(capsys, "prune", job, "--apply", "--all-jobs")
        assert rc == 2 and "in use by run run-holding" in err
        assert store_obj.stored_fingerprints() == before  # nothing deleted beside the running holder
    finally:
        holder.kill()
        holder.wait(timeout=30)
        holder.stdout.close()
    rc, out, _ = cli(capsys, "prune", job, "--apply", "--all-jobs")
    assert rc == 0 and "removed 1 stale record(s)" in out


# -- finding 4: damaged per-unit records --------------------------------------------------------------

def _damage(store: Path, how: str) -> str:
    """Damage the first unit record ``how``; return its fingerprint."""
    table = per_unit_tables(store)[0]
    fp = table.name[1:].split(".", 1)[0]
    envelope = table.parent / f"{fp}.json"
    if how == "flipped byte":
        flip_byte(table)
    elif how == "truncated table":
        table.write_bytes(table.read_bytes()[:-7])
    elif how == "missing table":
        table.unlink()
    elif how == "truncated envelope":
        envelope.write_bytes(envelope.read_bytes()[:25])
    elif how == "envelope of another fingerprint":
        doc = json.loads(envelope.read_text())
        doc["fingerprint"] = "cd" * 32
        envelope.write_text(json.dumps(doc))
    return fp


DAMAGES = ["flipped byte", "truncated table", "missing table", "truncated envelope", "envelope of another fingerprint"]


@pytest.mark.parametrize("how", DAMAGES)
def test_status_verify_and_the_planner_agree_on_a_damaged_record(copy, capsys, how):
    job_path, _, store = copy
    fp = _damage(store, how)
    job = load_job(job_path)
    assert corrupt_fps(store) == {fp} == pending_fps(job)  # one predicate
    rc, out, _ = cli(capsys, "status", job_path)
    assert rc == 0 and "1 damaged, 11 done" in out
    rc, out, _ = cli(capsys, "status", job_path, "--json")
    doc = json.loads(out)
    assert doc["counts"] == {"damaged": 1, "done": 11}
    (bad,) = [u for u in doc["units"] if u["state"] == "damaged"]
    assert bad["fingerprint"] == fp and "the next run recomputes it" in bad["detail"]


@pytest.mark.parametrize("how", ["flipped byte", "truncated table"])
def test_a_damaged_record_is_reported_by_readers_and_repaired_by_run(copy, capsys, how):
    job, _, store = copy
    fp = _damage(store, how)
    for args in (["export", job], ["compare", job, "enc0", "enc1"], ["report", job]):
        rc, out, err = cli(capsys, *args)
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert rc == 2 and len(lines) == 1, err
        assert f"fingerprint {fp[:16]}" in lines[0] and f"`cachescore run {job}` recomputes it" in lines[0]
        assert "/centre_" in lines[0]  # the unit's label: encoder/view/design/metric
    rc, out, err = cli(capsys, "run", job, "-q")
    assert rc == 0 and "executed 1," in out and "results tables not written" not in err
    assert verify_store(store) == [] and len(per_unit_tables(store)) == N_UNITS  # no orphan left
    assert ResultsStore(store).has(fp)
    scores = pd.read_parquet(store / "scores.parquet")
    assert len(scores) == N_UNITS and fp in set(scores["fingerprint"])
    for args in (["export", job], ["compare", job, "enc0", "enc1"], ["report", job]):
        assert cli(capsys, *args)[0] == 0


@pytest.mark.parametrize("table", ["probe.parquet", "scores.parquet"])
def test_a_truncated_tidy_table_is_reported_by_verify_and_rewritten_by_run(copy, capsys, table):
    job, _, store = copy
    path = store / table
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    problems = verify_store(store)
    assert [(p.kind, Path(p.path).name) for p in problems] == [("table", table)]
    rc, out, err = cli(capsys, "status", job, "--verify")
    assert rc == 1 and "table" in out and f"results store {store}: 1 problem(s)" in out
    assert cli(capsys, "run", job, "-q")[0] == 0 and verify_store(store) == []


SUBCOMMANDS = [["status"], ["status", "--verify"], ["status", "--json"], ["validate"], ["export"],
               ["compare", "enc0", "enc1"], ["report"], ["prune"], ["prune", "--apply"]]


@pytest.mark.parametrize("how", DAMAGES + ["lock symlink", "truncated scores.parquet", "store.json garbage",
                                           "provenance garbage", "failure garbage"])
def test_no_subcommand_prints_a_traceback_over_a_damaged_store(copy, tmp_path, capsys, how):
    job, _, store = copy
    if how in DAMAGES:
        _damage(store, how)
    elif how == "lock symlink":
        (store / LOCK_NAME).unlink(missing_ok=True)
        (store / LOCK_NAME).symlink_to("/etc/hostname")
    elif how == "truncated scores.parquet":
        (store / "scores.parquet").write_bytes(b"PAR1garbage")
    elif how == "store.json garbage":
        (store / "store.json").write_text("{not json")
    elif how == "provenance garbage":
        next((store / "runs").glob("*/provenance.json")).write_text("[1, 2")
    elif how == "failure garbage":
        (store / "failures" / "ab").mkdir(parents=True, exist_ok=True)
        (store / "failures" / "ab" / ("ab" * 32 + ".json")).write_text("\x00\xff")
    for sub in SUBCOMMANDS:
        rc, out, err = cli(capsys, sub[0], job, *sub[1:])
        assert rc in (0, 1, 2), (sub, rc)
        if rc == 2:
            assert err.strip().startswith("error:") or "error:" in err, (sub, err)


# -- finding 5: slide files -----------------------------------------------------------------------------

h5py = pytest.importorskip("h5py")


def _slides(root: Path, names, n=4, dim=4) -> tuple[Path, Path]:
    folder = root / "feats"
    folder.mkdir(parents=True, exist_ok=True)
    for k, s in enumerate(names):
        with h5py.File(folder / f"{s}.h5", "w") as fh:
            fh["features"] = np.random.default_rng(k).standard_normal((n, dim)).astype(np.float32)
            fh["coords"] = np.stack([np.arange(n), np.full(n, k)], axis=1).astype(np.int64)
    table = pd.DataFrame({"slide_id": list(names), "label": [i % 2 for i in range(len(names))],
                          "centre": ["A", "B"] * (len(names) // 2)})
    table.to_csv(root / "slides.csv", index=False)
    return folder, root / "slides.csv"


def _import(capsys, cache, csv, folder, *extra):
    return cli(capsys, "import", cache, "--tileset", "t", "--layout", "per_slide", "--manifest", csv,
               "--slide-column", "slide_id", "--encoder", f"e={folder}", *extra)


def test_slide_ids_that_are_not_plain_names_are_refused(tmp_path, capsys):
    folder, csv = _slides(tmp_path, ["S0", "S1"])
    outside = tmp_path / "outside"
    _slides(outside, ["A-tumor-0", "B"])  # a valid .h5 where a hostile slide id points
    table = pd.read_csv(csv)
    table.loc[1, "slide_id"] = "../outside/feats/A-tumor-0"
    table.to_csv(csv, index=False)
    rc, _, err = _import(capsys, tmp_path / "cache", csv, folder)
    assert rc == 2 and "slide id '../outside/feats/A-tumor-0' is not a plain file name" in err
    assert not (tmp_path / "cache" / "embeddings").exists()


def test_symlinks_leaving_the_slide_folder_are_refused_unless_followed_and_devices_always(tmp_path, capsys):
    folder, csv = _slides(tmp_path, ["S0", "S1"])
    elsewhere = tmp_path / "elsewhere.h5"
    (folder / "S1.h5").rename(elsewhere)
    (folder / "S1.h5").symlink_to(elsewhere)
    rc, _, err = _import(capsys, tmp_path / "cache", csv, folder)
    assert rc == 2 and "slide 'S1'" in err and "outside the slide folder" in err and "--follow-symlinks" in err
    assert not (tmp_path / "cache" / "embeddings").exists()  # nothing left behind, not even an empty folder
    assert _import(capsys, tmp_path / "cache", csv, folder, "--follow-symlinks")[0] == 0
    (folder / "S1.h5").unlink()
    (folder / "S1.h5").symlink_to("/dev/zero")
    for extra in ((), ("--follow-symlinks",)):
        rc, _, err = _import(capsys, tmp_path / "cache2", csv, folder, *extra)
        assert rc == 2 and "slide 'S1'" in err and ("is a device, not a regular file" in err
                                                    or "outside the slide folder" in err), err
    tiles = tmp_path / "tiles.csv"
    pd.DataFrame({"sample_id": ["a", "b"], "image_path": ["a.png", "b.png"]}).to_csv(tiles, index=False)
    rc, _, err = cli(capsys, "import", tmp_path / "cache3", "--tileset", "t", "--manifest", tiles, "--encoder", "e=/dev/zero")
    assert rc == 2 and "/dev/zero is a device, not a regular file" in err


def test_a_failed_import_leaves_no_empty_encoder_folder(tmp_path, capsys):
    folder, csv = _slides(tmp_path, ["S0", "S1"])
    with h5py.File(folder / "S1.h5", "r+") as fh:
        fh["features"][2, 1] = np.nan
    rc, _, err = _import(capsys, tmp_path / "cache", csv, folder)
    assert rc == 2 and "NaN" in err
    assert not (tmp_path / "cache" / "embeddings" / "e").exists()


def test_duplicated_slide_ids_are_named(tmp_path, capsys):
    folder, csv = _slides(tmp_path, ["S0", "S1", "S2", "S3"])
    table = pd.read_csv(csv)
    table.loc[3, "slide_id"] = "S1"
    table.to_csv(csv, index=False)
    rc, _, err = _import(capsys, tmp_path / "cache", csv, folder)
    assert rc == 2 and "repeats 1 slide id(s), e.g. 'S1' at rows" in err and "missing required columns" not in err
    rc, _, err = cli(capsys, "import", tmp_path / "cache", "--tileset", "t", "--layout", "per_slide", "--manifest", csv,
                     "--slide-column", "slide", "--encoder", f"e={folder}")
    assert rc == 2 and "no column 'slide' (--slide-column)" in err and "needs --layout per_slide" not in err


def test_names_are_one_path_component_and_consecutive_dots_are_allowed():
    assert check_name("encoder", "a..b") == "a..b"  # documented: cannot start with '.', so never '.' or '..'
    for bad in ("..", ".", "a/b", "a\nb", "-x", ""):
        with pytest.raises(ValueError):
            check_name("encoder", bad)


# -- finding 6, the rest: validate makes run's checks, tables, watch ------------------------------------

def test_validate_refuses_k_and_m_larger_than_the_scope_naming_both(copy, tmp_path, capsys):
    _, cache, store = copy
    job = write_job(tmp_path / "k", cache, tmp_path / "kstore", k=(500,), m=(400,))
    rc, out, _ = cli(capsys, "validate", job)
    assert rc == 2 and "0 unit(s) to run, 0 up to date, 12 invalid" in out
    assert "every k in k_candidates [500] is >= the 72 rows of its rows" in out
    assert "CRoMa m=400 needs 400 SO and 400 OS" in out and "72 rows" in out
    rc, out, err = cli(capsys, "run", job, "-q")  # the same checks: recorded at once, no cluster started
    assert rc == 1 and "executed 0," in out


def test_a_store_that_is_the_cache_or_inside_it_is_refused_by_every_command(copy, tmp_path, capsys):
    _, cache, _ = copy
    for store in (cache, cache / "results"):
        job = write_job(tmp_path / "same", cache, store)
        for sub in (["validate"], ["run", "-q"], ["status"], ["prune"]):
            rc, _, err = cli(capsys, sub[0], job, *sub[1:])
            assert rc == 2 and "the results store and the cache must be separate folders" in err, (sub, err)
        assert not (cache / "results").exists()


def test_tables_show_control_characters_escaped_one_row_per_line():
    text = format_table([{"name": "a\nb", "msg": "tab\there\r"}], ["name", "msg"])
    assert text.splitlines()[2].split() == ["a\\nb", "tab\\there\\r"] and len(text.splitlines()) == 3


def test_watch_retries_after_a_store_write_error(copy):
    job, cache, store = copy
    (cache / "embeddings" / "enc1").rename(cache / "enc1-away")
    shutil.rmtree(store)
    calls = []

    def run(job, **kw):
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, f"cannot write {store}/units/x.json: No space left on device")
        from cachescore.pipeline.run import run_job
        return run_job(job, **kw)

    polls = watch_job(job, interval=0, max_runs=2, run=run, out=None, progress=False)
    assert len(calls) == 2 and "No space left" in polls[0].error and polls[1].summary.succeeded == 6


def test_a_cache_without_views_says_so_and_how_to_write_one(copy, capsys):
    """Issue 24: a job whose cache has no view printed "0 unit(s) to run" and nothing else."""
    job, cache, _ = copy
    text = job.read_text().replace('views = ["centre_all", "centre_paired"]', "views = []")
    job.write_text(text)
    for view in ("centre_all", "centre_paired"):
        for suffix in (".json", ".parquet"):
            (cache / "views" / f"{view}{suffix}").unlink()
    for sub in (["validate"], ["run", "-q"]):
        rc, out, err = cli(capsys, sub[0], job, *sub[1:])
        assert rc == 0 and "has no view, so there is nothing to score" in err and "cachescore view" in err, err
