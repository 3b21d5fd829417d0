"""What running a training batch's rows in length chunks buys (`compute.length_chunk_tokens`): each
model's training step at the presets' shapes, with the shipped corpus's real row lengths, run as one
forward at the batch's width (0, the reference) against chunks of about 512 / 1024 / 2048 tokens, each
cut to its own widest row (components/models/encoder.py `run_length_chunks`); interleaved rounds,
medians, ratios against 0. Before timing, a fp32 check in eval mode (no dropout): the loss and
gradients of every budget against 0's on the same batch.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.bench_length_chunks     # -> bench/results/length_chunks.json
    OMP_NUM_THREADS=2 .venv/bin/python -m bench.bench_length_chunks --preset params.yaml --models biencoder --rounds 3

Why: the collators pad a batch to its longest row. The shipped corpus's blocks are 133 tokens on
average and up to 256, so a DPR batch of 16 passages is ~1.7x its real tokens, and REALM's (x, z)
pairs hold the null document (x alone) beside full blocks. Sorted into chunks, each padded to its
own widest row, the same rows cost ~1.1x their real tokens, and attention's (L, L) cost falls
faster still. A chunk of few rows is a smaller matmul, which is why the budget is measured, not assumed.

The batches: token ids are random (speed does not depend on them), the lengths are real. Each row's
length is drawn from the shipped corpus (`data.path`) tokenized as the stages see it: passages and
REALM's z from its blocks (capped at passage_len / block_len), DPR questions from its questions; REALM's
x windows and ICT's pseudo-queries keep their full length, as the stages fill them. Every step draws
fresh lengths from one seeded stream, the same for every budget. The models are the stages'
(`bench.bench_mfu`'s builders; the fast dropout masks where the Trainer uses them); REALM's step is one
micro-batch (realm.train.batch_size / grad_accum queries and their top_k rows), ICT's one
realm.ict_batch_size batch without its activation checkpointing.
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

from bench.bench_mfu import BUILDERS, Model, cpu_model, git_commit, minilm_bench_setup, train_step  # noqa: E402
from components.data import beir  # noqa: E402
from components.data.realm_batch import SpecialTokens  # noqa: E402
from components.data.tokenize import load_tokenizer  # noqa: E402
from components.io import write_json_atomic  # noqa: E402
from components.models.encoder import set_length_chunk_tokens  # noqa: E402
from components.models.ict import ICTModel  # noqa: E402
from components.models.ops.dropout import fast_dropout_masks, use_fast_dropout  # noqa: E402
from components.models.retriever import Retriever  # noqa: E402
from components.training.precision import cpu_has_native_bf16  # noqa: E402


# ----------------------------------------------------------------------------------------------
# real lengths on the builders' full-length rows
# ----------------------------------------------------------------------------------------------
def corpus_lengths(params, tokenizer) -> dict[str, np.ndarray]:
    """Token counts ([CLS] .. [SEP]) of the corpus's passages and questions, uncapped."""
    folder = ROOT / params.data.path
    docs = [d["text"] for d in beir.read_corpus(folder / "corpus.jsonl.gz").values()]
    questions = list(beir.read_queries(folder / "queries.jsonl.gz").values())
    count = lambda texts: np.array([len(ids) for ids in tokenizer(texts, add_special_tokens=True)["input_ids"]])  # noqa: E731
    return {"passage": count(docs), "question": count(questions)}


def with_lengths(ids: torch.Tensor, mask: torch.Tensor, lengths: np.ndarray, pad: int, sep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, L) full rows cut to `lengths` (each ends in [SEP], pads after it) and trimmed to the longest,
    as a collator pads them. Rows already shorter (the null document) keep their length."""
    ids, mask = ids.clone(), mask.clone()
    real = mask.sum(1).numpy()
    ends = np.minimum(np.maximum(lengths, 2), real)  # (N,)
    for i, n in enumerate(ends):
        ids[i, n:], mask[i, n:] = pad, 0
        ids[i, n - 1] = sep
    width = int(ends.max())
    return ids[:, :width].contiguous(), mask[:, :width].contiguous()


def draw(lengths: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    return rng.choice(lengths, n)


def biencoder_batch(m: Model, lens: dict, ids: SpecialTokens, rng: np.random.Generator) -> dict:
    b = dict(m.batch)
    for side, kind in (("query", "question"), ("passage", "passage")):
        n = b[f"{side}_input_ids"].size(0)
        b[f"{side}_input_ids"], b[f"{side}_attention_mask"] = with_lengths(
            b[f"{side}_input_ids"], b[f"{side}_attention_mask"], draw(lens[kind], n, rng), ids.pad, ids.sep)
    return b


def realm_batch(m: Model, lens: dict, ids: SpecialTokens, rng: np.random.Generator) -> dict:
    b = dict(m.batch)
    z, zm = b["z_input_ids"], b["z_attention_mask"]
    B, K, Lz = z.shape
    z2, zm2 = with_lengths(z.view(B * K, Lz), zm.view(B * K, Lz), draw(lens["passage"], B * K, rng) - 1, ids.pad, ids.sep)
    b["z_input_ids"], b["z_attention_mask"] = z2.view(B, K, -1), zm2.view(B, K, -1)  # z is `z [SEP]`: no [CLS]
    return b


def ict_batch(m: Model, lens: dict, ids: SpecialTokens, rng: np.random.Generator) -> dict:
    b = dict(m.batch)
    n = b["d_input_ids"].size(0)
    b["d_input_ids"], b["d_attention_mask"] = with_lengths(b["d_input_ids"], b["d_attention_mask"],
                                                           draw(lens["passage"], n, rng), ids.pad, ids.sep)
    return b


def build_ict(params, warm: str, ids: SpecialTokens, div: int) -> Model:
    r = params.realm
    B, Lq, Ld = max(1, r.ict_batch_size // div), r.ict_query_len or r.query_len, r.block_len
    torch.manual_seed(params.compute.seed)
    model = ICTModel(Retriever.from_encoder(warm, r.retriever_dim, r.share_towers))
    g = np.random.default_rng(0)
    q, d = (torch.as_tensor(g.integers(1000, ids.vocab_size, (B, n))) for n in (Lq, Ld))
    q[:, 0] = d[:, 0] = ids.cls
    batch = {"q_input_ids": q, "q_attention_mask": torch.ones_like(q), "d_input_ids": d, "d_attention_mask": torch.ones_like(d)}
    return Model("ict", model, batch, r.train, {"ict_batch": B, "query_len": Lq, "block_len": Ld})


BATCHES = {"biencoder": biencoder_batch, "realm": realm_batch, "ict": ict_batch}


def micro_batch_div(params, name: str) -> int:
    """The builders take a whole batch / div; REALM trains on micro-batches of batch_size / grad_accum queries."""
    return params.realm.train.grad_accum if name == "realm" else 1


# ----------------------------------------------------------------------------------------------
# the fp32 check: chunked loss and gradients against one forward
# ----------------------------------------------------------------------------------------------
def loss_and_grads(module: torch.nn.Module, batch: dict) -> tuple[float, torch.Tensor]:
    module.zero_grad(set_to_none=True)
    loss = module(batch)["loss"]
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in module.parameters() if p.grad is not None])
    module.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def exactness(m: Model, batch: dict, chunks: list[int]) -> dict[int, dict]:
    was = m.module.training
    m.module.eval()  # no dropout, so every budget sees the same function
    out = {}
    try:
        set_length_chunk_tokens(m.module, 0)
        ref_loss, ref = loss_and_grads(m.module, batch)
        for c in chunks:
            set_length_chunk_tokens(m.module, c)
            loss, g = loss_and_grads(m.module, batch)
            out[c] = {"loss_abs_diff": abs(loss - ref_loss), "grad_rel_diff": float((g - ref).norm() / ref.norm().clamp_min(1e-30))}
    finally:
        set_length_chunk_tokens(m.module, 0)
        m.module.train(was)
    return out


def fed_tokens(mask: torch.Tensor, chunk_tokens: int) -> int:
    """Tokens a forward feeds the encoder for an (N, L) mask at this token budget per chunk."""
    from components.models.encoder import length_chunks

    if chunk_tokens <= 0:
        return int(mask.numel())
    return sum(len(rows) * width for rows, width in length_chunks(mask, chunk_tokens=chunk_tokens)[1])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=list(BATCHES), default=["biencoder", "realm", "ict"])
    ap.add_argument("--preset", default="params/small.yaml", help="preset merged over params.yaml for the shapes")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--chunks", nargs="+", type=int, default=[0, 512, 1024, 2048], help="token budgets per chunk; 0 is the reference")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds; each round steps every budget once")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per budget first")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/length_chunks.json")
    args = ap.parse_args(argv)
    chunks = sorted(set([0, *args.chunks]))
    params, warm = minilm_bench_setup(args.preset, args.threads)
    tokenizer = load_tokenizer(warm)
    ids = SpecialTokens.from_tokenizer(tokenizer)
    lens = corpus_lengths(params, tokenizer)
    lens["passage"] = np.minimum(lens["passage"], params.finetune.passage_len)
    lens["question"] = np.minimum(lens["question"], params.finetune.query_len)
    fast = fast_dropout_masks(params.compute.dropout_masks, torch.device("cpu"))
    result = {"commit": git_commit(), "cpu": cpu_model(), "native_bf16": cpu_has_native_bf16(), "threads": args.threads,
              "precision": args.precision, "preset": args.preset, "rounds": args.rounds, "fast_dropout": fast,
              "corpus": str(params.data.path), "passage_tokens_mean": float(lens["passage"].mean()), "models": {}}
    builders = {**BUILDERS, "ict": build_ict}
    for name in args.models:
        m = builders[name](params, warm, ids, micro_batch_div(params, name))
        if fast:
            use_fast_dropout(m.module)
        rng = np.random.default_rng(0)
        batches = [BATCHES[name](m, lens, ids, rng) for _ in range(args.warmup + args.rounds)]
        m.batch = batches[0]
        check = exactness(m, batches[0], [c for c in chunks if c])
        rows_key = {"biencoder": "passage_attention_mask", "ict": "d_attention_mask"}.get(name)
        if rows_key is None:  # REALM: the reader's (x, z) pairs
            from components.models.realm import knowledge_augmented_inputs

            masks = [knowledge_augmented_inputs(b["x_input_ids"], b["x_attention_mask"], b["z_input_ids"], b["z_attention_mask"],
                                                ids.pad)[1].flatten(0, 1) for b in batches]
        else:
            masks = [b[rows_key] for b in batches]
        real = sum(int(k.sum()) for k in masks)
        times: dict[int, list[float]] = {c: [] for c in chunks}
        for i, b in enumerate(batches):  # interleaved: each batch is stepped at every budget
            m.batch = b
            for c in (chunks if i % 2 == 0 else chunks[::-1]):
                set_length_chunk_tokens(m.module, c)
                t0 = time.perf_counter()
                train_step(m, args.precision)
                if i >= args.warmup:
                    times[c].append(time.perf_counter() - t0)
        base = statistics.median(times[0])
        rows = {c: {"s_per_step": round(statistics.median(ts), 4), "speedup_vs_0": round(base / statistics.median(ts), 3),
                    "fed_over_real_tokens": round(sum(fed_tokens(k, c) for k in masks) / real, 3),
                    "rounds": [round(t, 4) for t in ts], **({"check_fp32_eval": check[c]} if c else {})}
                for c, ts in times.items()}
        result["models"][name] = {"shape": m.shape, "chunk_tokens": rows}
        print(f"{name} ({m.shape}):")
        for c, r in rows.items():
            chk = r.get("check_fp32_eval")
            print(f"  chunk_tokens {c:>5}: {r['s_per_step']:.3f} s/step  x{r['speedup_vs_0']:.2f}  fed/real tokens "
                  f"{r['fed_over_real_tokens']:.2f}" + (f"  |dloss| {chk['loss_abs_diff']:.1e}, grad rel diff "
                                                           f"{chk['grad_rel_diff']:.1e}" if chk else ""), flush=True)
    write_json_atomic(args.out, result)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
