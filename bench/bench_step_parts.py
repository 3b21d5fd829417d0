"""Where a REALM train step goes, and what hard negatives cost a DPR fine-tuning step.

    .venv/bin/python bench/bench_step_parts.py                      # tiny shapes (params/tiny.yaml), ~1 min on 2 cores
    .venv/bin/python bench/bench_step_parts.py --shape base --steps 3   # BERT-base shapes (slow on CPU)

REALM (`components.models.realm.REALM`, the model the stage trains), one step split into:
    retrieve   encode the masked queries with the retriever (no grad: the index side of the step)
               + FAISS inner-product search for the top-k over `--blocks` random block vectors
    score      `retrieval_log_probs`: re-embed the k candidates and the query WITH gradients, p(z|x)
    ka         the rest of the forward: the knowledge-augmented encoder over B*k `[CLS] x [SEP] z [SEP]`
               rows and the marginal likelihood (forward minus score, per round)
    backward   loss.backward() + AdamW.step()
Reported as median seconds and as the fraction of the step.

DPR (`components.models.biencoder.BiEncoder`), the whole train step with 0 vs `--hard-negatives`
hard negatives per query, interleaved A B A B ...; the ratio is what the hard negatives cost
(they add B*H passages to encode, so ~ (Lq + (1+H)*Lp) / (Lq + Lp) in encoder work).

Results merge into bench/results/step_parts.json under "<shape>/<device>/t<threads>".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_step import summarize  # noqa: E402
from components.data.special_tokens import IGNORE_INDEX  # noqa: E402
from components.index.faiss_index import BlockIndex  # noqa: E402
from components.io import write_json_atomic  # noqa: E402
from components.models.biencoder import BiEncoder  # noqa: E402
from components.models.realm import REALM, KnowledgeAugmentedEncoder  # noqa: E402
from components.models.retriever import Retriever  # noqa: E402

PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4
SHAPES = {
    # params/tiny.yaml: the tiny encoder; realm.{query_len, block_len, top_k, retriever_dim}, realm.train.batch_size;
    # finetune.{query_len, passage_len}, finetune.train.batch_size
    "tiny": dict(hidden=128, layers=2, heads=2, inter=512, vocab=4000, realm_batch=8, top_k=8, query_len=48, block_len=80,
                 dim=128, dpr_batch=16, dpr_query_len=32, dpr_passage_len=80, steps=20, warmup=3),
    # BERT-base with the paper's REALM lengths (96 / 288); small batches keep a CPU step in seconds
    "base": dict(hidden=768, layers=12, heads=12, inter=3072, vocab=30522, realm_batch=1, top_k=8, query_len=96, block_len=288,
                 dim=128, dpr_batch=4, dpr_query_len=32, dpr_passage_len=256, steps=3, warmup=1),
}


def bert_config(s: dict):
    from transformers import BertConfig

    return BertConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                      num_attention_heads=s["heads"], intermediate_size=s["inter"], pad_token_id=PAD,
                      max_position_embeddings=512)


def _rows(rng, n: int, length: int, vocab: int) -> torch.Tensor:
    return torch.as_tensor(rng.integers(5, vocab, (n, length)))


# ----------------------------------------------------------------------------------------------
# REALM
# ----------------------------------------------------------------------------------------------
def realm_batch(s: dict, rng) -> dict[str, torch.Tensor]:
    """Masked queries (one salient span of <= 10 [MASK]s each) and k candidates per query, slot 0
    the null document, as `realm_batch.collate` lays them out."""
    B, K, Lx, Lz = s["realm_batch"], s["top_k"], s["query_len"], s["block_len"]
    x = _rows(rng, B, Lx, s["vocab"])
    x[:, 0], x[:, -1] = CLS, SEP
    labels = torch.full_like(x, IGNORE_INDEX)
    for b in range(B):
        start = int(rng.integers(1, Lx - 11))
        span = slice(start, start + int(rng.integers(2, 11)))
        labels[b, span], x[b, span] = x[b, span], MASK
    z = _rows(rng, B * K, Lz, s["vocab"]).view(B, K, Lz)
    z[..., -1] = SEP
    z[:, 0] = PAD
    z[:, 0, 0] = SEP  # the null document: just [SEP]
    return {"x_input_ids": x, "x_attention_mask": torch.ones_like(x), "x_labels": labels,
            "z_input_ids": z, "z_attention_mask": (z != PAD).long()}


def bench_realm(s: dict, n_blocks: int, steps: int, warmup: int) -> dict:
    torch.manual_seed(0)
    cfg = bert_config(s)
    model = REALM(Retriever.from_config(cfg, s["dim"]), KnowledgeAugmentedEncoder.from_config(cfg)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    rng = np.random.default_rng(0)
    index = BlockIndex.build(rng.standard_normal((n_blocks, s["dim"])).astype(np.float32), None, "flat", use_gpu=False)
    batch = realm_batch(s, rng)
    parts: dict[str, list[float]] = {k: [] for k in ("retrieve", "score", "ka", "backward", "step")}
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        with torch.no_grad():
            q = model.retriever.encode_query(batch["x_input_ids"], batch["x_attention_mask"])  # (B, d)
        index.search(q.float().numpy(), s["top_k"] - 1)  # top-(k-1) + the null document
        t1 = time.perf_counter()
        model.retrieval_log_probs(batch)  # the score part alone (its graph is dropped)
        t2 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(batch)["loss"]  # score + ka
        t3 = time.perf_counter()
        loss.backward()
        opt.step()
        t4 = time.perf_counter()
        if i >= warmup:
            score = t2 - t1
            for k, v in (("retrieve", t1 - t0), ("score", score), ("ka", (t3 - t2) - score), ("backward", t4 - t3)):
                parts[k].append(v)
            parts["step"].append((t1 - t0) + (t4 - t2))  # a real step: retrieve + forward + backward
    med = {k: float(np.median(v)) for k, v in parts.items()}
    return {"median_s": med, "fraction": {k: med[k] / med["step"] for k in ("retrieve", "score", "ka", "backward")},
            "spread_iqr_s": {k: float(np.subtract(*np.percentile(v, [75, 25]))) for k, v in parts.items()},
            "blocks": n_blocks, "steps": steps}


# ----------------------------------------------------------------------------------------------
# DPR
# ----------------------------------------------------------------------------------------------
def dpr_batch(s: dict, hard_negatives: int, rng) -> dict[str, torch.Tensor]:
    B, G = s["dpr_batch"], 1 + hard_negatives
    q = _rows(rng, B, s["dpr_query_len"], s["vocab"])
    p = _rows(rng, B * G, s["dpr_passage_len"], s["vocab"])
    q[:, 0] = p[:, 0] = CLS
    keys = torch.arange(B * G)
    return {"query_input_ids": q, "query_attention_mask": torch.ones_like(q), "passage_input_ids": p,
            "passage_attention_mask": torch.ones_like(p), "passage_keys": keys, "query_positive_keys": keys.view(B, G)[:, :1]}


def bench_dpr(s: dict, hard_negatives: int, steps: int, warmup: int) -> dict:
    from transformers import BertModel

    cfg = bert_config(s)
    arms = {}
    for h in (0, hard_negatives):
        torch.manual_seed(0)  # the same initial encoder in both arms
        model = BiEncoder(BertModel(cfg, add_pooling_layer=False)).train()
        arms[f"hn{h}"] = (model, torch.optim.AdamW(model.parameters(), lr=1e-5), dpr_batch(s, h, np.random.default_rng(h)))
    times: dict[str, list[float]] = {k: [] for k in arms}
    for i in range(warmup + steps):
        for name, (model, opt, batch) in arms.items():  # interleaved: A B A B ...
            t = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            model(batch)["loss"].backward()
            opt.step()
            if i >= warmup:
                times[name].append(time.perf_counter() - t)
    out = {name: summarize(v, int(arms[name][2]["query_attention_mask"].sum() + arms[name][2]["passage_attention_mask"].sum()))
           for name, v in times.items()}
    a, b = out["hn0"]["median_s"], out[f"hn{hard_negatives}"]["median_s"]
    Lq, Lp, H = s["dpr_query_len"], s["dpr_passage_len"], hard_negatives
    return {"arms": out, "hard_negatives": H, "ratio_with_over_without": b / a,
            "token_ratio": (Lq + (1 + H) * Lp) / (Lq + Lp)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--blocks", type=int, default=100_000, help="random block vectors in the REALM index")
    ap.add_argument("--hard-negatives", type=int, default=1, help="params/tiny.yaml's finetune.hard_negatives (the default's is 0)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or torch.get_num_threads())
    ap.add_argument("--out", default=str(ROOT / "bench/results/step_parts.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    s = SHAPES[args.shape]
    steps = args.steps or s["steps"]

    realm = bench_realm(s, args.blocks, steps, s["warmup"])
    print(f"REALM step ({args.shape}, B={s['realm_batch']}, k={s['top_k']}, {args.blocks} blocks): "
          f"median {realm['median_s']['step'] * 1e3:.1f} ms = " +
          ", ".join(f"{k} {realm['fraction'][k]:.1%}" for k in ("retrieve", "score", "ka", "backward")))
    dpr = bench_dpr(s, args.hard_negatives, steps, s["warmup"])
    print(f"DPR step ({args.shape}, B={s['dpr_batch']}): with {args.hard_negatives} hard negative(s) / without = "
          f"{dpr['ratio_with_over_without']:.3f} (token ratio {dpr['token_ratio']:.3f})")

    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    results[f"{args.shape}/cpu/t{args.threads}"] = {
        "realm": realm, "dpr": dpr,
        "env": {"cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                "loadavg": os.getloadavg()}}
    write_json_atomic(out, results, sort_keys=False)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
