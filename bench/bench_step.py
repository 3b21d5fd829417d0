"""Train-step cost of RetroMAE against plain MLM on the same encoder, batch and sequence length.

    .venv/bin/python bench/bench_step.py --shape tiny              # params/tiny.yaml's encoder, len 128, batch 16
    .venv/bin/python bench/bench_step.py --shape base --steps 5    # BERT-base, len 512, batch 2
    .venv/bin/python bench/bench_step.py --shape base --profile    # + torch.profiler table per arm

A step is zero_grad + forward + backward + AdamW.step. Arms (each its own copy of the same
initial encoder and its own AdamW), run interleaved round-robin so drift hits all alike:
    retromae      components.models.retromae.RetroMAE (encoder MLM + one-layer enhanced decoder), as
                  trained: its fast path (last encoder layer and decoder output layers only where a
                  loss reads them, head fused with its cross-entropy)
    retromae_ref  the same model with `fast_path = False`: the straightforward computation the
                  tests hold the fast path to (same loss and gradients); before/after in one run
    mlm_hf        transformers BertForMaskedLM(labels=...) as is (head on every position)
    mlm           components.models.mlm.MLMModel (the project's MLM baseline; same fast path)
Reports the median and IQR per arm (wall and process CPU time), tokens/s (non-pad tokens / median
wall step) and the ratios retromae/mlm_hf (goal <= 1.10), retromae_ref/mlm_hf and retromae/mlm,
plus the FLOP ratio (torch FlopCounterMode), which no load on a shared box can disturb. Results merge into bench/results/step.json under "<shape>/<device>/<precision>/t<threads>".
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from components.config_shared import EncoderParams  # noqa: E402
from components.config_stages import RetroMAEParams  # noqa: E402
from components.data.masking import RetroMAECollator, SpecialTokens  # noqa: E402
from components.io import write_json_atomic  # noqa: E402
from components.models.mlm import MLMModel  # noqa: E402
from components.models.encoder import build_encoder  # noqa: E402
from components.models.retromae import RetroMAE  # noqa: E402

SHAPES = {
    # params/tiny.yaml's encoder and batch (dropout pinned to 0.0, as there, so timings stay comparable)
    "tiny": dict(hidden=128, layers=2, heads=2, inter=512, vocab=4000, max_len=128, batch=16, steps=30, warmup=5),
    # BERT-base as in the paper (len 512); batch 2 keeps a CPU step in seconds
    "base": dict(hidden=768, layers=12, heads=12, inter=3072, vocab=30522, max_len=512, batch=2, steps=5, warmup=1),
}
GOAL = 1.10


def make_batch(shape: dict, ids: SpecialTokens, params: RetroMAEParams, seed: int) -> dict[str, torch.Tensor]:
    """Full-length rows of random tokens, ~1.3 WordPiece pieces per word (English-like)."""
    rng = np.random.default_rng(seed)
    n = shape["max_len"] - 2
    rows = [{"input_ids": rng.integers(5, ids.vocab_size, n).tolist(),
             "word_ids": np.cumsum(rng.random(n) > 0.25).tolist()} for _ in range(shape["batch"])]
    return RetroMAECollator(ids, params, seed=seed)(rows)


def make_arms(shape: dict, ids: SpecialTokens, params: RetroMAEParams, device: torch.device) -> dict:
    torch.manual_seed(0)
    encoder = build_encoder(params.encoder, ids.vocab_size, ids.pad, cls_token_id=ids.cls, sep_token_id=ids.sep, mask_token_id=ids.mask)
    arms = {}
    retro = RetroMAE(copy.deepcopy(encoder), params).to(device)
    arms["retromae"] = (retro, lambda m, b: m(b)["loss"])
    ref = copy.deepcopy(retro)
    ref.fast_path = False
    arms["retromae_ref"] = (ref, lambda m, b: m(b)["loss"])
    hf = copy.deepcopy(encoder).to(device)
    arms["mlm_hf"] = (hf, lambda m, b: m(input_ids=b["encoder_input_ids"], attention_mask=b["attention_mask"], labels=b["encoder_labels"]).loss)
    arms["mlm"] = (MLMModel(copy.deepcopy(encoder)).to(device), lambda m, b: m(b)["loss"])
    return {name: (model.train(), fn, torch.optim.AdamW(model.parameters(), lr=1e-4)) for name, (model, fn) in arms.items()}


def train_step(model, loss_fn, opt, batch, autocast) -> None:
    opt.zero_grad(set_to_none=True)
    with autocast():
        loss = loss_fn(model, batch)
    loss.backward()
    opt.step()


def timed(fn, device: torch.device) -> tuple[float, float]:
    """(wall seconds, process CPU seconds). On a shared CPU box the CPU time is the steadier of the
    two (it does not count time spent waiting for a core); on a GPU only wall time means anything."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t, c = time.perf_counter(), time.process_time()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t, time.process_time() - c


def summarize(times: list[float], tokens: int) -> dict:
    q1, med, q3 = np.percentile(times, [25, 50, 75])
    return {"median_s": med, "iqr_s": q3 - q1, "q1_s": q1, "q3_s": q3, "tokens_per_s": tokens / med, "times_s": times}


def step_flops(arms: dict, batch: dict, autocast) -> dict[str, float]:
    """FLOPs of one forward+backward per arm (torch's FlopCounterMode: matmuls and attention),
    a noise-free measure of the extra work the decoder adds."""
    from torch.utils.flop_counter import FlopCounterMode

    out = {}
    for name, (model, fn, _) in arms.items():
        with FlopCounterMode(display=False) as counter:
            with autocast():
                loss = fn(model, batch)
            loss.backward()
        model.zero_grad(set_to_none=True)
        out[name] = float(counter.get_total_flops())
    return out


def profile(arms: dict, batch: dict, autocast, device: torch.device, rows: int = 18) -> None:
    from torch.profiler import ProfilerActivity, profile as tprofile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    for name, (model, fn, opt) in arms.items():
        with tprofile(activities=acts) as prof:
            train_step(model, fn, opt, batch, autocast)
        print(f"\n=== profile: {name} ===")
        print(prof.key_averages().table(sort_by=key, row_limit=rows))


def write_result(path: Path, key: str, result: dict) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = result
    write_json_atomic(path, data)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--steps", type=int, help="timed steps per arm (default: per shape)")
    ap.add_argument("--warmup", type=int, help="untimed steps per arm (default: per shape)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0 = torch default")
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table of one step per arm")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "step.json"))
    args = ap.parse_args(argv)

    shape = dict(SHAPES[args.shape])
    steps, warmup = args.steps or shape["steps"], args.warmup if args.warmup is not None else shape["warmup"]
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else ("cpu" if args.device == "auto" else args.device))
    precision = args.precision if args.precision != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    if args.threads:
        torch.set_num_threads(args.threads)
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if precision == "bf16" else nullcontext

    ids = SpecialTokens(pad=0, cls=2, sep=3, mask=4, vocab_size=shape["vocab"], special=(0, 1, 2, 3, 4))
    enc = EncoderParams(hidden_size=shape["hidden"], num_layers=shape["layers"], num_heads=shape["heads"],
                        intermediate_size=shape["inter"], max_position=max(512, shape["max_len"]), dropout=0.0)
    params = RetroMAEParams(encoder=enc, max_len=shape["max_len"])  # decoder ratio 0.5, pool 128, h1 raw
    batch = {k: v.to(device) for k, v in make_batch(shape, ids, params, seed=0).items()}
    tokens = int(batch["attention_mask"].sum())
    arms = make_arms(shape, ids, params, device)

    print(f"shape={args.shape} device={device} precision={precision} threads={torch.get_num_threads()} "
          f"batch={shape['batch']} len={shape['max_len']} steps={steps} warmup={warmup}", flush=True)
    for _ in range(warmup):
        for model, fn, opt in arms.values():
            train_step(model, fn, opt, batch, autocast)
    flops = step_flops(arms, batch, autocast)
    wall: dict[str, list[float]] = {name: [] for name in arms}
    cpu: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for r in range(steps):
        for name in names[r % len(names):] + names[: r % len(names)]:  # rotate who goes first
            model, fn, opt = arms[name]
            w, c = timed(lambda: train_step(model, fn, opt, batch, autocast), device)
            wall[name].append(w)
            cpu[name].append(c)
        print(f"  round {r + 1}/{steps}: " + "  ".join(f"{n}={wall[n][-1] * 1e3:.1f}ms" for n in names), flush=True)

    stats = {name: summarize(t, tokens) for name, t in wall.items()}
    cpu_stats = {name: summarize(t, tokens) for name, t in cpu.items()}

    def ratios(st: dict) -> tuple[float, float, float]:
        med = {name: s["median_s"] for name, s in st.items()}
        return med["retromae"] / med["mlm_hf"], med["retromae"] / med["mlm"], med["retromae_ref"] / med["mlm_hf"]

    def paired(times: dict[str, list[float]], num: str) -> dict:
        # per-round ratios (both arms in the same round, seconds apart): their spread says how
        # far load drift moved the ratio, which the ratio of medians hides
        r = np.array(times[num]) / np.array(times["mlm_hf"])
        q1, med, q3 = np.percentile(r, [25, 50, 75])
        return {"median": med, "q1": q1, "q3": q3}

    spread = {f"{kind}_{num}_vs_mlm_hf": paired(t, num) for kind, t in (("wall", wall), ("cpu_time", cpu))
              for num in ("retromae", "retromae_ref")}
    ratio_hf, ratio_mlm, ratio_ref = ratios(stats)
    cpu_ratio_hf, cpu_ratio_mlm, cpu_ratio_ref = ratios(cpu_stats)
    for name, s in stats.items():
        print(f"{name:12s} median {s['median_s'] * 1e3:9.2f} ms  IQR {s['iqr_s'] * 1e3:8.2f} ms  {s['tokens_per_s']:10.0f} tok/s"
              f"  | cpu-time median {cpu_stats[name]['median_s'] * 1e3:9.2f} ms  | {flops[name] / 1e9:8.2f} GFLOP fwd+bwd")
    print(f"ratio retromae/mlm_hf: wall {ratio_hf:.3f}  cpu-time {cpu_ratio_hf:.3f}  FLOPs {flops['retromae'] / flops['mlm_hf']:.3f}  (goal <= {GOAL})")
    print("per-round ratios, median [q1, q3]: " + "  ".join(
        f"{k} {v['median']:.3f} [{v['q1']:.3f}, {v['q3']:.3f}]" for k, v in spread.items()))
    print(f"ratio retromae_ref/mlm_hf: wall {ratio_ref:.3f}  cpu-time {cpu_ratio_ref:.3f}  FLOPs {flops['retromae_ref'] / flops['mlm_hf']:.3f}  (fast_path off)")
    print(f"ratio retromae/mlm   : wall {ratio_mlm:.3f}  cpu-time {cpu_ratio_mlm:.3f}  FLOPs {flops['retromae'] / flops['mlm']:.3f}")

    result = {
        "shape": args.shape, "config": shape, "device": str(device), "precision": precision,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "platform": platform.platform(),
        "cpu": platform.processor(), "steps": steps, "warmup": warmup, "tokens_per_step": tokens,
        "load_avg": os.getloadavg(), "arms": stats, "arms_cpu_time": cpu_stats, "gflops_fwd_bwd": {k: v / 1e9 for k, v in flops.items()},
        "ratio_retromae_vs_mlm_hf": ratio_hf, "ratio_retromae_vs_mlm": ratio_mlm,
        "cpu_time_ratio_retromae_vs_mlm_hf": cpu_ratio_hf, "cpu_time_ratio_retromae_vs_mlm": cpu_ratio_mlm,
        "flop_ratio_retromae_vs_mlm_hf": flops["retromae"] / flops["mlm_hf"], "flop_ratio_retromae_vs_mlm": flops["retromae"] / flops["mlm"],
        "ratio_retromae_ref_vs_mlm_hf": ratio_ref, "cpu_time_ratio_retromae_ref_vs_mlm_hf": cpu_ratio_ref,
        "flop_ratio_retromae_ref_vs_mlm_hf": flops["retromae_ref"] / flops["mlm_hf"],
        "paired_ratios": spread,
        "goal": GOAL,
        "params": {name: sum(p.numel() for p in m.parameters()) for name, (m, _, _) in arms.items()},
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    write_result(Path(args.out), f"{args.shape}/{device.type}/{precision}/t{torch.get_num_threads()}", result)
    if args.profile:
        profile(arms, batch, autocast, device)
    return result


if __name__ == "__main__":
    main()
