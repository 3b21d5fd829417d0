"""What dropout costs a CPU training step, at the presets' shapes: each model's step with torch's own
dropout masks (MiniLM's dropout 0.1 everywhere, `compute.dropout_masks: torch`) against the same step
with the fast masks (`fast`, what `auto` trains with on a CPU: the same dropout, components/models/ops/
dropout.py), with the attention-probability dropout off, and with every dropout off; interleaved
rounds, medians, ratios against "as is".

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.bench_dropout              # -> bench/results/dropout.json
    OMP_NUM_THREADS=2 .venv/bin/python -m bench.bench_dropout --models realm --rounds 3 --profile

Why it matters on a CPU: a dropout mask is one `bernoulli_` draw per element, and the attention
probabilities are (rows, heads, L, L): at 304 tokens that is ~20x the hidden states. With dropout on
them, `scaled_dot_product_attention` also leaves its fused CPU kernel for the math path (bmm, softmax,
mask) that writes every (L, L) matrix. Turning a dropout off is a recipe change, and on the dev split it
cost REALM and the 32-question fine-tunes (bench/README.md, "Dropout on a CPU"); the fast masks keep
every dropout. `--profile` prints the top operators of one "as is" and one "fast masks" step
(torch.profiler), where `aten::bernoulli_` shows what torch's masks cost.

The models and batches are `bench.bench_mfu`'s (the stages' models, shapes from `--preset`); REALM's
step is one query and its top_k candidates, the micro-batch the stages train on.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_mfu import BUILDERS, cpu_model, git_commit, minilm_bench_setup, train_step  # noqa: E402
from components.data.realm_batch import SpecialTokens  # noqa: E402
from components.data.tokenize import load_tokenizer  # noqa: E402
from components.io import write_json_atomic  # noqa: E402
from components.models.encoder import set_attention_dropout  # noqa: E402
from components.models.ops.dropout import use_fast_dropout  # noqa: E402
from components.training.precision import cpu_has_native_bf16  # noqa: E402

VARIANTS = ("as is", "fast masks", "no attention-prob dropout", "no dropout")
# a micro-batch as the stages train it: REALM one query (its top_k rows), the others their whole batch
MICRO_BATCH_DIV = {"realm": "batch_size", "biencoder": 1, "retromae": 1}


def set_dropout(module: torch.nn.Module, variant: str) -> int:
    """Zero the dropouts `variant` turns off; returns how many layers or modules changed. The attention
    variant is what `compute.attention_dropout: 0` does to every model a Trainer trains."""
    if variant == "as is":
        return 0
    if variant == "fast masks":  # every dropout kept, its masks drawn as `compute.dropout_masks: fast` draws them
        return use_fast_dropout(module)
    changed = set_attention_dropout(module, 0.0)
    if variant == "no dropout":
        for m in module.modules():
            if isinstance(m, torch.nn.Dropout) and m.p > 0:
                m.p = 0.0
                changed += 1
    return changed


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=list(BUILDERS), default=["realm", "biencoder", "retromae"])
    ap.add_argument("--preset", default="params/small.yaml", help="preset merged over params.yaml for the shapes")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds; each round steps every variant once")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="print the top operators of one 'as is' step per model")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/dropout.json")
    args = ap.parse_args(argv)
    params, warm = minilm_bench_setup(args.preset, args.threads)
    ids = SpecialTokens.from_tokenizer(load_tokenizer(warm))
    result = {"commit": git_commit(), "cpu": cpu_model(), "native_bf16": cpu_has_native_bf16(), "threads": args.threads,
              "precision": args.precision, "preset": args.preset, "rounds": args.rounds, "models": {}}
    for model_name in args.models:
        div = MICRO_BATCH_DIV[model_name]
        div = params.realm.train.batch_size if div == "batch_size" else div
        arms = {}
        for v in VARIANTS:  # one model per variant, built alike (the builders seed), so only the dropout differs
            m = BUILDERS[model_name](params, warm, ids, div)
            arms[v] = (m, set_dropout(m.module, v))
            for _ in range(args.warmup):
                train_step(m, args.precision)
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for _ in range(args.rounds):  # interleaved: a load change hits every variant alike
            for v, (m, _) in arms.items():
                t0 = time.perf_counter()
                train_step(m, args.precision)
                times[v].append(time.perf_counter() - t0)
        base = statistics.median(times["as is"])
        rows = {v: {"s_per_step": round(statistics.median(ts), 4), "speedup_vs_as_is": round(base / statistics.median(ts), 3),
                    "modules_changed": arms[v][1], "rounds": [round(t, 4) for t in ts]} for v, ts in times.items()}
        result["models"][model_name] = {"shape": arms["as is"][0].shape, "variants": rows}
        print(f"{model_name} ({arms['as is'][0].shape}):")
        for v, r in rows.items():
            print(f"  {v:<28} {r['s_per_step']:.3f} s/step  x{r['speedup_vs_as_is']:.2f}  ({r['modules_changed']} modules changed)")
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            for v in ("as is", "fast masks"):
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    train_step(arms[v][0], args.precision)
                print(f"{model_name}, {v}:")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    write_json_atomic(args.out, result)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
