"""Building a faiss index for maximum inner product search: which type (`resolve_index_type`: flat,
IVF or HNSW, `auto` by corpus size), its knobs (`ivf_nlist`, `ivf_nprobe`, HNSW's M and efSearch),
GPU placement (`gpu_count`, `to_gpu`, `to_cpu`), and `build_index`. Inner product everywhere: REALM
scores a block by `encode_query(x) . encode_passage(z)`, never by a distance. `faiss_index.BlockIndex`
wraps what this builds.
"""

from __future__ import annotations

import math
from typing import Literal

import faiss
import numpy as np

IndexType = Literal["flat", "ivf", "hnsw", "auto"]
UseGpu = bool | Literal["auto"]

# Defaults chosen from bench/bench_index.py (bench/results/index.json). `auto` is exact flat up to
# 1M blocks on the CPU: the bench's recommendation (up to there flat search costs a REALM index
# version less than building an IVF index would save), as params.yaml's `realm.index_auto_flat_max`.
DEFAULT_AUTO_FLAT_MAX = 1_000_000
DEFAULT_HNSW_M = 32
DEFAULT_HNSW_EF_CONSTRUCTION = 100
DEFAULT_HNSW_EF_SEARCH = 128
GPU_FLAT_MAX = 50_000_000  # auto with GPUs: 50M x 128-d fp32 = 25 GiB, sharded over the GPUs


# ----------------------------------------------------------------------------------------------
# building
# ----------------------------------------------------------------------------------------------
def resolve_index_type(
    n: int, index_type: IndexType, auto_flat_max: int = DEFAULT_AUTO_FLAT_MAX, *, gpu: bool | None = None
) -> str:
    """`auto` -> exact `flat` up to `auto_flat_max` blocks, `ivf` above; with GPUs (`gpu=None`:
    faiss sees one) `flat` up to `GPU_FLAT_MAX`, since a sharded GPU flat search over millions of
    blocks takes milliseconds (REALM itself used exact MIPS on accelerators).

    Why IVF over HNSW above the threshold (bench/bench_index.py, 100k x 128-d, inner product):
    IVF builds ~20x faster (a refresh rebuilds the index, so build time is paid every
    `refresh_every` steps) and reaches recall@10 ~1.0 on clustered data at nprobe = nlist/8, where
    HNSW-IP stays at ~0.6-0.75 (inner product is not a metric, which hurts HNSW's graph).
    """
    if index_type == "auto":
        if gpu is None:
            gpu = gpu_count() > 0
        return "flat" if n <= (max(auto_flat_max, GPU_FLAT_MAX) if gpu else auto_flat_max) else "ivf"
    if index_type not in ("flat", "ivf", "hnsw"):
        raise ValueError(f"index_type must be flat|ivf|hnsw|auto, got {index_type!r}")
    return index_type


def ivf_nlist(n: int) -> int:
    """~4 sqrt(N) inverted lists, but at least 39 training points per centroid (faiss' minimum)."""
    return int(max(1, min(round(4 * math.sqrt(n)), n // 39)))


def ivf_nprobe(nlist: int) -> int:
    """Lists visited per query: ~1/8 of them (at least 8). On random 128-d data this gives
    recall@10 ~0.9+ (bench/bench_index.py); real embeddings are clustered and do better."""
    return int(min(nlist, max(8, round(nlist / 8))))


def gpu_count() -> int:
    """GPUs faiss can use: 0 with faiss-cpu (no GPU symbols) or when none is visible."""
    if not hasattr(faiss, "GpuMultipleClonerOptions"):
        return 0
    try:
        return int(faiss.get_num_gpus())
    except Exception:  # a broken CUDA runtime must not take CPU search down with it
        return 0


def want_gpu(use_gpu: UseGpu) -> bool:
    n = gpu_count()
    if use_gpu is True and n == 0:
        raise RuntimeError("use_gpu=True, but faiss has no GPU support or no GPU is visible")
    return bool(use_gpu) and n > 0


def to_gpu(index: faiss.Index) -> faiss.Index:
    """Shard a CPU index over all visible GPUs (each holds N/ngpu rows; results are merged)."""
    co = faiss.GpuMultipleClonerOptions()
    co.shard = True  # sharded, not replicated: the corpus is split so it fits in GPU memory
    return faiss.index_cpu_to_all_gpus(index, co=co)


def to_cpu(index: faiss.Index) -> faiss.Index:
    """The CPU copy of a (possibly GPU) index; a CPU index is returned as is."""
    return faiss.index_gpu_to_cpu(index) if is_gpu_index(index) else index


def is_gpu_index(index: faiss.Index) -> bool:
    return "Gpu" in type(index).__name__ or "IndexShards" in type(index).__name__


def as_matrix(x: np.ndarray, name: str) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"{name} must be 2-D (N, d), got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError(f"{name} holds NaN/inf values; refusing to index them")
    return x


def build_index(
    embeddings: np.ndarray,
    index_type: IndexType = "flat",
    *,
    auto_flat_max: int = DEFAULT_AUTO_FLAT_MAX,
    use_gpu: UseGpu = "auto",
    nlist: int | None = None,
    nprobe: int | None = None,
    hnsw_m: int = DEFAULT_HNSW_M,
    ef_construction: int = DEFAULT_HNSW_EF_CONSTRUCTION,
    ef_search: int = DEFAULT_HNSW_EF_SEARCH,
    seed: int = 1234,
) -> faiss.Index:
    """A filled inner-product faiss index over `embeddings` (N, d) float32.

    flat: `IndexFlatIP` (exact; sharded over all GPUs when `use_gpu` and GPUs are visible).
    ivf:  `IndexIVFFlat(METRIC_INNER_PRODUCT)`, k-means trained on the data, nlist ~ 4 sqrt(N).
    hnsw: `IndexHNSWFlat(METRIC_INNER_PRODUCT)`, M=hnsw_m.
    IVF and HNSW stay on the CPU (faiss has no GPU HNSW; GPU IVF is not worth it at REALM sizes).
    """
    x = as_matrix(embeddings, "embeddings")  # (N, d)
    n, d = x.shape
    if n == 0:
        raise ValueError("cannot build an index over 0 embeddings")
    kind = resolve_index_type(n, index_type, auto_flat_max, gpu=want_gpu(use_gpu))

    if kind == "flat":
        index = faiss.IndexFlatIP(d)
        if want_gpu(use_gpu):
            index = to_gpu(index)
        index.add(x)
        return index

    if kind == "ivf":
        nlist = nlist or ivf_nlist(n)
        quantizer = faiss.IndexFlatIP(d)
        index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_INNER_PRODUCT)
        index.cp.seed = seed
        index.train(x)
        index.add(x)
        index.nprobe = nprobe or ivf_nprobe(nlist)
        return index  # faiss' Python wrapper keeps `quantizer` alive via the index's references

    # hnsw
    index = faiss.IndexHNSWFlat(d, hnsw_m, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = ef_construction
    index.hnsw.efSearch = ef_search
    index.add(x)
    return index


def index_kind(index: faiss.Index) -> str:
    cpu = faiss.downcast_index(index) if not is_gpu_index(index) else index
    if isinstance(cpu, faiss.IndexHNSW):
        return "hnsw"
    if isinstance(cpu, faiss.IndexIVF):
        return "ivf"
    return "flat"


def search_params(index: faiss.Index) -> dict[str, int]:
    """The query-time knobs, stored in meta.json and re-applied on load."""
    if is_gpu_index(index):
        return {}
    cpu = faiss.downcast_index(index)
    if isinstance(cpu, faiss.IndexIVF):
        return {"nlist": int(cpu.nlist), "nprobe": int(cpu.nprobe)}
    if isinstance(cpu, faiss.IndexHNSW):
        return {"efSearch": int(cpu.hnsw.efSearch), "efConstruction": int(cpu.hnsw.efConstruction)}
    return {}


def apply_search_params(index: faiss.Index, params: dict[str, int]) -> None:
    cpu = faiss.downcast_index(index)
    if isinstance(cpu, faiss.IndexIVF) and "nprobe" in params:
        cpu.nprobe = int(params["nprobe"])
    if isinstance(cpu, faiss.IndexHNSW) and "efSearch" in params:
        cpu.hnsw.efSearch = int(params["efSearch"])
