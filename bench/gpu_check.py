"""GPU check: RetroMAE BERT-base training throughput + MFU, and an index refresh over 1M blocks.

    bash bench/gpu_check.sh            # on a GPU machine (< 10 min on one H200)
    bash bench/gpu_check.sh --cpu      # the reduced CPU form that CI can run (tiny shape, 10k blocks)

Part 1 trains RetroMAE (BERT-base, len 512, bf16 autocast, fused AdamW) for `--steps` steps on
random token data and reports tokens/s and MFU = achieved FLOP/s / peak FLOP/s, where the model
FLOPs per token are 6 * N_params (forward + backward of every weight, embeddings excluded) plus
12 * layers * hidden * seq (attention scores and values), counted for the encoder and the
decoder layer. Peak: `--peak-tflops` (default 989, the H100/H200 SXM dense bf16 figure).
Part 2 embeds `--embed-blocks` blocks with the BERT-base passage tower (throughput), then
builds a flat inner-product index over `--index-vectors` random 128-d vectors (faiss-gpu when
available, sharded over all GPUs) and searches it with 1,000 queries.
Part 3, the sharded refresh (components/index/shard.py): 2 ranks under torchrun (gloo; on one GPU
both share it) each embed half of `--shard-blocks` blocks in bf16, all-gather and build the flat
index on faiss-gpu; every rank's index must be the same (sha256 of the vectors), and the refresh's
own blocks/s is recorded (the paper-scale extrapolation in docs/experiments/paper_scale.md uses it).
Part 4, only with more than one GPU: 2 processes with NCCL train RetroMAE BERT-base under DDP for
`--ddp-steps` steps (tokens/s per GPU vs part 1's single GPU).
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

from components.config_shared import EncoderParams  # noqa: E402
from components.config_stages import RetroMAEParams  # noqa: E402
from components.data.masking import RetroMAECollator, SpecialTokens  # noqa: E402
from components.models.encoder import build_encoder  # noqa: E402
from components.models.retromae import RetroMAE  # noqa: E402
from components.io import write_text_atomic  # noqa: E402

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
    from components.index.build import gpu_count
    from components.index.faiss_index import BlockIndex

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


def _torchrun(nproc: int, args: list[str], timeout: int) -> dict:
    """Run this file's worker under torchrun; its rank 0 writes a JSON file, returned here."""
    import os
    import subprocess
    import tempfile

    out = Path(tempfile.mkdtemp()) / "worker.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", __file__,
           *args, "--worker-out", str(out)]
    # the repo first, and whatever PYTHONPATH already held (packages installed beside the image's) after it
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        return {"ok": False, "rc": p.returncode, "tail": (p.stdout + p.stderr)[-2000:]}
    return {"ok": True, **json.loads(out.read_text())}


def shard_worker(shape: dict, n_blocks: int, out: str) -> None:
    """Part 3 inside each rank: the sharded refresh, then every rank's index digest compared."""
    import hashlib
    import os

    import torch.distributed as dist

    from components.index.build import gpu_count
    from components.index.shard import RefreshGroups, embed_and_build_sharded

    dist.init_process_group("gloo")  # 2 ranks may share one GPU, which NCCL refuses
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()) if cuda else torch.device("cpu")
    groups = RefreshGroups.create()
    ids = SpecialTokens(pad=0, cls=2, sep=3, mask=4, vocab_size=shape["vocab"], special=(0, 1, 2, 3, 4))
    enc = EncoderParams(hidden_size=shape["hidden"], num_layers=shape["layers"], num_heads=shape["heads"],
                        intermediate_size=shape["inter"], max_position=shape["max_len"], dropout=0.0)
    torch.manual_seed(0)
    tower = build_encoder(enc, ids.vocab_size, ids.pad).base_model.to(device).eval()
    L, B = min(288, shape["max_len"]), 256 if cuda else 16
    rng = np.random.default_rng(0)
    blocks = [{"input_ids": rng.integers(5, shape["vocab"], L).tolist()} for _ in range(n_blocks)]

    def collate(rows):
        x = torch.tensor([r["input_ids"] for r in rows])
        return {"input_ids": x, "attention_mask": torch.ones_like(x)}

    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)

    def encode(b):
        with amp:
            h = tower(input_ids=b["input_ids"].to(device), attention_mask=b["attention_mask"].to(device))
        return h.last_hidden_state[:, 0, :128]  # (B, 128): the projection's width

    embed_and_build_sharded(encode, blocks[: 2 * B * world], list(range(2 * B * world)), batch_size=B, collate=collate,
                            groups=groups, index_type="flat")  # warm-up
    dist.barrier()
    t0 = time.perf_counter()
    index, st = embed_and_build_sharded(encode, blocks, list(range(n_blocks)), batch_size=B, collate=collate,
                                        groups=groups, index_type="flat", use_gpu="auto")
    wall = time.perf_counter() - t0
    digest = hashlib.sha256(index.embeddings().tobytes()).digest()[:8]
    d = torch.tensor(list(digest), dtype=torch.int64)
    gathered = [torch.empty_like(d) for _ in range(world)]
    dist.all_gather(gathered, d)
    if rank == 0:
        write_text_atomic(out, json.dumps({
            "ranks": world, "blocks": n_blocks, "block_len": L, "batch": B, "refresh_s": wall,
            "blocks_per_s": n_blocks / wall, "tokens_per_s": n_blocks * L / wall, "shard_seconds": st["shard_seconds"],
            "build_seconds": st["build_seconds"], "faiss_gpus": gpu_count(),
            "ranks_agree": all(torch.equal(g, gathered[0]) for g in gathered)}))
    dist.barrier()
    dist.destroy_process_group()


def nccl_worker(shape: dict, steps: int, out: str) -> None:
    """Part 4 inside each rank: DDP RetroMAE over NCCL, one GPU per rank."""
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    ids = SpecialTokens(pad=0, cls=2, sep=3, mask=4, vocab_size=shape["vocab"], special=(0, 1, 2, 3, 4))
    enc = EncoderParams(hidden_size=shape["hidden"], num_layers=shape["layers"], num_heads=shape["heads"],
                        intermediate_size=shape["inter"], max_position=shape["max_len"], dropout=0.1)
    params = RetroMAEParams(encoder=enc, max_len=shape["max_len"])
    torch.manual_seed(0)
    model = DDP(RetroMAE.from_params(params, ids).to(device).train(), device_ids=[device.index])
    collate = RetroMAECollator(ids, params, seed=rank, pad_to_max_len=True)
    rng = np.random.default_rng(rank)
    batch = {k: v.to(device) for k, v in collate(random_rows(shape["batch"], shape["max_len"] - 2, shape["vocab"], rng)).items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(batch)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tokens = torch.tensor([float(batch["attention_mask"].sum()) * steps], device=device)
    dist.all_reduce(tokens)
    if rank == 0:
        write_text_atomic(out, json.dumps({"ranks": world, "steps": steps, "seconds": dt, "tokens_per_s": float(tokens) / dt,
                                         "tokens_per_s_per_gpu": float(tokens) / dt / world,
                                         "final_loss": float(loss.detach())}))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="reduced CPU form (tiny shape, few steps, 10k vectors)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--embed-blocks", type=int, default=None)
    ap.add_argument("--index-vectors", type=int, default=None)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU (H100/H200 SXM: 989)")
    ap.add_argument("--shard-blocks", type=int, default=None, help="part 3: blocks of the 2-rank sharded refresh")
    ap.add_argument("--ddp-steps", type=int, default=30, help="part 4 (> 1 GPU): NCCL DDP steps")
    ap.add_argument("--out", default=str(ROOT / "bench/results/gpu_check.json"))
    ap.add_argument("--shard-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--nccl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.shard_worker:
        return shard_worker(SHAPES[args.shape], args.shard_blocks, args.worker_out) or {}
    if args.nccl_worker:
        return nccl_worker(SHAPES[args.shape], args.ddp_steps, args.worker_out) or {}
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
    shape_name = "base" if cuda else "tiny"
    res["sharded_refresh"] = _torchrun(2, ["--shard-worker", f"--shape={shape_name}",
                                           f"--shard-blocks={args.shard_blocks or (100_000 if cuda else 64)}"], timeout=240)
    n_gpus = torch.cuda.device_count() if cuda else 0
    if n_gpus > 1:
        res["nccl_ddp"] = _torchrun(2, ["--nccl-worker", f"--shape={shape_name}", f"--ddp-steps={args.ddp_steps}"], timeout=180)
        if res["nccl_ddp"].get("ok"):
            res["nccl_ddp"]["per_gpu_vs_single"] = res["nccl_ddp"]["tokens_per_s_per_gpu"] / res["train"]["tokens_per_s"]
    else:
        res["nccl_ddp"] = {"ok": None, "skipped": f"{n_gpus} GPU(s) visible; the NCCL run needs 2"}
    write_text_atomic(args.out, json.dumps(res, indent=2) + "\n")
    t = res["train"]
    print(f"train: {t['tokens_per_s']:.0f} tokens/s, {t['step_ms']:.1f} ms/step, {t['achieved_tflops']:.2f} TFLOP/s"
          + (f", MFU {t['mfu']:.1%} (goal 40%)" if "mfu" in t else " (CPU: no MFU)"))
    r = res["refresh"]
    print(f"refresh: {r['embed_blocks_per_s']:.0f} blocks/s embedding, flat index over {r['index_vectors']} vectors "
          f"built in {r['index_build_s']}s on {r['faiss_gpus']} GPU(s), 1000 queries in {r['search_1000q_top10_s']}s")
    sr = res["sharded_refresh"]
    print(f"sharded refresh: {sr.get('blocks_per_s', 0):.0f} blocks/s on {sr.get('ranks')} ranks, ranks agree: "
          f"{sr.get('ranks_agree')}" if sr.get("ok") else f"sharded refresh FAILED: {sr.get('tail')}")
    print(f"nccl ddp: {res['nccl_ddp']}")
    return res


if __name__ == "__main__":
    main()
