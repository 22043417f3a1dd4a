"""Job-file schema (cachescore.jobs): versioning, defaults, unknown keys, types, paths.

Pins: every key of the schema has a default or is required; a minimal job gets every default;
unknown keys (at any level) and wrong types are JobErrors naming the file and the dotted key;
relative paths resolve against the job file's folder; the shipped job files (jobs/demo.toml,
jobs/template.toml, the CLI's packaged demo) are valid.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from cachescore.jobs import SCHEMA, SCHEMA_VERSION, JobError, describe_schema, load_job, parse_job

REPO = Path(__file__).resolve().parents[1]
MINIMAL = 'schema_version = 1\n[job]\ncache = "c"\nstore = "s"\n'


def write(tmp_path, text, name="job.toml"):
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def test_minimal_job_gets_every_default(tmp_path):
    job = load_job(write(tmp_path, MINIMAL))
    assert job.cache == (tmp_path / "c").resolve()
    assert job.store == (tmp_path / "s").resolve()
    assert job.name == "job"
    assert job.encoders == () and job.views == () and job.design == "auto"
    assert job.metrics.families == ("ri", "mari", "croma")
    assert job.metrics.family("ri")["k_candidates"] == [5, 11, 21]
    assert job.metrics.family("mari")["tau"] == "auto"
    assert job.metrics.family("croma") == {"m": [5], "alpha": 0.10, "start_k": 200, "k_growth_factor": 2.0}
    assert job.neighbors.backend == "auto"
    assert job.execution.retries == 2
    # the normalised document holds every key of every section
    for section, keys in SCHEMA.items():
        assert set(job.document[section]) == set(keys)


def test_every_key_is_documented():
    for section, keys in SCHEMA.items():
        for name, key in keys.items():
            assert key.doc.strip(), f"{section}.{name} has no description"
            assert f"  {name} = " in describe_schema()


def test_absolute_paths_are_kept(tmp_path):
    job = parse_job({"schema_version": 1, "job": {"cache": str(tmp_path / "x"), "store": "/abs/store"}})
    assert job.cache == tmp_path / "x" and str(job.store) == "/abs/store"


@pytest.mark.parametrize(
    "text, match",
    [
        (MINIMAL + "bogus = 1\n", r"unknown key 'job\.bogus' in section \[job\]"),
        (MINIMAL + "[metrics.ri]\nk = [5]\n", r"unknown key 'metrics\.ri\.k'"),
        (MINIMAL + "[metrics.rii]\nk_candidates = [5]\n", r"unknown key 'metrics\.rii'"),
        (MINIMAL + "[nope]\n", r"unknown key 'nope' in the top level"),
        ('schema_version = 1\n[job]\ncache = "c"\n', r"missing required key 'job\.store'"),
        ('[job]\ncache = "c"\nstore = "s"\n', r"missing key 'schema_version'"),
        ('schema_version = 2\n[job]\ncache = "c"\nstore = "s"\n', r"unsupported schema_version 2"),
        (MINIMAL + 'encoders = "enc0"\n', r"'job\.encoders' must be a list"),
        (MINIMAL + 'encoders = ["a", "a"]\n', r"'job\.encoders' must be a list without duplicates"),
        (MINIMAL + 'design = "paired"\n', r"'job\.design' must be one of 'auto', 'all', 'paired_2x2'"),
        (MINIMAL + "[metrics]\nfamilies = [\"ri\", \"apd\"]\n", r"'metrics\.families' must be a list drawn"),
        (MINIMAL + "[metrics.ri]\nk_candidates = [5, 0]\n", r"positive integers"),
        (MINIMAL + "[metrics.ri]\nk_candidates = []\n", r"positive integers"),
        (MINIMAL + "[metrics.mari]\ntau = -0.1\n", r"'metrics\.mari\.tau' must be 'auto' or a finite number > 0"),
        (MINIMAL + "[metrics.mari]\ntau = \"sharp\"\n", r"'metrics\.mari\.tau'"),
        (MINIMAL + "[metrics.croma]\nalpha = 1.5\n", r"'metrics\.croma\.alpha' must be a number in \(0, 1\)"),
        (MINIMAL + "[metrics.croma]\nm = 5\n", r"'metrics\.croma\.m' must be a list"),
        (MINIMAL + "[neighbors]\nbackend = \"faiss\"\n", r"'neighbors\.backend' must be one of"),
        (MINIMAL + "[execution]\nretries = true\n", r"'execution\.retries' must be an integer, got True"),
        (MINIMAL + "[execution]\nn_workers = 0\n", r"'execution\.n_workers' must be a positive integer"),
        ("schema_version = 1\njob = 3\n", r"'job' must be a table"),
    ],
)
def test_schema_errors_name_file_and_key(tmp_path, text, match):
    p = write(tmp_path, text)
    with pytest.raises(JobError, match=match) as info:
        load_job(p)
    assert str(p) in str(info.value)


def test_invalid_toml_and_missing_file(tmp_path):
    with pytest.raises(JobError, match=r"not valid TOML"):
        load_job(write(tmp_path, "schema_version = = 1\n"))
    with pytest.raises(FileNotFoundError, match=r"job file not found: .*absent\.toml"):
        load_job(tmp_path / "absent.toml")
    assert issubclass(JobError, ValueError)


def test_typed_values_are_accepted(tmp_path):
    text = MINIMAL + (
        'encoders = ["enc1", "enc0"]\nviews = ["v"]\ndesign = "paired_2x2"\n'
        "[metrics]\nfamilies = [\"croma\"]\n[metrics.mari]\ntau = 0.25\n[metrics.croma]\nm = [1, 5, 20]\nalpha = 0.2\n"
        "[neighbors]\nbackend = \"ann\"\nauto_threshold = 1000\n[execution]\nscheduler = \"tcp://127.0.0.1:8786\"\n"
    )
    job = load_job(write(tmp_path, text))
    assert job.encoders == ("enc1", "enc0") and job.design == "paired_2x2"
    assert job.metrics.families == ("croma",)
    assert job.metrics.family("mari")["tau"] == 0.25 and job.metrics.family("croma")["m"] == [1, 5, 20]
    assert job.neighbors.auto_threshold == 1000 and job.execution.scheduler == "tcp://127.0.0.1:8786"


@pytest.mark.parametrize("name", ["demo.toml", "template.toml"])
def test_shipped_job_files_are_valid(name):
    job = load_job(REPO / "jobs" / name)
    assert job.document["schema_version"] == SCHEMA_VERSION


def test_demo_job_is_self_contained_and_one_file():
    """One demo job: the repository's ``jobs/demo.toml`` links to the package's, which
    ``cachescore demo`` writes out (``cli.DEMO_JOB``)."""
    from cachescore.cli import DEMO_JOB

    job = load_job(REPO / "jobs" / "demo.toml")
    assert job.demo.synthesise is True
    assert set(job.views) == {"centre_all", "centre_paired"}
    assert set(job.metrics.families) == {"ri", "mari", "croma"}
    link = REPO / "jobs" / "demo.toml"
    assert link.is_symlink() and link.resolve() == (REPO / "src" / "cachescore" / "jobs" / "demo.toml").resolve()
    assert DEMO_JOB == link.read_text(encoding="utf-8")
    # its relative paths are the repository's, where the link is named
    assert job.cache == REPO / "demo-cache" and job.store == REPO / "results" / "demo"


def test_relative_paths_resolve_where_a_linked_job_file_is_named(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "here").mkdir()
    target = tmp_path / "real" / "job.toml"
    target.write_text('schema_version = 1\n[job]\nname = "j"\ncache = "c"\nstore = "s"\n', encoding="utf-8")
    (tmp_path / "here" / "job.toml").symlink_to(target)
    job = load_job(tmp_path / "here" / "job.toml")
    assert job.cache == tmp_path / "here" / "c" and job.store == tmp_path / "here" / "s"
    assert load_job(target).cache == tmp_path / "real" / "c"


def test_template_documents_every_key():
    text = (REPO / "jobs" / "template.toml").read_text(encoding="utf-8")
    for section, keys in SCHEMA.items():
        assert f"[{section}]" in text, section
        for name in keys:
            assert f"{name} =" in text, f"{section}.{name} missing from jobs/template.toml"


def test_sections_are_typed_frozen_and_carry_their_keys():
    """Issue 23, part 4: each table is a frozen dataclass whose fields carry the schema's Key; code
    reads attributes; a section pickles and turns back into its table."""
    import dataclasses
    import pickle

    from cachescore.jobs.schema import Cluster, Execution, Neighbors
    from cachescore.jobs.sections import as_dict, key_of

    job = load_job(REPO / "jobs" / "demo.toml")
    for table, section in (("execution", job.execution), ("neighbors", job.neighbors), ("demo", job.demo),
                           ("report", job.report), ("metrics.bootstrap", job.metrics.bootstrap),
                           ("cluster.slurm", job.cluster.slurm), ("cluster.kubernetes", job.cluster.kubernetes)):
        keys = {f.name: f.metadata["key"] for f in dataclasses.fields(section)}
        assert keys == SCHEMA[table], table
        assert as_dict(section) == job.document[table], table
    assert key_of(Execution, "retries").default == 2 and key_of(Neighbors, "backend").check("nope")
    assert job.execution.retries == 1 and job.neighbors.backend == "exact" and job.cluster.kind == "local"
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.execution.retries = 5
    assert pickle.loads(pickle.dumps(job)) == job
    assert dataclasses.replace(job.cluster, kind="slurm").slurm == job.cluster.slurm
    assert Cluster().kubernetes.namespace == "default"  # defaults come from the keys
