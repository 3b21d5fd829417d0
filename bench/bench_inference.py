"""Inference on a CPU (issue 27): how close `evaluate`'s and the index refresh's MiniLM forward runs to this
machine's matmul peak, where its time goes, and the two alternatives tried for its costliest parts.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.bench_inference              # -> bench/results/inference.json
    .venv/bin/python -m bench.bench_inference --threads 1 --rounds 1 --out /tmp/inference.json

What is measured, in one process:
    embed     the default's retrieval blocks (the shipped corpus, prepared and tokenized by the real stage
              bodies into a temporary folder) embedded by the warm start with [CLS] pooling, as evaluate's
              dense rows embed them (`components.eval.dense.encode_token_rows`: longest first,
              `evaluate.batch_size` rows per forward, `evaluate.passage_len`; REALM's index refresh
              takes the same `embed_blocks` path at `realm.embed_batch_size`), under
              `torch.inference_mode()` and autocast in each precision. Median seconds over `--rounds`,
              and MFU = (the pass's FLOPs / seconds) / the measured matmul peak of that precision (FLOPs
              and peak as bench/bench_mfu.py counts and measures them: Linear layers and attention).
    profile   one bf16 pass (fp32 without native bf16) under torch.profiler: the share of self CPU
              time in the Linear layers' GEMMs, in attention, and in everything else.
    attention the scaled-dot-product attention of one such forward alone: `--attn-rows` rows x the
              model's heads (12) x L tokens x its head width (32), a padding mask on every other row,
              at each `--attn-len` (default: the shipped blocks' mean, 130 with [CLS] and [SEP], and
              the longest, 256). SDPA's default kernel (the CPU flash kernel), its math backend, and a
              hand-written matmul + softmax + matmul, as TFLOP/s (4 * B * H * L^2 * d FLOPs) and
              against the default.
    linear_cast  the Linear layers' weights cast to bf16 once, before the pass, against autocast casting
              them at every call: whether the output is the same bits, and the time ratio.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_embed_sort import shipped_blocks  # noqa: E402
from bench.bench_mfu import COUNTED_ELSEWHERE, Peak, cpu_model, git_commit, peak_shapes  # noqa: E402
from components.io import write_json_atomic  # noqa: E402
from components.training.precision import autocast_for, cpu_has_native_bf16  # noqa: E402

LINEAR_OPS = ("aten::addmm", "aten::mm", "aten::linear", "aten::bmm", "aten::matmul")


def embed_pass(encoder, rows: list[list[int]], tokenizer, ev, precision: str) -> Callable[[], Any]:
    """One embed of every block, as the dense rows run it."""
    from components.eval.dense import encode_token_rows

    def run():
        with torch.inference_mode(), autocast_for(precision, "cpu"):
            return encode_token_rows(encoder, rows, tokenizer, ev.passage_len, ev.batch_size, "bench")[0]

    return run


def seconds(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def median_seconds(fn: Callable[[], Any], rounds: int) -> tuple[float, list[float]]:
    fn()  # warm-up: oneDNN primitives for each width
    times = [seconds(fn) for _ in range(rounds)]
    return statistics.median(times), times


def pass_flops(fn: Callable[[], Any]) -> float:
    """Matmul and attention FLOPs of one pass (the CPU flash kernel counted with torch's SDPA formula)."""
    with FlopCounterMode(display=False, custom_mapping=COUNTED_ELSEWHERE) as counter:
        fn()
    return float(counter.get_total_flops())


def time_shares(fn: Callable[[], Any]) -> dict[str, float]:
    """Self CPU time of one pass by kind of op: the Linear layers' GEMMs, attention, the rest."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    kinds = {"linear": 0.0, "attention": 0.0, "other": 0.0}
    for e in prof.key_averages():
        kind = "attention" if "scaled_dot_product" in e.key else "linear" if e.key in LINEAR_OPS else "other"
        kinds[kind] += e.self_cpu_time_total
    total = sum(kinds.values()) or 1.0
    return {k: v / total for k, v in kinds.items()}


def attention_arms(rows: int, heads: int, length: int, dim: int, dtype: torch.dtype, rounds: int) -> dict[str, dict]:
    """SDPA's default kernel, its math backend and a hand-written one on (rows, heads, length, dim)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(rows, heads, length, dim, generator=g).to(dtype) for _ in range(3))
    mask = torch.zeros(rows, 1, 1, length, dtype=dtype)
    mask[::2, ..., length * 3 // 4 :] = float("-inf")  # every other row padded by a quarter

    def by_hand():
        scores = torch.matmul(q, k.transpose(-1, -2)) * dim**-0.5 + mask  # (B, H, L, L)
        return torch.matmul(torch.softmax(scores, dim=-1), v)  # (B, H, L, d)

    def math():
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    arms = {"sdpa (CPU flash kernel)": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
            "sdpa math backend": math, "matmul + softmax + matmul": by_hand}
    flops = 4.0 * rows * heads * length * length * dim
    out = {}
    with torch.inference_mode():
        reference = arms["sdpa (CPU flash kernel)"]().float()
        for name, fn in arms.items():
            sec, _ = median_seconds(fn, rounds)
            out[name] = {"seconds": sec, "tflops": flops / sec / 1e12,
                         "max_abs_diff": float((fn().float() - reference).abs().max())}
    base = out["sdpa (CPU flash kernel)"]["seconds"]
    for arm in out.values():
        arm["speedup_vs_sdpa"] = base / arm["seconds"]
    return out


def linear_cast(encoder):
    """A copy of `encoder` whose Linear layers hold bf16 weights (what autocast casts them to at each call)."""
    cast = copy.deepcopy(encoder)
    for module in cast.model.modules():
        if isinstance(module, torch.nn.Linear):
            module.to(torch.bfloat16)
    return cast


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--attn-rows", type=int, default=64, help="rows of the attention arms (evaluate.batch_size)")
    ap.add_argument("--attn-len", type=int, nargs="+", default=[130, 256], help="tokens per row: the shipped blocks' mean "
                    "(+ [CLS] [SEP]) and the longest")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/inference.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    native = cpu_has_native_bf16()
    precisions = ["fp32", "bf16"] if native else ["fp32"]

    from components.eval.dense import HFEncoder

    with tempfile.TemporaryDirectory() as tmp:
        p, warm, rows, tokenizer = shipped_blocks(Path(tmp), presets=[])  # the default's blocks
    ev = p.evaluate
    encoder = HFEncoder.load(warm)
    cfg = encoder.model.config
    peak = Peak(peak_shapes(cfg, {"embed": ev.batch_size * args.attn_len[0]}), precisions, repeats=5)
    result: dict[str, Any] = {"cpu": cpu_model(), "commit": git_commit(), "threads": args.threads, "rounds": args.rounds,
                              "native_bf16": native, "blocks": len(rows), "block_tokens": sum(map(len, rows)),
                              "batch_size": ev.batch_size, "passage_len": ev.passage_len, "embed": {}}
    for precision in precisions:
        run = embed_pass(encoder, rows, tokenizer, ev, precision)
        peak.measure()
        sec, times = median_seconds(run, args.rounds)
        peak.measure()
        flops = pass_flops(run)
        result["embed"][precision] = {"seconds": sec, "per_round": times, "flops": flops,
                                      "tflops": flops / sec / 1e12, "peak_tflops": peak.best(precision),
                                      "mfu": flops / sec / 1e12 / peak.best(precision)}
        print(f"embed {precision}: {sec:.2f} s ({', '.join(f'{t:.2f}' for t in times)}), "
              f"{flops / sec / 1e12:.3f} TFLOP/s, peak {peak.best(precision):.3f}: MFU {result['embed'][precision]['mfu']:.2f}")
    main_precision = precisions[-1]
    result["profile"] = {"precision": main_precision,
                         "time_share": time_shares(embed_pass(encoder, rows, tokenizer, ev, main_precision))}
    print("time shares ({}): {}".format(main_precision, ", ".join(f"{k} {v:.0%}" for k, v in result["profile"]["time_share"].items())))
    result["attention"] = []
    heads = cfg.num_attention_heads
    dim = cfg.hidden_size // heads
    for length in args.attn_len:
        for precision in precisions:
            dtype = torch.bfloat16 if precision == "bf16" else torch.float32
            arms = attention_arms(args.attn_rows, heads, length, dim, dtype, args.rounds)
            result["attention"].append({"shape": [args.attn_rows, heads, length, dim], "precision": precision, "arms": arms})
            for name, a in arms.items():
                print(f"attention L={length} {precision} {name}: {a['seconds'] * 1e3:.1f} ms, {a['tflops']:.3f} TFLOP/s, "
                      f"{a['speedup_vs_sdpa']:.2f}x, max |diff| {a['max_abs_diff']:.1e}")
    if native:
        cast = linear_cast(encoder)
        auto, pre = embed_pass(encoder, rows, tokenizer, ev, "bf16"), embed_pass(cast, rows, tokenizer, ev, "bf16")
        same = bool(torch.equal(torch.as_tensor(auto()), torch.as_tensor(pre())))  # also the arms' warm-up
        rounds = {"autocast": [], "cast once": []}
        for _ in range(args.rounds):  # interleaved: the host's drift hits both arms alike
            rounds["autocast"].append(seconds(auto))
            rounds["cast once"].append(seconds(pre))
        a, c = statistics.median(rounds["autocast"]), statistics.median(rounds["cast once"])
        result["linear_cast"] = {"same_bits": same, "seconds": {"autocast": a, "cast once": c}, "per_round": rounds,
                                 "speedup": a / c}
        print(f"Linear weights cast once: same bits {same}, {a:.2f} s -> {c:.2f} s ({a / c:.2f}x)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out, result)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
