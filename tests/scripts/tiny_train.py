"""A tiny masked-LM trained by the shared Trainer: the subprocess side of the kill and DDP tests.

    OMP_NUM_THREADS=1 python -m tests.scripts.tiny_train --out /tmp/run --log-file /tmp/run/loss.jsonl
    python -m torch.distributed.run --standalone --nproc_per_node=2 -m tests.scripts.tiny_train --out ... --mask fixed

Writes one JSON line per logged step ({"step", "loss", ...}) to --log-file (rank 0), and the
TrainResult to <out>/result.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from components.config_shared import ComputeParams, TrainParams

VOCAB, MASK_ID, SEQ = 64, 1, 12


class TinyLM(nn.Module):
    """Embedding -> 1 transformer layer -> LayerNorm -> LM head tied to the embedding."""

    def __init__(self, vocab: int = VOCAB, hidden: int = 32, dropout: float = 0.1, max_len: int = SEQ):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_len, hidden)
        # bias=False: an attention key bias has an exactly-zero true gradient (softmax ignores a
        # constant shift), so Adam turns float noise there into full-size steps and DDP-vs-single
        # comparisons would fail for reasons that are not the trainer's.
        self.block = nn.TransformerEncoderLayer(hidden, 2, 64, dropout=dropout, batch_first=True, bias=False)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)
        nn.init.normal_(self.emb.weight, std=0.02)
        self.head.weight = self.emb.weight  # tied: checkpoints must store it once and restore the tie

    def forward(self, batch: dict) -> dict:
        ids, labels = batch["input_ids"], batch["labels"]  # (B, L)
        x = self.emb(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))  # (B, L, H)
        logits = self.head(self.norm(self.block(x)))  # (B, L, V)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        masked = labels != -100
        acc = (logits.argmax(-1)[masked] == labels[masked]).float().mean()
        return {"loss": loss, "acc": acc, "num_tokens": masked.sum()}


def make_rows(n: int = 64, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    # A learnable pattern: token t+1 = (token t + 1) mod VOCAB, from a random start (ids >= 2).
    starts = torch.randint(2, VOCAB, (n,), generator=g)
    return [{"input_ids": [int(2 + (s - 2 + i) % (VOCAB - 2)) for i in range(SEQ)]} for s in starts.tolist()]


def random_mask_collate(rows: list[dict], generator: torch.Generator) -> dict:
    ids = torch.tensor([r["input_ids"] for r in rows])  # (B, L)
    mask = torch.rand(ids.shape, generator=generator) < 0.3
    mask[:, 0] |= ~mask.any(1)  # at least one target per row
    return {"input_ids": ids.masked_fill(mask, MASK_ID), "labels": ids.masked_fill(~mask, -100)}


def fixed_mask_collate(rows: list[dict]) -> dict:
    """Every row masks the same positions: a sample-mean loss, so DDP == one process exactly."""
    ids = torch.tensor([r["input_ids"] for r in rows])
    mask = (torch.arange(ids.shape[1]) % 3 == 1).expand_as(ids)
    return {"input_ids": ids.masked_fill(mask, MASK_ID), "labels": ids.masked_fill(~mask, -100)}


def main(argv: list[str] | None = None) -> None:
    from components.training import distributed as D
    from components.training.trainer import Trainer

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--log-file", default=None)
    ap.add_argument("--max-steps", type=int, default=20)
    ap.add_argument("--checkpoint-every", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--mask", choices=["random", "fixed"], default="random")
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds per step (gives the kill test a window)")
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args(argv)

    torch.manual_seed(0)  # same init in every process (DDP also broadcasts rank 0's weights)
    model = TinyLM(dropout=a.dropout)
    train = TrainParams(batch_size=a.batch_size, grad_accum=a.grad_accum, lr=3e-3, max_steps=a.max_steps,
                        checkpoint_every=a.checkpoint_every, keep_checkpoints=2, warmup_ratio=0.2)
    compute = ComputeParams(device="cpu", seed=a.seed, num_threads=1, precision="fp32")  # DDP vs one process: exact math
    log_file = open(a.log_file, "a") if a.log_file else None

    def log_fn(metrics: dict, step: int) -> None:
        if log_file:
            log_file.write(json.dumps({"step": step, **metrics}) + "\n")
            log_file.flush()

    hooks = {"on_step_end": [lambda step, trainer: time.sleep(a.sleep)]} if a.sleep else None
    collate = random_mask_collate if a.mask == "random" else fixed_mask_collate
    try:
        trainer = Trainer(model, make_rows(), collate, train, compute, a.out, log_fn=log_fn, hooks=hooks)
        result = trainer.fit()
        if trainer.is_rank0:
            Path(a.out, "result.json").write_text(json.dumps(
                {"step": result.step, "bad_steps": result.bad_steps, "resumed_from": result.resumed_from,
                 "checkpoint": str(result.checkpoint), "world_size": trainer.world_size}))
    finally:
        D.cleanup()


if __name__ == "__main__":
    main()
