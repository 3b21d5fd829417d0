"""Model-FLOPs utilisation (MFU) of the training steps, against this machine's own measured matmul peak.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.bench_mfu                          # all models, fp32 + bf16, 2 threads
    .venv/bin/python -m bench.bench_mfu --models retromae --precisions bf16 --steps 5
    .venv/bin/python -m bench.bench_mfu --smoke --threads 1 --steps 2 --models retromae --out /tmp/mfu.json
    OMP_NUM_THREADS=2 .venv/bin/python -m bench.bench_mfu --compile --out bench/results/mfu_compile.json   # + torch.compile'd steps

MFU = (FLOPs per step / median seconds per step) / peak FLOP/s of the same precision, goal >= 0.50.

What is measured, all in one process (issue 27 item 4):
    peak      the machine's own matmul rate: `F.linear(x, W)` (as the models' Linear layers compute it)
              at the shapes that dominate the steps, plus a large square matmul, in fp32 and in bf16
              (bf16 tensors, no autocast casts in the way); best of `--repeats` per shape per round,
              and the best over all shapes and rounds is "the measured peak" of that precision.
    steps     full training steps as the shared Trainer runs them (components/training/trainer.py,
              one micro-batch, one rank): its dropout masks (`--dropout-masks`, default the preset's
              compute.dropout_masks: fast ones on a CPU), autocast forward, loss.backward(),
              clip_grad_norm_, fused AdamW.step(), zero_grad. The collate (and REALM's index search) is not in the step.
    FLOPs     one forward + backward per model under torch.utils.flop_counter.FlopCounterMode: matmuls
              and attention, as executed (RetroMAE's fast path, which skips work no loss reads, counts
              less than 6 x params x tokens). The CPU's fused attention kernel, which FlopCounterMode
              does not know, is counted with torch's own SDPA formula (`COUNTED_ELSEWHERE`); any
              other matmul-like op the step ran uncounted is listed in the JSON (`uncounted_ops`).
              Non-matmul work (softmax, LayerNorm, AdamW) counts 0 FLOPs, as MFU figures do.
Models, at the `small` preset's shapes (params.yaml + params/small.yaml), warm-started from the
offline all-MiniLM-L6-v2 (`warm_start.path`; L6, H 384, FFN 1536, V 30522, dropout 0.1), built
by the same constructors the stages use:
    retromae   RetroMAE (encoder MLM + enhanced decoder), retromae.train.batch_size x retromae.max_len
               = 8 x 64 tokens (bench_step's batch: random full-length rows, whole-word masking)
    biencoder  BiEncoder, finetune.train.batch_size questions x query_len = 8 x 32 and
               (1 + hard_negatives) passages each x passage_len = 16 x 256 (bench_step_parts'
               batch, every row full length: real questions are shorter, so this is the upper end)
    realm      REALM (shared retriever towers, retriever_dim 384, reader = MiniLM + a fresh MLM head),
               one micro-batch of realm.train.batch_size / grad_accum queries x top_k candidates
               (small: 2 x 4, slot 0 the null document), query_len 48, block_len 256: 8 reader rows
               of 304 tokens, 8 + 2 retriever rows (bench_step_parts' batch: full-length x with one
               masked span of 2-10 tokens); with realm.freeze_reader (small) the reader is frozen as
               the stage freezes it after its warm-ups, so its rows are read under no_grad
`--compile` adds a `compiled` variant of every arm: the same module (the same parameters and optimiser)
behind `torch.compile` (inductor; C++ kernels on a CPU, so it needs a C++ compiler), whose first steps
compile it (`compile_s`, reported apart, never timed as a step). Its FLOPs are the eager step's: the
same computation, so the same count, and the two variants' MFU compare as their speeds do.
Every (model, precision, variant) arm is timed once per round, in a rotating order, with one peak
measurement per round, so load drift hits all alike. bf16 on a CPU without AVX512-BF16/AMX is
emulated by oneDNN: it is still reported, with `native_bf16` false (and "(emulated)" in the table).
Writes bench/results/mfu.json (or --out) atomically; `--smoke` shrinks the batches 4x, for a
quick check that everything runs, and writes nothing unless --out is given.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count
from transformers import AutoConfig
from transformers.utils import logging as hf_logging

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_step import make_batch as retromae_batch, summarize, timed  # noqa: E402
from bench.bench_step_parts import dpr_batch, realm_batch  # noqa: E402
from components.config import Params, load_params  # noqa: E402
from components.cpuinfo import cpu_model  # noqa: E402
from components.data.special_tokens import SpecialTokens  # noqa: E402
from components.data.tokenize import load_tokenizer  # noqa: E402
from components.io import write_json_atomic  # noqa: E402
from components.models.biencoder import BiEncoder  # noqa: E402
from components.models.encoder import warm_start_path  # noqa: E402
from components.models.ops.dropout import fast_dropout_masks, use_fast_dropout  # noqa: E402
from components.models.realm import REALM, KnowledgeAugmentedEncoder  # noqa: E402
from components.models.retriever import Retriever  # noqa: E402
from components.models.retromae import RetroMAE  # noqa: E402
from components.training.memory import allocator  # noqa: E402
from components.training.precision import autocast_for, cpu_has_native_bf16  # noqa: E402
from components.training.optim import param_groups  # noqa: E402

GOAL = 0.50
MODELS = ("retromae", "biencoder", "realm")
PRECISIONS = ("fp32", "bf16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEVICE = torch.device("cpu")  # the GPU figure is bench/gpu_check.py's
aten = torch.ops.aten


# ----------------------------------------------------------------------------------------------
# FLOP counting
# ----------------------------------------------------------------------------------------------
def _cpu_sdpa_flop(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)  # (B, nh, Lq, d) x (B, nh, Lk, d): QK^T and PV


def _cpu_sdpa_backward_flop(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


# SDPA without dropout (eval, or a config with attention dropout 0) runs this fused CPU kernel, which
# FlopCounterMode counts as 0 FLOPs; with dropout > 0 (training here: MiniLM's 0.1) SDPA takes the
# math path, whose bmm's it counts. Same formulas as torch's for the CUDA kernels.
COUNTED_ELSEWHERE = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flop,
}
_MATMUL_LIKE = re.compile(r"mm|matmul|attention|conv|linear|einsum|gemm")


class _OpsSeen(TorchDispatchMode):
    """The names of the ops a step executes (below FlopCounterMode, so after its decompositions)."""

    def __init__(self):
        super().__init__()
        self.ops: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func._overloadpacket)
        return func(*args, **(kwargs or {}))


def count_step_flops(model: torch.nn.Module, batch: dict, precision: str) -> dict[str, Any]:
    """FLOPs of one forward + backward (no optimiser step): total, per aten op, the matmul-like ops
    the counter has no formula for (should be empty), and the real tokens the step read."""
    seen = _OpsSeen()
    with seen, FlopCounterMode(display=False, custom_mapping=COUNTED_ELSEWHERE) as counter:
        with autocast_for(precision, DEVICE):
            out = model(batch)
        out["loss"].float().backward()
    model.zero_grad(set_to_none=True)
    by_op = {str(k): int(v) for k, v in counter.get_flop_counts()["Global"].items()}
    uncounted = sorted(str(op) for op in seen.ops if op not in counter.flop_registry and _MATMUL_LIKE.search(str(op)))
    return {"flops": float(counter.get_total_flops()), "flops_by_op": by_op, "uncounted_ops": uncounted,
            "tokens": int(out["num_tokens"])}


# ----------------------------------------------------------------------------------------------
# the machine's peak: a matmul microbenchmark
# ----------------------------------------------------------------------------------------------
def peak_shapes(cfg, rows: dict[str, int]) -> dict[str, tuple[int, int, int]]:
    """name -> (M, K, N) of `F.linear((M, K), (N, K))`: the FFN's first GEMM at each model's token
    count, the MLM head's vocabulary projection, and a large square matmul."""
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    shapes = {f"ffn {name} ({m} x {H} x {I})": (m, H, I) for name, m in rows.items()}
    shapes[f"mlm head (640 x {H} x {V})"] = (640, H, V)  # RetroMAE: ~30% of 8 x 64 (encoder) + 8 x 62 (decoder) rows
    shapes["square (2048 x 2048 x 2048)"] = (2048, 2048, 2048)
    return shapes


def matmul_tflops(x: torch.Tensor, w: torch.Tensor, repeats: int) -> float:
    """Best TFLOP/s of `F.linear(x, w)` over `repeats` calls."""
    flops = 2.0 * x.size(0) * x.size(1) * w.size(0)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        F.linear(x, w)
        best = min(best, time.perf_counter() - t)
    return flops / best / 1e12


@dataclass
class Peak:
    """Operands per (precision, shape), made once; `measure` adds one round of best-of-`repeats`."""

    shapes: dict[str, tuple[int, int, int]]
    precisions: list[str]
    repeats: int
    operands: dict = field(default_factory=dict)
    rounds: dict = field(default_factory=dict)  # (precision, shape) -> [TFLOP/s per round]

    def __post_init__(self):
        g = torch.Generator().manual_seed(0)
        for p in self.precisions:
            for name, (m, k, n) in self.shapes.items():
                self.operands[p, name] = (torch.randn(m, k, generator=g).to(DTYPES[p]),
                                          torch.randn(n, k, generator=g).to(DTYPES[p]))
                F.linear(*self.operands[p, name])  # warm-up: oneDNN primitive creation, first touch
                self.rounds[p, name] = []

    def measure(self) -> None:
        for key, (x, w) in self.operands.items():
            self.rounds[key].append(matmul_tflops(x, w, self.repeats))

    def best(self, precision: str) -> float:
        return max(max(v) for (p, _), v in self.rounds.items() if p == precision)

    def report(self, precision: str) -> dict:
        by_shape = {name: {"best_tflops": max(v), "median_tflops": float(np.median(v))}
                    for (p, name), v in self.rounds.items() if p == precision}
        return {"tflops": self.best(precision), "by_shape": by_shape}


# ----------------------------------------------------------------------------------------------
# models and batches at the small preset's shapes
# ----------------------------------------------------------------------------------------------
def load_preset(preset: str) -> Params:
    return load_params(ROOT / "params.yaml", presets=[ROOT / preset])


def minilm_bench_setup(preset: str, threads: int) -> tuple[Params, str]:
    """The step benchmarks' common start: `threads` torch threads, expected warnings quiet ("no MLM head,
    building one", "emulated bf16"), the preset's params and its warm-start folder (which must be set)."""
    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.WARNING)
    for name in ("components", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    params = load_preset(preset)
    warm = warm_start_path(params)
    if warm is None:
        raise SystemExit(f"{preset}: warm_start.path is null; this benchmark measures the MiniLM-sized models")
    return params, warm


@dataclass
class Model:
    name: str
    module: torch.nn.Module
    batch: dict[str, torch.Tensor]
    train: Any  # the section's TrainParams (lr, betas, weight decay, max_grad_norm)
    shape: dict  # what the batch is, for the JSON
    opt: torch.optim.Optimizer | None = None
    compiled: torch.nn.Module | None = None  # `--compile`: torch.compile(module), sharing its parameters

    def __post_init__(self):
        t = self.train
        self.module.train()
        # as the Trainer builds it: decay / no-decay groups, fused AdamW (also on CPU)
        self.opt = torch.optim.AdamW(param_groups(self.module, t.weight_decay), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2),
                                     eps=t.adam_eps, fused=True)


def build_retromae(params: Params, warm: str, ids: SpecialTokens, div: int) -> Model:
    p = params.retromae
    B, L = max(1, p.train.batch_size // div), p.max_len  # 8 x 64
    model = RetroMAE.from_params(p, ids, pretrained=warm)
    batch = retromae_batch({"batch": B, "max_len": L}, ids, p, seed=0)  # (B, L) full rows, ~30% masked
    return Model("retromae", model, batch, p.train, {"batch": B, "max_len": L})


def build_biencoder(params: Params, warm: str, ids: SpecialTokens, div: int) -> Model:
    f = params.finetune
    s = {"dpr_batch": max(1, f.train.batch_size // div), "dpr_query_len": f.query_len, "dpr_passage_len": f.passage_len,
         "vocab": ids.vocab_size}
    model = BiEncoder.from_pretrained(warm, temperature=f.temperature, negatives_cross_device=f.negatives_cross_device)
    batch = dpr_batch(s, f.hard_negatives, np.random.default_rng(0))  # (B, Lq) questions, (B*(1+H), Lp) passages
    return Model("biencoder", model, batch, f.train, {**s, "hard_negatives": f.hard_negatives})


def build_realm(params: Params, warm: str, ids: SpecialTokens, div: int) -> Model:
    r = params.realm
    # The stage's micro-batch: batch_size / grad_accum queries, each micro-batch its own forward and
    # backward (small: 16 / 8 = 2 queries, 8 reader rows).
    s = {"realm_batch": max(1, r.train.batch_size // (div * r.train.grad_accum)), "top_k": r.top_k, "query_len": r.query_len,
         "block_len": r.block_len, "vocab": ids.vocab_size}
    # the stage's build_model with retriever_init: retromae, from the warm-start folder
    torch.manual_seed(params.compute.seed)
    model = REALM(Retriever.from_encoder(warm, r.retriever_dim, r.share_towers), KnowledgeAugmentedEncoder.from_pretrained(warm),
                  r.marginalization)
    if r.freeze_reader:
        model.freeze_reader()  # as after the stage's warm-ups: the reader reads under no_grad, only the retriever trains
    batch = realm_batch(s, np.random.default_rng(0))  # x (B, Lx), z (B, K, Lz): reader rows (B*K, Lx+Lz)
    return Model("realm", model, batch, r.train, {**s, "retriever_dim": r.retriever_dim, "share_towers": r.share_towers,
                                                  "freeze_reader": r.freeze_reader, "grad_accum": r.train.grad_accum})


BUILDERS = {"retromae": build_retromae, "biencoder": build_biencoder, "realm": build_realm}


VARIANTS = ("eager", "compiled")


def train_step(m: Model, precision: str, variant: str = "eager") -> None:
    """One optimiser step as Trainer._train_step_inner takes it (grad_accum 1, one rank)."""
    module = m.compiled if variant == "compiled" else m.module
    with autocast_for(precision, DEVICE):
        out = module(m.batch)
    out["loss"].float().backward()
    max_norm = m.train.max_grad_norm if m.train.max_grad_norm > 0 else float("inf")
    torch.nn.utils.clip_grad_norm_(m.module.parameters(), max_norm)
    m.opt.step()
    m.opt.zero_grad(set_to_none=True)


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------
def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def verdict(mfu: float) -> str:
    return "pass" if mfu >= GOAL else "**fail**"


def markdown(arms: dict, native: bool) -> str:
    lines = ["| model | precision | variant | FLOPs/step | s/step | achieved TFLOP/s | peak TFLOP/s | MFU | goal | verdict |",
             "|---|---|---|---:|---:|---:|---:|---:|---|---|"]
    for a in arms.values():
        prec = a["precision"] + (" (emulated)" if a["precision"] == "bf16" and not native else "")
        lines.append(f"| {a['model']} | {prec} | {a['variant']} | {a['flops'] / 1e9:.1f} G | {a['median_s']:.3f} | {a['achieved_tflops']:.3f} "
                     f"| {a['peak_tflops']:.3f} | {a['mfu']:.3f} | >= {GOAL:.2f} | {a['verdict']} |")
    return "\n".join(lines)


def readme_rows(arms: dict, threads: int) -> str:
    """Rows in bench/README.md's format (benchmark | measure | value | goal | verdict)."""
    return "\n".join(f"| mfu | {a['model']} train step MFU, small/cpu/{a['precision']}/{a['variant']}/t{threads} (of the measured matmul "
                     f"peak, {a['peak_tflops']:.3f} TFLOP/s) | {a['mfu']:.3f} | >= {GOAL:.2f} | {a['verdict']} |"
                     for a in arms.values())


# ----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    ap.add_argument("--steps", type=int, default=10, help="timed steps per arm (rounds)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per arm before the FLOP count")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--repeats", type=int, default=3, help="matmul calls per peak shape per round (best taken)")
    ap.add_argument("--preset", default="params/small.yaml", help="preset merged over params.yaml for the shapes")
    ap.add_argument("--smoke", action="store_true", help="batches / 4, 1 warm-up step, 1 matmul repeat: does it run?")
    ap.add_argument("--out", default=None, help="default bench/results/mfu.json; with --smoke, nothing unless given")
    ap.add_argument("--dropout-masks", choices=("auto", "torch", "fast"), default=None,
                    help="as compute.dropout_masks (default: the preset's): the masks the Trainer's steps draw")
    ap.add_argument("--compile", action="store_true", help="also time each step through torch.compile(model) (inductor)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.warmup, args.repeats = min(args.warmup, 1), 1
    out_path = Path(args.out) if args.out else (None if args.smoke else ROOT / "bench" / "results" / "mfu.json")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for name in ("components", "transformers"):  # "no MLM head, building one", "emulated bf16": expected here
        logging.getLogger(name).setLevel(logging.ERROR)
    hf_logging.disable_progress_bar()  # "Loading weights" bars
    native = cpu_has_native_bf16()
    load_start = os.getloadavg()

    params = load_preset(args.preset)
    warm = warm_start_path(params)
    if warm is None:
        raise SystemExit(f"{args.preset}: warm_start.path is null; this benchmark measures the MiniLM-sized models")
    ids = SpecialTokens.from_tokenizer(load_tokenizer(warm))
    div = 4 if args.smoke else 1
    t0 = time.perf_counter()
    models = {name: BUILDERS[name](params, warm, ids, div) for name in args.models}
    masks = args.dropout_masks or params.compute.dropout_masks
    fast = fast_dropout_masks(masks, DEVICE)
    for m in models.values():  # the Trainer's module swap, so the steps are the stages' steps
        if fast:
            use_fast_dropout(m.module)
        if args.compile:
            m.compiled = torch.compile(m.module)
    variants = VARIANTS if args.compile else VARIANTS[:1]
    print(f"built {', '.join(models)} in {time.perf_counter() - t0:.1f}s; dropout_masks={masks} ({'fast' if fast else 'torch'}); "
          f"threads={torch.get_num_threads()} "
          f"cpu={cpu_model()!r} native_bf16={native} steps={args.steps} warmup={args.warmup}"
          f"{' SMOKE (batches / 4)' if args.smoke else ''}", flush=True)

    cfg = AutoConfig.from_pretrained(warm)  # every model is MiniLM-sized: H 384, FFN 1536, V 30522
    rows = {"retromae": params.retromae.train.batch_size * params.retromae.max_len,  # 8 x 64
            "passages": params.finetune.train.batch_size * (1 + params.finetune.hard_negatives) * params.finetune.passage_len,
            "reader": params.realm.train.batch_size * params.realm.top_k * (params.realm.query_len + params.realm.block_len)}
    peak = Peak(peak_shapes(cfg, {k: max(1, v // div) for k, v in rows.items()}), args.precisions, args.repeats)

    counts, compile_s = {}, {}
    for m in models:
        for p in args.precisions:
            for _ in range(args.warmup):
                train_step(models[m], p)
            counts[m, p] = count_step_flops(models[m].module, models[m].batch, p)
            print(f"  {m}/{p}: {counts[m, p]['flops'] / 1e9:.1f} GFLOP fwd+bwd, {counts[m, p]['tokens']} tokens"
                  + (f", UNCOUNTED {counts[m, p]['uncounted_ops']}" if counts[m, p]["uncounted_ops"] else ""), flush=True)
            if args.compile:  # the first compiled step compiles (and autocast's dtype is part of the graph)
                t = time.perf_counter()
                train_step(models[m], p, "compiled")
                compile_s[m, p] = time.perf_counter() - t
                for _ in range(args.warmup):
                    train_step(models[m], p, "compiled")
                print(f"  {m}/{p}/compiled: first step (compiling) {compile_s[m, p]:.1f}s", flush=True)
    arms = [(m, p, v) for m in models for p in args.precisions for v in variants]

    wall = {a: [] for a in arms}
    cpu = {a: [] for a in arms}
    for r in range(args.steps):
        peak.measure()
        for m, p, v in arms[r % len(arms):] + arms[: r % len(arms)]:  # rotate who goes first
            w, c = timed(lambda: train_step(models[m], p, v), DEVICE)
            wall[m, p, v].append(w)
            cpu[m, p, v].append(c)
        print(f"  round {r + 1}/{args.steps}: " + "  ".join(f"{'/'.join(a)}={wall[a][-1]:.2f}s" for a in arms)
              + "  peak " + " ".join(f"{p}={peak.best(p):.3f}" for p in args.precisions) + " TFLOP/s", flush=True)

    results = {}
    for m, p, v in arms:
        st = summarize(wall[m, p, v], counts[m, p]["tokens"])
        achieved = counts[m, p]["flops"] / st["median_s"] / 1e12
        mfu = achieved / peak.best(p)
        key = f"{m}/{p}" if v == "eager" else f"{m}/{p}/{v}"  # eager keeps the keys of the JSONs before --compile
        results[key] = {
            "model": m, "precision": p, "variant": v, **counts[m, p], **st,
            "cpu_time": summarize(cpu[m, p, v], counts[m, p]["tokens"]),
            "achieved_tflops": achieved, "peak_tflops": peak.best(p), "mfu": mfu, "goal": GOAL, "verdict": verdict(mfu),
            "shape": models[m].shape, **({"compile_s": compile_s[m, p]} if v == "compiled" else {}),
        }
    table = markdown(results, native)
    print("\n" + table + "\n\nREADME rows:\n" + readme_rows(results, torch.get_num_threads()))

    report = {
        "arms": results,
        "peak": {p: peak.report(p) for p in args.precisions},
        "goal": GOAL, "smoke": args.smoke, "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
        "preset": args.preset, "warm_start": warm, "table": table, "dropout_masks": masks, "fast_dropout": fast,
        "compile": args.compile,
        "env": {"cpu": cpu_model(), "native_bf16": native, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                "malloc": allocator(),  # the stages preload mimalloc (scripts/py); `python -m bench...` runs glibc's
                "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
                "loadavg_start": load_start, "loadavg": os.getloadavg(), "commit": git_commit(),
                "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
    }
    if out_path is not None:
        write_json_atomic(out_path, report)
        print(f"wrote {out_path}")
    return report


if __name__ == "__main__":
    main()
