"""REALM's learning signal in a world small enough to watch: does the retriever learn to find the
document that helps the reader, through the marginal likelihood alone, and does refreshing the
MIPS index matter?

    .venv/bin/python -m bench.realm_toy                    # refresh every 10 steps vs never, ~1-2 min on 2 cores
    .venv/bin/python -m bench.realm_toy --steps 600 --refresh-every 20

The world: N documents `key_j f f value_j f [SEP]` (f: random filler tokens, value_j drawn at random
from a pool, so no rule maps keys to values). A query is `[CLS] f key_j f [MASK] [SEP]` with the
masked token = value_j: the answer is only in document j. Both the retriever and the knowledge-
augmented encoder start from random weights; the retriever gets no supervision but REALM's
    log p(y|x) = logsumexp_z [log p(y|x,z) + log p(z|x)]
with the top-(k-1) documents from a FAISS inner-product index over `encode_passage` vectors plus the
null document (`components.models.realm.REALM`, `components.index.faiss_index.BlockIndex`, the
stage's own pieces). Arms (same seed, same steps):
    refresh   rebuild the index from the current document tower every `--refresh-every` steps
    never     keep the index built from the initial weights (the paper's stale-index ablation)
Reported per arm, over steps: recall@(k-1) of the gold document under the index in use and under a
fresh one, masked-token accuracy and p(null). Writes bench/results/realm_toy.json.

What it shows (2026-11-29, defaults, CPU): 25 ICT steps lift recall@7 from chance (0.014) to
0.44; within the first 10-25 REALM steps it falls back to chance in BOTH arms and stays there, while
the reader climbs only slowly (masked-token accuracy 0.02 -> ~0.05-0.09 by memorising facts, not
by reading documents). Freezing the retriever for the first 150 steps (`--freeze-retriever-steps`)
does not help: with the gold document among the candidates 44% of the time, a from-scratch reader
still does not learn to copy from it in 150 steps, and the retriever collapses once released.
p(null) stays ~0, so this is not a collapse onto the null document. Reading: while p(y|x,z) does
not depend on z for the right reason, the retriever's gradient (posterior - prior over the k
candidates) follows the random reader's arbitrary preferences, and Adam turns it into lr-sized
steps that erase the warm start. REALM gets past this because its reader starts as a pre-trained
BERT that already uses its context; the same holds for the tiny synthetic preset of the pipeline
(see the pretrain_realm notes). The script is kept as the smallest reproduction of that
dependency, and as the harness to test a fix (a reader warm-up, a lower retriever lr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from components.index.faiss_index import BlockIndex  # noqa: E402
from components.models.realm import IGNORE_INDEX, REALM, KnowledgeAugmentedEncoder, Retriever, tiny_bert_config  # noqa: E402

PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4


class ToyWorld:
    """Token ids: specials 0-4, then fillers, keys, values."""

    def __init__(self, n_docs: int, n_values: int, n_fillers: int, seed: int):
        rng = np.random.default_rng(seed)
        self.fillers = 5 + np.arange(n_fillers)
        self.keys = 5 + n_fillers + np.arange(n_docs)
        values = 5 + n_fillers + n_docs + np.arange(n_values)
        self.vocab_size = int(values[-1]) + 1
        self.value = rng.choice(values, n_docs)  # (N,) the fact each document states
        f = lambda *s: rng.choice(self.fillers, s)  # noqa: E731
        fill = f(n_docs, 3)
        self.docs = np.stack([self.keys, fill[:, 0], fill[:, 1], self.value, fill[:, 2], np.full(n_docs, SEP)], 1)  # (N, Lz)
        self.n = n_docs

    def queries(self, doc_rows: np.ndarray, rng) -> dict[str, torch.Tensor]:
        B = len(doc_rows)
        f = rng.choice(self.fillers, (B, 2))
        x = np.stack([np.full(B, CLS), f[:, 0], self.keys[doc_rows], f[:, 1], np.full(B, MASK), np.full(B, SEP)], 1)  # (B, Lx)
        labels = np.full_like(x, IGNORE_INDEX)
        labels[:, 4] = self.value[doc_rows]
        x, labels = torch.as_tensor(x), torch.as_tensor(labels)
        return {"x_input_ids": x, "x_attention_mask": torch.ones_like(x), "x_labels": labels}


@torch.no_grad()
def embed_docs(model: REALM, world: ToyWorld) -> np.ndarray:
    ids = torch.as_tensor(np.concatenate([np.full((world.n, 1), CLS), world.docs], 1))  # `[CLS] z [SEP]`
    return model.retriever.encode_passage(ids, torch.ones_like(ids)).float().numpy()  # (N, d)


def candidates(batch: dict, index: BlockIndex, model: REALM, world: ToyWorld, k: int) -> dict:
    """Top-(k-1) documents for each query from the index, after the null document (slot 0)."""
    with torch.no_grad():
        q = model.retriever.encode_query(batch["x_input_ids"], batch["x_attention_mask"]).float().numpy()
    _, rows = index.search(q, k - 1)  # (B, k-1)
    B, Lz = len(rows), world.docs.shape[1]
    z = np.zeros((B, k, Lz), dtype=np.int64)
    z[:, 0, 0] = SEP  # the null document: `[SEP]`
    z[:, 1:] = world.docs[rows]
    z = torch.as_tensor(z)
    return {**batch, "z_input_ids": z, "z_attention_mask": (z != PAD).long()}, rows


def recall(model: REALM, world: ToyWorld, index: BlockIndex, k: int, rng) -> float:
    batch = world.queries(np.arange(world.n), rng)
    _, rows = candidates(batch, index, model, world, k)
    return float((rows == np.arange(world.n)[:, None]).any(1).mean())


def ict_warm_start(model: REALM, world: ToyWorld, steps: int, batch: int, lr: float, rng) -> None:
    """A few steps of ICT-style in-batch contrastive training of the retriever alone (query vs the
    document it was cut from, as ORQA/REALM warm-start): without it the untrained [CLS] vectors
    rank the same few "hub" documents first for every query, the gold document is never a
    candidate, and the marginal likelihood has nothing to teach the retriever."""
    opt = torch.optim.AdamW(model.retriever.parameters(), lr=lr)
    for _ in range(steps):
        rows = rng.choice(world.n, batch, replace=False)
        x = world.queries(rows, rng)
        z = torch.as_tensor(np.concatenate([np.full((batch, 1), CLS), world.docs[rows]], 1))
        q = model.retriever.encode_query(x["x_input_ids"], x["x_attention_mask"])  # (B, d)
        d = model.retriever.encode_passage(z, torch.ones_like(z))  # (B, d)
        loss = torch.nn.functional.cross_entropy(q @ d.T, torch.arange(batch))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def run_arm(args, refresh_every: int) -> dict:
    torch.manual_seed(args.seed)
    world = ToyWorld(args.docs, args.values, args.fillers, seed=args.seed)
    cfg = tiny_bert_config(vocab_size=world.vocab_size, hidden=args.hidden, layers=args.layers, max_position=64)
    model = REALM(Retriever.from_config(cfg, args.dim), KnowledgeAugmentedEncoder.from_config(cfg)).train()
    rng = np.random.default_rng(args.seed)
    ict_warm_start(model, world, args.ict_steps, args.batch, args.lr, rng)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    index = BlockIndex.build(embed_docs(model, world), None, "flat", use_gpu=False)
    curve, accs, pnull, t0 = [], [], [], time.perf_counter()
    curve.append({"step": 0, "recall_index_in_use": recall(model, world, index, args.k, np.random.default_rng(0)),
                  "recall_fresh_index": recall(model, world, index, args.k, np.random.default_rng(0)), "mlm_acc": 0.0, "p_null": 0.0})
    for step in range(1, args.steps + 1):
        batch, _ = candidates(world.queries(rng.integers(0, world.n, args.batch), rng), index, model, world, args.k)
        out = model(batch)
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        if step <= args.freeze_retriever_steps:  # AdamW skips parameters without a gradient
            for prm in model.retriever.parameters():
                prm.grad = None
        opt.step()
        accs.append(float(out["mlm_acc"]))
        pnull.append(float(out["p_null"]))
        if refresh_every and step % refresh_every == 0:
            index = BlockIndex.build(embed_docs(model, world), None, "flat", use_gpu=False)
        if step % args.eval_every == 0 or step == args.steps:
            fresh = BlockIndex.build(embed_docs(model, world), None, "flat", use_gpu=False)
            eval_rng = np.random.default_rng(0)
            curve.append({"step": step, "recall_index_in_use": recall(model, world, index, args.k, eval_rng),
                          "recall_fresh_index": recall(model, world, fresh, args.k, np.random.default_rng(0)),
                          "mlm_acc": float(np.mean(accs[-args.eval_every:])), "p_null": float(np.mean(pnull[-args.eval_every:]))})
            print(f"  {'refresh' if refresh_every else 'never':7s} step {step:4d}  " +
                  "  ".join(f"{k} {v:.3f}" for k, v in curve[-1].items() if k != "step"), flush=True)
    return {"refresh_every": refresh_every, "curve": curve, "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=512)
    ap.add_argument("--values", type=int, default=64)
    ap.add_argument("--fillers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--k", type=int, default=8, help="candidates per query, the null document included")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--refresh-every", type=int, default=10)
    ap.add_argument("--ict-steps", type=int, default=25, help="retriever warm-start steps (0: none)")
    ap.add_argument("--freeze-retriever-steps", type=int, default=0, help="REALM steps that train the reader only")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench/results/realm_toy.json"))
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    arms = {name: run_arm(args, every) for name, every in (("refresh", args.refresh_every), ("never", 0))}
    res = {"args": vars(args), "chance_recall": (args.k - 1) / args.docs, "arms": arms}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".tmp").write_text(json.dumps(res, indent=2))
    os.replace(out.with_suffix(".tmp"), out)
    for name, arm in arms.items():
        last = arm["curve"][-1]
        print(f"{name:7s}: recall@{args.k - 1} {arm['curve'][0]['recall_fresh_index']:.3f} (step {arm['curve'][0]['step']}) -> "
              f"{last['recall_fresh_index']:.3f} (step {last['step']}), masked-token acc {last['mlm_acc']:.3f}, {arm['seconds']:.0f} s")
    print(f"chance recall {res['chance_recall']:.3f}; wrote {out}")


if __name__ == "__main__":
    main()
