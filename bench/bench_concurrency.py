"""Stage-level parallelism (issue 31 item 2): the fine-tuning phase's wall time at `--concurrency 1`
and `2`, on the tiny preset (or another), in one fresh clone of HEAD.

    .venv/bin/python bench/bench_concurrency.py                     # tiny preset, concurrency 1 and 2
    .venv/bin/python bench/bench_concurrency.py --preset small --levels 1 2 4

One clone runs the pipeline `--upto pretrain_realm` and `pretrain_mlm` (untimed, concurrency 1).
Then per level, after removing the phase's outputs and checkpoints, the fine-tuning phase, timed
from the client: `--only finetune_retriever` then `--only finetune_reader` at that concurrency
(`flows.pipeline.run_concurrently`: every stage whose inputs are ready is a Prefect task, at most N at a time; each runs its stage command in its own process, two stage
processes at once at concurrency 2). Against a local Prefect API started by the pipeline itself,
or `PREFECT_API_URL` when set (a served API with process workers: `infra/servers.sh`).

Reports the phase's wall time per level, the sum of the stages' own MLflow run times (the work),
and work / wall (how many stages ran at once, on average). On 2 shared CPU cores the stages contend
for the CPUs: the wall-time gain is bounded by the cores free, not by the stage count; the fixed
start-up of each stage process (imports, MLflow and Prefect runs) overlaps best.
Writes bench/results/concurrency.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.workspace import fresh_clone  # noqa: E402
from components.io import write_json_atomic  # noqa: E402

PHASE = ("finetune_retriever", "finetune_reader")


def pipeline(ws: Path, *args: str, log, threads: int = 1) -> float:
    """`python -m flows.pipeline ARGS` in `ws`, each stage process with `threads` OpenMP threads; its wall seconds."""
    t0 = time.perf_counter()
    subprocess.run([".venv/bin/python", "-m", "flows.pipeline", *args], cwd=ws, stdout=log, stderr=subprocess.STDOUT,
                   check=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return time.perf_counter() - t0


def stage_seconds(ws: Path) -> dict[str, float]:
    """Each fine-tuning stage's newest finished MLflow run, start to end (seconds)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{ws / 'mlflow.db'}")
    exps = [e.experiment_id for e in client.search_experiments()]
    newest: dict[str, object] = {}
    for group in PHASE:
        for r in client.search_runs(exps, f"tags.`dvc.stage` LIKE '{group}@%' and attributes.status = 'FINISHED'",
                                    order_by=["attributes.start_time DESC"]):
            newest.setdefault(r.data.tags["dvc.stage"], r)
    return {s: round((r.info.end_time - r.info.start_time) / 1000, 1) for s, r in sorted(newest.items())}


def prepare(preset: str, workdir: Path) -> tuple[Path, float]:
    """One clone with every input of the fine-tuning phase (untimed for the levels): the pipeline
    `--upto pretrain_realm`, then `pretrain_mlm` (not upstream of REALM, but `ft:mlm` starts from it)."""
    ws = fresh_clone(workdir / "ws")
    threads = os.cpu_count() or 1
    with open(ws / "bench.log", "a") as log:
        setup_s = pipeline(ws, "--preset", preset, "--upto", "pretrain_realm", log=log, threads=threads)
        setup_s += pipeline(ws, "--only", "pretrain_mlm", log=log, threads=threads)
    return ws, setup_s


def run_level(level: int, ws: Path) -> dict:
    """The fine-tuning phase at `level`, from scratch: its outputs and its checkpoints (which a rerun
    would resume) are removed first, so DVC and the stages redo all of it. The cores are shared out:
    each of the `level` stage processes gets cpus // level OpenMP threads, so every level uses the
    same cores and only the overlap differs."""
    threads = max(1, (os.cpu_count() or 1) // level)
    shutil.rmtree(ws / "models" / "finetune", ignore_errors=True)
    for ckpt in (ws / "checkpoints").glob("finetune_*"):
        shutil.rmtree(ckpt)
    with open(ws / "bench.log", "a") as log:
        phase = {g: round(pipeline(ws, "--only", g, "--concurrency", str(level), log=log, threads=threads), 1) for g in PHASE}
    stages = stage_seconds(ws)
    wall, work = sum(phase.values()), sum(stages.values())
    return {"concurrency": level, "threads_per_stage": threads, "phase_wall_s": round(wall, 1), "phase_by_group_s": phase,
            "stage_work_s": round(work, 1), "overlap": round(work / wall, 2) if wall else None, "stages_s": stages,
            "loadavg_after": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", help="a params/ preset: tiny, small or paper")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/rr-bench-concurrency"))
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/concurrency.json")
    a = ap.parse_args()
    results = {"preset": a.preset, "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(), "levels": []}
    ws, results["setup_s"] = prepare(a.preset, a.workdir)
    for level in a.levels:
        r = run_level(level, ws)
        results["levels"].append(r)
        print(f"concurrency {level}: fine-tuning phase {r['phase_wall_s']} s wall, {r['stage_work_s']} s of stage runs "
              f"(overlap {r['overlap']})", flush=True)
    base = results["levels"][0]["phase_wall_s"]
    for r in results["levels"]:
        r["speedup"] = round(base / r["phase_wall_s"], 2) if r["phase_wall_s"] else None
    write_json_atomic(a.out, results)
    print(json.dumps({r["concurrency"]: r["speedup"] for r in results["levels"]}), f"-> {a.out}")


if __name__ == "__main__":
    main()
