"""The content behind `data.path` as one digest: the input that makes `prepare_corpus` rerun when
the corpus changes, local or on S3.

    python -m components.data.source_digest      # dvc.yaml's `source` stage -> data/source.json

`data.path` is a param, so `dvc.yaml` cannot name it as a dependency itself (and the default
synthetic source has no path). The `source` stage is `always_changed`: DVC runs it before every
`dvc repro`, it rewrites `data/source.json` byte for byte the same while the content is the same,
and `prepare_corpus` depends on that file, so DVC reruns `prepare_corpus` (and what follows)
exactly when the digest changes. What the digest covers:

    a local file      sha256 of its bytes
    a local folder    sha256 over every file's relative path and sha256 (a BEIR folder, an HF save_to_disk)
    s3://bucket/pfx   every object's key, size and ETag under the prefix (one listing, no download)
    synthetic         nothing: the world is made from `data.synthetic` and code, both prepare_corpus deps
    an HF hub name    the name only (a hub dataset can change under it: save it to disk to pin it)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from components.config import load_params
from components.config_stages import DataParams
from components.data.errors import DataError
from components.io import parse_s3_uri, s3_client, tree_digest, write_text_atomic

SOURCE_DIGEST = Path("data/source.json")


def _s3_listing_digest(uri: str, endpoint_url: str | None) -> tuple[str, int, int]:
    client = s3_client(endpoint_url)
    bucket, prefix = parse_s3_uri(uri)
    h, n, size = hashlib.sha256(), 0, 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in sorted(page.get("Contents", []), key=lambda o: o["Key"]):
            if obj["Key"].endswith("/"):
                continue
            h.update(f"{obj['Key']}\0{obj['Size']}\0{obj['ETag']}\n".encode())
            n, size = n + 1, size + obj["Size"]
    if not n:
        raise DataError(uri, "no objects under this prefix", fix="check data.path and data.s3_endpoint_url / AWS_ENDPOINT_URL")
    return h.hexdigest(), n, size


def source_digest(p: DataParams) -> dict:
    """{source, path, digest, files, bytes} for the content behind `data.path` (see the module doc)."""
    card: dict = {"source": p.source, "path": p.path}
    if p.source == "synthetic":
        return card
    if p.path.startswith("s3://"):
        digest, n, size = _s3_listing_digest(p.path, p.s3_endpoint_url)
        return {**card, "digest": digest, "files": n, "bytes": size, "kind": "s3 key+size+etag"}
    path = Path(p.path)
    if not path.exists():
        if p.source == "hf":
            return {**card, "kind": "hub name"}
        raise DataError(path, "not found", fix="check data.path in params.yaml (paths are relative to the repo root)")
    digest, n, size = tree_digest(path, "sha256")
    return {**card, "digest": digest, "files": n, "bytes": size, "kind": "sha256"}


def main() -> None:
    card = source_digest(load_params().data)
    write_text_atomic(SOURCE_DIGEST, json.dumps(card, indent=2, sort_keys=True) + "\n")
    print(f"{SOURCE_DIGEST}: {card.get('digest', '-')} ({card.get('files', 0)} file(s) behind {card['path'] or card['source']})")


if __name__ == "__main__":
    main()
