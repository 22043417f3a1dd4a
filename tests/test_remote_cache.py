"""A cache in object storage (issue 27, part 1): fsspec URLs, tested against a real S3 HTTP
endpoint on 127.0.0.1 (moto's standalone server, :mod:`s3_endpoint`) with s3fs as the client.

Import into S3, run (values equal to the same cache on disk, bit for bit), status, report, a
re-run that executes nothing, a missing object and a wrong credential with clear errors, and no
credential in any file the product writes."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import s3_endpoint as se

REPO = Path(__file__).resolve().parents[1]
#: A job without a demo to synthesise (its cache and store are replaced by :func:`_job`).
SMALL_JOB = ('schema_version = 1\n[job]\nname = "small"\ncache = "../demo-cache"\nstore = "../results/demo"\n'
             '[metrics]\nfamilies = ["ri"]\n[metrics.ri]\nk_candidates = [5]\n'
             '[execution]\nn_workers = 1\ndashboard = false\nperformance_report = false\n')


@pytest.fixture(scope="module")
def endpoint():
    if se.missing_reason():  # skipped, saying why (a failure under .ci/run, which installs the test extra)
        from cluster_utils import service_missing

        service_missing(se.missing_reason())
    server, ep = se.start_endpoint()
    yield ep
    server.stop()


@pytest.fixture
def bucket(endpoint, monkeypatch):
    se.s3_env(monkeypatch, endpoint)
    monkeypatch.setenv("CACHESCORE_CODE_VERSION", "test-pinned")
    return se.new_bucket()


def _fs():
    import s3fs

    return s3fs.S3FileSystem()


def _job(tmp_path: Path, name: str, cache: str, store: Path, *, body: str | None = None) -> Path:
    text = (REPO / "jobs" / "demo.toml").read_text() if body is None else body
    text = text.replace('cache = "../demo-cache"', f'cache = "{cache}"').replace('store = "../results/demo"',
                                                                              f'store = "{store}"')
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


def _digest(store: Path) -> dict:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from stored_values_digest import digest_store

    return digest_store(store)


# -- the shard reader ------------------------------------------------------------------------------

def test_remote_shard_reads_slices_and_gathers_by_ranged_requests(bucket, monkeypatch):
    from cachescore.cache import ShardError, ShardNotFoundError
    from cachescore.cache import shards

    rng = np.random.default_rng(0)
    x = rng.standard_normal((1000, 24)).astype(np.float32)
    buf = io.BytesIO()
    np.save(buf, x)
    fs = _fs()
    fs.pipe(f"{bucket}/x.npy", buf.getvalue())
    shard = shards.open_shard(f"s3://{bucket}/x.npy", 1000, 24, np.dtype(np.float32), "lbl")
    assert isinstance(shard, shards.RemoteShard) and shard.shape == (1000, 24)
    np.testing.assert_array_equal(shard[17:333], x[17:333])
    np.testing.assert_array_equal(np.asarray(shard), x)
    rows = np.sort(rng.choice(1000, 300))  # repeats, gaps small and large
    monkeypatch.setattr(shards, "MAX_REQUEST_BYTES", 10 * 24 * 4)  # runs split into requests of 10 rows
    np.testing.assert_array_equal(shard[rows], x[rows])
    np.testing.assert_array_equal(shard[0:1000], x)
    got = shards.gather_rows((f"s3://{bucket}/x.npy",), np.array([0, 1000]), 24, "<f4", rows[::-1].copy(), "lbl")
    np.testing.assert_array_equal(got, x[rows[::-1]])
    with pytest.raises(ShardError, match=r"shape \(1000, 24\), meta.json says \(999, 24\)"):
        shards.open_shard(f"s3://{bucket}/x.npy", 999, 24, np.dtype(np.float32), "lbl")
    fs.pipe(f"{bucket}/cut.npy", buf.getvalue()[:-40])
    with pytest.raises(ShardError, match=r"cut.npy is corrupt or truncated"):
        shards.open_shard(f"s3://{bucket}/cut.npy", 1000, 24, np.dtype(np.float32), "lbl")
    with pytest.raises(ShardNotFoundError, match=rf"lbl: shard file missing: s3://{bucket}/nope.npy"):
        shards.open_shard(f"s3://{bucket}/nope.npy", 1000, 24, np.dtype(np.float32), "lbl")


def test_a_url_with_credentials_or_a_store_url_is_refused(tmp_path):
    from cachescore.jobs import JobError, load_job

    path = _job(tmp_path, "j", "s3://AKIAXYZ:verysecret@bkt/cache", tmp_path / "store")
    with pytest.raises(JobError) as err:
        load_job(path)
    assert "credentials in the URL are not accepted" in str(err.value) and "verysecret" not in str(err.value)
    path = _job(tmp_path, "k", "s3://bkt/cache", "s3://bkt/store")
    with pytest.raises(JobError, match="the results store is a local or shared folder, not a URL"):
        load_job(path)
    path = _job(tmp_path, "f", f"file://{tmp_path / 'c'}", tmp_path / "store")
    assert load_job(path).cache == tmp_path / "c"


# -- the product on S3 -----------------------------------------------------------------------------

def test_demo_on_s3_equals_the_local_cache_bit_for_bit(bucket, tmp_path, capsys):
    """The demo job with its cache in S3 (synthesised there on first use): the same stored values
    as on disk; a re-run executes nothing; status and report read the remote cache; no credential
    in the store or the cache."""
    from cachescore.cli import main

    local = _job(tmp_path, "local", str(tmp_path / "demo-cache"), tmp_path / "store-local")
    remote = _job(tmp_path, "remote", f"s3://{bucket}/demo", tmp_path / "store-s3")
    assert main(["run", str(local), "--quiet"]) == 0
    assert main(["run", str(remote), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.count("executed 28") == 2 and "failed 0" in out
    a, b = _digest(tmp_path / "store-local"), _digest(tmp_path / "store-s3")
    assert len(a) == 40 and a == b  # every stored value and per-unit table, bit for bit
    fs = _fs()
    assert fs.isfile(f"{bucket}/demo/cache.json") and fs.isfile(f"{bucket}/demo/embeddings/enc0/demo/meta.json")

    assert main(["run", str(remote), "--quiet"]) == 0
    assert "executed 0, skipped 28" in capsys.readouterr().out
    assert main(["status", str(remote), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "40 done" in out and f"cache s3://{bucket}/demo: healthy" in out
    assert main(["report", str(remote)]) == 0
    assert (tmp_path / "store-s3" / "report.html").is_file()
    capsys.readouterr()

    secret, key = os.environ["AWS_SECRET_ACCESS_KEY"], os.environ["AWS_ACCESS_KEY_ID"]
    written = [p for p in (tmp_path / "store-s3").rglob("*") if p.is_file()]
    assert written
    for path in written:
        data = path.read_bytes()
        assert secret.encode() not in data and key.encode() not in data, path
    for name in fs.find(f"{bucket}/demo"):
        data = fs.cat_file(name)
        assert secret.encode() not in data and key.encode() not in data, name
    prov = json.loads(next((tmp_path / "store-s3" / "runs").glob("*/provenance.json")).read_text())
    assert prov["cache"] == prov["job"]["job"]["cache"] == f"s3://{bucket}/demo"


def test_import_into_s3_then_run_then_a_missing_object_is_named(bucket, tmp_path, capsys):
    from cachescore.cache import Cache
    from cachescore.cli import main

    rng = np.random.default_rng(1)
    n = 240
    manifest = pd.DataFrame({"sample_id": [f"t{i}" for i in range(n)], "image_path": [f"img/{i}.png" for i in range(n)],
                             "label": np.tile(["a", "b"], n // 2), "group_id": [f"g{i // 6}" for i in range(n)],
                             "centre": np.repeat(["x", "y", "z"], n // 3)})
    manifest.to_csv(tmp_path / "tiles.csv", index=False)
    for name in ("encA", "encB"):
        np.save(tmp_path / f"{name}.npy", rng.standard_normal((n, 16)).astype(np.float32))
    url = f"s3://{bucket}/cache"
    argv = ["import", url, "--tileset", "tiles", "--manifest", str(tmp_path / "tiles.csv"), "--shard-rows", "100",
            "--encoder", f"encA={tmp_path / 'encA.npy'}", "--view", "v=centre:all"]
    assert main(argv) == 0, capsys.readouterr().err
    assert f"imported encA into {url}" in capsys.readouterr().out
    fs = _fs()
    etags = {p: fs.info(p)["ETag"] for p in fs.find(f"{bucket}/cache")}
    assert main(argv) == 2  # as on disk: an existing view is not replaced without --overwrite
    assert f"view 'v' already exists in {url}; pass --overwrite" in capsys.readouterr().err
    assert main(argv[:-2]) == 0  # identical bytes: nothing is uploaded again
    se.fresh_listings()
    assert {p: _fs().info(p)["ETag"] for p in _fs().find(f"{bucket}/cache")} == etags
    assert main(argv[:-4] + ["--encoder", f"encB={tmp_path / 'encB.npy'}"]) == 0  # a second encoder added
    cache = Cache(url)
    assert cache.encoders() == ["encA", "encB"] and cache.views() == ["v"]
    for name in ("encA", "encB"):
        np.testing.assert_array_equal(cache.load_rows(name, "tiles"), np.load(tmp_path / f"{name}.npy"))
        cache.validate_embeddings(name, "tiles", reuse=False)  # checksums and finiteness, from the objects
    np.testing.assert_array_equal(cache.read_view("v")["row"].to_numpy(), np.arange(n))
    assert main(["view", url, "--tileset", "tiles", "--name", "half", "--confounder", "centre",
                 "--rows-per-slide", "3", "--seed", "0"]) == 0  # a view written into S3
    assert f"-> {url}/views/half.parquet" in capsys.readouterr().out
    assert Cache(url).views() == ["half", "v"] and len(Cache(url).read_view("half")) == n // 2
    assert main(["view", url, "--delete", "half"]) == 0
    assert Cache(url).views() == ["v"] and not fs.exists(f"{bucket}/cache/views/half.parquet")

    job = _job(tmp_path, "imp", url, tmp_path / "store", body=SMALL_JOB)
    assert main(["run", str(job), "--quiet"]) == 0
    assert "executed 2" in capsys.readouterr().out

    # a missing shard object: the unit fails naming the object, and verify lists it
    fs.rm_file(f"{bucket}/cache/embeddings/encB/tiles/shard-00001.npy")
    se.fresh_listings()
    local_copy = tmp_path / "local"
    shutil.rmtree(local_copy, ignore_errors=True)
    from cachescore.cache import ShardNotFoundError

    with pytest.raises(ShardNotFoundError, match=rf"encoder 'encB', tileset 'tiles': shard file missing: "
                                                 rf"s3://{bucket}/cache/embeddings/encB/tiles/shard-00001\.npy"):
        Cache(url).validate_embeddings("encB", "tiles", reuse=False)
    assert main(["status", str(job), "--verify"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"shard_missing|missing", out) and "encB" in out


def test_a_wrong_credential_and_a_missing_cache_get_clear_errors(bucket, endpoint, tmp_path, capsys):
    from cachescore.cli import main

    job = _job(tmp_path, "nope", f"s3://{bucket}/no-such-cache", tmp_path / "store", body=SMALL_JOB)
    assert main(["status", str(job)]) == 2
    assert f"cache not found: s3://{bucket}/no-such-cache" in capsys.readouterr().err
    assert main(["run", str(job), "--quiet"]) == 2
    assert "cache folder not found" in capsys.readouterr().err

    fs = _fs()
    fs.pipe(f"{bucket}/c/cache.json", b"{}")
    job = _job(tmp_path, "c", f"s3://{bucket}/c", tmp_path / "store", body=SMALL_JOB)
    probe = ("import sys\nfrom cachescore.cache import Cache, CacheAccessError\n"
             f"try:\n    Cache('s3://{bucket}/c').info()\nexcept CacheAccessError as exc:\n"
             "    print('refused:', exc)\n    sys.exit(3)\n")
    with se.enforced_auth(endpoint):
        assert _fs().cat_file(f"{bucket}/c/cache.json") == b"{}"  # the right key is accepted
        wrong = dict(os.environ, **se.env_for(endpoint, secret="not-the-secret"))  # a fresh process, a wrong secret
        proc = subprocess.run([sys.executable, "-m", "cachescore.cli", "status", str(job)], env=wrong,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert f"cache s3://{bucket}/c: access denied" in proc.stderr and "AWS_SECRET_ACCESS_KEY" in proc.stderr
        assert "not-the-secret" not in proc.stderr + proc.stdout
        proc = subprocess.run([sys.executable, "-c", probe], env=wrong, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 3 and "refused:" in proc.stdout and "access denied" in proc.stdout, proc.stderr

def test_zarr_shards_in_s3_are_read_by_chunks_and_checked(bucket, tmp_path):
    """``import --format zarr`` into S3: rows, gathers and the store digest read from the objects;
    a changed chunk object fails the checksum."""
    from cachescore.cache import Cache, ShardError
    from cachescore.cli import main

    rng = np.random.default_rng(2)
    n = 300
    pd.DataFrame({"sample_id": [f"t{i}" for i in range(n)], "image_path": [f"i/{i}" for i in range(n)],
                  "label": np.tile(["a", "b"], n // 2), "group_id": [f"g{i // 10}" for i in range(n)],
                  "centre": np.repeat(["x", "y"], n // 2)}).to_csv(tmp_path / "tiles.csv", index=False)
    x = rng.standard_normal((n, 12)).astype(np.float32)
    np.save(tmp_path / "z.npy", x)
    url = f"s3://{bucket}/zc"
    assert main(["import", url, "--tileset", "tiles", "--manifest", str(tmp_path / "tiles.csv"), "--format", "zarr",
                 "--chunk-rows", "40", "--shard-rows", "200", "--encoder", f"z={tmp_path / 'z.npy'}"]) == 0
    cache = Cache(url)
    meta = cache.validate_embeddings("z", "tiles", reuse=False)
    assert meta.format == "cachescore.zarr-shards" and [s.file for s in meta.shards] == ["shard-00000.zarr",
                                                                                           "shard-00001.zarr"]
    np.testing.assert_array_equal(cache.load_rows("z", "tiles"), x)
    pick = np.array([299, 0, 41, 41, 250])
    np.testing.assert_array_equal(cache.load_rows("z", "tiles", pick), x[pick])
    fs = _fs()
    chunk = sorted(p for p in fs.find(f"{bucket}/zc/embeddings/z/tiles/shard-00001.zarr") if "/c/" in p)[0]
    data = fs.cat_file(chunk)
    fs.pipe(chunk, data[:-1] + bytes([data[-1] ^ 0xFF]))
    with pytest.raises(ShardError, match=r"shard-00001\.zarr .*does not match its sha256"):
        Cache(url).validate_embeddings("z", "tiles", reuse=False)

    # re-imported as one .npy shard: the Zarr stores' objects go, meta.json is the new one
    assert main(["import", url, "--tileset", "tiles", "--manifest", str(tmp_path / "tiles.csv"), "--overwrite",
                 "--shard-rows", "300", "--encoder", f"z={tmp_path / 'z.npy'}"]) == 0
    se.fresh_listings()
    left = sorted(p.rsplit("/tiles/", 1)[1] for p in fs.find(f"{bucket}/zc/embeddings/z/tiles"))
    assert left == ["meta.json", "shard-00000.npy"]
    assert Cache(url).validate_embeddings("z", "tiles", reuse=False).format == "cachescore.npy-shards"
    np.testing.assert_array_equal(Cache(url).load_rows("z", "tiles"), x)


def test_any_fsspec_protocol_reads_the_same_and_a_missing_package_is_named(tmp_path):
    """Nothing in the reader is S3-specific: a cache in fsspec's in-memory file system reads the
    same rows and views as on disk (gs:// and az:// go the same way through gcsfs / adlfs); a
    protocol whose package is absent is refused at job parsing, naming the package."""
    import fsspec

    from cachescore.cache import Cache, make_demo_cache
    from cachescore.jobs import JobError, load_job

    make_demo_cache(tmp_path / "demo", seed=3)
    fs = fsspec.filesystem("memory")
    for path in (tmp_path / "demo").rglob("*"):
        if path.is_file():
            fs.pipe(f"/demo3/{path.relative_to(tmp_path / 'demo').as_posix()}", path.read_bytes())
    local, remote = Cache(tmp_path / "demo"), Cache("memory://demo3")
    assert remote.encoders() == local.encoders() and remote.views() == local.views()
    for view in local.views():
        pd.testing.assert_frame_equal(remote.read_view(view), local.read_view(view))
    for enc in local.encoders():
        np.testing.assert_array_equal(remote.load_rows(enc, "demo"), local.load_rows(enc, "demo"))
        assert remote.embedding_fingerprint(enc, "demo") == local.embedding_fingerprint(enc, "demo")
        remote.validate_embeddings(enc, "demo", reuse=False)
    fs.rm("/demo3", recursive=True)

    for url, package in (("gs://bkt/cache", "gcsfs"), ("az://bkt/cache", "adlfs")):
        try:
            __import__(package)
            continue  # installed here: nothing to refuse
        except ImportError:
            pass
        with pytest.raises(JobError, match=rf"job.cache: cache URL {url}: no fsspec file system .*install its package"):
            load_job(_job(tmp_path, "g", url, tmp_path / "store"))
