"""Fine-tuning, one run at a time: a DPR bi-encoder from one starting encoder (RetroMAE's question)
and an open-QA reader over one retrieval system (REALM's question). The stage bodies
(components/stages/finetune_retriever.py, finetune_reader.py) call these once per DVC stage;
benches and tests call them directly.

    folder = retrieval_start_folder(params, "retromae")                  # models/retromae/encoder
    rows = size_subset(pairs, 32, seed)                                  # the first 32 of a seeded order
    model, result, sha = train_biencoder(params, tokenizer, folder, rows, corpus, bm25_rows, ckpt, log_fn)
    reader, summary = train_gold_reader(params, tokenizer, blocks, qa, init, ckpt, log_fn)
    model, result = train_reader(params, tokenizer, "realm", blocks, qa, reader, ckpt, log_fn)

Same recipe, same data: every bi-encoder of one size gets the same pairs, hard-negative pools (BM25's
are mined from the whole training set), `finetune.train` and seed, so the trainer draws the same
batches in the same order; only the starting weights differ. A size's questions are the first `size`
of one seeded permutation, so a smaller set is always inside a larger one. `realm` starts from REALM's
query tower (`models/realm/retriever/query_encoder`): its BERT, without the projection to
`realm.retriever_dim`, so that every start trains the same architecture ([CLS], shared towers, dot
product) and the comparison is about the starting weights alone.

A dense open-QA system is ORQA's: at every step the collator searches the frozen block index of its
REALM arm (`paths.REALM_SYSTEM_OUT`: `realm` the refreshed arm, `realm-stale` the stale one) with the
arm's query tower as it is then, takes the top `qa_retrieval_beam` for the retrieval loss and reads
the first `qa_top_k` (models/reader.py). BM25 reads its fixed top k. Each reader starts from its
arm's knowledge-augmented encoder (BM25's: the refreshed arm's; RetroMAE's encoder when REALM did
not run). With `finetune.qa_gold_steps` the reader first reads each training question's own
paragraph (SQuAD's reading-comprehension setting). A span head new to a warm-started encoder trains
at `warm_start.head_lr`, as the MLM head does.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from components.config import Params
from components.data.finetune_data import BiEncoderCollator
from components.models.biencoder import BiEncoder, make_encode_fn, weights_digest
from components.paths import INIT_ENCODER, MLM_ENCODER, REALM_OUT, REALM_SYSTEM_OUT, RETROMAE_ENCODER
from components.retrieval.negatives import mine_dense_negatives
from components.retrieval.search import bm25_qa_blocks, frozen_search_fn, gold_qa_blocks, load_block_index, tower_search_fn
from components.training.optim import LrGroup, phase_params
from components.training.resume import model_metrics
from components.training.trainer import Trainer, TrainResult, prefixed

log = logging.getLogger(__name__)

START_FOLDERS = {"init": INIT_ENCODER, "mlm": MLM_ENCODER, "retromae": RETROMAE_ENCODER,
                 "realm": REALM_OUT / "retriever" / "query_encoder"}
# the params sections that decide a start's weights: a change there starts a fresh checkpoint folder
START_SECTIONS = {"init": ["retromae"], "mlm": ["retromae", "mlm"], "retromae": ["retromae"],
                  "realm": ["retromae", "realm"]}
READER_SECTIONS = ["finetune", "warm_start", "realm"]  # the params a reader's checkpoint folder is keyed by (with its start: reader_inputs)


# ----------------------------------------------------------------------------------------------
# dense retrieval (DPR)
# ----------------------------------------------------------------------------------------------
def retrieval_start_folder(params: Params, name: str) -> Path:
    """The encoder folder the `ft:<name>` run starts from: a stage's output (a pre-trained model enters
    through warm_start.path, as `init`)."""
    return START_FOLDERS[name]


def size_subset(rows: list, size: int | str, seed: int) -> list:
    """The first `size` rows of one seeded permutation (`all`: every row, in order): nested subsets."""
    if size == "all" or size >= len(rows):
        if size != "all":
            log.warning("finetune.train_sizes: %d > the %d training questions; training on all of them", size, len(rows))
        return list(rows)
    order = np.random.default_rng(seed).permutation(len(rows))
    return [rows[i] for i in sorted(order[:size].tolist())]


def train_biencoder(params: Params, tokenizer, folder, pairs: list[dict], corpus, bm25_rows: list[dict] | None,
                    ckpt: Path, log_fn) -> tuple[BiEncoder, TrainResult, str]:
    """One DPR run from `folder` on `pairs` (BM25 negatives: `bm25_rows`, row-aligned with `pairs`,
    or None to mine from this start's own index): (trained model, result, start weights' sha256)."""
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
    trainer = Trainer(model, rows, collate, ft.train, params.compute, ckpt, log_fn=log_fn,
                      log_every=params.tracking.log_every, param_prefix="finetune.train",
                      progress_every=params.tracking.progress_every)
    result = trainer.fit()
    return trainer.raw_model, result, start_sha


# ----------------------------------------------------------------------------------------------
# open QA: one reader per retrieval system
# ----------------------------------------------------------------------------------------------
def reader_init_folder(system: str = "realm") -> Path:
    """REALM fine-tunes its reader from the knowledge-augmented encoder of its own arm (BM25's reader:
    the refreshed arm's); RetroMAE's encoder when REALM did not run."""
    arm = REALM_SYSTEM_OUT.get(system, REALM_OUT)
    for folder in (arm / "knowledge_augmented_encoder", RETROMAE_ENCODER):
        if (folder / "config.json").exists():
            return folder
    raise FileNotFoundError(f"no encoder to start the reader from ({arm / 'knowledge_augmented_encoder'} or {RETROMAE_ENCODER})")


def reader_inputs(system: str) -> list[Path]:
    """What a system's reader starts from on disk: its encoder folder and, for a dense system, its
    REALM arm's retriever and final index (the checkpoint key's `inputs`)."""
    arm = REALM_SYSTEM_OUT.get(system)
    dense = [] if arm is None else [arm / "retriever", arm / "index" / "final"]
    return [reader_init_folder(system), *dense]


def qa_inputs_exist(system: str) -> bool:
    """BM25 needs nothing; a dense system needs its REALM arm's retriever and final index."""
    arm = REALM_SYSTEM_OUT.get(system)
    return arm is None or ((arm / "retriever").exists() and (arm / "index" / "final").exists())


def qa_selection(system: str, ft, tokenizer, blocks, qa: list[dict]):
    """(rows, block vectors or None, query tower or None, retrieve or None) for one QA system.
    Dense systems: their arm's query tower, the vectors of its frozen final index and `retrieve`, that
    index searched with the tower as it is at each call (the collator's per-step search), or with
    `finetune.qa_search: fixed` as it was before fine-tuning. BM25: rows + its fixed top k
    `block_rows`, no tower (uniform p(z|x) over its top k)."""
    from components.models.retriever import Retriever

    if system == "bm25":
        return bm25_qa_blocks(qa, ft.qa_top_k, block_texts=list(blocks["text"])), None, None, None
    arm = REALM_SYSTEM_OUT[system]
    vecs, index = load_block_index(arm / "index" / "final", blocks)  # frozen during fine-tuning
    retriever = Retriever.from_pretrained(arm / "retriever")
    search = tower_search_fn(retriever, tokenizer, ft.query_len, index.search)
    if ft.qa_search == "fixed":  # the ablation: every beam from the tower before fine-tuning
        search = frozen_search_fn(search, [r["question"] for r in qa], ft.qa_retrieval_beam)
    return list(qa), vecs, retriever, search


def new_reader(ft, folder: Path | None = None, system: str = "realm"):
    """The reader a system starts from: `reader_init_folder(system)` with `finetune.span_scorer`."""
    from components.models.reader import SpanReader

    return SpanReader.from_pretrained(folder or reader_init_folder(system), span_scorer=ft.span_scorer, span_hidden=ft.span_hidden)


def reader_lr_groups(params: Params) -> list[LrGroup]:
    """The span head (`qa_outputs`, or ORQA's `span_mlp`) starts random on a warm-started encoder:
    `warm_start.head_lr`."""
    lr = params.warm_start.head_lr
    if params.warm_start.path is None or lr is None:
        return []
    return [LrGroup("head", lambda name: ".qa_outputs." in name or ".span_mlp." in name, lr)]


def train_gold_reader(params: Params, tokenizer, blocks, qa: list[dict], reader, ckpt: Path, log_fn) -> tuple[object, dict]:
    """`reader` after `finetune.qa_gold_steps` on (question, own paragraph) pairs, and a summary;
    `reader` unchanged and {} when the phase is off or no question names its paragraph."""
    from components.data.qa_batch import QACollator
    from components.models.reader import OpenQA

    ft = params.finetune
    if not ft.qa_gold_steps:
        return reader, {}
    rows = gold_qa_blocks(qa, blocks["doc_id"], blocks["text"])
    if not rows:
        log.warning("finetune.qa_gold_steps=%d but no training question has a positive_ctx paragraph holding its "
                    "answer: skipping the reader's own-paragraph phase", ft.qa_gold_steps)
        return reader, {}
    model = OpenQA(None, reader, ft.max_answer_tokens, ft.span_softmax, ft.reader_chunk_rows)
    train = phase_params(ft.qa_train, ft.qa_gold_steps, ft.qa_train.lr, batch_size=ft.qa_gold_batch_size)
    trainer = Trainer(model, rows, QACollator.from_params(tokenizer, blocks, None, ft, top_k=1), train, params.compute,
                      ckpt, log_fn=prefixed(log_fn, "qa.gold."), log_every=params.tracking.log_every,
                      param_prefix="finetune.qa_gold", lr_groups=reader_lr_groups(params),
                      progress_every=params.tracking.progress_every)
    result = trainer.fit()
    return trainer.raw_model.reader, {"qa.gold.questions": len(rows), "qa.gold.steps": result.step,
                                      "qa.gold.resumed_from": result.resumed_from or 0,
                                      **{f"qa.gold.final_{k}": v for k, v in model_metrics(result.metrics).items()}}


def train_reader(params: Params, tokenizer, system: str, blocks, qa: list[dict], reader, ckpt: Path, log_fn):
    """`reader` fine-tuned over `system`'s top k: (the trained OpenQA, result)."""
    from components.data.qa_batch import QACollator
    from components.models.reader import OpenQA

    ft = params.finetune
    rows, vecs, retriever, retrieve = qa_selection(system, ft, tokenizer, blocks, qa)
    if retrieve is not None and ft.qa_train.num_workers:
        raise ValueError("finetune.qa_train.num_workers must be 0: the per-step search reads the query tower "
                         "in the training process (a worker would search with a stale copy)")
    model = OpenQA(retriever, reader, ft.max_answer_tokens, ft.span_softmax, ft.reader_chunk_rows)
    collate = QACollator.from_params(tokenizer, blocks, vecs, ft, retrieve=retrieve)
    trainer = Trainer(model, rows, collate, ft.qa_train, params.compute, ckpt, log_fn=log_fn,
                      log_every=params.tracking.log_every, param_prefix="finetune.qa_train",
                      # a batch without block_embeddings (uniform p(z|x)) never runs the query tower
                      find_unused_parameters=True, lr_groups=reader_lr_groups(params),
                      progress_every=params.tracking.progress_every)
    result = trainer.fit()
    return trainer.raw_model, result
