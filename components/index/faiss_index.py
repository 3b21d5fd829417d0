"""Maximum inner product search (MIPS) over block embeddings: REALM's `retriever` index and dense eval.

* `BlockIndex`: a faiss index (built by `build.build_index`, inner product everywhere) plus the
  row -> block id mapping; `search(q, k)` returns `(scores (B, k) float32, rows (B, k) int64)` and
  `ids_for(rows)` maps rows to block ids. Treated as immutable once built, so any number of
  threads may search it while a new one is built.
* `IndexStore(root)`: versions on disk (`root/v0001/`, `root/v0002/`, ...) behind a `CURRENT`
  pointer, plus the in-memory current index that the training loop swaps at a step boundary.

One version on disk (never pickled; every file hashed in meta.json, checked on load) is
`index_files.py`'s.

Try it:
    .venv/bin/python -c "import numpy as np; from components.index.faiss_index import BlockIndex; \
x = np.random.rand(1000, 32).astype('float32'); bi = BlockIndex.build(x, index_type='hnsw'); \
print(bi.search(x[:2], 3))"
"""
from __future__ import annotations

import contextlib
import copy
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import faiss
import numpy as np

from components.index import index_files as files
from components.index.build import IndexType, UseGpu, as_matrix, build_index, index_kind, is_gpu_index, to_cpu, to_gpu, want_gpu
from components.index.index_files import META_FILE, IndexIntegrityError
from components.io import atomic_dir, remove_dir, remove_leftovers, write_text_atomic

try:  # POSIX only; used to keep two *processes* from publishing the same version number.
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

CURRENT_FILE = "CURRENT"
_VERSION_DIR = re.compile(r"^v(\d{4,})$")


# ----------------------------------------------------------------------------------------------
# block index: faiss index + row -> block id
# ----------------------------------------------------------------------------------------------
def _as_ids(ids: Sequence[str] | Sequence[int] | np.ndarray | None, n: int) -> np.ndarray:
    """Block ids as a pickle-free array: fixed-width unicode for strings, int64 for ints."""
    if ids is None:
        return np.arange(n, dtype=np.int64)
    arr = np.asarray(ids)
    if arr.dtype == object:  # e.g. a list mixing str subclasses; np.save would need pickle
        arr = np.asarray([str(i) for i in ids])
    if arr.dtype.kind in "iu":
        arr = arr.astype(np.int64)
    elif arr.dtype.kind != "U":
        raise TypeError(f"block ids must be str or int, got dtype {arr.dtype}")
    if arr.shape != (n,):
        raise ValueError(f"need one id per embedding row: {n} rows, ids shape {arr.shape}")
    return arr


class BlockIndex:
    """A faiss inner-product index over N blocks plus their ids (row i <-> ids[i]).

    Immutable after construction (`with_meta` returns a shallow copy), so a reader holding a
    reference keeps a complete index even while the store swaps in the next version.
    """

    def __init__(self, index: faiss.Index, ids: Sequence | np.ndarray | None = None, meta: dict | None = None):
        self.index = index
        self.ids = _as_ids(ids, index.ntotal)
        self.meta: dict[str, Any] = dict(meta or {})
        self.meta.setdefault("type", index_kind(index))
        self.meta.setdefault("n", int(index.ntotal))
        self.meta.setdefault("dim", int(index.d))
        # faiss CPU indexes allow concurrent searches; GPU ones do not (their StandardGpuResources
        # is not thread-safe), so GPU searches are serialized.
        self._gpu_lock = threading.Lock() if is_gpu_index(index) else None

    @classmethod
    def build(
        cls,
        embeddings: np.ndarray,
        ids: Sequence | np.ndarray | None = None,
        index_type: IndexType = "flat",
        *,
        step: int | None = None,
        **build_kwargs: Any,
    ) -> "BlockIndex":
        """`build_index` + ids + build time in meta. `build_kwargs` go to `build_index`."""
        t0 = time.perf_counter()
        index = build_index(embeddings, index_type, **build_kwargs)
        meta = {"build_seconds": round(time.perf_counter() - t0, 6), "step": step}
        return cls(index, ids, meta)

    # -- properties ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.index.ntotal)

    @property
    def dim(self) -> int:
        return int(self.index.d)

    @property
    def index_type(self) -> str:
        return str(self.meta["type"])

    @property
    def version(self) -> int | None:
        return self.meta.get("version")

    @property
    def step(self) -> int | None:
        return self.meta.get("step")

    def with_meta(self, **updates: Any) -> "BlockIndex":
        """A copy sharing the faiss index and ids, with `meta` updated."""
        other = copy.copy(self)
        other.meta = {**self.meta, **updates}
        return other

    def __repr__(self) -> str:
        return f"BlockIndex(type={self.index_type}, n={len(self)}, dim={self.dim}, version={self.version})"

    # -- search --------------------------------------------------------------------------------
    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k blocks by inner product for each query.

        q: (B, d) float32. Returns scores (B, k) float32, best first, and rows (B, k) int64.
        A slot with no result (k > N, or an approximate index that found fewer) has row -1 and
        score -inf; callers that need exactly k must check `rows >= 0`.
        """
        q = as_matrix(q, "queries")  # (B, d)
        if q.shape[1] != self.dim:
            raise ValueError(f"query dim {q.shape[1]} != index dim {self.dim}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        lock = self._gpu_lock or contextlib.nullcontext()
        with lock:
            scores, rows = self.index.search(q, k)  # (B, k), (B, k)
        rows = rows.astype(np.int64, copy=False)
        scores = scores.astype(np.float32, copy=False)
        scores[rows < 0] = -np.inf  # faiss pads with -FLT_MAX; -inf says "no block" unambiguously
        return scores, rows

    def ids_for(self, rows: np.ndarray) -> np.ndarray:
        """Block ids for `rows` (any shape). Row -1 maps to "" (str ids) or -1 (int ids)."""
        rows = np.asarray(rows, dtype=np.int64)
        out = self.ids[np.clip(rows, 0, None)]
        out[rows < 0] = "" if self.ids.dtype.kind == "U" else -1
        return out

    def embeddings(self) -> np.ndarray | None:
        """The stored vectors (N, d) for flat/hnsw/ivf-flat indexes, else None (debug/tests)."""
        try:
            return to_cpu(self.index).reconstruct_n(0, len(self))
        except RuntimeError:
            return None

    # -- persistence ---------------------------------------------------------------------------
    def save(self, folder: str | os.PathLike, *, extra_meta: dict | None = None) -> dict:
        """Write this index to `folder` atomically (`components.io.atomic_dir`). Returns meta."""
        folder = Path(folder)
        if folder.exists() and any(folder.iterdir()):
            raise FileExistsError(f"{folder} exists and is not empty")
        with atomic_dir(folder, replace=False) as tmp:
            meta = files.write_version_dir(self, tmp, extra_meta or {})
        return meta

    @classmethod
    def load(cls, folder: str | os.PathLike, *, use_gpu: UseGpu = "auto", verify: bool = True) -> "BlockIndex":
        """Read a version folder; with `verify`, every file's sha256 must match meta.json."""
        index, ids, meta = files.read_version_dir(Path(folder), verify)
        if meta.get("type") == "flat" and want_gpu(use_gpu):
            index = to_gpu(index)
        return cls(index, ids, meta)


# ----------------------------------------------------------------------------------------------
# versioned store
# ----------------------------------------------------------------------------------------------
class IndexStore:
    """Index versions under `root` plus the in-memory current index.

        root/v0001/ root/v0002/ ...   complete versions (a version directory appears atomically)
        root/CURRENT                  "v0002": the published current version (atomic swap)
        root/.tmp-v0003               a version being written (removed by `cleanup_partial`)

    `publish` persists a new version and makes it current; `swap` only changes the in-memory
    current index (the training loop's step-boundary swap). `current()` / `search()` are
    thread-safe: a reader always gets one complete `BlockIndex`, never a half-built one.
    One process writes a store; a file lock keeps a second writer from reusing a version number.
    """

    def __init__(self, root: str | os.PathLike, *, use_gpu: UseGpu = "auto", verify: bool = True):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.use_gpu = use_gpu
        self.verify = verify
        self._lock = threading.RLock()  # guards _current (and lazy loading)
        self._write_lock = threading.Lock()  # one publish/cleanup at a time in this process
        self._current: BlockIndex | None = None

    # -- listing -------------------------------------------------------------------------------
    def path(self, version: int) -> Path:
        return self.root / f"v{version:04d}"

    def versions(self) -> list[int]:
        """Complete versions, ascending. `.tmp-*` directories are never listed, so never loaded."""
        out = []
        for p in self.root.iterdir():
            m = _VERSION_DIR.match(p.name)
            if m and p.is_dir() and (p / META_FILE).is_file():
                out.append(int(m.group(1)))
        return sorted(out)

    def first_version(self) -> int | None:
        v = self.versions()
        return v[0] if v else None

    def latest_version(self) -> int | None:
        v = self.versions()
        return v[-1] if v else None

    def current_version(self) -> int | None:
        """The version named by `CURRENT` on disk (None when nothing was published)."""
        try:
            name = (self.root / CURRENT_FILE).read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            return None
        m = _VERSION_DIR.match(name)
        if not m:
            raise IndexIntegrityError(f"{self.root / CURRENT_FILE}: bad pointer {name!r}")
        return int(m.group(1))

    # -- loading -------------------------------------------------------------------------------
    def load(self, version: int) -> BlockIndex:
        path = self.path(version)
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: no such index version (have {self.versions()})")
        return BlockIndex.load(path, use_gpu=self.use_gpu, verify=self.verify)

    def first(self) -> BlockIndex | None:
        v = self.first_version()
        return None if v is None else self.load(v)

    def latest(self) -> BlockIndex | None:
        v = self.latest_version()
        return None if v is None else self.load(v)

    def current(self) -> BlockIndex:
        """The in-memory current index; loaded from `CURRENT` (else the latest version) on first use."""
        with self._lock:
            if self._current is None:
                v = self.current_version()
                v = self.latest_version() if v is None else v
                if v is None:
                    raise LookupError(f"{self.root}: no index published yet")
                self._current = self.load(v)
            return self._current

    def reload(self) -> bool:
        """Follow a `CURRENT` written by another process. True when the in-memory index changed."""
        v = self.current_version()
        with self._lock:
            if v is None or (self._current is not None and self._current.version == v):
                return False
        new = self.load(v)  # load outside the lock: readers keep searching the old one meanwhile
        self.swap(new)
        return True

    def swap(self, new: BlockIndex) -> BlockIndex | None:
        """Make `new` the in-memory current index; returns the previous one. Not persisted."""
        if not isinstance(new, BlockIndex):
            raise TypeError(f"swap needs a BlockIndex, got {type(new).__name__}")
        with self._lock:
            old, self._current = self._current, new
        return old

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """`current().search(q, k)`: takes a reference under the lock, searches outside it."""
        return self.current().search(q, k)

    # -- writing -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _writer(self) -> Iterator[None]:
        with self._write_lock:
            if fcntl is None:
                yield
                return
            with open(self.root / ".lock", "a+") as lf:
                fcntl.flock(lf, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(lf, fcntl.LOCK_UN)

    def publish(
        self, index: BlockIndex, step: int | None = None, extra_meta: dict | None = None, *, make_current: bool = True
    ) -> int:
        """Persist `index` as the next version; with `make_current`, point `CURRENT` at it and
        swap it in memory. Returns the new version number.

        Crash safety: files go to `root/.tmp-vNNNN`, which is renamed to `root/vNNNN` only when
        complete; `CURRENT` is replaced atomically after that. A crash leaves either the old
        `CURRENT` (plus a `.tmp-*` that `cleanup_partial` removes) or the new one.
        """
        with self._writer():
            version = (self.latest_version() or 0) + 1
            stamped = index.with_meta(version=version, step=step if step is not None else index.step)
            # built in root/.tmp-vNNNN (a killed publish's leftover of that name is removed first)
            with atomic_dir(self.path(version), replace=False, unique=False) as tmp:
                meta = files.write_version_dir(stamped, tmp, extra_meta or {})
            stamped = stamped.with_meta(**{k: meta[k] for k in ("files", "extra", "created_unix", "search_params")})
            if make_current:
                self._write_pointer(version)
                self.swap(stamped)
        return version

    def set_current(self, version: int) -> BlockIndex:
        """Point `CURRENT` at an existing version (e.g. roll back) and swap it in."""
        bi = self.load(version)
        with self._writer():
            self._write_pointer(version)
        self.swap(bi)
        return bi

    def _write_pointer(self, version: int) -> None:
        write_text_atomic(self.root / CURRENT_FILE, f"v{version:04d}\n")

    def cleanup_partial(self) -> list[Path]:
        """Remove `.tmp-*` / `.old-*` leftovers (a refresh killed mid-write). Returns what was removed."""
        with self._writer():
            return remove_leftovers(self.root)

    def prune(self, keep_last: int = 2, keep_first: bool = True) -> list[int]:
        """Delete old versions, keeping the newest `keep_last`, the first (the staleness baseline)
        and whatever `CURRENT` names. In-memory indexes are unaffected. Returns deleted versions."""
        with self._writer():
            versions = self.versions()
            keep = set(versions[-keep_last:]) if keep_last > 0 else set()
            if keep_first and versions:
                keep.add(versions[0])
            cur = self.current_version()
            if cur is not None:
                keep.add(cur)
            gone = [v for v in versions if v not in keep]
            for v in gone:
                remove_dir(self.path(v))  # a half-deleted directory never looks like a version
        return gone
