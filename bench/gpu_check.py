"""GPU check: RetroMAE BERT-base training throughput + MFU, and an index refresh over 1M blocks.

    bash bench/gpu_check.sh            # on a GPU machine (< 8 min on one H200)
    bash bench/gpu_check.sh --cpu      # the reduced CPU form that CI can run (tiny shape, 10k blocks)

Part 1 trains RetroMAE (BERT-base, len 512, bf16 autocast, fused AdamW) for `--steps` steps on
random token data and reports tokens/s and MFU = achieved FLOP/s / peak FLOP/s, where the model
FLOPs per token are 6 * N_params (forward + backward of every weight, embeddings excluded) plus
12 * layers * hidden * seq (attention scores and values), counted for the encoder and the
decoder layer. Peak: `--peak-tflops` (default 989, the H100/H200 SXM dense bf16 figure).
Part 2 embeds `--embed-blocks` blocks with the BERT-base passage tower (throughput), then
builds a flat inner-product index over `--index-vectors` random 128-d vectors (faiss-gpu when
available, sharded over all GPUs) and searches it with 1,000 queries.
Writes bench/results/gpu_check.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from components.config import EncoderParams, RetroMAEParams  # noqa: E402
from components.data.masking import RetroMAECollator, SpecialTokens  # noqa: E402
from components.models.encoder import build_encoder  # noqa: E402
from components.models.retromae import RetroMAE  # noqa: E402

SHAPES = {
    "base": dict(hidden=768, layers=12, heads=12, inter=3072, vocab=30522, max_len=512, batch=32),
    "tiny": dict(hidden=64, layers=2, heads=2, inter=256, vocab=1000, max_len=128, batch=8),
}


def flops_per_token(model: torch.nn.Module, layers: int, hidden: int, seq: int) -> float:
    n = sum(p.numel() for name, p in model.named_parameters() if "embeddings" not in name)
    return 6.0 * n + 12.0 * (layers + 1) * hidden * seq  # +1: the enhanced-decoding layer


def random_rows(n: int, length: int, vocab: int, rng: np.random.Generator) -> list[dict]:
    rows = []
    for _ in range(n):
        ids = rng.integers(5, vocab, size=length)
        words = np.cumsum(rng.random(length) < 0.7) - 1  # ~1.4 pieces per word, like WordPiece
        words -= words[0]
        rows.append({"input_ids": ids.tolist(), "word_ids": words.tolist()})
    return rows


def train_throughput(shape: dict, steps: int, device: torch.device, bf16: bool) -> dict:
    ids = SpecialTokens(pad=0, cls=2, sep=3, mask=4, vocab_size=shape["vocab"], special=(0, 1, 2, 3, 4))
    enc = EncoderParams(hidden_size=shape["hidden"], num_layers=shape["layers"], num_heads=shape["heads"],
                        intermediate_size=shape["inter"], max_position=shape["max_len"], dropout=0.1)
    params = RetroMAEParams(encoder=enc, max_len=shape["max_len"])
    torch.manual_seed(0)
    model = RetroMAE.from_params(params, ids).to(device).train()
    collate = RetroMAECollator(ids, params, seed=0, pad_to_max_len=True)
    rng = np.random.default_rng(0)
    batches = [collate(random_rows(shape["batch"], shape["max_len"] - 2, shape["vocab"], rng)) for _ in range(4)]
    batches = [{k: v.to(device, non_blocking=True) for k, v in b.items()} for b in batches]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)

    def step(b):
        with amp:
            out = model(b)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out

    warm = min(5, max(1, steps // 10))
    for i in range(warm):
        step(batches[i % len(batches)])
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    tokens = 0
    for i in range(steps):
        out = step(batches[i % len(batches)])
        tokens += int(batches[i % len(batches)]["attention_mask"].sum())
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    fpt = flops_per_token(model, shape["layers"], shape["hidden"], shape["max_len"])
    return {"steps": steps, "batch": shape["batch"], "seq": shape["max_len"], "seconds": round(dt, 3),
            "tokens_per_s": tokens / dt, "step_ms": 1000 * dt / steps, "flops_per_token": fpt,
            "achieved_tflops": tokens * fpt / dt / 1e12, "final_loss": float(out["loss"].detach())}


def refresh_throughput(shape: dict, n_embed: int, n_index: int, device: torch.device, bf16: bool) -> dict:
    from components.index.faiss_index import BlockIndex, gpu_count

    ids = SpecialTokens(pad=0, cls=2, sep=3, mask=4, vocab_size=shape["vocab"], special=(0, 1, 2, 3, 4))
    enc = EncoderParams(hidden_size=shape["hidden"], num_layers=shape["layers"], num_heads=shape["heads"],
                        intermediate_size=shape["inter"], max_position=shape["max_len"], dropout=0.0)
    tower = build_encoder(enc, ids.vocab_size, ids.pad).base_model.to(device).eval()
    L, B = min(288, shape["max_len"]), 256 if device.type == "cuda" else 16
    x = torch.randint(5, shape["vocab"], (B, L), device=device)
    mask = torch.ones_like(x)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    with torch.inference_mode(), amp:
        tower(input_ids=x, attention_mask=mask)  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        done = 0
        while done < n_embed:
            tower(input_ids=x, attention_mask=mask).last_hidden_state[:, 0]
            done += B
        if device.type == "cuda":
            torch.cuda.synchronize()
        embed_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((n_index, 128), dtype=np.float32)
    t0 = time.perf_counter()
    index = BlockIndex.build(vecs, None, "flat", use_gpu="auto")
    build_s = time.perf_counter() - t0
    q = rng.standard_normal((1000, 128), dtype=np.float32)
    t0 = time.perf_counter()
    index.search(q, 10)
    search_s = time.perf_counter() - t0
    return {"embed_blocks": done, "block_len": L, "embed_blocks_per_s": done / embed_s,
            "index_vectors": n_index, "faiss_gpus": gpu_count(), "index_build_s": round(build_s, 3),
            "search_1000q_top10_s": round(search_s, 4),
            "projected_refresh_s_1M_blocks": round(1_000_000 / (done / embed_s) + build_s, 1)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="reduced CPU form (tiny shape, few steps, 10k vectors)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--embed-blocks", type=int, default=None)
    ap.add_argument("--index-vectors", type=int, default=None)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU (H100/H200 SXM: 989)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/gpu_check.json"))
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if cuda else "cpu")
    shape = SHAPES["base" if cuda else "tiny"]
    bf16 = cuda and torch.cuda.is_bf16_supported()
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    steps = args.steps or (200 if cuda else 6)
    res = {"device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu", "bf16": bf16,
           "shape": shape, "torch": torch.__version__}
    res["train"] = train_throughput(shape, steps, device, bf16)
    if cuda:
        res["train"]["mfu"] = res["train"]["achieved_tflops"] / args.peak_tflops
        res["train"]["mfu_goal"] = 0.40
    res["refresh"] = refresh_throughput(shape, args.embed_blocks or (50_000 if cuda else 64),
                                        args.index_vectors or (1_000_000 if cuda else 10_000), device, bf16)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    t = res["train"]
    print(f"train: {t['tokens_per_s']:.0f} tokens/s, {t['step_ms']:.1f} ms/step, {t['achieved_tflops']:.2f} TFLOP/s"
          + (f", MFU {t['mfu']:.1%} (goal 40%)" if "mfu" in t else " (CPU: no MFU)"))
    r = res["refresh"]
    print(f"refresh: {r['embed_blocks_per_s']:.0f} blocks/s embedding, flat index over {r['index_vectors']} vectors "
          f"built in {r['index_build_s']}s on {r['faiss_gpus']} GPU(s), 1000 queries in {r['search_1000q_top10_s']}s")
    return res


if __name__ == "__main__":
    main()
