"""Stage body of `finetune`: the DPR bi-encoder from each starting encoder (RetroMAE's question) and
one open-QA reader per retrieval system (REALM's question), each with one recipe.

    python -m flows.finetune
    torchrun --standalone --nproc_per_node=2 -m components.stages.finetune   # compute.nproc=2

Outputs (rank 0):
  models/finetune/retriever/<start>/   one bi-encoder per `finetune.retrieval_inits` (HF + sentence-
                                       transformers, [CLS] pooling): init, mlm, retromae, realm, pretrained
  models/finetune/open_qa/<system>/    one retriever + span reader per trained `finetune.qa_systems`
                                       entry (`OpenQA.from_pretrained`): bm25, realm, realm-stale
  metrics/finetune.json

Same recipe, same data: every bi-encoder run gets the same pairs, hard-negative pools (BM25's are
mined once), `finetune.train` and seed, so the trainer draws the same batches in the same order;
only the starting weights differ (their sha256 is recorded per run). `realm` starts from REALM's
query tower (`models/realm/retriever/query_encoder`): its BERT, without the projection to
`realm.retriever_dim`, so that all four runs train the same architecture ([CLS], shared towers,
dot product) and the comparison is about the starting weights alone.

Every reader starts from the same encoder (`reader_init_folder`), with `finetune.qa_train` and the
same seed, over its own system's top `qa_top_k` blocks. A dense system is ORQA's: at every step
the collator searches the frozen block index (pretrain_realm's; the passage tower never trains)
with the query tower as it is then, takes the top `qa_retrieval_beam` for the retrieval loss and
reads the first `qa_top_k` (models/reader.py). BM25 reads its fixed top k (the BM25 + reader
baseline). With `finetune.qa_gold_steps`, the reader
first reads each training question's own paragraph (SQuAD's reading-comprehension setting): that
phase involves no retriever, so it runs once and every system's reader starts from its result,
exactly as if each ran it. A span head new to a warm-started encoder trains at
`warm_start.head_lr`, as the MLM head does. `closed-book` trains nothing: with the null document
alone an extractive reader has no span to learn or to answer (evaluate scores it).
"""

from __future__ import annotations

import logging
from pathlib import Path

import datasets

from components.config import Params
from components.data.finetune_data import BiEncoderCollator, load_corpus, load_pairs, load_qa
from components.data.tokenize import load_tokenizer
from components.models.biencoder import BiEncoder, make_encode_fn, weights_digest
from components.models.encoder import resolve_pretrained
from components.paths import (CORPUS, FINETUNE_OPEN_QA, FINETUNE_OUT, FINETUNE_RETRIEVERS, INIT_ENCODER, MLM_ENCODER,
                              REALM_OUT, RETROMAE_ENCODER, TOKENS, stage_metrics)
from components.retrieval.negatives import mine_bm25_negatives, mine_dense_negatives
from components.retrieval.search import (QA_SYSTEM_INDEX, bm25_qa_blocks, frozen_search_fn, gold_qa_blocks, load_block_index,
                                         tower_search_fn)
from components.stages.common import RankZeroLogger, checkpoint_dir, torchrun_worker, write_stage_metrics
from components.training import distributed as D
from components.training.trainer import LrGroup, Trainer, phase_params, prefixed

log = logging.getLogger(__name__)

RETRIEVER_OUT = FINETUNE_RETRIEVERS
OPEN_QA_OUT = FINETUNE_OPEN_QA
REALM_QUERY_TOWER = REALM_OUT / "retriever" / "query_encoder"
START_FOLDERS = {"init": INIT_ENCODER, "mlm": MLM_ENCODER, "retromae": RETROMAE_ENCODER, "realm": REALM_QUERY_TOWER}
# the params sections that decide a start's weights: a change there starts a fresh checkpoint folder
_START_SECTIONS = {"init": ["retromae"], "mlm": ["retromae", "mlm"], "retromae": ["retromae"],
                   "realm": ["retromae", "realm"], "pretrained": []}


def retrieval_start_folder(params: Params, name: str) -> Path | str:
    """The encoder folder (or hub name) the `ft:<name>` run starts from."""
    if name == "pretrained":
        return resolve_pretrained(params.finetune.retrieval_pretrained_path, key="finetune.retrieval_pretrained_path")
    return START_FOLDERS[name]


def _available(folder: Path | str) -> bool:
    return not isinstance(folder, Path) or (folder / "config.json").exists()


# ----------------------------------------------------------------------------------------------
# dense retrieval (DPR), once per starting encoder
# ----------------------------------------------------------------------------------------------
def finetune_retrievers(params: Params, run, tokenizer) -> dict:
    ft = params.finetune
    pairs = load_pairs(CORPUS, "train")
    if not pairs:
        log.warning("no training questions in %s: skipping retrieval fine-tuning", CORPUS / "beir/qrels/train.tsv")
        return {"retrieval_trained": 0}
    starts = {name: retrieval_start_folder(params, name) for name in ft.retrieval_inits}
    missing = [f"{n} ({f})" for n, f in starts.items() if not _available(f)]
    starts = {n: f for n, f in starts.items() if _available(f)}
    if missing:
        log.warning("finetune.retrieval_inits: no encoder for %s (its stage did not run); fine-tuning the others", missing)
    if not starts:
        raise FileNotFoundError(f"finetune.retrieval_inits={ft.retrieval_inits}: none of their encoders exists "
                                f"({', '.join(missing)}); run their stages first, or pick others")
    corpus = load_corpus(CORPUS)
    bm25_rows = mine_bm25_negatives(pairs, corpus) if ft.hard_negatives and ft.hard_negative_source == "bm25" else None
    summary: dict = {"retrieval_pairs": len(pairs), "retrieval_inits": ",".join(starts), "retrieval_skipped": ",".join(missing)}
    for name, folder in starts.items():
        summary.update(_finetune_one(params, run, tokenizer, name, folder, pairs, corpus, bm25_rows))
    return summary


def _finetune_one(params: Params, run, tokenizer, name: str, folder, pairs, corpus, bm25_rows) -> dict:
    ft = params.finetune
    model = BiEncoder.from_params(folder, ft)
    start_sha = weights_digest(model.encoder)
    if ft.hard_negatives == 0:
        rows = [{**p, "negatives": []} for p in pairs]
    elif bm25_rows is not None:
        rows = bm25_rows
    else:  # the two-stage recipe: negatives from this start's own index
        rows = mine_dense_negatives(make_encode_fn(model, tokenizer, ft.query_len, ft.passage_len), pairs, corpus)
    collate = BiEncoderCollator.from_params(tokenizer, ft, corpus)
    ckpt = checkpoint_dir(f"finetune_retrieval_{name}", params, ["finetune", "warm_start", *_START_SECTIONS[name]])
    trainer = Trainer(model, rows, collate, ft.train, params.compute, ckpt,
                      log_fn=prefixed(RankZeroLogger(run), f"retrieval.{name}."),
                      log_every=params.tracking.log_every, param_prefix="finetune.train",
                      progress_every=params.tracking.progress_every)
    result = trainer.fit()
    if D.is_rank0():
        trainer.raw_model.save_pretrained(RETRIEVER_OUT / name, tokenizer, max_seq_length=ft.passage_len)
    log.info("retrieval fine-tuning ft:%s from %s: %s", name, folder, result.metrics)
    return {f"retrieval.{name}.start": str(folder), f"retrieval.{name}.start_sha256": start_sha,
            f"retrieval.{name}.steps": result.step, **{f"retrieval.{name}.final_{k}": v for k, v in result.metrics.items()}}


# ----------------------------------------------------------------------------------------------
# open-QA: one reader per retrieval system
# ----------------------------------------------------------------------------------------------
def reader_init_folder() -> Path:
    """REALM fine-tunes its reader from the knowledge-augmented encoder; fall back to RetroMAE."""
    for folder in (REALM_OUT / "knowledge_augmented_encoder", RETROMAE_ENCODER):
        if (folder / "config.json").exists():
            return folder
    raise FileNotFoundError(f"no encoder to start the reader from ({REALM_OUT / 'knowledge_augmented_encoder'} or {RETROMAE_ENCODER})")


def qa_selection(system: str, ft, tokenizer, blocks, qa: list[dict]):
    """(rows, block vectors or None, query tower or None, retrieve or None) for one QA system.
    Dense systems: REALM's query tower, the vectors of a frozen REALM index and `retrieve`, that
    index searched with the tower as it is at each call (the collator's per-step search), or with
    `finetune.qa_search: fixed` as it was before fine-tuning. BM25:
    rows + its fixed top k `block_rows`, no tower (uniform p(z|x) over its top k)."""
    from components.models.retriever import Retriever

    if system == "bm25":
        return bm25_qa_blocks(qa, ft.qa_top_k, block_texts=list(blocks["text"])), None, None, None
    vecs, index = load_block_index(REALM_OUT / "index" / QA_SYSTEM_INDEX[system], blocks)  # frozen during fine-tuning
    retriever = Retriever.from_pretrained(REALM_OUT / "retriever")
    search = tower_search_fn(retriever, tokenizer, ft.query_len, index.search)
    if ft.qa_search == "fixed":  # the ablation: every beam from the tower before fine-tuning
        search = frozen_search_fn(search, [r["question"] for r in qa], ft.qa_retrieval_beam)
    return list(qa), vecs, retriever, search


def new_reader(ft, folder: Path | None = None):
    """The reader every system starts from: `reader_init_folder` with `finetune.span_scorer`."""
    from components.models.reader import SpanReader

    return SpanReader.from_pretrained(folder or reader_init_folder(), span_scorer=ft.span_scorer, span_hidden=ft.span_hidden)


def reader_lr_groups(params: Params) -> list[LrGroup]:
    """The span head (`qa_outputs`, or ORQA's `span_mlp`) starts random on a warm-started encoder:
    `warm_start.head_lr`."""
    lr = params.warm_start.head_lr
    if params.warm_start.path is None or lr is None:
        return []
    return [LrGroup("head", lambda name: ".qa_outputs." in name or ".span_mlp." in name, lr)]


def gold_reader(params: Params, run, tokenizer, blocks, qa: list[dict]) -> tuple[dict | None, dict]:
    """The reader after `finetune.qa_gold_steps` on (question, own paragraph) pairs: (its
    state_dict, summary), or (None, {}) when the phase is off or no question names its paragraph."""
    from components.data.qa_batch import QACollator
    from components.models.reader import OpenQA

    ft = params.finetune
    if not ft.qa_gold_steps:
        return None, {}
    rows = gold_qa_blocks(qa, blocks["doc_id"], blocks["text"])
    if not rows:
        log.warning("finetune.qa_gold_steps=%d but no training question has a positive_ctx paragraph holding its "
                    "answer: skipping the reader's own-paragraph phase", ft.qa_gold_steps)
        return None, {}
    model = OpenQA(None, new_reader(ft), ft.max_answer_tokens, ft.span_softmax)
    train = phase_params(ft.qa_train, ft.qa_gold_steps, ft.qa_train.lr, batch_size=ft.qa_gold_batch_size)
    ckpt = checkpoint_dir("finetune_qa_gold", params, ["finetune", "warm_start", "realm"])
    trainer = Trainer(model, rows, QACollator.from_params(tokenizer, blocks, None, ft, top_k=1), train, params.compute,
                      ckpt, log_fn=prefixed(RankZeroLogger(run), "qa.gold."), log_every=params.tracking.log_every,
                      param_prefix="finetune.qa_gold", lr_groups=reader_lr_groups(params),
                      progress_every=params.tracking.progress_every)
    result = trainer.fit()
    state = {k: v.detach().clone() for k, v in trainer.raw_model.reader.state_dict().items()}
    return state, {"qa.gold.questions": len(rows), "qa.gold.steps": result.step,
                   **{f"qa.gold.final_{k}": v for k, v in result.metrics.items()}}


def _qa_inputs_exist(system: str) -> bool:
    if system == "bm25":
        return True
    return (REALM_OUT / "retriever").exists() and (REALM_OUT / "index" / QA_SYSTEM_INDEX[system]).exists()


def finetune_readers(params: Params, run, tokenizer) -> dict:
    ft = params.finetune
    qa = load_qa(CORPUS, "train")
    systems = [s for s in ft.qa_systems if s != "closed-book"]  # closed-book: nothing to train (module docstring)
    if not ft.qa_enabled or not qa or not systems:
        log.warning("open-QA fine-tuning skipped (finetune.qa_enabled=%s, %d training questions, systems %s)",
                    ft.qa_enabled, len(qa), systems)
        return {"qa_trained": 0}
    blocks = datasets.load_from_disk(str(TOKENS / "blocks"))
    gold_state, summary = gold_reader(params, run, tokenizer, blocks, qa)
    summary["qa_questions"] = len(qa)
    trained = []
    for system in systems:
        if not _qa_inputs_exist(system):
            log.warning("open-QA system %s skipped: no REALM retriever / index under %s", system, REALM_OUT)
            continue
        trained.append(system)
        summary.update(_finetune_reader(params, run, tokenizer, system, blocks, qa, gold_state))
    return {**summary, "qa_systems": ",".join(trained)}


def _finetune_reader(params: Params, run, tokenizer, system: str, blocks, qa: list[dict], gold_state: dict | None) -> dict:
    from components.data.qa_batch import QACollator
    from components.models.reader import OpenQA

    ft = params.finetune
    rows, vecs, retriever, retrieve = qa_selection(system, ft, tokenizer, blocks, qa)
    if retrieve is not None and ft.qa_train.num_workers:
        raise ValueError("finetune.qa_train.num_workers must be 0: the per-step search reads the query tower "
                         "in the training process (a worker would search with a stale copy)")
    reader = new_reader(ft)
    if gold_state is not None:
        reader.load_state_dict(gold_state)
    model = OpenQA(retriever, reader, ft.max_answer_tokens, ft.span_softmax)
    collate = QACollator.from_params(tokenizer, blocks, vecs, ft, retrieve=retrieve)
    ckpt = checkpoint_dir(f"finetune_qa_{system}", params, ["finetune", "warm_start", "realm"])
    trainer = Trainer(model, rows, collate, ft.qa_train, params.compute, ckpt,
                      log_fn=prefixed(RankZeroLogger(run), f"qa.{system}."),
                      log_every=params.tracking.log_every, param_prefix="finetune.qa_train",
                      # a batch without block_embeddings (uniform p(z|x)) never runs the query tower
                      find_unused_parameters=True, lr_groups=reader_lr_groups(params),
                      progress_every=params.tracking.progress_every)
    result = trainer.fit()
    if D.is_rank0():
        trainer.raw_model.save_pretrained(OPEN_QA_OUT / system, tokenizer)
    return {f"qa.{system}.steps": result.step, **{f"qa.{system}.final_{k}": v for k, v in result.metrics.items()}}


def finetune(params: Params, run=None) -> dict:
    tokenizer = load_tokenizer(TOKENS / "tokenizer")
    summary = {**finetune_retrievers(params, run, tokenizer), **finetune_readers(params, run, tokenizer)}
    if D.is_rank0():
        FINETUNE_OUT.mkdir(parents=True, exist_ok=True)
        summary = write_stage_metrics(stage_metrics("finetune"), summary)
    D.barrier()
    return summary


def main() -> None:
    torchrun_worker("finetune", finetune)


if __name__ == "__main__":
    main()
