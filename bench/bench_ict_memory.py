"""ICT's training step with and without activation checkpointing (`realm.ict_checkpoint_every`): peak
host memory, seconds per step, and whether the gradients stay the same.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.bench_ict_memory                 # small's ICT step, ~3 min on 2 cores
    .venv/bin/python -m bench.bench_ict_memory --preset params/tiny.yaml --steps 2 --out /tmp/ict_mem.json

Why: ICT's loss takes its negatives from the micro-batch, so splitting the step (`realm.ict_grad_accum`)
to save memory would also cut the negatives. `small`'s step (32 blocks of 256 tokens and 32 sentences
through MiniLM, in one micro-batch) raised `pretrain_realm`'s peak to 4.1-4.2 GB (bench/README.md,
"Host memory"). Checkpointing keeps every negative and drops the checkpointed layers' activations until
backward recomputes them.

Each arm runs in its own process, because a peak RSS is per process (`ru_maxrss`). An arm builds the
retriever as the stage does (`Retriever.from_encoder` on `warm_start.path`, the preset's `retriever_dim`
and `share_towers`), wraps it in `ICTModel`, swaps in the Trainer's dropout masks and autocast
(`compute.dropout_masks`, `compute.precision`), and runs `--steps` forward + backward passes on a batch of
the preset's ICT shape with every row full length: `ict_batch_size / ict_grad_accum` sentences of
`ict_query_len` (or `query_len`) and as many blocks of `block_len` tokens, the shape that sets the peak.
Arms: `every_n_layers` 0 (every activation stored: the baseline) and each `--every` stride. Reported per
arm: peak RSS, its rise over the RSS before the first step (the step's transient), and the median seconds
of the steps after the first, with both as ratios to the baseline. Each arm's first-step gradients (same
seed, dropout on) are compared with the baseline's: checkpointing replays the generator, so they must agree.
The optimiser is left out: its state is the same in every arm.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_mfu import load_preset  # noqa: E402
from components.config import Params  # noqa: E402
from components.io import write_json_atomic  # noqa: E402


def ict_shape(params: Params) -> dict[str, int]:
    p = params.realm
    return {"batch": p.ict_batch_size // p.ict_grad_accum, "query_len": p.ict_query_len or p.query_len,
            "block_len": p.block_len}


def run_arm(preset: str, every: int, steps: int, grads_out: Path) -> dict:
    """One arm, in this process: see the module docstring."""
    from components.models.encoder import activation_checkpointing, set_attention_dropout, warm_start_path
    from components.models.ict import ICTModel
    from components.models.ops.dropout import fast_dropout_masks, use_fast_dropout
    from components.models.retriever import Retriever
    from components.training import memory
    from components.training.precision import autocast_for, resolve_precision

    params = load_preset(preset)
    warm = warm_start_path(params)
    if warm is None:
        raise SystemExit(f"{preset}: warm_start.path is null; this benchmark measures the stage's warm-started towers")
    torch.manual_seed(params.compute.seed)
    p, compute, cpu = params.realm, params.compute, torch.device("cpu")
    model = ICTModel(Retriever.from_encoder(warm, p.retriever_dim, p.share_towers))
    if compute.attention_dropout is not None:
        set_attention_dropout(model, compute.attention_dropout)
    if fast_dropout_masks(compute.dropout_masks, cpu):
        use_fast_dropout(model)
    s = ict_shape(params)
    vocab = model.retriever.query_encoder.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def rows(length: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(1000, vocab, (s["batch"], length), generator=gen)  # (B, L), clear of the special ids
        ids[:, 0], ids[:, -1] = 101, 102  # BERT's [CLS], [SEP]
        return ids, torch.ones_like(ids)

    (qi, qm), (di, dm) = rows(s["query_len"]), rows(s["block_len"])
    batch = {"q_input_ids": qi, "q_attention_mask": qm, "d_input_ids": di, "d_attention_mask": dm}
    model.train()
    rss_before, times = memory.rss_mb(), []
    with activation_checkpointing(model, every):
        for step in range(steps):
            torch.manual_seed(params.compute.seed + step)  # the same dropout masks in both arms
            t = time.perf_counter()
            with autocast_for(compute.precision, cpu):
                loss = model(batch)["loss"]
            loss.backward()
            times.append(time.perf_counter() - t)
            if step == 0:
                torch.save({n: q.grad.float().clone() for n, q in model.named_parameters() if q.grad is not None}, grads_out)
            model.zero_grad(set_to_none=True)
    peak = memory.peak_rss_mb()
    return {"every_n_layers": every, "peak_rss_mb": round(peak), "step_rise_mb": round(peak - rss_before),
            "s_per_step": round(statistics.median(times[1:] or times), 3), **s,
            "precision": resolve_precision(compute.precision, cpu)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="params/small.yaml", help="preset merged over params.yaml: the ICT shape and towers")
    ap.add_argument("--every", type=int, nargs="+", default=[1, 2, 3],
                    help="the checkpointed arms' layer strides (every_n_layers); the baseline arm, 0, stores every activation")
    ap.add_argument("--steps", type=int, default=6, help="forward + backward passes per arm (the first is not timed)")
    ap.add_argument("--rounds", type=int, default=1, help="every arm once per round, in a rotating order; medians over rounds")
    ap.add_argument("--out", default=str(ROOT / "bench/results/ict_memory.json"))
    ap.add_argument("--arm", type=int, help=argparse.SUPPRESS)  # internal: run one arm (its stride) in this process
    ap.add_argument("--grads", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.arm is not None:
        print(json.dumps(run_arm(args.preset, args.arm, args.steps, Path(args.grads))))
        return

    arms = [0, *sorted(set(args.every) - {0})]
    runs: dict[int, list[dict]] = {a: [] for a in arms}
    diffs: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for a in arms[r % len(arms):] + arms[:r % len(arms)]:
                cmd = [sys.executable, "-m", "bench.bench_ict_memory", "--preset", args.preset, "--steps", str(args.steps),
                       "--arm", str(a), "--grads", str(Path(tmp) / f"{a}.pt")]
                out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
                runs[a].append(json.loads(out.strip().splitlines()[-1]))
        ref = torch.load(Path(tmp) / "0.pt")
        scale = max(t.abs().max().item() for t in ref.values())
        for a in arms[1:]:
            g = torch.load(Path(tmp) / f"{a}.pt")
            diffs[a] = max((ref[n] - g[n]).abs().max().item() for n in ref)

    def med(a: int, key: str) -> float:
        return statistics.median(x[key] for x in runs[a])

    first = runs[0][0]
    print(f"ICT step, {args.preset}: {first['batch']} sentences x {first['query_len']} + {first['batch']} blocks x "
          f"{first['block_len']} tokens, {first['precision']}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')}, "
          f"{args.rounds} round(s) of {args.steps} steps")
    print(f"{'every_n_layers':<16}{'peak RSS MB':>12}{'step rise MB':>14}{'x':>7}{'s/step':>9}{'x':>7}{'grad max |diff|':>17}")
    table = []
    for a in arms:
        row = {"every_n_layers": a, "peak_rss_mb": med(a, "peak_rss_mb"), "step_rise_mb": med(a, "step_rise_mb"),
               "s_per_step": med(a, "s_per_step"), "grad_max_abs_diff": diffs.get(a, 0.0)}
        row["rise_ratio"] = row["step_rise_mb"] / max(med(0, "step_rise_mb"), 1)
        row["time_ratio"] = row["s_per_step"] / med(0, "s_per_step")
        table.append(row)
        name = "0 (stored)" if a == 0 else str(a)
        print(f"{name:<16}{row['peak_rss_mb']:>12.0f}{row['step_rise_mb']:>14.0f}{row['rise_ratio']:>7.2f}"
              f"{row['s_per_step']:>9.2f}{row['time_ratio']:>7.2f}{row['grad_max_abs_diff']:>17.1e}")
    print(f"(largest first-step gradient element {scale:.2e}; checkpointing must leave the gradients as they are)")
    write_json_atomic(Path(args.out), {"preset": args.preset, "steps": args.steps, "rounds": args.rounds,
                                       "threads": os.environ.get("OMP_NUM_THREADS"),
                                       "machine": platform.processor() or platform.machine(), "table": table,
                                       "runs": {str(a): v for a, v in runs.items()}, "grad_max_abs": scale})


if __name__ == "__main__":
    main()
