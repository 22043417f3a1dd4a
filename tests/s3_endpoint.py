"""A real S3 HTTP endpoint on 127.0.0.1 for tests: moto's standalone server (what s3fs's own
test suite uses), with request signing enforced, and s3fs as the client.

:func:`start_endpoint` starts one server per test session; an IAM user with an access key is
created while the server still accepts unsigned requests, then authentication is switched on
(moto's ``/moto-api/reset-auth``), so a wrong secret is refused as on AWS. :func:`s3_env` points
the process (and the Dask workers it starts, which inherit the environment) at it.
"""

from __future__ import annotations

import json
import os
import urllib.request
import uuid
from contextlib import contextmanager
from dataclasses import dataclass

ENV_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION",
            "AWS_SESSION_TOKEN", "AWS_PROFILE")


@dataclass(frozen=True)
class Endpoint:
    url: str
    key: str
    secret: str


def missing_reason() -> str | None:
    """Why the S3 tests cannot run here (a package missing), or None."""
    try:
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
        import upath  # noqa: F401
    except ImportError as exc:
        return f"S3 tests need moto[server], s3fs and universal_pathlib (pip install -e '.[test]'): {exc}"
    return None


def start_endpoint():
    """``(server, Endpoint)``: a moto server on a free port of 127.0.0.1 with one IAM user."""
    import boto3
    from moto.server import ThreadedMotoServer

    import logging

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    iam = boto3.client("iam", endpoint_url=url, region_name="us-east-1", aws_access_key_id="setup",
                       aws_secret_access_key="setup")
    iam.create_user(UserName="cachescore-test")
    policy = iam.create_policy(PolicyName="s3-all", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
    iam.attach_user_policy(UserName="cachescore-test", PolicyArn=policy["Policy"]["Arn"])
    key = iam.create_access_key(UserName="cachescore-test")["AccessKey"]
    return server, Endpoint(url=url, key=key["AccessKeyId"], secret=key["SecretAccessKey"])


def _reset_auth(endpoint: Endpoint, count: bytes) -> None:
    req = urllib.request.Request(f"{endpoint.url}/moto-api/reset-auth", data=count, method="POST",
                                 headers={"Content-Type": "application/octet-stream"})
    urllib.request.urlopen(req, timeout=10).read()


@contextmanager
def enforced_auth(endpoint: Endpoint):
    """Inside the block every request must be signed by a known key (as on AWS)."""
    _reset_auth(endpoint, b"0")
    try:
        yield
    finally:
        _reset_auth(endpoint, b"inf")


def s3_env(monkeypatch, endpoint: Endpoint) -> None:
    """Point this process (and processes it starts) at ``endpoint`` with the IAM user's key."""
    for name, value in env_for(endpoint).items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    fresh_listings()


def env_for(endpoint: Endpoint, *, secret: str | None = None) -> dict:
    """The environment variables that point a process at ``endpoint`` (``secret`` overrides the key's)."""
    return {"AWS_ACCESS_KEY_ID": endpoint.key, "AWS_SECRET_ACCESS_KEY": endpoint.secret if secret is None else secret,
            "AWS_ENDPOINT_URL": endpoint.url, "AWS_DEFAULT_REGION": "us-east-1"}


def fresh_listings() -> None:
    """Forget the listings the process's S3 file system cached (objects changed behind it). The
    file system itself is kept: dropping it leaves its HTTP session to the garbage collector,
    which warns (a ResourceWarning at a random later test). A test that needs other credentials
    runs a subprocess with :func:`env_for`."""
    import s3fs

    s3fs.S3FileSystem().invalidate_cache()


def new_bucket() -> str:
    """Create a bucket with a unique name (credentials from the environment); return its name."""
    import s3fs

    name = f"cachescore-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem().mkdir(name)
    return name


def upload_folder(local, url: str) -> None:
    """Copy a local cache folder to ``url`` (what ``aws s3 sync`` would do)."""
    import fsspec

    fs, base = fsspec.core.url_to_fs(url)
    for root, _dirs, files in os.walk(local):
        for name in files:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, local).replace(os.sep, "/")
            fs.put_file(path, f"{base}/{rel}")
