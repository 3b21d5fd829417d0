"""REALM's learning signal in a world small enough to watch: does the retriever learn to find the
document that helps the reader through the marginal likelihood alone, and does refreshing the MIPS
index matter? The world, the arms and what the runs showed: docs/experiments/realm_toy.md.

    .venv/bin/python -m experiments.realm_toy                    # refresh every 10 steps vs never, 4 seeds, ~2 min
    .venv/bin/python -m experiments.realm_toy --reader-steps 0   # a from-scratch reader: no signal

Writes experiments/results/realm_toy.json: per seed and arm, recall@(k-1) of the gold document under the
index in use and under a fresh one, masked-token accuracy and p(null), over steps.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from components.index.faiss_index import BlockIndex  # noqa: E402
from components.io import write_json_atomic  # noqa: E402
from components.data.special_tokens import IGNORE_INDEX  # noqa: E402
from components.models.realm import REALM, KnowledgeAugmentedEncoder, tiny_bert_config  # noqa: E402
from components.models.retriever import Retriever  # noqa: E402

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


def with_documents(batch: dict, world: ToyWorld, rows: np.ndarray) -> dict:
    """`batch` + the candidates REALM reads: the null document (slot 0), then documents `rows` (B, k-1)."""
    B, Lz = len(rows), world.docs.shape[1]
    z = np.zeros((B, rows.shape[1] + 1, Lz), dtype=np.int64)
    z[:, 0, 0] = SEP  # the null document: `[SEP]`
    z[:, 1:] = world.docs[rows]
    z = torch.as_tensor(z)
    return {**batch, "z_input_ids": z, "z_attention_mask": (z != PAD).long()}


def candidates(batch: dict, index: BlockIndex, model: REALM, world: ToyWorld, k: int) -> dict:
    """Top-(k-1) documents for each query from the index, after the null document (slot 0)."""
    with torch.no_grad():
        q = model.retriever.encode_query(batch["x_input_ids"], batch["x_attention_mask"]).float().numpy()
    _, rows = index.search(q, k - 1)  # (B, k-1)
    return with_documents(batch, world, rows), rows


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


def reader_warm_up(model: REALM, world: ToyWorld, steps: int, batch: int, k: int, lr: float, rng) -> float:
    """Train the knowledge-augmented encoder alone with the gold document always among its k
    candidates (slot 1; the rest random), as a pre-trained reader would come: one that already
    reads its context. The retriever gets no update here. Returns the last steps' accuracy."""
    opt = torch.optim.AdamW(model.knowledge_augmented_encoder.parameters(), lr=lr)
    acc = []
    for _ in range(steps):
        rows = rng.integers(0, world.n, batch)
        cand = rng.integers(0, world.n, (batch, k - 1))
        cand[:, 0] = rows
        out = model(with_documents(world.queries(rows, rng), world, cand))
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        opt.step()
        acc.append(float(out["mlm_acc"]))
    return float(np.mean(acc[-20:])) if acc else 0.0


def run_arm(args, refresh_every: int) -> dict:
    torch.manual_seed(args.seed)
    world = ToyWorld(args.docs, args.values, args.fillers, seed=args.seed)
    cfg = tiny_bert_config(vocab_size=world.vocab_size, hidden=args.hidden, layers=args.layers, max_position=64)
    model = REALM(Retriever.from_config(cfg, args.dim), KnowledgeAugmentedEncoder.from_config(cfg)).train()
    rng = np.random.default_rng(args.seed)
    ict_warm_start(model, world, args.ict_steps, args.batch, args.lr, rng)
    reader_acc = reader_warm_up(model, world, args.reader_steps, args.batch, args.k, args.lr, rng)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    index = BlockIndex.build(embed_docs(model, world), None, "flat", use_gpu=False)
    curve, accs, pnull, t0 = [], [], [], time.perf_counter()
    r0 = recall(model, world, index, args.k, np.random.default_rng(0))  # the index was just built: in use = fresh
    curve.append({"step": 0, "recall_index_in_use": r0, "recall_fresh_index": r0, "mlm_acc": 0.0, "p_null": 0.0})
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
            curve.append({"step": step, "recall_index_in_use": recall(model, world, index, args.k, np.random.default_rng(0)),
                          "recall_fresh_index": recall(model, world, fresh, args.k, np.random.default_rng(0)),
                          "mlm_acc": float(np.mean(accs[-args.eval_every:])), "p_null": float(np.mean(pnull[-args.eval_every:]))})
            print(f"  {'refresh' if refresh_every else 'never':7s} step {step:4d}  " +
                  "  ".join(f"{k} {v:.3f}" for k, v in curve[-1].items() if k != "step"), flush=True)
    return {"refresh_every": refresh_every, "curve": curve, "seconds": time.perf_counter() - t0,
            "reader_warm_up_acc": reader_acc}


def build_parser() -> argparse.ArgumentParser:
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
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--refresh-every", type=int, default=10)
    ap.add_argument("--ict-steps", type=int, default=25, help="retriever warm-start steps (0: none)")
    ap.add_argument("--reader-steps", type=int, default=300, help="reader warm-up steps with the gold document present")
    ap.add_argument("--freeze-retriever-steps", type=int, default=0, help="REALM steps that train the reader only")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0, help="first seed")
    ap.add_argument("--seeds", type=int, default=4, help="seeds to run (the outcome is bimodal: report how many learn)")
    ap.add_argument("--out", default=str(ROOT / "experiments/results/realm_toy.json"))
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    runs = {}
    for seed in range(args.seed, args.seed + args.seeds):
        a = argparse.Namespace(**{**vars(args), "seed": seed})
        runs[str(seed)] = {name: run_arm(a, every) for name, every in (("refresh", args.refresh_every), ("never", 0))}
    learned = {arm: sum(r[arm]["curve"][-1]["recall_index_in_use"] > 0.9 for r in runs.values()) for arm in ("refresh", "never")}
    res = {"args": vars(args), "chance_recall": (args.k - 1) / args.docs, "threads": torch.get_num_threads(),
           "seeds_reaching_recall_0.9": learned, "runs": runs}
    out = Path(args.out)
    write_json_atomic(out, res, sort_keys=False)
    for seed, arms in runs.items():
        for name, arm in arms.items():
            c = arm["curve"]
            print(f"seed {seed} {name:7s}: recall@{args.k - 1} of the index in use {c[0]['recall_index_in_use']:.3f} -> "
                  f"{c[-1]['recall_index_in_use']:.3f} (step {c[-1]['step']}), p(null) {c[-1]['p_null']:.2f}, "
                  f"masked-token acc {c[-1]['mlm_acc']:.3f}, {arm['seconds']:.0f} s")
    print(f"seeds whose index in use ends above 0.9 recall: {learned} of {args.seeds}; chance {res['chance_recall']:.3f}; wrote {out}")


if __name__ == "__main__":
    main()
