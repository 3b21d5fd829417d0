"""Stage body of `finetune_reader@<system>`: one open-QA reader over one retrieval system's top k
(REALM's question; the recipe: components/training/finetune.py). `closed-book` has no stage: with the
null document alone an extractive reader has no span to learn or to answer (evaluate scores it).

    python -m flows.finetune_reader --item realm-stale
    RR_STAGE_ITEM=realm torchrun --standalone --nproc_per_node=2 -m components.stages.finetune_reader

Outputs (rank 0): models/finetune/open_qa/<system>/ (`OpenQA.from_pretrained`; a SKIPPED note instead
when the system is not in `finetune.qa_systems`, open QA is off, there are no training questions or
its REALM arm wrote no retriever / index) and metrics/finetune_reader_<system>.json.

Every reader runs the same recipe from its own arm's encoder: the own-paragraph phase
(`finetune.qa_gold_steps`, no retriever) and then `finetune.qa_train` over the system's top k. The
own-paragraph phase reads no retriever, so readers that start from the same encoder (bm25's and
realm's: the refreshed arm's) share it: its checkpoint folder is keyed by that encoder, not by the
system, and the stage that comes second resumes the finished phase (`shared_phase`).
"""

from __future__ import annotations

import logging
import os

import datasets

from components.config import Params
from components.data.finetune_data import load_qa
from components.data.tokenize import load_tokenizer
from components.paths import CORPUS, TOKENS, reader_out
from components.stages.common import (ENV_STAGE_ITEM, RankZeroLogger, checkpoint_dir, finish_stage, item_worker, shared_phase,
                                      skip_stage)
from components.training import distributed as D
from components.training.batches import seed_everything
from components.training.finetune import (READER_SECTIONS, new_reader, qa_inputs_exist, reader_init_folder, reader_inputs,
                                         train_gold_reader, train_reader)
from components.training.trainer import prefixed

log = logging.getLogger(__name__)

GROUP = "finetune_reader"


def _skip_reason(ft, system: str, qa: list[dict]) -> str | None:
    if system not in ft.qa_systems:
        return f"{system} is not in finetune.qa_systems={ft.qa_systems}"
    if not ft.qa_enabled:
        return "finetune.qa_enabled is false"
    if not qa:
        return "no training questions in data/corpus/qa/train.jsonl"
    if not qa_inputs_exist(system):
        return f"no REALM retriever / final index for {system} (its pretrain_realm arm did not run)"
    return None


def finetune_reader(params: Params, run=None, item: str | None = None) -> dict:
    system = item or os.environ[ENV_STAGE_ITEM]
    stage, out = f"{GROUP}@{system}", reader_out(system)
    ft = params.finetune
    qa = load_qa(CORPUS, "train")
    skip = _skip_reason(ft, system, qa)
    if skip:
        return skip_stage(stage, out, skip)
    D.init_distributed(params.compute)  # before shared_phase, which asks for the rank
    tokenizer = load_tokenizer(TOKENS / "tokenizer")
    blocks = datasets.load_from_disk(str(TOKENS / "blocks"))
    log_fn = RankZeroLogger(run)
    seed_everything(params.compute.seed)  # the fresh span head: the same weights in every run of this stage
    reader = new_reader(ft, system=system)
    starts = reader_inputs(system)  # the arm's encoder, query tower and index: an upstream change starts afresh
    gold = checkpoint_dir("finetune_qa_gold", params, READER_SECTIONS, inputs=[reader_init_folder(system)])
    with shared_phase(gold, f"{stage} own-paragraph phase"):
        reader, summary = train_gold_reader(params, tokenizer, blocks, qa, reader, gold, log_fn)
    model, result = train_reader(params, tokenizer, system, blocks, qa, reader,
                                 checkpoint_dir(f"finetune_qa_{system}", params, READER_SECTIONS, inputs=starts),
                                 prefixed(log_fn, f"qa.{system}."))
    summary = {**summary, "qa_questions": len(qa), "steps": result.step, **{f"final_{k}": v for k, v in result.metrics.items()}}
    return finish_stage(stage, summary, lambda: model.save_pretrained(out, tokenizer))


def main() -> None:
    item_worker(GROUP, finetune_reader)


if __name__ == "__main__":
    main()
