"""Refresh wall time vs ranks (issue 19): the sharded refresh (components/index/shard.py) on 1 and
2 gloo ranks on the CPU, interleaved in the same two processes, and its scaling efficiency.

    nice -n 19 .venv/bin/python bench/bench_refresh_scale.py            # launches 2 ranks itself

One refresh = embed `--blocks` blocks (random ids, 40-`--seq` tokens, padded per batch) with a
BERT-shaped passage tower (`--shape`), all-gather, build a flat index. Three modes take turns,
`--repeats` rounds, so a slow minute on the shared box hits all of them alike:
  A  1 rank x 1 thread   (rank 0 alone, the single-process code path; rank 1 waits at a barrier)
  B  1 rank x 2 threads  (the same cores as C, given to one process's intra-op threads)
  C  2 ranks x 1 thread  (the sharded refresh: each rank embeds half, then the all-gather)
Reported: medians, and per round
  efficiency      = A / (2 C)  strong scaling with one core per rank (the one-GPU-per-rank case;
                               goal >= 0.85)
  fair_ratio      = B / C      the same two cores as threads vs as ranks
  cpu_efficiency  = cpu(A) / (cpu(C, rank 0) + cpu(C, rank 1)), from process CPU seconds: the
                    extra work sharding adds (gather, duplicated glue), free of the neighbours'
                    load, but blind to one rank waiting for the other.
Writes bench/results/refresh_scale.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from components.io import write_text_atomic  # noqa: E402

SHAPES = {"small": dict(hidden=256, layers=4, heads=4, inter=1024), "tiny": dict(hidden=64, layers=2, heads=2, inter=256)}


def _world(a: argparse.Namespace):
    from components.config_shared import EncoderParams
    from components.models.encoder import build_encoder

    s = SHAPES[a.shape]
    enc = EncoderParams(hidden_size=s["hidden"], num_layers=s["layers"], num_heads=s["heads"], intermediate_size=s["inter"],
                        max_position=a.seq, dropout=0.0)
    torch.manual_seed(0)
    tower = build_encoder(enc, 30522, 0).base_model.eval()
    rng = np.random.default_rng(0)
    blocks = [{"input_ids": rng.integers(5, 30522, rng.integers(40, a.seq + 1)).tolist()} for _ in range(a.blocks)]

    def collate(rows):
        L = max(len(r["input_ids"]) for r in rows)
        x = torch.zeros(len(rows), L, dtype=torch.long)
        for i, r in enumerate(rows):
            x[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        return {"input_ids": x, "attention_mask": (x != 0).long()}

    def encode(b):
        return tower(**b).last_hidden_state[:, 0, :128]  # (B, 128)

    return blocks, collate, encode


def worker(a: argparse.Namespace) -> None:
    import torch.distributed as dist

    from components.index.shard import RefreshGroups, embed_and_build_sharded

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = RefreshGroups.create()
    blocks, collate, encode = _world(a)
    ids = list(range(len(blocks)))

    def one(mode: str) -> dict:
        torch.set_num_threads(2 if mode == "B" else 1)
        dist.barrier()
        w0, c0 = time.perf_counter(), time.process_time()
        if mode == "C":
            index, _ = embed_and_build_sharded(encode, blocks, ids, batch_size=a.batch, collate=collate,
                                               groups=groups, index_type="flat", use_gpu=False)
        elif rank == 0:
            index, _ = embed_and_build_sharded(encode, blocks, ids, batch_size=a.batch, collate=collate,
                                               index_type="flat", use_gpu=False)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        t = torch.tensor([cpu])
        dist.all_reduce(t)  # C: both ranks' CPU seconds; A/B: rank 1 idled (~0)
        dist.barrier()
        return {"wall_s": wall, "cpu_s": cpu, "cpu_all_s": float(t)}

    one("C")  # warm-up: allocator, gloo buffers, code paths
    one("A")
    rounds = []
    for r in range(a.repeats):
        order = ["A", "B", "C"] if r % 2 == 0 else ["C", "B", "A"]  # alternate the order too
        rounds.append({m: one(m) for m in order} | {"loadavg": os.getloadavg()[0]})
    if rank == 0:
        for x in rounds:
            x["efficiency"] = x["A"]["wall_s"] / (2 * x["C"]["wall_s"])
            x["fair_ratio"] = x["B"]["wall_s"] / x["C"]["wall_s"]
            x["cpu_efficiency"] = x["A"]["cpu_s"] / x["C"]["cpu_all_s"]
        med = {k: float(np.median([x[k] for x in rounds])) for k in ("efficiency", "fair_ratio", "cpu_efficiency")}
        med.update({f"{m}_wall_s": float(np.median([x[m]["wall_s"] for x in rounds])) for m in "ABC"})
        res = {"config": vars(a) | {"worker": None}, "rounds": rounds, "median": med,
               "goal": {"efficiency": ">= 0.85"}, "env": {"cpus": os.cpu_count(), "torch": torch.__version__}}
        write_text_atomic(a.out, json.dumps(res, indent=2))
        print(json.dumps(med, indent=2), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "refresh_scale.json"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a)
        return
    args = [f"--shape={a.shape}", f"--blocks={a.blocks}", f"--seq={a.seq}", f"--batch={a.batch}",
            f"--repeats={a.repeats}", f"--out={a.out}", "--worker"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
