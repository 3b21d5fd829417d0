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
import numpy as np
import torch

from components.config import Params
from components.data.finetune_data import load_corpus, load_pairs, load_qa, mine_bm25_negatives, mine_dense_negatives, retrieve_qa_blocks
from components.data.tokenize import load_tokenizer
from components.models.biencoder import BiEncoder, make_encode_fn
from components.stages.common import RankZeroLogger, checkpoint_dir, torchrun_worker, write_stage_metrics
from components.training import distributed as D
from components.training.trainer import Trainer

log = logging.getLogger(__name__)

CORPUS, TOKENS, MODELS = Path("data/corpus"), Path("data/tokens"), Path("models")
OUT = MODELS / "finetune"

INIT_FOLDERS = {"retromae": MODELS / "retromae/encoder", "mlm": MODELS / "mlm/encoder", "init": MODELS / "retromae/init_encoder"}


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
        log.warning("no training questions in data/corpus/beir/qrels/train.tsv: skipping retrieval fine-tuning")
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
    from components.data.finetune_data import BiEncoderCollator

    collate = BiEncoderCollator.from_params(tokenizer, ft, corpus)
    trainer = Trainer(model, rows, collate, ft.train, params.compute, checkpoint_dir("finetune_retrieval", params, ["finetune", "retromae"]),
                      log_fn=_Prefixed(run, "retrieval"), log_every=params.tracking.log_every, param_prefix="finetune.train")
    result = trainer.fit()
    if D.is_rank0():
        trainer.raw_model.save_pretrained(OUT / "retriever", tokenizer, max_seq_length=ft.passage_len)
    log.info("retrieval fine-tuning from %s: %s", init, result.metrics)
    return {"retrieval_init": ft.retrieval_init, "retrieval_pairs": len(rows), "retrieval_steps": result.step,
            **{f"retrieval_final_{k}": v for k, v in result.metrics.items()}}


# ----------------------------------------------------------------------------------------------
# open-QA (REALM retriever + reader)
# ----------------------------------------------------------------------------------------------
def realm_index_vectors(blocks) -> tuple[np.ndarray, object]:
    """The final REALM index (frozen document embeddings), row-aligned with the block table."""
    from components.index.faiss_index import BlockIndex

    index = BlockIndex.load(MODELS / "realm/index/final")
    if list(index.ids) != list(blocks["block_id"]):
        raise ValueError("models/realm/index/final does not list the blocks of data/tokens/blocks in order; rerun pretrain_realm")
    return index.embeddings(), index


def reader_init_folder() -> Path:
    """REALM fine-tunes its reader from the knowledge-augmented encoder; fall back to RetroMAE."""
    for folder in (MODELS / "realm/knowledge_augmented_encoder", MODELS / "retromae/encoder"):
        if (folder / "config.json").exists():
            return folder
    raise FileNotFoundError("no encoder to start the reader from (models/realm/knowledge_augmented_encoder or models/retromae/encoder)")


def realm_query_encode_fn(retriever, tokenizer, query_len: int):
    @torch.no_grad()
    def encode(texts, side="query"):
        retriever.eval()
        t = tokenizer(list(texts), max_length=query_len, truncation=True, padding=True, return_tensors="pt", return_token_type_ids=False)
        return retriever.encode_query(t["input_ids"], t["attention_mask"]).float().numpy()
    return encode


def finetune_reader(params: Params, run, tokenizer) -> dict:
    from components.models.realm import Retriever
    from components.models.reader import OpenQA, QACollator, SpanReader

    ft = params.finetune
    qa = load_qa(CORPUS, "train")
    if not ft.qa_enabled or not qa or not (MODELS / "realm/retriever").exists():
        log.warning("open-QA fine-tuning skipped (finetune.qa_enabled=%s, %d training questions)", ft.qa_enabled, len(qa))
        return {"qa_trained": 0}
    blocks = datasets.load_from_disk(str(TOKENS / "blocks"))
    vecs, index = realm_index_vectors(blocks)
    retriever = Retriever.from_pretrained(MODELS / "realm/retriever")
    rows = retrieve_qa_blocks(realm_query_encode_fn(retriever, tokenizer, ft.query_len), qa, ft.qa_top_k, search_fn=index.search)
    model = OpenQA(retriever, SpanReader.from_pretrained(reader_init_folder()), ft.max_answer_tokens)
    collate = QACollator.from_params(tokenizer, blocks, vecs, ft)
    trainer = Trainer(model, rows, collate, ft.qa_train, params.compute, checkpoint_dir("finetune_qa", params, ["finetune", "realm"]),
                      log_fn=_Prefixed(run, "qa"), log_every=params.tracking.log_every, param_prefix="finetune.qa_train",
                      find_unused_parameters=True)
    result = trainer.fit()
    if D.is_rank0():
        trainer.raw_model.save_pretrained(OUT / "open_qa", tokenizer)
    return {"qa_questions": len(rows), "qa_steps": result.step, **{f"qa_final_{k}": v for k, v in result.metrics.items()}}


def finetune(params: Params, run=None) -> dict:
    tokenizer = load_tokenizer(TOKENS / "tokenizer")
    summary = {**finetune_retriever(params, run, tokenizer), **finetune_reader(params, run, tokenizer)}
    if D.is_rank0():
        OUT.mkdir(parents=True, exist_ok=True)
        write_stage_metrics(Path("metrics/finetune.json"), summary)
    D.barrier()
    return summary


# ----------------------------------------------------------------------------------------------
# inference for the evaluate stage
# ----------------------------------------------------------------------------------------------
class OpenQAPredictor:
    """Answer questions with the fine-tuned retriever + reader over the final REALM index."""

    def __init__(self, params: Params, tokenizer, batch_size: int = 8):
        from components.models.reader import OpenQA, QACollator

        self.ft, self.tokenizer, self.batch_size = params.finetune, tokenizer, batch_size
        self.model = OpenQA.from_pretrained(OUT / "open_qa").eval()
        self.blocks = datasets.load_from_disk(str(TOKENS / "blocks"))
        self.vecs, self.index = realm_index_vectors(self.blocks)
        self.collate = QACollator.from_params(tokenizer, self.blocks, self.vecs, self.ft)

    @torch.no_grad()
    def predict_all(self, questions: list[tuple[str, str]], closed_book: bool = False) -> dict[str, str]:
        from components.data.realm_batch import NULL_ROW

        encode = realm_query_encode_fn(self.model.retriever, self.tokenizer, self.ft.query_len)
        rows = [{"id": i, "question": q, "answers": []} for i, q in questions]
        if closed_book:  # the null document only: the floor that shows what retrieval adds
            rows = [{**r, "block_rows": [NULL_ROW]} for r in rows]
        else:
            rows = retrieve_qa_blocks(encode, rows, self.ft.qa_top_k, search_fn=self.index.search)
        preds = {}
        for i in range(0, len(rows), self.batch_size):
            chunk = rows[i : i + self.batch_size]
            batch = self.collate(chunk)
            texts = [[None if r < 0 else self.blocks[int(r)]["text"] for r in b] for b in batch["candidate_rows"].tolist()]
            for r, p in zip(chunk, self.model.predict_batch(batch, texts)):
                preds[r["id"]] = p["answer"]
        return preds


def main() -> None:
    torchrun_worker("finetune", finetune)


if __name__ == "__main__":
    main()
