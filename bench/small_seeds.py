"""The `small` preset's claims over seeds: the whole pipeline once per seed, then every paper
comparison per seed and pooled over (seed, query) pairs.

    python -m bench.small_seeds --seeds 0 1 --split test         # one fresh clone of HEAD per seed (~30 min each)
    python -m bench.small_seeds --collect /tmp/small_seeds/seed0 /tmp/small_seeds/seed1   # tables only

Each seed runs in its own clone of this commit (`git clone`, the venv linked), so the checkout is
never touched and every run is the committed code: `python -m flows.pipeline --preset small --set
compute.seed=<N> --set evaluate.split=<split>` (the preset and the overrides written into the
clone's params.yaml, so its dvc.lock records them).
The corpus split (`data.split.seed`) stays fixed, so every seed answers the same questions.

Writes bench/results/small_seeds.json and prints Markdown for docs/results.md: per-seed rows,
the stage wall times (from each stage's MLflow run), and each comparison with its delta and
two-sided p per seed and pooled (the paired randomisation test over every (seed, query) pair).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from components.eval.comparisons import paper_comparisons, per_query_path, read_per_query  # noqa: E402
from components.eval.significance import paired_test, per_query_metric  # noqa: E402

RESULTS = ROOT / "bench/results/small_seeds.json"
STAGES = ("prepare_corpus", "tokenize", "pretrain_retromae", "pretrain_mlm", "pretrain_realm", "finetune", "evaluate")
ROW_METRICS = ("ndcg_at_10", "recall_at_20", "em", "f1")
ROW_ORDER = ("bm25", "warm-start:mean", "init", "retromae", "mlm", "realm", "realm-stale", "ft:init", "ft:mlm", "ft:retromae",
             "ft:realm", "qa:closed-book", "qa:bm25", "qa:realm", "qa:realm-stale")


def run_seed(seed: int, split: str, workdir: Path) -> Path:
    """Clone HEAD into workdir/seed<N> and run the small preset there; returns the clone."""
    dest = workdir / f"seed{seed}"
    if (dest / "metrics/eval.json").exists():
        print(f"seed {seed}: {dest} already has metrics/eval.json; collecting it", flush=True)
        return dest
    subprocess.run(["rm", "-rf", str(dest)], check=True)
    subprocess.run(["git", "clone", "-q", str(ROOT), str(dest)], check=True)
    os.symlink(ROOT / ".venv", dest / ".venv")
    shared = ROOT.parent / "shared"
    if shared.exists() and not (dest.parent / "shared").exists():
        os.symlink(shared, dest.parent / "shared")  # params/small.yaml reads ../shared/data
    cmd = [".venv/bin/python", "-m", "flows.pipeline", "--preset", "small", "--set", f"compute.seed={seed}",
           "--set", f"evaluate.split={split}"]
    t0 = time.time()
    with open(dest / "pipeline.log", "w") as log:
        subprocess.run(cmd, cwd=dest, stdout=log, stderr=subprocess.STDOUT, check=True)
    (dest / "wall_seconds.txt").write_text(f"{time.time() - t0:.0f}\n")
    return dest


def stage_seconds(ws: Path) -> dict[str, float]:
    """Wall time of each stage's newest finished MLflow run in a workspace's embedded store."""
    from mlflow.tracking import MlflowClient

    from components.tracking import latest_stage_run

    client = MlflowClient(tracking_uri=f"sqlite:///{ws / 'mlflow.db'}")
    exps = [e.experiment_id for e in client.search_experiments()]
    out: dict[str, float] = {}
    for stage in STAGES:
        run = latest_stage_run(client, exps, stage)
        if run is not None:
            out[stage] = round((run.info.end_time - run.info.start_time) / 1000, 1)
    return out


def collect(workspaces: list[Path]) -> dict:
    seeds = []
    for ws in workspaces:
        table = json.loads((ws / "metrics/eval.json").read_text())
        wall = ws / "wall_seconds.txt"
        seeds.append({"workspace": str(ws), "split": table.get("split"), "rows": table["main"],
                      "wall_seconds": float(wall.read_text()) if wall.exists() else None, "stage_seconds": stage_seconds(ws)})
    realm_start = "retromae"
    comparisons = []
    for c in paper_comparisons(realm_start):
        for metric in c.metrics:
            per_seed, pooled_a, pooled_b = [], {}, {}
            for i, ws in enumerate(workspaces):
                out = ws / "metrics/eval"
                pa, pb = per_query_path(out, "main", c.a), per_query_path(out, "main", c.b)
                if not (pa.exists() and pb.exists()):
                    break
                a, b = per_query_metric(read_per_query(pa), metric), per_query_metric(read_per_query(pb), metric)
                r = paired_test(a, b)
                per_seed.append({"delta": r.delta, "p": r.p_value, "n": r.n})
                pooled_a.update({f"{i}/{q}": v for q, v in a.items()})
                pooled_b.update({f"{i}/{q}": v for q, v in b.items()})
            else:
                r = paired_test(pooled_a, pooled_b)
                comparisons.append({"a": c.a, "b": c.b, "metric": metric, "question": c.question, "per_seed": per_seed,
                                    "pooled": {"delta": r.delta, "p": r.p_value, "n": r.n}})
    return {"seeds": seeds, "comparisons": comparisons}


def markdown(res: dict) -> str:
    seeds = res["seeds"]
    names = sorted(seeds[0]["rows"], key=lambda n: (ROW_ORDER.index(n) if n in ROW_ORDER else len(ROW_ORDER), n))
    lines = [f"Split: {seeds[0]['split']}; {len(seeds)} seeds. Mean over seeds (per-seed values in brackets).", "",
             "| System | nDCG@10 | R@20 | EM | F1 |", "|---|---:|---:|---:|---:|"]
    for name in names:
        cells = []
        for m in ROW_METRICS:
            vals = [s["rows"].get(name, {}).get(m) for s in seeds]
            vals = [v for v in vals if v is not None]
            cells.append(f"{sum(vals) / len(vals):.3f} ({', '.join(f'{v:.3f}' for v in vals)})" if vals else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Paired randomisation tests (delta = mean(A - B); two-sided p per seed, and pooled over every (seed, query) pair):", "",
              "| A | B | Metric | Delta per seed (p) | Pooled delta | Pooled p | n |", "|---|---|---|---|---:|---:|---:|"]
    for c in res["comparisons"]:
        per = "; ".join(f"{s['delta']:+.3f} ({s['p']:.3f})" for s in c["per_seed"])
        lines.append(f"| {c['a']} | {c['b']} | {c['metric']} | {per} | {c['pooled']['delta']:+.3f} | {c['pooled']['p']:.4f} | {c['pooled']['n']} |")
    lines += ["", "Stage wall times (seconds; MLflow run start to end):", "",
              "| Stage | " + " | ".join(f"seed {i}" for i in range(len(seeds))) + " |", "|---|" + "---:|" * len(seeds)]
    for st in STAGES:
        lines.append(f"| {st} | " + " | ".join(str(s["stage_seconds"].get(st, "-")) for s in seeds) + " |")
    lines.append("| **pipeline (wall)** | " + " | ".join(str(s["wall_seconds"]) for s in seeds) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--split", choices=["test", "dev"], default="test")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/small_seeds"))
    ap.add_argument("--collect", type=Path, nargs="*", help="finished workspaces: only build the tables")
    args = ap.parse_args()
    workspaces = args.collect or [run_seed(s, args.split, args.workdir) for s in args.seeds]
    res = collect(workspaces)
    RESULTS.write_text(json.dumps(res, indent=1))
    print(markdown(res))


if __name__ == "__main__":
    main()
