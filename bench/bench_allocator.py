"""Which malloc a training process should run on: RSS slope and step time, side by side.

    python -m bench.bench_allocator                 # 200 RetroMAE steps per arm (~2 min each on 2 cores)
    python -m bench.bench_allocator --steps 400 --arms glibc mimalloc

One RetroMAE loop as the `small` preset runs it (MiniLM warm start, batch 8, blocks of 8-62 tokens
so every batch pads to its own length, the preset's precision), on synthetic token ids, in a fresh
process per arm: glibc as it comes (`malloc_trim_every` 0), glibc with the Trainer's heap trim
every 50 steps, and mimalloc (the `cmeel-mimalloc` wheel), jemalloc and tcmalloc preloaded (the
last two when the system has them). Prints, per arm, the RSS slope after the first quarter of the
steps (MB per 1,000 steps), the last RSS, and the wall time as a ratio to glibc's.
Writes bench/results/allocator.json.
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

RESULTS = ROOT / "bench/results/allocator.json"
ARMS = ("glibc", "glibc+trim", "mimalloc", "jemalloc", "tcmalloc")


def child(steps: int, trim_every: int) -> dict:
    """The loop itself, in this process: per-step RSS and the loop's wall time."""
    import tempfile

    import numpy as np

    from components.config import load_params
    from components.data.masking import RetroMAECollator
    from components.data.special_tokens import SpecialTokens
    from components.models.encoder import warm_start_path
    from components.models.retromae import RetroMAE
    from components.training import memory
    from components.training.trainer import Trainer

    p = load_params(ROOT / "params.yaml", presets=[ROOT / "params/small.yaml"], overrides={
        "compute.malloc_trim_every": trim_every, "retromae.train.max_steps": steps,
        "retromae.train.checkpoint_every": 10**6})
    ids = SpecialTokens(pad=0, cls=101, sep=102, mask=103, vocab_size=30522, special=(0, 100, 101, 102, 103))
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(4000):
        n = int(rng.integers(8, 63))
        rows.append({"input_ids": rng.integers(1000, 30000, n).tolist(), "word_ids": list(range(n))})
    model = RetroMAE.from_params(p.retromae, ids, pretrained=warm_start_path(p))
    rss: list[float] = []
    trainer = Trainer(model, rows, RetroMAECollator(ids, p.retromae, seed=1), p.retromae.train, p.compute,
                      tempfile.mkdtemp(), hooks={"on_step_end": lambda s, t: rss.append(memory.rss_mb())},
                      progress=False, progress_every=0)
    t0 = time.perf_counter()
    trainer.fit()
    return {"allocator": memory.allocator(), "seconds": time.perf_counter() - t0, "rss_mb": rss}


def run_arm(arm: str, steps: int) -> dict | None:
    """The loop in a fresh process started as every stage is, by scripts/py, with RR_ALLOCATOR set."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["RR_ALLOCATOR"] = "system" if arm.startswith("glibc") else arm
    trim = 50 if arm == "glibc+trim" else 0
    out = subprocess.run([str(ROOT / "scripts/py"), "-m", "bench.bench_allocator", "--child", str(steps), str(trim)],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode == 127:  # scripts/py: that allocator is not installed here
        print(f"{arm}: skipped ({out.stderr.strip().splitlines()[0]})", flush=True)
        return None
    if out.returncode:
        raise RuntimeError(f"{arm}: exit {out.returncode}\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(*a.child)))
        return
    from bench.bench_memory import slope_per_1000
    from components.io import write_json_atomic

    res = {}
    for arm in a.arms:
        r = run_arm(arm, a.steps)
        if r is not None:
            r["slope_mb_per_1000"] = slope_per_1000(list(enumerate(r["rss_mb"], 1)))
            res[arm] = r
            print(f"{arm}: {r['seconds']:.1f} s, RSS {r['rss_mb'][0]:.0f} -> {r['rss_mb'][-1]:.0f} MB", flush=True)
    base = res.get("glibc", {}).get("seconds")
    print("\n| allocator | steps | RSS slope (MB/1k steps) | RSS at the end (MB) | wall / glibc |\n|---|---:|---:|---:|---:|")
    for arm, r in res.items():
        ratio = f"{r['seconds'] / base:.2f}" if base else "-"
        print(f"| {arm} ({r['allocator']}) | {len(r['rss_mb'])} | {r['slope_mb_per_1000']:+.0f} | {r['rss_mb'][-1]:.0f} | {ratio} |")
    write_json_atomic(RESULTS, {"steps": a.steps, "arms": res})


if __name__ == "__main__":
    main()
