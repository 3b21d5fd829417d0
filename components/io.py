"""Persistence: atomic file and folder writes, sha256 manifests, digests; S3 access through boto3.

Nothing half-written is ever visible under a final name: files are written to a temp sibling,
fsynced and `os.replace`d; folders are built in a temp sibling, fsynced and swapped in
(`atomic_dir`, or `begin_dir` / `commit_dir` when several processes fill one folder). A folder
that must prove its files intact on load carries a manifest, `meta.json`, written last:

    {..., "files": {"<name>": {"sha256": "<hex>", "bytes": <size>}, ...}}

`write_manifest` writes it; `verify_manifest` checks every listed file against it
(`ManifestError`). Checkpoints and index versions are such folders.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Iterable, Iterator, Mapping

MANIFEST = "meta.json"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"


# ----------------------------------------------------------------------------------------------
# files
# ----------------------------------------------------------------------------------------------
LOW_SPACE_BYTES = 256 * 2**20  # a write that fails with less than this free on its device blames the disk


@contextlib.contextmanager
def explain_full_disk(folder: str | os.PathLike, what: str) -> Iterator[None]:
    """Re-raise a write under `folder` that failed on a (nearly) full device as ENOSPC naming the
    folder, the free space and the way out: torch.save's zip writer reports a full disk only as
    "unexpected pos ... iostream error". Any other failure propagates unchanged."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        try:
            free = shutil.disk_usage(folder).free
        except OSError:
            raise e from None
        if getattr(e, "errno", None) != errno.ENOSPC and free >= LOW_SPACE_BYTES:
            raise
        raise OSError(errno.ENOSPC, f"{what}: no space left under {folder} ({free / 2**20:.0f} MiB free). Free space on "
                      "that disk (old clones, `dvc gc`, other runs' checkpoints/), then rerun the same command: training "
                      "resumes from the last complete checkpoint, and the half-written one is removed") from e


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new entry in `path` durable."""
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be fsynced
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_file(path: str | os.PathLike, data: bytes | memoryview) -> dict:
    """Write and fsync `data` in place; returns its manifest entry. Only for a folder that is not
    visible yet (the temp folder of `atomic_dir` / `begin_dir`): elsewhere use `write_bytes_atomic`."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": memoryview(data).nbytes}


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{path.name}.", dir=path.parent)
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
    fsync_dir(path.parent)
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike, obj: object, *, sort_keys: bool = True) -> Path:
    """`sort_keys=False` keeps the insertion order (a report whose key order is its reading order)."""
    return write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=sort_keys, ensure_ascii=False) + "\n")


def write_jsonl_atomic(path: str | os.PathLike, rows: list[dict]) -> Path:
    return write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


# ----------------------------------------------------------------------------------------------
# folders
# ----------------------------------------------------------------------------------------------
def begin_dir(target: str | os.PathLike, *, unique: bool = True) -> Path:
    """An empty temp sibling of `target` to build it in (`commit_dir` swaps it in), after removing
    what a killed write of `target` left. `unique=False` names it `.tmp-<name>`, a name other
    processes can compute (a checkpoint that every rank writes into; an index version)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in [temp_sibling(target), *target.parent.glob(f"{TMP_PREFIX}{target.name}-*"),
                  *target.parent.glob(f"{OLD_PREFIX}{target.name}-*")]:  # fmt: skip
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
    tmp = (target.parent / f"{TMP_PREFIX}{target.name}-{uuid.uuid4().hex[:8]}") if unique else temp_sibling(target)
    tmp.mkdir()
    return tmp


def temp_sibling(target: str | os.PathLike) -> Path:
    """`begin_dir(target, unique=False)`'s folder."""
    return Path(target).parent / f"{TMP_PREFIX}{Path(target).name}"


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        fsync_dir(dirpath)


def commit_dir(tmp: str | os.PathLike, target: str | os.PathLike, *, replace: bool = True) -> Path:
    """fsync everything under `tmp`, then rename it to `target`.

    rename(2) cannot replace a non-empty folder, so with `replace` an existing `target` is first
    renamed aside and deleted after: a crash leaves the old or the new folder under `target` (plus
    a `.old-*` leftover that the next write removes), never a mixture. Without `replace` (an index
    version, never rewritten) an existing non-empty `target` is a `FileExistsError`.
    """
    tmp, target = Path(tmp), Path(target)
    _fsync_tree(tmp)
    old = _move_aside(target) if replace and target.exists() else None
    try:
        os.replace(tmp, target)
    except OSError as e:
        if old is not None:
            os.replace(old, target)
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise FileExistsError(f"{target} already exists and is not empty") from None
        raise
    fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return target


def _move_aside(path: Path) -> Path:
    old = path.parent / f"{OLD_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}"
    os.replace(path, old)
    return old


def remove_dir(path: str | os.PathLike) -> None:
    """Delete a folder; renamed aside first, so a crash never leaves a half-deleted one under its
    name (only a `.old-*` leftover, which `remove_leftovers` or the next write of that name removes)."""
    shutil.rmtree(_move_aside(Path(path)), ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike, *, replace: bool = True, unique: bool = True) -> Iterator[Path]:
    """Build a folder in a temp sibling; on success swap it in for `target` (`commit_dir`), on
    error delete it."""
    tmp = begin_dir(target, unique=unique)
    try:
        yield tmp
        commit_dir(tmp, target, replace=replace)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_leftovers(root: str | os.PathLike) -> list[Path]:
    """Delete the `.tmp-*` / `.old-*` entries under `root` that killed writes left (call only when
    no write into `root` is in flight). Returns what was removed."""
    root = Path(root)
    if not root.is_dir():
        return []
    removed = sorted(p for p in root.iterdir() if p.name.startswith((TMP_PREFIX, OLD_PREFIX)))
    for p in removed:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return removed


# ----------------------------------------------------------------------------------------------
# manifests
# ----------------------------------------------------------------------------------------------
class ManifestError(ValueError):
    """A folder's manifest is missing or malformed, or a file differs from its entry."""


def file_entry(path: str | os.PathLike) -> dict:
    """The manifest entry of a file already on disk."""
    return {"sha256": file_digest(path, "sha256"), "bytes": os.path.getsize(path)}


def write_manifest(folder: str | os.PathLike, meta: Mapping, files: Mapping[str, dict] | None = None) -> dict:
    """Write `folder/meta.json`: `meta` plus `files`, the entry of every other file (hashed here
    from disk when not given, e.g. by `write_file` as it wrote them). Written last and fsynced: a
    folder with a manifest is complete. Returns what was written."""
    folder = Path(folder)
    if files is None:
        files = {p.name: file_entry(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    out = {**meta, "files": dict(files)}
    write_file(folder / MANIFEST, json.dumps(out, indent=2, sort_keys=True).encode())
    fsync_dir(folder)
    return out


def read_manifest(folder: str | os.PathLike) -> dict:
    """`folder/meta.json`, unverified."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise ManifestError(f"{folder}: no {MANIFEST} (an incomplete write, as it comes last, or not such a folder)")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{folder}: {MANIFEST} is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ManifestError(f"{folder}: {MANIFEST} is not a JSON object")
    return meta


def verify_manifest(folder: str | os.PathLike, meta: dict | None = None, *, required: Iterable[str] = (),
                    blobs: Mapping[str, bytes] | None = None) -> dict:  # fmt: skip
    """Check that every file `meta` (default: `read_manifest(folder)`) lists is in `folder` with its
    recorded size and sha256, and that it lists each of `required`. A file in `blobs` (name ->
    the bytes the caller already read) is checked by those bytes, so what is verified is exactly
    what the caller parses. Returns `meta`."""
    folder = Path(folder)
    meta = read_manifest(folder) if meta is None else meta
    files = meta.get("files")
    if not isinstance(files, dict):
        raise ManifestError(f"{folder}: {MANIFEST} has no \"files\" table")
    for name in required:
        if name not in files:
            raise ManifestError(f"{folder}: {MANIFEST} lists no {name}")
    for name, entry in files.items():
        if Path(name).name != name or name in (".", ".."):  # a manifest must not point outside its folder
            raise ManifestError(f"{folder}: {MANIFEST} lists a file outside the folder: {name!r}")
        if not isinstance(entry, dict) or not {"sha256", "bytes"} <= entry.keys():
            raise ManifestError(f"{folder}: {MANIFEST} entry of {name} is not {{sha256, bytes}}: {entry!r}")
        path, data = folder / name, (blobs or {}).get(name)
        if data is None and not path.is_file():
            raise ManifestError(f"{folder}: {name} is missing")
        size = len(data) if data is not None else path.stat().st_size
        digest = hashlib.sha256(data).hexdigest() if data is not None else file_digest(path, "sha256")
        if size != entry["bytes"] or digest != entry["sha256"]:
            raise ManifestError(f"{folder}: {name} does not match its sha256 in {MANIFEST} "
                                f"({size} bytes, {entry['bytes']} recorded: truncated or modified)")  # fmt: skip
    return meta


# ----------------------------------------------------------------------------------------------
# digests
# ----------------------------------------------------------------------------------------------
def file_digest(path: str | os.PathLike, algo: str = "md5") -> str:
    h = hashlib.new(algo)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tree_digest(root: str | os.PathLike, algo: str = "md5", pattern: str = "*") -> tuple[str, int, int]:
    """(digest, n_files, total_bytes) over every file under `root` whose name matches `pattern`,
    in sorted path order."""
    root = Path(root)
    h = hashlib.new(algo)
    n = size = 0
    files = [root] if root.is_file() else sorted(p for p in root.rglob(pattern) if p.is_file())
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


DEFAULT_S3_ATTEMPTS = 5


def s3_max_attempts() -> int:
    """Attempts per S3 call, the first one included: $AWS_MAX_ATTEMPTS (the AWS SDKs' own variable,
    with the same meaning) if set, else 5."""
    raw = os.environ.get("AWS_MAX_ATTEMPTS", "").strip()
    if not raw:
        return DEFAULT_S3_ATTEMPTS
    try:
        attempts = int(raw)
    except ValueError:
        attempts = 0
    if attempts < 1:
        raise ValueError(f"AWS_MAX_ATTEMPTS={raw!r}: expected a whole number of attempts per S3 call "
                         f"(1 = no retry), or unset it for {DEFAULT_S3_ATTEMPTS}")
    return attempts


def s3_client(endpoint_url: str | None = None, max_attempts: int | None = None, connect_timeout: float = 5.0,
              read_timeout: float = 30.0):
    """A boto3 S3 client. Endpoint: the argument, else $AWS_ENDPOINT_URL(_S3), else AWS.
    Attempts per call, the first one included: the argument, else `s3_max_attempts()`.

    Credentials come only from the environment / standard AWS config, never from params.
    """
    import boto3
    from botocore.config import Config

    endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    cfg = Config(
        # Standard mode: exponential backoff with jitter, each wait capped at 20 s. botocore's own
        # `max_attempts` key counts retries only; `total_max_attempts` counts as AWS_MAX_ATTEMPTS does.
        retries={"total_max_attempts": max_attempts or s3_max_attempts(), "mode": "standard"},
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
