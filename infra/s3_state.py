"""Buckets and a durable snapshot for the local S3 endpoint (moto_server).

moto_server keeps every object in memory, so a restart would lose the DVC remote and the MLflow
artifacts. `infra/servers.sh down` (and the test fixtures' `stop()`) therefore copy every bucket
to a folder first, and `up`/`start()` copy it back. A crash (SIGKILL) loses what changed since the
last snapshot; use MinIO (`infra/compose.yaml`) when you need a store that survives crashes.

    python infra/s3_state.py wait     --endpoint http://127.0.0.1:9000 [--timeout 15]
    python infra/s3_state.py init     --endpoint http://127.0.0.1:9000 --bucket retro-realm-dvc ... [--dir SNAPSHOT]
    python infra/s3_state.py snapshot --endpoint http://127.0.0.1:9000 --dir .servers/s3/snapshot
    python infra/s3_state.py restore  --endpoint http://127.0.0.1:9000 --dir .servers/s3/snapshot

Credentials come from the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY; moto accepts
any value, `infra/env.sh` suggests `testing`). Only stdlib + boto3; no pickles: the snapshot is
plain files plus a JSON manifest (object keys are never used as file paths).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

MANIFEST = "manifest.json"
DEFAULT_BUCKETS = ("retro-realm-dvc", "retro-realm-mlflow", "retro-realm-data")


def s3_client(endpoint: str, access_key: str | None = None, secret_key: str | None = None):
    """A boto3 S3 client for `endpoint`; keys default to the environment's (boto3's chain)."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        region_name=os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
        # Path-style: bucket names never become DNS names of 127.0.0.1.
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 3, "mode": "standard"}),
    )


def wait_ready(endpoint: str, timeout: float = 15.0) -> None:
    """Block until moto answers its own API (no S3 credentials needed); raise TimeoutError."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(endpoint.rstrip("/") + "/moto-api/", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError) as e:  # not listening yet
            last = e
        time.sleep(0.05)
    raise TimeoutError(f"S3 endpoint {endpoint} did not answer within {timeout}s ({last})")


def ensure_buckets(client, buckets) -> list[str]:
    """Create each bucket unless it exists; return the ones created."""
    existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    created = []
    for name in buckets:
        if name not in existing:
            region = client.meta.region_name
            extra = {} if region in (None, "us-east-1") else {"CreateBucketConfiguration": {"LocationConstraint": region}}
            client.create_bucket(Bucket=name, **extra)
            created.append(name)
    return created


# Objects are copied by this many threads at once: each copy is one request to a local endpoint, so a
# sequential loop waits on round trips (~14 ms an object against moto: 8 s for 600), not on bandwidth.
COPY_THREADS = 8


def _each(fn, jobs: list, threads: int) -> None:
    """fn(*job) for every job on `threads` threads (boto3 clients are thread-safe); the first error
    is raised once every job has finished or failed."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, threads)) as pool:
        for future in [pool.submit(fn, *job) for job in jobs]:
            future.result()


# Up to this size an object is one GET / PUT; above it, boto3's transfer manager (ranged GETs,
# multipart PUTs), whose per-call set-up costs more than a small object's whole copy.
SINGLE_REQUEST_BYTES = 8 * 1024 * 1024


def _get(client, bucket: str, key: str, size: int, path: str) -> None:
    if size > SINGLE_REQUEST_BYTES:
        client.download_file(bucket, key, path)
        return
    with open(path, "wb") as f:
        shutil.copyfileobj(client.get_object(Bucket=bucket, Key=key)["Body"], f)


def _put(client, path: str, bucket: str, key: str) -> None:
    if os.path.getsize(path) > SINGLE_REQUEST_BYTES:
        client.upload_file(path, bucket, key)
        return
    with open(path, "rb") as f:
        client.put_object(Bucket=bucket, Key=key, Body=f)


def snapshot(client, folder: str | os.PathLike, threads: int = COPY_THREADS) -> int:
    """Copy every object of every bucket into `folder` (atomically replaced); return the count."""
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "objects").mkdir(parents=True)
    manifest: dict = {"buckets": {}}
    jobs = []
    for bucket in sorted(b["Name"] for b in client.list_buckets().get("Buckets", [])):
        entries = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for obj in page.get("Contents", []):
                # Files are numbered: an object key ("../x", "a/", "a/b/") is never a safe path.
                fname = f"{len(jobs):08d}"
                jobs.append((bucket, obj["Key"], obj["Size"], str(tmp / "objects" / fname)))
                entries.append({"key": obj["Key"], "file": fname})
        manifest["buckets"][bucket] = entries
    _each(lambda *job: _get(client, *job), jobs, threads)
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    old = folder.with_name(folder.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)
    return len(jobs)


def restore(client, folder: str | os.PathLike, threads: int = COPY_THREADS) -> int:
    """Recreate the buckets and objects of a snapshot; return the object count (0 if none)."""
    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        return 0
    manifest = json.loads((folder / MANIFEST).read_text())
    ensure_buckets(client, manifest["buckets"])
    jobs = [(str(folder / "objects" / e["file"]), bucket, e["key"]) for bucket, entries in manifest["buckets"].items()
            for e in entries]
    _each(lambda *job: _put(client, *job), jobs, threads)
    return len(jobs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("action", choices=["wait", "init", "snapshot", "restore"])
    ap.add_argument("--endpoint", default=os.environ.get("AWS_ENDPOINT_URL", "http://127.0.0.1:9000"))
    ap.add_argument("--bucket", action="append", default=[], help="repeatable; init only")
    ap.add_argument("--dir", help="snapshot folder (snapshot/restore; init restores it first when given)")
    ap.add_argument("--timeout", type=float, default=15.0)
    a = ap.parse_args(argv)
    if a.action == "wait":
        wait_ready(a.endpoint, a.timeout)
        return 0
    client = s3_client(a.endpoint)
    if a.action == "init":
        if a.dir:
            print(f"[s3] restore: {restore(client, a.dir)} objects <- {a.dir}")
        created = ensure_buckets(client, a.bucket or DEFAULT_BUCKETS)
        print(f"[s3] buckets {', '.join(a.bucket or DEFAULT_BUCKETS)} ready (created: {', '.join(created) or 'none'})")
    elif not a.dir:
        ap.error(f"{a.action} needs --dir")
    elif a.action == "snapshot":
        print(f"[s3] snapshot: {snapshot(client, a.dir)} objects -> {a.dir}")
    else:
        print(f"[s3] restore: {restore(client, a.dir)} objects <- {a.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
