"""An index version on disk, never pickled: every file hashed in meta.json and checked on load.

    vNNNN/index.faiss   faiss.write_index format (a GPU index is copied to the CPU first)
    vNNNN/ids.npy       block ids: fixed-width unicode (`<U..`) or int64, `allow_pickle=False`
    vNNNN/meta.json     version, step, n, dim, type, build_seconds, sha256 of the two files, extra

`write_version_dir` writes the files (fsynced, meta.json last: it carries the hashes) into a temp
folder that `replace_dir` renames into place; `read_version_dir` verifies and reads one back.
`faiss_index.BlockIndex.save` / `load` and `IndexStore.publish` use them.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import faiss
import numpy as np

from components.index.build import apply_search_params, index_kind, search_params, to_cpu

if TYPE_CHECKING:
    from components.index.faiss_index import BlockIndex

INDEX_FILE = "index.faiss"
IDS_FILE = "ids.npy"
META_FILE = "meta.json"
TMP_PREFIX = ".tmp-"
FORMAT_VERSION = 1


class IndexIntegrityError(ValueError):
    """A stored index version is incomplete, or a file's sha256 differs from its meta.json."""


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be fsynced
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_bytes(path: Path, data: bytes | memoryview) -> str:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


def write_version_dir(bi: "BlockIndex", folder: Path, extra_meta: dict) -> dict:
    """Write index.faiss, ids.npy, then meta.json (last: it carries the hashes) into `folder`."""
    folder.mkdir(parents=True)
    cpu = to_cpu(bi.index)
    index_bytes = faiss.serialize_index(cpu)  # uint8 array, the faiss.write_index format
    ids_buf = io.BytesIO()
    np.save(ids_buf, bi.ids, allow_pickle=False)
    files = {
        INDEX_FILE: {"sha256": write_bytes(folder / INDEX_FILE, memoryview(index_bytes)), "bytes": int(index_bytes.size)},
        IDS_FILE: {"sha256": write_bytes(folder / IDS_FILE, ids_buf.getbuffer()), "bytes": ids_buf.getbuffer().nbytes},
    }
    meta = {
        **{k: v for k, v in bi.meta.items() if k not in ("files",)},
        "format": FORMAT_VERSION,
        "n": len(bi),
        "dim": bi.dim,
        "type": index_kind(cpu),
        "search_params": search_params(cpu),
        "ids_dtype": str(bi.ids.dtype),
        "faiss_version": faiss.__version__,
        "created_unix": round(time.time(), 3),
        "extra": {**bi.meta.get("extra", {}), **extra_meta},
        "files": files,
    }
    write_bytes(folder / META_FILE, json.dumps(meta, indent=2, sort_keys=True).encode())
    fsync_dir(folder)
    return meta


def replace_dir(src: Path, dst: Path) -> None:
    """os.replace for a directory: atomic on POSIX when `dst` is absent or an empty directory."""
    try:
        os.replace(src, dst)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise FileExistsError(f"{dst} already exists and is not empty") from None
        raise
    fsync_dir(dst.parent)


def read_version_dir(folder: Path, verify: bool = True) -> tuple[faiss.Index, np.ndarray, dict]:
    """(faiss index on the CPU, ids, meta) of a version folder; with `verify`, every file's sha256
    must match meta.json."""
    meta_path = folder / META_FILE
    if not meta_path.is_file():
        raise IndexIntegrityError(f"{folder}: no {META_FILE} (incomplete or not an index folder)")
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    blobs = {}
    for name in (INDEX_FILE, IDS_FILE):
        path = folder / name
        if not path.is_file():
            raise IndexIntegrityError(f"{folder}: missing {name}")
        # Hash exactly the bytes we deserialize (no window between check and read).
        blobs[name] = path.read_bytes()
        if verify:
            want = meta.get("files", {}).get(name, {}).get("sha256")
            got = hashlib.sha256(blobs[name]).hexdigest()
            if want != got:
                raise IndexIntegrityError(f"{path}: sha256 {got} != {want} recorded in {META_FILE}")
    index = faiss.deserialize_index(np.frombuffer(blobs.pop(INDEX_FILE), dtype=np.uint8))
    apply_search_params(index, meta.get("search_params", {}))
    ids = np.load(io.BytesIO(blobs.pop(IDS_FILE)), allow_pickle=False)
    if index.ntotal != meta.get("n") or index.d != meta.get("dim") or len(ids) != index.ntotal:
        raise IndexIntegrityError(
            f"{folder}: meta says n={meta.get('n')} dim={meta.get('dim')}, files hold "
            f"n={index.ntotal} dim={index.d} ids={len(ids)}"
        )
    return index, ids, meta
