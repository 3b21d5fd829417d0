"""Print experiments/results/warm_start.jsonl as a compact table."""
import json
from pathlib import Path

KEYS = ["name", "ndcg", "r20", "acc_enc", "acc_dec", "loss_enc", "loss_dec", "s_per_step_head", "s_per_step_joint", "eval_s", "load"]
for line in Path("experiments/results/warm_start.jsonl").read_text().splitlines():
    r = json.loads(line)
    print("  ".join(f"{k}={r[k]:.4g}" if isinstance(r.get(k), float) else f"{k}={r[k]}" for k in KEYS if k in r))
