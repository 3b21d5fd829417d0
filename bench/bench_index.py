"""FAISS flat vs IVF vs HNSW (inner product) on random vectors: build time, search time, recall@k.

    .venv/bin/python bench/bench_index.py                  # 10k and 100k, 128-d
    .venv/bin/python bench/bench_index.py --big            # + 1M (about 10-20 min on 2 cores)
    .venv/bin/python bench/bench_index.py --data clustered # mixture of Gaussians (closer to real embeddings)

Each size: build every index with `components.index.build.build_index` (the defaults the
pipeline uses), then time
  * a batch of `--queries` queries (dense eval / throughput: ms per query),
  * a batch of `--step-batch` queries (one REALM training step's retrieval: ms per call),
and recall@k of IVF/HNSW against flat's exact answers. `--sweep` adds IVF nprobe / HNSW efSearch
sweeps. Prints a table, writes `bench/results/index.json` (or `--out`), and recommends
`realm.index_auto_flat_max` from the numbers (see `recommend`).

Gaussian random vectors are the hard case for approximate search (no cluster structure), so the
recall here is a lower bound on what real block embeddings get.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from components.index import build as fi  # noqa: E402
from components.io import write_json_atomic  # noqa: E402


def make_data(n: int, d: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    if kind == "gaussian":
        return rng.standard_normal((n, d), dtype=np.float32)
    # clustered: sqrt(n) centres, points = centre + noise (embeddings of related passages cluster)
    centres = rng.standard_normal((max(2, int(np.sqrt(n))), d), dtype=np.float32)
    which = rng.integers(0, len(centres), n)
    return centres[which] + 0.5 * rng.standard_normal((n, d), dtype=np.float32)


def recall_at(rows: np.ndarray, exact: np.ndarray) -> float:
    return float(np.mean([len(set(a[a >= 0]) & set(b)) / len(b) for a, b in zip(rows, exact)]))


def time_search(index: faiss.Index, q: np.ndarray, k: int, reps: int) -> tuple[float, np.ndarray]:
    """Fastest of `reps` calls (after one warm-up) and the rows of the last call. The minimum,
    not the median: on a shared box the slow calls measure the neighbours, not the index."""
    index.search(q, k)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _, rows = index.search(q, k)
        times.append(time.perf_counter() - t0)
    return float(np.min(times)), rows


def index_bytes(index: faiss.Index) -> int:
    return int(faiss.serialize_index(index).size)


def bench_size(n: int, args: argparse.Namespace, rng: np.random.Generator, kinds: list[str]) -> dict:
    x = make_data(n, args.dim, args.data, rng)  # (N, d)
    q = make_data(args.queries, args.dim, args.data, rng)  # (Q, d)
    q_step = q[: args.step_batch]
    out: dict = {"n": n, "indexes": {}}
    exact = None
    for kind in kinds:
        t0 = time.perf_counter()
        index = fi.build_index(x, kind, use_gpu=False)
        build_s = time.perf_counter() - t0
        batch_s, rows = time_search(index, q, args.k, reps=2 if n >= 1_000_000 else 3)
        step_s, _ = time_search(index, q_step, args.k, reps=10 if n >= 1_000_000 else 30)
        if kind == "flat":
            exact = rows
        row = {
            "build_s": build_s,
            "search_ms_per_query": 1000 * batch_s / len(q),
            "step_search_ms": 1000 * step_s,
            f"recall@{args.k}": recall_at(rows, exact),
            "bytes": index_bytes(index),
            "params": fi.search_params(index),
        }
        if args.sweep and kind in ("ivf", "hnsw"):
            row["sweep"] = sweep(index, kind, q, exact, args)
        out["indexes"][kind] = row
        print(
            f"{n:>9,} {kind:<5} build {build_s:8.2f}s  search {row['search_ms_per_query']:8.4f} ms/q  "
            f"step(B={args.step_batch}) {row['step_search_ms']:8.2f} ms  recall@{args.k} {row[f'recall@{args.k}']:.3f}  "
            f"{row['bytes'] / 2**20:8.1f} MiB  {row['params']}",
            flush=True,
        )
        del index
    flat = out["indexes"]["flat"]
    for kind in [k for k in kinds if k != "flat"]:
        ann = out["indexes"][kind]
        saved_ms = flat["search_ms_per_query"] - ann["search_ms_per_query"]
        # queries one index version must serve before the ANN build pays for itself
        ann["break_even_queries"] = 1000 * ann["build_s"] / saved_ms if saved_ms > 0 else None
    return out


def sweep(index: faiss.Index, kind: str, q: np.ndarray, exact: np.ndarray, args: argparse.Namespace) -> list[dict]:
    cpu = faiss.downcast_index(index)
    original = fi.search_params(cpu)
    if kind == "ivf":
        knob, values = "nprobe", sorted({max(1, cpu.nlist // f) for f in (64, 32, 16, 8, 4)})
    else:
        knob, values = "efSearch", [16, 32, 64, 128, 256]
    res = []
    for v in values:
        fi.apply_search_params(cpu, {knob: v})
        s, rows = time_search(cpu, q, args.k, reps=2)
        res.append({knob: v, "ms_per_query": 1000 * s / len(q), f"recall@{args.k}": recall_at(rows, exact)})
    fi.apply_search_params(cpu, original)
    return res


def recommend(results: list[dict], args: argparse.Namespace) -> dict:
    """Where `auto` should stop using exact search, from the largest measured size.

    Flat has no build, so an index version costs only its searches. An ANN index is rebuilt at
    every refresh and must pay its build back within the queries one version serves:
    REALM: `refresh_every` steps of `step_batch` queries (25 x 8 = 200 with params.yaml);
    dense eval: `eval_queries` queries against one index. Flat search time is linear in N;
    IVF build time grows ~N^1.5 (k-means over N points with ~4 sqrt(N) centroids), search
    time keeps its measured ratio to flat. Flat stays the choice at N while
      (1) a REALM step's exact search <= `step_budget_ms` (training-step latency),
      (2) flat's total per-version time <= max(IVF's, `slack_s`) for REALM, and (3) for dense eval
    (an approximate index must save at least `slack_s` per version to be worth its lost recall).
    The step budget is only a sanity cap: the rebuild cost is what usually decides, because on a
    CPU box a "hidden" async build still takes cores from training.
    The recommendation is the largest 1-2-5 size up to 10M where all three hold.
    """
    with_ivf = [r for r in results if "ivf" in r["indexes"]]
    big = max(results, key=lambda r: r["n"])
    big_ivf = max(with_ivf, key=lambda r: r["n"]) if with_ivf else None
    flat = big["indexes"]["flat"]
    step_ms_per_block = flat["step_search_ms"] / big["n"]
    q_ms_per_block = flat["search_ms_per_query"] / big["n"]
    queries_per_version = args.refresh_every * args.step_batch
    table = []
    for n in [v for v in _nice_numbers() if 10_000 <= v <= 10_000_000]:
        flat_step_ms = step_ms_per_block * n
        realm_flat_s = args.refresh_every * flat_step_ms / 1000
        eval_flat_s = args.eval_queries * q_ms_per_block * n / 1000
        row = {"n": n, "flat_step_ms": flat_step_ms, "realm_flat_s": realm_flat_s, "eval_flat_s": eval_flat_s}
        ok = flat_step_ms <= args.step_budget_ms
        if big_ivf is not None:
            ivf, bflat = big_ivf["indexes"]["ivf"], big_ivf["indexes"]["flat"]
            build_s = ivf["build_s"] * (n / big_ivf["n"]) ** 1.5
            row["ivf_build_s"] = build_s
            row["realm_ivf_s"] = build_s + realm_flat_s * ivf["step_search_ms"] / bflat["step_search_ms"]
            row["eval_ivf_s"] = build_s + eval_flat_s * ivf["search_ms_per_query"] / bflat["search_ms_per_query"]
            ok = ok and realm_flat_s <= max(row["realm_ivf_s"], args.slack_s)
            ok = ok and eval_flat_s <= max(row["eval_ivf_s"], args.slack_s)
        row["flat_preferred"] = ok
        table.append(row)
    best = 10_000
    for row in table:  # largest size such that flat is preferred at it and every size below
        if not row["flat_preferred"]:
            break
        best = row["n"]
    return {
        "index_auto_flat_max": best,
        "flat_step_ms_per_1M_blocks": step_ms_per_block * 1e6,
        "flat_ms_per_query_per_1M_blocks": q_ms_per_block * 1e6,
        "step_budget_ms": args.step_budget_ms,
        "slack_s": args.slack_s,
        "realm_queries_per_index_version": queries_per_version,
        "eval_queries": args.eval_queries,
        "extrapolated_from_n": {"flat": big["n"], "ivf": big_ivf["n"] if big_ivf else None},
        "table": table,
    }


def _nice_numbers() -> list[int]:
    return [m * 10**e for e in range(3, 10) for m in (1, 2, 5)]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--big", action="store_true", help="add 1M vectors")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--step-batch", type=int, default=8, help="queries per REALM step (realm.train.batch_size)")
    ap.add_argument("--refresh-every", type=int, default=25, help="realm.refresh_every")
    ap.add_argument("--step-budget-ms", type=float, default=1000.0,
                    help="cap on exact-search ms per REALM step (a sanity cap; the cost rule decides)")
    ap.add_argument("--slack-s", type=float, default=30.0, help="seconds per index version an ANN must save")
    ap.add_argument("--eval-queries", type=int, default=5000, help="queries a dense-eval index serves")
    ap.add_argument("--big-kinds", nargs="+", default=["flat", "ivf"], choices=["flat", "ivf", "hnsw"],
                    help="indexes built at 1M (HNSW-1M takes ~15+ min on 2 cores)")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--data", choices=["gaussian", "clustered"], default="gaussian")
    ap.add_argument("--sweep", action="store_true", help="nprobe / efSearch sweeps")
    ap.add_argument("--threads", type=int, default=0, help="faiss OpenMP threads (0 = all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/index.json")
    ap.add_argument("--recommend-only", action="store_true",
                    help="recompute the recommendation from the results already in --out (no benchmark)")
    args = ap.parse_args(argv)
    if args.recommend_only:
        report = json.loads(Path(args.out).read_text())
        report["recommendation"] = rec = recommend(report["results"], args)
        report["recommendation_args"] = vars(args)
        _print_recommendation(rec, args)
        _write_json(report, Path(args.out))
        return report
    if args.threads:
        faiss.omp_set_num_threads(args.threads)
    sizes = sorted(set(args.sizes + ([1_000_000] if args.big else [])))
    rng = np.random.default_rng(args.seed)

    env = {
        "faiss": faiss.__version__,
        "omp_threads": faiss.omp_get_max_threads(),
        "cpu_count": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "loadavg_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    print(f"faiss {env['faiss']}, {env['omp_threads']} threads, dim {args.dim}, {args.data} data, "
          f"{args.queries} queries, k={args.k}", flush=True)
    kinds = ["flat", "ivf", "hnsw"]
    results = [bench_size(n, args, rng, kinds if n < 1_000_000 else ["flat"] + [k for k in args.big_kinds if k != "flat"])
               for n in sizes]
    rec = recommend(results, args)

    print(f"\n{'N':>9} {'index':<5} {'build s':>9} {'ms/query':>9} {'step ms':>9} {f'R@{args.k}':>6} {'break-even q':>13}")
    for r in results:
        for kind, row in r["indexes"].items():
            be = row.get("break_even_queries")
            be_s = "-" if kind == "flat" else ("never" if be is None else f"{be:,.0f}")
            print(f"{r['n']:>9,} {kind:<5} {row['build_s']:>9.2f} {row['search_ms_per_query']:>9.4f} "
                  f"{row['step_search_ms']:>9.2f} {row[f'recall@{args.k}']:>6.3f} {be_s:>13}")
    _print_recommendation(rec, args)
    report = {"args": vars(args), "env": env, "results": results, "recommendation": rec}
    _write_json(report, Path(args.out))
    return report


def _print_recommendation(rec: dict, args: argparse.Namespace) -> None:
    print(f"\n{'N':>10} {'flat step ms':>12} {'REALM flat s':>12} {'REALM ivf s':>11} {'eval flat s':>11} {'eval ivf s':>10}  flat?")
    for row in rec["table"]:
        print(f"{row['n']:>10,} {row['flat_step_ms']:>12.1f} {row['realm_flat_s']:>12.1f} {row.get('realm_ivf_s', float('nan')):>11.1f} "
              f"{row['eval_flat_s']:>11.1f} {row.get('eval_ivf_s', float('nan')):>10.1f}  {row['flat_preferred']}")
    print(f"(per index version: REALM = {args.refresh_every} steps x {args.step_batch} queries, eval = {args.eval_queries} queries; "
          f"sizes above the measured ones are extrapolated)")
    print(f"recommend realm.index_auto_flat_max = {rec['index_auto_flat_max']:,} "
          f"(flat step search ~{rec['flat_step_ms_per_1M_blocks']:.0f} ms per 1M blocks at B={args.step_batch}; "
          f"budget {args.step_budget_ms:.0f} ms)")


def _write_json(report: dict, out: Path) -> None:
    write_json_atomic(out, report, sort_keys=False)  # a killed run never leaves half a JSON
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
