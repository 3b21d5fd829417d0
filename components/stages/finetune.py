"""Stage body of `finetune`: the DPR bi-encoder (RetroMAE's recipe) and the open-QA reader (REALM/ORQA).

    python -m flows.finetune
    torchrun --standalone --nproc_per_node=2 -m components.stages.finetune   # compute.nproc=2

Outputs (rank 0):
  models/finetune/retriever/   the fine-tuned bi-encoder (HF + sentence-transformers, [CLS] pooling)
  models/finetune/open_qa/     REALM query tower + span reader (`OpenQA.from_pretrained`)
  metrics/finetune.json
"""

from __future__ import annotations

import logging
from pathlib import Path

import datasets

from components.config import Params
from components.data.finetune_data import BiEncoderCollator, load_corpus, load_pairs, load_qa
from components.data.tokenize import load_tokenizer
from components.models.biencoder import BiEncoder, make_encode_fn
from components.paths import (CORPUS, FINETUNE_OUT, INIT_ENCODER, MLM_ENCODER, REALM_OUT, RETROMAE_ENCODER, TOKENS,
                              stage_metrics)
from components.retrieval.negatives import mine_bm25_negatives, mine_dense_negatives
from components.retrieval.search import load_block_index, retrieve_qa_blocks, retriever_encode_fn
from components.stages.common import RankZeroLogger, checkpoint_dir, torchrun_worker, write_stage_metrics
from components.training import distributed as D
from components.training.trainer import Trainer

log = logging.getLogger(__name__)

INIT_FOLDERS = {"retromae": RETROMAE_ENCODER, "mlm": MLM_ENCODER, "init": INIT_ENCODER}


class _Prefixed(RankZeroLogger):
    """Two trainings share the stage's MLflow run: prefix their metric names."""

    def __init__(self, run, prefix: str):
        super().__init__(run)
        self.prefix = prefix

    def __call__(self, metrics: dict[str, float], step: int) -> None:
        super().__call__({f"{self.prefix}.{k}": v for k, v in metrics.items()}, step)


def retrieval_init_folder(params: Params) -> Path:
    ft = params.finetune
    folder = Path(ft.retrieval_pretrained_path) if ft.retrieval_init == "pretrained" else INIT_FOLDERS[ft.retrieval_init]
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"finetune.retrieval_init={ft.retrieval_init}: no encoder at {folder} "
                                f"(run its stage first, or pick another finetune.retrieval_init)")
    return folder


# ----------------------------------------------------------------------------------------------
# dense retrieval (DPR)
# ----------------------------------------------------------------------------------------------
def finetune_retriever(params: Params, run, tokenizer) -> dict:
    ft = params.finetune
    pairs = load_pairs(CORPUS, "train")
    if not pairs:
        log.warning("no training questions in %s: skipping retrieval fine-tuning", CORPUS / "beir/qrels/train.tsv")
        return {"retrieval_trained": 0}
    init = retrieval_init_folder(params)
    corpus = load_corpus(CORPUS)
    model = BiEncoder.from_params(init, ft)
    if ft.hard_negatives == 0:
        rows = [{**p, "negatives": []} for p in pairs]
    elif ft.hard_negative_source == "bm25":
        rows = mine_bm25_negatives(pairs, corpus)
    else:  # the two-stage recipe: negatives from the stage-1 encoder's own index
        rows = mine_dense_negatives(make_encode_fn(model, tokenizer, ft.query_len, ft.passage_len), pairs, corpus)
    collate = BiEncoderCollator.from_params(tokenizer, ft, corpus)
    trainer = Trainer(model, rows, collate, ft.train, params.compute, checkpoint_dir("finetune_retrieval", params, ["finetune", "retromae"]),
                      log_fn=_Prefixed(run, "retrieval"), log_every=params.tracking.log_every, param_prefix="finetune.train")
    result = trainer.fit()
    if D.is_rank0():
        trainer.raw_model.save_pretrained(FINETUNE_OUT / "retriever", tokenizer, max_seq_length=ft.passage_len)
    log.info("retrieval fine-tuning from %s: %s", init, result.metrics)
    return {"retrieval_init": ft.retrieval_init, "retrieval_pairs": len(rows), "retrieval_steps": result.step,
            **{f"retrieval_final_{k}": v for k, v in result.metrics.items()}}


# ----------------------------------------------------------------------------------------------
# open-QA (REALM retriever + reader)
# ----------------------------------------------------------------------------------------------
def reader_init_folder() -> Path:
    """REALM fine-tunes its reader from the knowledge-augmented encoder; fall back to RetroMAE."""
    for folder in (REALM_OUT / "knowledge_augmented_encoder", RETROMAE_ENCODER):
        if (folder / "config.json").exists():
            return folder
    raise FileNotFoundError(f"no encoder to start the reader from ({REALM_OUT / 'knowledge_augmented_encoder'} or {RETROMAE_ENCODER})")


def finetune_reader(params: Params, run, tokenizer) -> dict:
    from components.models.retriever import Retriever
    from components.data.qa_batch import QACollator
    from components.models.reader import OpenQA, SpanReader

    ft = params.finetune
    qa = load_qa(CORPUS, "train")
    if not ft.qa_enabled or not qa or not (REALM_OUT / "retriever").exists():
        log.warning("open-QA fine-tuning skipped (finetune.qa_enabled=%s, %d training questions)", ft.qa_enabled, len(qa))
        return {"qa_trained": 0}
    blocks = datasets.load_from_disk(str(TOKENS / "blocks"))
    vecs, index = load_block_index(REALM_OUT / "index" / "final", blocks)  # frozen: the selection of the top k
    retriever = Retriever.from_pretrained(REALM_OUT / "retriever")
    rows = retrieve_qa_blocks(retriever_encode_fn(retriever, tokenizer, ft.query_len), qa, ft.qa_top_k, search_fn=index.search)
    model = OpenQA(retriever, SpanReader.from_pretrained(reader_init_folder()), ft.max_answer_tokens)
    collate = QACollator.from_params(tokenizer, blocks, vecs, ft)
    trainer = Trainer(model, rows, collate, ft.qa_train, params.compute, checkpoint_dir("finetune_qa", params, ["finetune", "realm"]),
                      log_fn=_Prefixed(run, "qa"), log_every=params.tracking.log_every, param_prefix="finetune.qa_train",
                      # a batch without block_embeddings (uniform p(z|x)) never runs the query tower
                      find_unused_parameters=True)
    result = trainer.fit()
    if D.is_rank0():
        trainer.raw_model.save_pretrained(FINETUNE_OUT / "open_qa", tokenizer)
    return {"qa_questions": len(rows), "qa_steps": result.step, **{f"qa_final_{k}": v for k, v in result.metrics.items()}}


def finetune(params: Params, run=None) -> dict:
    tokenizer = load_tokenizer(TOKENS / "tokenizer")
    summary = {**finetune_retriever(params, run, tokenizer), **finetune_reader(params, run, tokenizer)}
    if D.is_rank0():
        FINETUNE_OUT.mkdir(parents=True, exist_ok=True)
        write_stage_metrics(stage_metrics("finetune"), summary)
    D.barrier()
    return summary


def main() -> None:
    torchrun_worker("finetune", finetune)


if __name__ == "__main__":
    main()
