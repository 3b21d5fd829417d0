r"""Does REALM's reader learn to read in its warm-up? Issue 28, item 1.

For each variant (dotted param overrides over the workspace's params.yaml), build the knowledge-augmented
encoder as `pretrain_realm` does (from models/retromae/encoder, seeded), run `reader_warmup` on the
stage's training rows, and measure the reader before and after on the stage's held-out masked queries
(`realm.heldout_queries` blocks the warm-up never reads) with fixed documents: x's own block, an answer
block, a random block without the span, a block of x's article without it, the null document
(components/eval/realm_reading.py). A reader that reads copies from its own block: `acc_own_block` far
above `acc_null`, and log p(y|x,z_answer) - log p(y|x,z_other) several nats.

    .venv/bin/python -m experiments.reader_warmup_study --workspace WS \
        --variant base: \
        --variant own300:realm.reader_warmup_doc=own_block,realm.reader_warmup_steps=300,realm.reader_warmup_lr=3e-4 \
        --out experiments/results/reader_warmup.jsonl

WS must have run `pretrain_retromae` (data/tokens, models/retromae/encoder). Results append to `--out`
as JSON lines (one per variant), written atomically; a variant already in the file is skipped.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "2")


def measure(reader, queries, blocks, p, special, device, precision: str, batch_size: int, seed: int) -> dict[str, Any]:
    """The reader's fixed-document report over `queries` (eval mode, no grad)."""
    import numpy as np
    import torch

    from components.data.realm_batch import passage_columns
    from components.eval.realm_probes import answer_blocks, same_entity_gold
    from components.data.salient_spans import span_tagger_for
    from components.eval.realm_reading import FixedReads, article_rows, fixed_documents, read_fixed_documents
    from components.training.precision import autocast_for

    rng = np.random.default_rng(seed)
    answers = answer_blocks(queries, blocks)
    about = same_entity_gold(queries, answers, blocks, span_tagger_for(p))
    article, by_article = article_rows(blocks)
    lookup = blocks.select_columns(passage_columns(p))
    reads = FixedReads()
    was_training = reader.training
    reader.eval()
    with torch.no_grad(), autocast_for(precision, device):
        for i in range(0, len(queries), batch_size):
            qs = queries[i:i + batch_size]
            mates = [by_article[article[q.source_row]] for q in qs] if article is not None else None
            rows = fixed_documents(qs, answers[i:i + batch_size], about[i:i + batch_size], len(blocks), rng, mates)
            read_fixed_documents(reader, qs, rows, lookup, p, special, device, reads)
    reader.train(was_training)
    return {**reads.report(), "queries": len(queries), "queries_with_answer_block": sum(bool(a) for a in answers)}


def run_variant(ws: Path, name: str, overrides: dict[str, Any], n_queries: int, device: str) -> dict[str, Any]:
    import datasets
    import torch

    from components import paths
    from components.config import load_params
    from components.data.special_tokens import SpecialTokens
    from components.data.tokenize import load_tokenizer
    from components.models.realm import KnowledgeAugmentedEncoder
    from components.stages.pretrain_realm import split_rows
    from components.training.warmups import reader_warmup

    params = load_params(ws / "params.yaml", overrides=overrides)
    p, seed = params.realm, params.compute.seed
    tokenizer = load_tokenizer(ws / paths.TOKENS / "tokenizer")
    special = SpecialTokens.from_tokenizer(tokenizer)
    blocks = datasets.load_from_disk(str(ws / paths.TOKENS / "blocks"))
    train_rows, held, held_queries, _ = split_rows(blocks, p, special, seed)
    queries = held_queries[:n_queries]
    torch.manual_seed(seed)  # build_model's seed: the same reader init as the stage
    reader = KnowledgeAugmentedEncoder.from_pretrained(ws / paths.RETROMAE_ENCODER).to(device)
    dev = torch.device(device)
    curve: list[dict[str, float]] = []

    def log_fn(metrics: dict[str, float], step: int) -> None:
        curve.append({"step": step, **{k: float(v) for k, v in metrics.items()}})

    before = measure(reader, queries, blocks, p, special, dev, params.compute.precision, 8, seed)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="reader_warmup_") as tmp:
        info = reader_warmup(reader, blocks, train_rows, params, special, Path(tmp), log_fn) if p.reader_warmup_steps else {}
    seconds = time.time() - t0
    after = measure(reader, queries, blocks, p, special, dev, params.compute.precision, 8, seed)
    return {"variant": name, "overrides": overrides, "seconds": round(seconds, 1), "train_rows": len(train_rows),
            "heldout_rows": len(held), "before": before, "after": after, "warmup": info, "curve": curve}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workspace", type=Path, required=True, help="a folder that ran pretrain_retromae")
    ap.add_argument("--variant", action="append", required=True, help="NAME:key=value,key=value (dotted params keys; NAME: alone for none)")
    ap.add_argument("--queries", type=int, default=128, help="held-out masked queries measured")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, required=True, help="JSON lines, one per variant (appended)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")

    from components.io import write_jsonl_atomic

    from experiments.variants import parse_variant

    variants = [parse_variant(v) for v in args.variant]
    done = [json.loads(line) for line in args.out.read_text().splitlines() if line.strip()] if args.out.exists() else []
    for name, overrides in variants:
        if any(r["variant"] == name for r in done):
            print(f"{name}: already in {args.out}, skipped")
            continue
        row = run_variant(args.workspace, name, overrides, args.queries, args.device)
        done.append(row)
        write_jsonl_atomic(args.out, done)
        b, a = row["before"], row["after"]
        print(f"{name}: {row['seconds']:.0f}s  own {b['acc_own_block']:.3f}->{a['acc_own_block']:.3f}  "
              f"answer {b['acc_answer_block']:.3f}->{a['acc_answer_block']:.3f}  null {b['acc_null']:.3f}->{a['acc_null']:.3f}  "
              f"gap {b['gap_nats']['mean']:+.2f}->{a['gap_nats']['mean']:+.2f} nats  "
              f"same-article gap {b['gap_nats_same_article']['mean']:+.2f}->{a['gap_nats_same_article']['mean']:+.2f}", flush=True)
    return done


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, ValueError) as e:
        print(f"reader_warmup_study: {e}", file=sys.stderr)
        sys.exit(2)
