"""An index version on disk, never pickled: every file hashed in meta.json and checked on load.

    vNNNN/index.faiss   faiss.write_index format (a GPU index is copied to the CPU first)
    vNNNN/ids.npy       block ids: fixed-width unicode (`<U..`) or int64, `allow_pickle=False`
    vNNNN/meta.json     version, step, n, dim, type, build_seconds, sha256 and size of the two files, extra

`write_version_dir` writes the files (fsynced, meta.json last: it carries the hashes) into the temp
folder of a `components.io.atomic_dir`; `read_version_dir` verifies and reads one back. The folder
and the manifest are `components.io`'s. `faiss_index.BlockIndex.save` / `load` and
`IndexStore.publish` use them.
"""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import TYPE_CHECKING

import faiss
import numpy as np

from components.index.build import apply_search_params, index_kind, search_params, to_cpu
from components.io import MANIFEST, ManifestError, read_manifest, verify_manifest, write_file, write_manifest

if TYPE_CHECKING:
    from components.index.faiss_index import BlockIndex

INDEX_FILE = "index.faiss"
IDS_FILE = "ids.npy"
META_FILE = MANIFEST
FORMAT_VERSION = 1


class IndexIntegrityError(ValueError):
    """A stored index version is incomplete, or a file's sha256 differs from its meta.json."""


def write_version_dir(bi: "BlockIndex", folder: Path, extra_meta: dict) -> dict:
    """Write index.faiss, ids.npy, then meta.json (last: it carries the hashes) into the empty `folder`."""
    cpu = to_cpu(bi.index)
    index_bytes = faiss.serialize_index(cpu)  # uint8 array, the faiss.write_index format
    ids_buf = io.BytesIO()
    np.save(ids_buf, bi.ids, allow_pickle=False)
    files = {  # hashed as written, not read back
        INDEX_FILE: write_file(folder / INDEX_FILE, memoryview(index_bytes)),
        IDS_FILE: write_file(folder / IDS_FILE, ids_buf.getbuffer()),
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
    }
    return write_manifest(folder, meta, files)


def read_version_dir(folder: Path, verify: bool = True) -> tuple[faiss.Index, np.ndarray, dict]:
    """(faiss index on the CPU, ids, meta) of a version folder; with `verify`, every file's sha256
    must match meta.json."""
    try:
        meta = read_manifest(folder)
        blobs = {}
        for name in (INDEX_FILE, IDS_FILE):
            path = folder / name
            if not path.is_file():
                raise IndexIntegrityError(f"{folder}: missing {name}")
            blobs[name] = path.read_bytes()
        if verify:  # hashes exactly the bytes deserialized below: no window between check and read
            verify_manifest(folder, meta, required=(INDEX_FILE, IDS_FILE), blobs=blobs)
    except ManifestError as e:
        raise IndexIntegrityError(str(e)) from None
    index = faiss.deserialize_index(np.frombuffer(blobs.pop(INDEX_FILE), dtype=np.uint8))
    apply_search_params(index, meta.get("search_params", {}))
    ids = np.load(io.BytesIO(blobs.pop(IDS_FILE)), allow_pickle=False)
    if index.ntotal != meta.get("n") or index.d != meta.get("dim") or len(ids) != index.ntotal:
        raise IndexIntegrityError(
            f"{folder}: meta says n={meta.get('n')} dim={meta.get('dim')}, files hold "
            f"n={index.ntotal} dim={index.d} ids={len(ids)}"
        )
    return index, ids, meta
