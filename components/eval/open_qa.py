"""Open-QA inference for the evaluate stage: a fine-tuned reader over its system's own top k,
retrieved exactly as in training: the fine-tuned query tower over the same frozen index (the
same `tower_search_fn`), the first `qa_top_k`, the span scorer and `span_softmax` the reader was
trained with (saved in its openqa_config.json).

    qa = OpenQAPredictor.for_system("realm", params.finetune, tokenizer)   # models/finetune/open_qa/realm + REALM's final index
    preds = qa.predict_all([(qid, question), ...])                         # {qid: answer}
    floor = qa.predict_all(questions, closed_book=True)                    # the null document only

The systems (`finetune.qa_systems`), each with the reader its finetune run trained over the same
selection of blocks:
  realm        the fine-tuned query tower over the final index of REALM's refreshed arm (models/realm)
  realm-stale  the same over the final index of the stale arm (models/realm-stale), its own run
  bm25         BM25 over the block texts; no query tower, uniform p(z|x) over the top k
It joins the reader (models) with a frozen block index (index) and the block selection
(retrieval), so it lives in eval, the lowest layer that may use all three.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import datasets
import torch

from components.data.qa_batch import QACollator
from components.data.special_tokens import MISSING_ROW, NULL_ROW
from components.models.reader import OpenQA
from components.paths import FINETUNE_OPEN_QA, REALM_OUT, REALM_SYSTEM_OUT, TOKENS
from components.progress import ProgressClock, count_line
from components.retrieval.search import bm25_over_blocks, bm25_qa_blocks, load_block_index, tower_search_fn

OPEN_QA_OUT = FINETUNE_OPEN_QA
log = logging.getLogger(__name__)


class OpenQAPredictor:
    """Answer questions with a trained `OpenQA` over a frozen block selection, `batch_size` at a time.

    `ft`: a FinetuneParams (query_len, passage_len, qa_top_k, max_answer_tokens: the lengths of
    training; `load` also reads `reader_chunk_rows`, the reader's length bucketing, from it);
    `blocks`: the block table the index rows point into; `block_vecs` (N, D) its vectors (None for
    BM25); `index`: anything with `search(q, k) -> (scores, rows)`, or None for BM25 top-k over the
    block texts (`bm25`: a fitted `bm25_over_blocks`, built here when not given).
    """

    def __init__(self, model: OpenQA, ft, tokenizer, blocks, block_vecs, index, batch_size: int = 8, bm25=None,
                 name: str = "open-qa"):
        self.model, self.ft, self.tokenizer, self.batch_size = model.eval(), ft, tokenizer, batch_size
        self.name = name  # what its progress lines start with
        self.blocks, self.vecs, self.index = blocks, block_vecs, index
        if index is None and bm25 is None:
            bm25 = bm25_over_blocks(list(blocks["text"]) if hasattr(blocks, "column_names") else [b["text"] for b in blocks])
        self.bm25 = bm25
        self.collate = QACollator.from_params(tokenizer, blocks, block_vecs, ft)

    @classmethod
    def load(cls, ft, tokenizer, model_dir: str | os.PathLike = OPEN_QA_OUT / "realm",
             blocks_dir: str | os.PathLike = TOKENS / "blocks", index_dir: str | os.PathLike | None = REALM_OUT / "index" / "final",
             batch_size: int = 8, blocks=None, bm25=None, name: str = "open-qa") -> "OpenQAPredictor":
        """From the DAG's folders: a finetune open_qa model, the tokenize stage's blocks and a
        pretrain_realm index (checked to be row-aligned with the blocks); `index_dir=None`: BM25."""
        blocks = blocks if blocks is not None else datasets.load_from_disk(str(blocks_dir))
        vecs, index = load_block_index(index_dir, blocks) if index_dir is not None else (None, None)
        model = OpenQA.from_pretrained(model_dir, ft.reader_chunk_rows)
        return cls(model, ft, tokenizer, blocks, vecs, index, batch_size, bm25=bm25, name=name)

    @classmethod
    def for_system(cls, system: str, ft, tokenizer, open_qa_dir: str | os.PathLike = OPEN_QA_OUT, blocks=None,
                   bm25=None, batch_size: int = 8) -> "OpenQAPredictor":
        """The reader `finetune_reader@<system>` trained, over the same selection: BM25, or the final
        index of the system's REALM arm (`paths.REALM_SYSTEM_OUT`)."""
        arm = REALM_SYSTEM_OUT.get(system)
        index_dir = None if arm is None else arm / "index" / "final"
        return cls.load(ft, tokenizer, Path(open_qa_dir) / system, index_dir=index_dir, blocks=blocks, bm25=bm25,
                        batch_size=batch_size, name=f"open-qa qa:{system}")

    def select(self, rows: list[dict]) -> list[dict]:
        """Rows + `block_rows`: the top k of this system's retrieval."""
        if self.index is None:
            return bm25_qa_blocks(rows, self.ft.qa_top_k, bm25=self.bm25)
        search = tower_search_fn(self.model.retriever, self.tokenizer, self.ft.query_len, self.index.search)
        top = search([r["question"] for r in rows], self.ft.qa_top_k) if rows else []
        return [{**r, "block_rows": [int(x) if x >= 0 else MISSING_ROW for x in top[i]]} for i, r in enumerate(rows)]

    @torch.no_grad()
    def predict_all(self, questions: list[tuple[str, str]], closed_book: bool = False) -> dict[str, str]:
        """[(id, question)] -> {id: answer}; `closed_book`: the null document only, the floor
        that shows what retrieval adds. Logs a progress line at least every PROGRESS_EVERY_S: a
        reader over its top k of a few hundred questions takes minutes on a CPU."""
        desc = f"{self.name} closed-book" if closed_book else self.name
        clock = ProgressClock()
        rows = [{"id": i, "question": q, "answers": []} for i, q in questions]
        rows = [{**r, "block_rows": [NULL_ROW]} for r in rows] if closed_book else self.select(rows)
        preds = {}
        for i in range(0, len(rows), self.batch_size):
            chunk = rows[i : i + self.batch_size]
            batch = self.collate(chunk)
            texts = [[None if r < 0 else self.blocks[int(r)]["text"] for r in b] for b in batch["candidate_rows"].tolist()]
            for r, p in zip(chunk, self.model.predict_batch(batch, texts)):
                preds[r["id"]] = p["answer"]
            done = i + len(chunk)
            if clock.due(done, final=done == len(rows)):
                log.info("%s", count_line(desc, done, len(rows), clock.elapsed(), unit="questions"))
        return preds
