"""Stage body of `finetune_retriever@<start>-<size>`: one DPR bi-encoder from one starting encoder on
the first `size` training questions (RetroMAE's question as a label-efficiency curve; the recipe:
components/training/finetune.py).

    python -m flows.finetune_retriever --item retromae-32
    RR_STAGE_ITEM=retromae-32 torchrun --standalone --nproc_per_node=2 -m components.stages.finetune_retriever

Outputs (rank 0): models/finetune/retriever/<start>-<size>/ (HF + sentence-transformers, [CLS]
pooling; a SKIPPED note instead when the start's stage wrote no encoder or there are no training
questions) and metrics/finetune_retriever_<start>-<size>.json.
"""

from __future__ import annotations

import logging
import os

from components.config import Params
from components.data.finetune_data import load_corpus, load_pairs
from components.data.tokenize import load_tokenizer
from components.paths import CORPUS, TOKENS, retriever_item, retriever_out
from components.retrieval.negatives import mine_bm25_negatives
from components.stages.common import ENV_STAGE_ITEM, RankZeroLogger, checkpoint_dir, finish_stage, item_worker, skip_stage
from components.training.finetune import START_SECTIONS, retrieval_start_folder, size_subset, train_biencoder
from components.training.trainer import prefixed

log = logging.getLogger(__name__)

GROUP = "finetune_retriever"


def finetune_retriever(params: Params, run=None, item: str | None = None) -> dict:
    item = item or os.environ[ENV_STAGE_ITEM]
    start, size = retriever_item(item)
    stage, out = f"{GROUP}@{item}", retriever_out(start, size)
    ft = params.finetune
    folder = retrieval_start_folder(params, start)
    pairs = load_pairs(CORPUS, "train")
    skip = ("no training questions in data/corpus/beir/qrels/train.tsv" if not pairs else
            f"no encoder at {folder} (its stage did not train one)" if not (folder / "config.json").exists() else None)
    if skip:
        return skip_stage(stage, out, skip)
    tokenizer = load_tokenizer(TOKENS / "tokenizer")
    corpus = load_corpus(CORPUS)
    rows = size_subset(pairs, size, params.compute.seed)
    bm25_rows = mine_bm25_negatives(rows, corpus) if ft.hard_negatives and ft.hard_negative_source == "bm25" else None
    ckpt = checkpoint_dir(f"finetune_retrieval_{start}-{size}", params, ["finetune", "warm_start", *START_SECTIONS[start]],
                          inputs=[folder])
    log_fn = prefixed(RankZeroLogger(run), f"retrieval.{start}.")
    model, result, start_sha = train_biencoder(params, tokenizer, folder, rows, corpus, bm25_rows, ckpt, log_fn)
    log.info("%s from %s on %d questions: %s", stage, folder, len(rows), result.metrics)
    summary = {"start": str(folder), "start_sha256": start_sha, "size": str(size), "questions": len(rows),
               "steps": result.step, "resumed_from": result.resumed_from or 0, **{f"final_{k}": v for k, v in result.metrics.items()}}
    return finish_stage(stage, summary, lambda: model.save_pretrained(out, tokenizer, max_seq_length=ft.passage_len))


def main() -> None:
    item_worker(GROUP, finetune_retriever)


if __name__ == "__main__":
    main()
