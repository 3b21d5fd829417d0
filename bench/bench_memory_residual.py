"""What is left of a loop's RSS slope once the allocator is fixed: Python objects, or native memory?

    python -m bench.bench_memory_residual --stage pretrain_retromae --steps 2000
    python -m bench.bench_memory_residual --stage pretrain_realm@refreshed --steps 1000
    python -m bench.bench_memory_residual --stage finetune_retriever@retromae-32 --steps 2000

bench/bench_memory.py measures each loop's RSS slope through the real pipeline. Under mimalloc a
few loops still rise by a few MB per 1,000 steps. This study runs one real stage flow (tiny preset,
in a fresh clone, through scripts/py so the allocator is the stages' own) with tracemalloc on, and
records at every logged step the RSS and the memory Python's allocator holds (tracemalloc's traced
total: every Python object, not torch's tensor storage). Their slopes over the run after its first
quarter say which part of the residual is Python objects; a tracemalloc snapshot diff between the
quarter and the end names the lines that hold them. The quarter's snapshot itself takes ~300 MB of RSS
for the rest of the run (a step in the curve, not growth), so both slopes are fitted after it.

    python -m bench.bench_memory_residual --stage pretrain_retromae --steps 2000 --refit   # refit a finished workspace

Writes bench/results/memory_residual_<stage>.json and prints the slopes and the top growing lines.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_memory import slope_per_1000  # noqa: E402
from bench.workspace import fresh_clone  # noqa: E402
from components.io import write_json_atomic  # noqa: E402

RESULTS = ROOT / "bench/results"
STEP_KEYS = {"pretrain_retromae": ["retromae.train.max_steps"], "pretrain_mlm": ["retromae.train.max_steps"],
             "pretrain_realm@refreshed": ["realm.train.max_steps", "realm.ict_steps", "realm.reader_warmup_steps"],
             "finetune_retriever@retromae-32": ["finetune.train.max_steps"],
             "finetune_reader@realm": ["finetune.qa_train.max_steps"]}
UPTO = {"pretrain_retromae": "tokenize", "pretrain_mlm": "tokenize", "pretrain_realm@refreshed": "pretrain_retromae",
        "finetune_retriever@retromae-32": "pretrain_retromae", "finetune_reader@realm": "pretrain_realm@refreshed"}
ITEM_FLAG = {"pretrain_realm": "--arm", "finetune_retriever": "--item", "finetune_reader": "--item"}
FRAMES = 4


def after_snapshot(steps: int) -> int:
    """The last step whose RSS the first snapshot can still move: fits start after it."""
    return steps // 4 + 5


def slope_after_snapshot(points: list[tuple[int, float]], steps: int) -> float | None:
    """MB per 1,000 steps over the (step, MB) points after `after_snapshot(steps)`."""
    return slope_per_1000([p for p in points if p[0] > after_snapshot(steps)], skip=0)


def refit(ws: Path, stage: str, steps: int) -> dict:
    """Each loop's RSS slope after the first snapshot, from a finished workspace's MLflow `rss_mb`
    curves (runs made before the child kept its curves)."""
    from bench.bench_memory import curves

    out = {}
    for key, pts in curves(ws)[0].items():
        if key.startswith(stage) and len(pts) >= 40:
            out[key] = {"steps": pts[-1][0], "fit_from_step": after_snapshot(steps) + 1,
                        "rss_slope_mb_per_1000": slope_after_snapshot(pts, steps),
                        "rss_mb_at": {str(s): v for s, v in pts if s in (after_snapshot(steps) + 1, steps // 2, steps)}}
    return out


def child(stage: str, steps: int, out: Path) -> None:
    """In the prepared workspace: run the stage flow with tracemalloc, sampling at every logged step."""
    from components.training import memory
    from components.training.trainer import Trainer

    tracemalloc.start(FRAMES)
    samples: list[tuple[str, int, float, float]] = []
    snaps: dict[str, tracemalloc.Snapshot] = {}
    original = Trainer._log

    def sampled_log(self) -> None:
        original(self)
        samples.append((self.prefix, self.step, memory.rss_mb(), tracemalloc.get_traced_memory()[0] / 2**20))
        if self.step == steps // 4 and self.prefix not in snaps:
            snaps[self.prefix] = tracemalloc.take_snapshot()
        elif self.step == steps and self.prefix in snaps:
            snaps[self.prefix + ":end"] = tracemalloc.take_snapshot()

    Trainer._log = sampled_log
    group, _, item = stage.partition("@")
    sys.argv = [f"flows.{group}", *([ITEM_FLAG[group], item] if item else [])]
    runpy.run_module(f"flows.{group}", run_name="__main__")
    tracemalloc.stop()  # the diffs below are slow enough without tracing their own allocations
    loops: dict[str, dict] = {}
    for prefix in dict.fromkeys(p for p, *_ in samples):
        pts = [(s, r, t) for p, s, r, t in samples if p == prefix]
        if len(pts) < 40:
            continue
        top = []
        if prefix + ":end" in snaps:
            diff = snaps[prefix + ":end"].compare_to(snaps[prefix], "lineno")  # "traceback" took minutes
            top = [{"kib": round(d.size_diff / 1024, 1), "count": d.count_diff,
                    "where": [f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in d.traceback]}
                   for d in diff[:12]]
        loops[prefix] = {"steps": pts[-1][0], "fit_from_step": after_snapshot(steps) + 1,
                         "rss_slope_mb_per_1000": slope_after_snapshot([(s, r) for s, r, _ in pts], steps),
                         "python_slope_mb_per_1000": slope_after_snapshot([(s, t) for s, _, t in pts], steps),
                         "rss_mb": [pts[0][1], pts[-1][1]], "python_mb": [pts[0][2], pts[-1][2]],
                         "top_growth": top, "curve": pts}
    write_json_atomic(out, {"stage": stage, "steps": steps, "allocator": memory.allocator(), "loops": loops})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", choices=list(STEP_KEYS), default="pretrain_retromae")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench_memory_residual"))
    ap.add_argument("--refit", action="store_true", help="refit the finished workspace under --workdir; run nothing")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(a.stage, a.steps, a.child)
    if a.refit:
        fits = refit(a.workdir / a.stage.replace("@", "-"), a.stage, a.steps)
        out = RESULTS / f"memory_residual_{a.stage.replace('@', '-')}.json"
        res = json.loads(out.read_text()) if out.exists() else {"stage": a.stage, "steps": a.steps}
        write_json_atomic(out, {**res, "refit": fits})
        print(json.dumps(fits, indent=1))
        return None
    ws = fresh_clone(a.workdir / a.stage.replace("@", "-"))
    sets = [f"{k}={a.steps}" for k in STEP_KEYS[a.stage]] + ["tracking.log_every=1", "finetune.train_sizes=[all]"]
    subprocess.run([".venv/bin/python", "-m", "flows.pipeline", "--upto", UPTO[a.stage], "--preset", "tiny",
                    *[x for s in sets for x in ("--set", s)]], cwd=ws, check=True)
    raw = ws / "residual.json"
    subprocess.run(["scripts/py", "-m", "bench.bench_memory_residual", "--stage", a.stage, "--steps", str(a.steps),
                    "--child", str(raw)], cwd=ws, check=True, env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})
    res = json.loads(raw.read_text())
    write_json_atomic(RESULTS / f"memory_residual_{a.stage.replace('@', '-')}.json", res)
    print(f"{a.stage}, {a.steps} steps, allocator {res['allocator']}")
    for prefix, r in res["loops"].items():
        print(f"  {prefix or '(loop)'}: RSS {r['rss_slope_mb_per_1000']:+.2f} MB/1k steps, Python objects "
              f"{r['python_slope_mb_per_1000']:+.2f} MB/1k steps ({r['python_mb'][0]:.1f} -> {r['python_mb'][1]:.1f} MB)")
        for d in r["top_growth"][:6]:
            print(f"      {d['kib']:+8.1f} KiB {d['count']:+6d} objs  {d['where'][0]}")


if __name__ == "__main__":
    main()
