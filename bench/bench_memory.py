"""Soak benchmark: does each training loop hold its RSS flat, and what is each stage's peak?

    python -m bench.bench_memory --preset tiny                       # every loop >= 2,000 steps, both arms
    python -m bench.bench_memory --preset small --steps 300 --realm-steps 100
    python -m bench.bench_memory --preset tiny --arms glibc --steps 1000 --workdir /tmp/bm_glibc   # arms side by side
    python -m bench.bench_memory --preset tiny --steps 10000 --ict-steps 200 --realm-steps 2000 --arms auto --upto pretrain_realm@refreshed
    python -m bench.bench_memory --collect bench/results/memory_tiny_auto.json bench/results/memory_tiny_glibc.json

Each arm runs the real pipeline (`flows.pipeline --upto finetune_reader@realm`, so every stage goes through
`dvc repro` and scripts/py) in its own clone of HEAD, with the loops' step counts raised:
- `glibc`: RR_ALLOCATOR=system and compute.malloc_trim_every=0, the allocator as it was;
- `auto`: scripts/py's default (mimalloc from the lock) and the Trainer's glibc fallback as params say;
- `glibc+trim` (with --arms): no preloaded allocator, the Trainer trimming glibc's heap.
Every Trainer logs `rss_mb` at each logged step (MLflow), so the curves are read back from each
clone's embedded store: one curve per loop (RetroMAE's head phase and joint phase, MLM, REALM's ICT
and reader warm-ups and its training with refreshes, each bi-encoder and reader fine-tune). The slope
is a least-squares fit of RSS on step over the curve after its first quarter (the warm-up, where the
allocator and caches fill), in MB per 1,000 steps. Peaks are each stage's `peak_rss_mb` (MLflow).

Writes bench/results/memory_<preset>[_<n>steps]_<arms>.json (--collect: without the arms), a PNG beside it (RSS
against step for RetroMAE, REALM's reader warm-up and REALM, every arm) and prints the Markdown rows of
bench/README.md.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.workspace import fresh_clone  # noqa: E402
from components.cpuinfo import cpu_model  # noqa: E402
from components.io import write_bytes_atomic, write_json_atomic, write_text_atomic  # noqa: E402

RESULTS = ROOT / "bench/results"
# the stages measured (one start, one size and one open-QA system stand for the fine-tunes: step_overrides)
STAGES = ("prepare_corpus", "tokenize", "pretrain_retromae", "pretrain_mlm", "pretrain_realm@refreshed",
          "finetune_retriever@retromae-32", "finetune_reader@realm")
ARMS = {"glibc": ({"RR_ALLOCATOR": "system"}, ["compute.malloc_trim_every=0"]),
        "auto": ({}, []),
        "glibc+trim": ({"RR_ALLOCATOR": "system"}, [])}
GOAL_SLOPE_MB = 1.0   # per 1,000 steps (issue 30)
GOAL_PEAK_MB = 4096.0


def step_overrides(preset: str, steps: int, realm_steps: int, ict_steps: int | None = None) -> list[str]:
    """Every loop at `steps` (REALM's own training at `realm_steps`, tiny's ICT warm-up at `ict_steps`,
    default `steps`; 0: the preset's own counts); one start and one open-QA system stand for the
    fine-tunes (each runs the same loop)."""
    if not steps:
        return ["tracking.log_every=1"]
    sets = [f"retromae.train.max_steps={steps}", f"realm.train.max_steps={realm_steps}",
            f"realm.reader_warmup_steps={steps}", f"finetune.train.max_steps={steps}",
            f"finetune.qa_train.max_steps={steps}", "finetune.retrieval_inits=[retromae]", "finetune.train_sizes=[all]",
            "finetune.qa_systems=[realm]", "tracking.log_every=1",
            f"retromae.train.checkpoint_every={max(50, steps // 4)}", f"realm.train.checkpoint_every={max(20, realm_steps // 4)}",
            f"finetune.train.checkpoint_every={max(50, steps // 4)}", f"finetune.qa_train.checkpoint_every={max(50, steps // 4)}"]
    if preset == "tiny":
        sets.append(f"realm.ict_steps={steps if ict_steps is None else ict_steps}")
    return sets


def run_arm(preset: str, arm: str, sets: list[str], workdir: Path, upto: str) -> Path:
    """Clone HEAD into workdir/<preset>-<arm> and run the pipeline up to `upto` there."""
    dest = workdir / f"{preset}-{arm}"
    if (dest / "wall_seconds.txt").exists():
        print(f"{dest}: already run; collecting it", flush=True)
        return dest
    fresh_clone(dest)
    env_extra, arm_sets = ARMS[arm]
    cmd = [".venv/bin/python", "-m", "flows.pipeline", "--upto", upto,
           "--preset", preset, *[a for s in sets + arm_sets for a in ("--set", s)]]
    t0 = time.time()
    with open(dest / "pipeline.log", "w") as log:
        subprocess.run(cmd, cwd=dest, stdout=log, stderr=subprocess.STDOUT, check=True,
                       env={**{k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}, **env_extra})
    write_text_atomic(dest / "wall_seconds.txt", f"{time.time() - t0:.0f}\n")
    return dest


def curves(ws: Path) -> tuple[dict[str, list[tuple[int, float]]], dict[str, float]]:
    """Every `*rss_mb` history of the workspace's newest stage runs ({"<stage>/<metric>": [(step, MB)]})
    and each stage's peak_rss_mb."""
    from mlflow.tracking import MlflowClient

    from components.tracking import latest_stage_run

    client = MlflowClient(tracking_uri=f"sqlite:///{ws / 'mlflow.db'}")
    exps = [e.experiment_id for e in client.search_experiments()]
    out, peaks = {}, {}
    for stage in STAGES:
        run = latest_stage_run(client, exps, stage)
        if run is None:
            continue
        peaks[stage] = run.data.metrics.get("peak_rss_mb")
        for key in run.data.metrics:
            if key.endswith("rss_mb") and key != "peak_rss_mb" and "final_" not in key:  # summaries, not curves
                hist = client.get_metric_history(run.info.run_id, key)
                out[f"{stage}/{key}"] = sorted((m.step, m.value) for m in hist)
    return out, peaks


def slope_per_1000(points: list[tuple[int, float]], skip: float = 0.25) -> float | None:
    """Least-squares MB per 1,000 steps over the curve after its first `skip` fraction."""
    pts = points[int(len(points) * skip):]
    if len(pts) < 10:
        return None
    x, y = np.array(pts, dtype=float).T
    return float(np.polyfit(x, y, 1)[0] * 1000)


def summarise(arm_curves: dict, arm_peaks: dict) -> dict:
    loops = {}
    for name, pts in arm_curves.items():
        # a short run (the default size's 300 steps) spends ~100-150 of them filling the allocator: its second half says more
        loops[name] = {"steps": pts[-1][0] if pts else 0, "slope_mb_per_1000": slope_per_1000(pts),
                       "slope_second_half_mb_per_1000": slope_per_1000(pts, skip=0.5),
                       "start_mb": pts[0][1] if pts else None, "end_mb": pts[-1][1] if pts else None,
                       "max_mb": max(v for _, v in pts) if pts else None}
    return {"loops": loops, "peaks_mb": arm_peaks}


def plot(results: dict, path: Path, preset: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({k for res in results["arms"].values() for k in res["curves"]})
    group_metric = lambda k: (k.split("/")[0].split("@")[0], k.split("/")[-1])  # pretrain_realm@refreshed: REALM's group  # noqa: E731
    keys = [k for want in (("pretrain_retromae", "rss_mb"), ("pretrain_realm", "reader_warmup_rss_mb"), ("pretrain_realm", "rss_mb"))
            for k in names if group_metric(k) == want]
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4), squeeze=False)
    axes = axes[0]
    for ax, key in zip(axes, keys):
        for arm, res in results["arms"].items():
            pts = res["curves"].get(key)
            if pts:
                s, v = zip(*pts)
                slope = res["summary"]["loops"][key]["slope_mb_per_1000"]
                ax.plot(s, v, label=arm if slope is None else f"{arm} ({slope:+.1f} MB/1k steps)")
        ax.set(title=f"{key.split('/')[0]}{' reader warm-up' if 'warmup' in key else ''} ({preset})", xlabel="optimiser step", ylabel="RSS (MiB)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    write_bytes_atomic(path, buf.getvalue())


def markdown(results: dict) -> str:
    arms = list(results["arms"])
    first = results["arms"][arms[0]]["summary"]
    lines = [f"Preset `{results['preset']}`, steps {results['steps']} (REALM {results['realm_steps']}), commit "
             f"{results['commit']}, {results['cpu']}.", "",
             "| loop | steps | " + " | ".join(f"{a} slope (MB/1k steps; second half)" for a in arms) + " | " +
             " | ".join(f"{a} max RSS (MB)" for a in arms) + " |",
             "|---|---:|" + "---:|" * (2 * len(arms))]
    for loop in first["loops"]:
        row = [results["arms"][a]["summary"]["loops"].get(loop, {}) for a in arms]
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        lines.append(f"| {loop} | {row[0].get('steps')} | " + " | ".join(
            f'{fmt(r.get("slope_mb_per_1000"), "+.1f")}; {fmt(r.get("slope_second_half_mb_per_1000"), "+.1f")}' for r in row)
                     + " | " + " | ".join(fmt(r.get("max_mb"), ".0f") for r in row) + " |")
    lines += ["", "| stage | " + " | ".join(f"{a} peak RSS (MB)" for a in arms) + " |", "|---|" + "---:|" * len(arms)]
    for stage in STAGES:
        vals = [results["arms"][a]["summary"]["peaks_mb"].get(stage) for a in arms]
        lines.append(f"| {stage} | " + " | ".join("-" if v is None else f"{v:.0f}" for v in vals) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", help="a params/ preset: tiny, small or paper")
    ap.add_argument("--steps", type=int, default=2000, help="steps of every loop but REALM's own training; 0: the preset's")
    ap.add_argument("--realm-steps", type=int, default=None, help="REALM's training steps (default: --steps)")
    ap.add_argument("--ict-steps", type=int, default=None, help="tiny's ICT warm-up steps (default: --steps)")
    ap.add_argument("--upto", default="finetune_reader@realm", choices=STAGES[2:], help="the last stage run")
    ap.add_argument("--arms", nargs="+", default=["glibc", "auto"], choices=list(ARMS))
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench_memory"))
    ap.add_argument("--collect", nargs="*", type=Path, default=None,
                    help="tables and plot from saved results only: these files' arms in one table (none: this preset's)")
    a = ap.parse_args(argv)
    # the 2,000-step soak keeps its historical name; other lengths are filed apart
    base = f"memory_{a.preset}{'_preset_steps' if not a.steps else '' if a.steps == 2000 else f'_{a.steps}steps'}"
    if a.collect is not None:
        parts = [json.loads(f.read_text()) for f in a.collect] or [json.loads((RESULTS / f"{base}.json").read_text())]
        results = {**parts[0], "arms": {arm: r for part in parts for arm, r in part["arms"].items()}}
        for r in results["arms"].values():  # refit: the summary's columns may be newer than the file
            r["summary"] = summarise(r["curves"], r["summary"]["peaks_mb"])
        out = RESULTS / f"{base}.json"
        if a.collect:
            write_json_atomic(out, results)
    else:
        realm_steps = a.realm_steps if a.realm_steps is not None else a.steps
        sets = step_overrides(a.preset, a.steps, realm_steps, a.ict_steps)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        cpu = cpu_model()
        results = {"preset": a.preset, "upto": a.upto, "steps": a.steps, "realm_steps": realm_steps, "commit": commit, "cpu": cpu,
                   "overrides": sets, "arms": {}}
        for arm in a.arms:
            ws = run_arm(a.preset, arm, sets, a.workdir, a.upto)
            c, peaks = curves(ws)
            results["arms"][arm] = {"curves": c, "summary": summarise(c, peaks),
                                    "wall_s": float((ws / "wall_seconds.txt").read_text())}
        out = RESULTS / f"{base}_{'-'.join(a.arms)}.json"  # one file per call: arms can run side by side
        write_json_atomic(out, results)
    plot(results, out.with_suffix(".png"), a.preset)
    print(markdown(results))


if __name__ == "__main__":
    main()
