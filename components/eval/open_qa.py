"""Open-QA inference for the evaluate stage: the fine-tuned retriever + reader over REALM's final index.

    qa = OpenQAPredictor.load(params.finetune, tokenizer)       # models/finetune/open_qa + models/realm/index/final
    preds = qa.predict_all([(qid, question), ...])              # {qid: answer}
    floor = qa.predict_all(questions, closed_book=True)         # the null document only

It joins the reader (models) with a frozen block index (index) and the block selection
(retrieval), so it lives in eval, the lowest layer that may use all three.
"""

from __future__ import annotations

import os

import datasets
import torch

from components.data.qa_batch import QACollator
from components.data.special_tokens import NULL_ROW
from components.models.reader import OpenQA
from components.paths import FINETUNE_OUT, REALM_OUT, TOKENS
from components.retrieval.search import load_block_index, retrieve_qa_blocks, retriever_encode_fn


class OpenQAPredictor:
    """Answer questions with a trained `OpenQA` over a frozen block index, `batch_size` at a time.

    `ft`: a FinetuneParams (query_len, passage_len, qa_top_k, max_answer_tokens: the lengths of
    training); `blocks`: the block table the index rows point into; `block_vecs` (N, D) its vectors;
    `index`: anything with `search(q, k) -> (scores, rows)`.
    """

    def __init__(self, model: OpenQA, ft, tokenizer, blocks, block_vecs, index, batch_size: int = 8):
        self.model, self.ft, self.tokenizer, self.batch_size = model.eval(), ft, tokenizer, batch_size
        self.blocks, self.vecs, self.index = blocks, block_vecs, index
        self.collate = QACollator.from_params(tokenizer, blocks, block_vecs, ft)

    @classmethod
    def load(cls, ft, tokenizer, model_dir: str | os.PathLike = FINETUNE_OUT / "open_qa",
             blocks_dir: str | os.PathLike = TOKENS / "blocks", index_dir: str | os.PathLike = REALM_OUT / "index" / "final",
             batch_size: int = 8) -> "OpenQAPredictor":
        """From the DAG's folders: the finetune stage's open_qa model, the tokenize stage's
        blocks and pretrain_realm's final index (checked to be row-aligned with the blocks)."""
        blocks = datasets.load_from_disk(str(blocks_dir))
        vecs, index = load_block_index(index_dir, blocks)
        return cls(OpenQA.from_pretrained(model_dir), ft, tokenizer, blocks, vecs, index, batch_size)

    @torch.no_grad()
    def predict_all(self, questions: list[tuple[str, str]], closed_book: bool = False) -> dict[str, str]:
        """[(id, question)] -> {id: answer}; `closed_book`: the null document only, the floor
        that shows what retrieval adds."""
        encode = retriever_encode_fn(self.model.retriever, self.tokenizer, self.ft.query_len)
        rows = [{"id": i, "question": q, "answers": []} for i, q in questions]
        if closed_book:
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
