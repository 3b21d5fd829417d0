"""Atomic file and folder writes, digests, and S3 access through boto3.

Nothing half-written is ever visible under a final name: files are written to a temp sibling and
`os.replace`d; folders are built in a temp sibling and swapped in (`atomic_dir`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Iterator


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes 0600; outputs are meant to be shared/readable
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike, obj: object) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def write_jsonl_atomic(path: str | os.PathLike, rows: list[dict]) -> Path:
    return write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike) -> Iterator[Path]:
    """Build a folder in a temp sibling; on success swap it in for `target`, on error delete it.

    rename(2) cannot replace a non-empty folder, so the old one is first renamed aside and then
    deleted: a crash leaves either the old or the new folder under `target` (plus a `.old-*`
    leftover that the next run removes), never a mixture.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".tmp-{target.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in target.parent.glob(f".old-{target.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = target.parent / f".tmp-{target.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if target.exists():
        old = target.parent / f".old-{target.name}-{uuid.uuid4().hex[:8]}"
        os.replace(target, old)
    os.replace(tmp, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def file_digest(path: str | os.PathLike, algo: str = "md5") -> str:
    h = hashlib.new(algo)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tree_digest(root: str | os.PathLike, algo: str = "md5") -> tuple[str, int, int]:
    """(digest, n_files, total_bytes) over every file under `root`, in sorted path order."""
    root = Path(root)
    h = hashlib.new(algo)
    n = size = 0
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    for p in files:
        rel = p.name if root.is_file() else p.relative_to(root).as_posix()
        h.update(rel.encode() + b"\0" + file_digest(p, algo).encode() + b"\n")
        n += 1
        size += p.stat().st_size
    return h.hexdigest(), n, size


# ----------------------------------------------------------------------------------------------
# S3 (boto3). Retries use botocore's own retry modes, never a hand-written loop.
# ----------------------------------------------------------------------------------------------
def parse_s3_uri(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://"):
        raise ValueError(f"{uri!r} is not an s3:// URI")
    bucket, _, prefix = uri[5:].partition("/")
    if not bucket:
        raise ValueError(f"{uri!r} names no bucket (expected s3://bucket/prefix)")
    return bucket, prefix


def s3_client(endpoint_url: str | None = None, max_attempts: int = 5, connect_timeout: float = 5.0, read_timeout: float = 30.0):
    """A boto3 S3 client. Endpoint: the argument, else $AWS_ENDPOINT_URL(_S3), else AWS.

    Credentials come only from the environment / standard AWS config, never from params.
    """
    import boto3
    from botocore.config import Config

    endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    cfg = Config(
        retries={"max_attempts": max_attempts, "mode": "standard"},  # exponential backoff with jitter
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        s3={"addressing_style": "path"},
    )
    return boto3.client("s3", endpoint_url=endpoint_url, config=cfg)


class S3Error(RuntimeError):
    """An S3 call failed after boto3's retries. Names the bucket/key and the endpoint."""


def _s3_fail(client, op: str, bucket: str, key: str, err: Exception) -> S3Error:
    endpoint = getattr(getattr(client, "meta", None), "endpoint_url", "?")
    return S3Error(f"S3 {op} s3://{bucket}/{key} at endpoint {endpoint} failed after retries: {err}")


def s3_download_prefix(uri: str, dest: str | os.PathLike, endpoint_url: str | None = None, client=None) -> list[Path]:
    """Download every object under `s3://bucket/prefix` into `dest`, keeping relative paths."""
    from boto3.exceptions import Boto3Error
    from botocore.exceptions import BotoCoreError, ClientError

    client = client or s3_client(endpoint_url)
    bucket, prefix = parse_s3_uri(uri)
    dest = Path(dest)
    out: list[Path] = []
    key = prefix
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                key = obj["Key"]
                if key.endswith("/"):
                    continue
                rel = key[len(prefix):].lstrip("/") if prefix and key != prefix else Path(key).name
                local = dest / rel
                local.parent.mkdir(parents=True, exist_ok=True)
                client.download_file(bucket, key, str(local))
                out.append(local)
    except (BotoCoreError, ClientError, Boto3Error) as e:  # Boto3Error: the transfer manager's wrappers
        raise _s3_fail(client, "download", bucket, key, e) from None
    if not out:
        raise S3Error(f"s3://{bucket}/{prefix}: no objects under this prefix (endpoint {client.meta.endpoint_url})")
    return sorted(out)


def s3_upload_file(path: str | os.PathLike, uri: str, endpoint_url: str | None = None, client=None) -> str:
    """Upload one file. S3 PUTs are atomic per object: a failed upload leaves no partial object.

    A file over the transfer manager's multipart threshold (8 MiB) goes up in parts; the object
    appears only when the upload completes (a failed upload is aborted; a killed process leaves
    invisible parts that a bucket lifecycle rule `AbortIncompleteMultipartUpload` reclaims).
    """
    from boto3.exceptions import Boto3Error
    from botocore.exceptions import BotoCoreError, ClientError

    client = client or s3_client(endpoint_url)
    bucket, key = parse_s3_uri(uri)
    try:
        client.upload_file(str(path), bucket, key)
    except (BotoCoreError, ClientError, Boto3Error) as e:  # upload_file wraps ClientError in S3UploadFailedError
        raise _s3_fail(client, "upload", bucket, key, e) from None
    return uri
