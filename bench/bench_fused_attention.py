"""Attention-probability dropout on a CPU's fused kernel: each model's training step at the presets'
shapes, as the stages run it (the fast dropout masks, length chunks, the shipped corpus's real row
lengths), with the probabilities' dropout through SDPA's math path written out (`math`, the path until
`FusedDropoutAttention`) against the fused kernel (`fused`, components/models/ops/dropout.py), and with
that dropout off (`off`: what `compute.attention_dropout: 0` would buy, a recipe change, for scale);
interleaved rounds, medians, ratios against `math`.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.bench_fused_attention --precision fp32   # -> bench/results/fused_attention_fp32.json
    OMP_NUM_THREADS=2 .venv/bin/python -m bench.bench_fused_attention --models biencoder --rounds 3

Why: with dropout on the attention probabilities, SDPA leaves its fused CPU kernel for the math path,
which writes every (L, L) score, probability and gradient matrix; MiniLM's heads are 32 wide, so those
matrices cost more than the matmuls around them. The fused path gets the same output from two flash
forwards and the same gradients from two flash backwards.

Before timing, an exactness check per model: one training step's loss and gradients from `math` and
from `fused` with the same seed (so the same keep masks), fp32, dropout on.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_length_chunks import BATCHES, build_ict, corpus_lengths, micro_batch_div  # noqa: E402
from bench.bench_mfu import BUILDERS, cpu_model, git_commit, minilm_bench_setup, train_step  # noqa: E402
from components.data.realm_batch import SpecialTokens  # noqa: E402
from components.data.tokenize import load_tokenizer  # noqa: E402
from components.io import write_json_atomic  # noqa: E402
from components.models.encoder import attention_layers, set_attention_dropout, set_length_chunk_tokens  # noqa: E402
from components.models.ops import dropout as D  # noqa: E402
from components.training.precision import autocast_for, cpu_has_native_bf16  # noqa: E402

VARIANTS = ("math", "fused", "off")


class _Path:
    """Route `attention`'s dropout through the math path (`math`), the fused kernel (`fused`), or
    turn the attention-probability dropout off (`off`) for the duration of a step."""

    def __init__(self, module: torch.nn.Module, variant: str):
        self.module, self.variant = module, variant

    def __enter__(self):
        self.flash = D._FLASH
        if self.variant == "math":
            D._FLASH = None
        elif self.variant == "off":
            layer = next(attention_layers(self.module))
            self.p = layer.attn_dropout if isinstance(getattr(layer, "attn_dropout", None), float) else layer.dropout.p
            set_attention_dropout(self.module, 0.0)
        return self

    def __exit__(self, *exc):
        D._FLASH = self.flash
        if self.variant == "off":
            set_attention_dropout(self.module, self.p)  # every layer of these models had the same p


def loss_and_grads(module: torch.nn.Module, batch: dict, variant: str, seed: int) -> tuple[float, torch.Tensor]:
    module.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with _Path(module, variant), autocast_for("fp32", "cpu"):
        loss = module(batch)["loss"]
        loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in module.parameters() if p.grad is not None])
    module.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def exactness(module: torch.nn.Module, batch: dict) -> dict:
    module.train()
    ref_loss, ref = loss_and_grads(module, batch, "math", seed=11)
    loss, g = loss_and_grads(module, batch, "fused", seed=11)
    return {"loss_abs_diff": abs(loss - ref_loss), "grad_rel_diff": float((g - ref).norm() / ref.norm().clamp_min(1e-30))}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=["biencoder", "realm", "ict", "retromae"],
                    default=["biencoder", "realm", "ict", "retromae"])
    ap.add_argument("--preset", default="params/small.yaml", help="preset merged over params.yaml for the shapes")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--rounds", type=int, default=9, help="timed rounds; each round steps every variant once")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per variant first")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="default bench/results/fused_attention_<precision>.json")
    args = ap.parse_args(argv)
    out_path = args.out or ROOT / f"bench/results/fused_attention_{args.precision}.json"
    params, warm = minilm_bench_setup(args.preset, args.threads)
    tokenizer = load_tokenizer(warm)
    ids = SpecialTokens.from_tokenizer(tokenizer)
    lens = corpus_lengths(params, tokenizer)
    lens["passage"] = np.minimum(lens["passage"], params.finetune.passage_len)
    lens["question"] = np.minimum(lens["question"], params.finetune.query_len)
    chunk = params.compute.length_chunk_tokens
    result = {"commit": git_commit(), "cpu": cpu_model(), "native_bf16": cpu_has_native_bf16(), "threads": args.threads,
              "precision": args.precision, "preset": args.preset, "rounds": args.rounds, "length_chunk_tokens": chunk,
              "models": {}}
    builders = {**BUILDERS, "ict": build_ict}
    for name in args.models:
        m = builders[name](params, warm, ids, micro_batch_div(params, name))
        D.use_fast_dropout(m.module)
        set_length_chunk_tokens(m.module, chunk)
        rng = np.random.default_rng(0)
        batches = ([BATCHES[name](m, lens, ids, rng) for _ in range(args.warmup + args.rounds)] if name in BATCHES
                   else [m.batch] * (args.warmup + args.rounds))  # RetroMAE: fixed 64-token windows
        check = exactness(m.module, batches[0])
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for i, b in enumerate(batches):  # interleaved: each batch is stepped with every variant
            m.batch = b
            for v in (VARIANTS if i % 2 == 0 else VARIANTS[::-1]):
                with _Path(m.module, v):
                    t0 = time.perf_counter()
                    train_step(m, args.precision)
                    dt = time.perf_counter() - t0
                if i >= args.warmup:
                    times[v].append(dt)
        base = statistics.median(times["math"])
        # paired: each round steps one batch with every variant back to back, so its ratio is free of the
        # host's drift between rounds; the median of those ratios is the figure to read
        rows = {v: {"s_per_step": round(statistics.median(ts), 4), "speedup_vs_math": round(base / statistics.median(ts), 3),
                    "paired_speedup_median": round(statistics.median(m / t for m, t in zip(times["math"], ts)), 3),
                    "paired_speedup_range": [round(min(m / t for m, t in zip(times["math"], ts)), 3),
                                             round(max(m / t for m, t in zip(times["math"], ts)), 3)],
                    "rounds": [round(t, 4) for t in ts]} for v, ts in times.items()}
        result["models"][name] = {"shape": m.shape, "check_fp32_same_masks": check, "variants": rows}
        print(f"{name} ({m.shape}): fused vs math, same masks: |dloss| {check['loss_abs_diff']:.1e}, "
              f"grad rel diff {check['grad_rel_diff']:.1e}")
        for v, r in rows.items():
            lo, hi = r["paired_speedup_range"]
            print(f"  {v:>5}: {r['s_per_step']:.3f} s/step  x{r['speedup_vs_math']:.2f}  paired x{r['paired_speedup_median']:.2f} "
                  f"({lo:.2f}-{hi:.2f})", flush=True)
    write_json_atomic(out_path, result)
    print(f"wrote {out_path}")
    return result


if __name__ == "__main__":
    main()
