"""Top-k block search for fine-tuning and open-QA: exact inner product, a frozen block index, or BM25.

    encode = retriever_encode_fn(retriever, tokenizer, query_len=32)       # (texts, side) -> (N, D)
    vecs, index = load_block_index(REALM_OUT / "index" / "final", blocks)  # row-aligned with `blocks`
    qa = retrieve_qa_blocks(encode, qa, k=5, search_fn=index.search)       # + block_rows
    search = tower_search_fn(retriever, tokenizer, 32, index.search)        # (questions, n) -> (Q, n) rows, now
    qa = bm25_qa_blocks(qa, k=5, block_texts=blocks["text"])               # the sparse system: + block_rows
    qa = gold_qa_blocks(qa, blocks["doc_id"], blocks["text"])              # each question's own paragraph

An `EncodeFn` maps (texts, "query"|"passage") to float32 vectors (N, D); `biencoder.make_encode_fn`
and `retriever_encode_fn` build one.
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

import numpy as np
import torch

SIDE_QUERY, SIDE_PASSAGE = "query", "passage"
EncodeFn = Callable[[Sequence[str], str], np.ndarray]  # (texts, "query"|"passage") -> (N, D) float32
SearchFn = Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]  # (queries (Q, D), k) -> (scores, rows)


def dense_search(query_vecs: np.ndarray, passage_vecs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact inner-product top-k with faiss IndexFlatIP: (scores, rows), each (Q, min(k, N))."""
    import faiss

    p = np.ascontiguousarray(passage_vecs, dtype=np.float32)
    q = np.ascontiguousarray(query_vecs, dtype=np.float32)
    index = faiss.IndexFlatIP(p.shape[1])
    index.add(p)
    return index.search(q, min(k, p.shape[0]))


def retrieve_qa_blocks(
    encode_fn: EncodeFn, qa_rows: Sequence[dict], k: int, block_vecs: np.ndarray | None = None,
    search_fn: SearchFn | None = None,
) -> list[dict]:
    """Add `block_rows` (the top-k block rows) to each QA row, searching the frozen block index
    once with `encode_fn`: `search_fn(q, k) -> (scores, rows)` (e.g. `BlockIndex.search`), or an
    exact IndexFlatIP over `block_vecs`. A one-off selection; open-QA fine-tuning and evaluation
    search with the current tower instead (`tower_search_fn`)."""
    if (block_vecs is None) == (search_fn is None):
        raise ValueError("give exactly one of block_vecs or search_fn")
    if not qa_rows:
        return []
    q = encode_fn([r["question"] for r in qa_rows], SIDE_QUERY)
    _, rows = search_fn(q, k) if search_fn is not None else dense_search(q, block_vecs, k)
    return [{**r, "block_rows": [int(x) for x in rows[i] if x >= 0]} for i, r in enumerate(qa_rows)]


def bm25_qa_blocks(qa_rows: Sequence[dict], k: int, block_texts: Sequence[str] | None = None, bm25=None) -> list[dict]:
    """Add `block_rows` (the BM25 top-k block rows) to each QA row: the sparse system of open QA
    (the BM25 + reader baseline). Give the block table's texts (fitted here) or a `BM25Retriever`
    already fitted on them with the row numbers as doc ids (`bm25_over_blocks`)."""
    if (block_texts is None) == (bm25 is None):
        raise ValueError("give exactly one of block_texts or bm25")
    if not qa_rows:
        return []
    bm25 = bm25 if bm25 is not None else bm25_over_blocks(block_texts)
    ids, _ = bm25.retrieve([r["question"] for r in qa_rows], k)
    return [{**r, "block_rows": [int(x) for x in ids[i]]} for i, r in enumerate(qa_rows)]


def gold_qa_blocks(qa_rows: Sequence[dict], block_doc_ids: Sequence[str], block_texts: Sequence[str]) -> list[dict]:
    """Add `block_rows` = [the first block of the question's own paragraph (`positive_ctx`) whose
    text holds a gold answer] to each QA row that has one; the others are left out. The reader's
    reading-comprehension phase (SQuAD's setting): no retriever is involved, so every open-QA
    system can share it."""
    from components.data.text import normalize_answer

    by_doc: dict[str, list[int]] = {}
    for row, doc in enumerate(block_doc_ids):
        by_doc.setdefault(str(doc), []).append(row)
    out = []
    for r in qa_rows:
        golds = [normalize_answer(a) for a in r.get("answers", []) if normalize_answer(a)]
        rows = by_doc.get(str(r.get("positive_ctx")), [])
        hit = next((b for b in rows if any(g in normalize_answer(block_texts[b]) for g in golds)), None)
        if hit is not None:
            out.append({**r, "block_rows": [hit]})
    return out


def bm25_over_blocks(block_texts: Sequence[str]):
    """A BM25Retriever over the block table, its doc ids the row numbers ("0", "1", ...)."""
    from components.retrieval.bm25 import BM25Retriever

    return BM25Retriever().fit([str(i) for i in range(len(block_texts))], list(block_texts))


def load_block_index(folder: str | os.PathLike, blocks) -> tuple[np.ndarray, object]:
    """A saved BlockIndex (e.g. REALM's final one) and its vectors (N, D), checked to list the rows
    of the block table `blocks` in order: the readers look blocks up by index row."""
    from components.index.faiss_index import BlockIndex

    index = BlockIndex.load(folder)
    if list(index.ids) != list(blocks["block_id"]):
        raise ValueError(f"{folder} was built from other blocks than this block table (ids differ or are out of "
                         "order); rerun the stage that built it (pretrain_realm for REALM's index)")
    return index.embeddings(), index


def retriever_encode_fn(retriever, tokenizer, query_len: int) -> EncodeFn:
    """An EncodeFn over a retriever's query tower (`encode_query(ids, mask) -> (B, D)`), eval mode,
    no gradient; questions are cut to `query_len` tokens."""
    @torch.no_grad()
    def encode(texts, side=SIDE_QUERY):
        retriever.eval()
        t = tokenizer(list(texts), max_length=query_len, truncation=True, padding=True, return_tensors="pt", return_token_type_ids=False)
        return retriever.encode_query(t["input_ids"], t["attention_mask"]).float().numpy()
    return encode


def frozen_search_fn(search: Callable[[Sequence[str], int], np.ndarray], questions: Sequence[str],
                     n: int) -> Callable[[Sequence[str], int], np.ndarray]:
    """`search` (a `tower_search_fn`) run once, now, over every question, then answered from that
    table: each question's top n as the tower is *before* fine-tuning, whatever it becomes
    (`finetune.qa_search: fixed`, the ablation of ORQA's per-step search). Same contract as
    `search`; asking for a question it was not built with, or for more than n rows, is an error."""
    unique = list(dict.fromkeys(questions))
    table = dict(zip(unique, np.asarray(search(unique, n)))) if unique else {}  # question -> (n,) rows

    def lookup(texts: Sequence[str], k: int) -> np.ndarray:
        if k > n:
            raise ValueError(f"the fixed search holds each question's top {n}, not {k}")
        missing = [t for t in texts if t not in table]
        if missing:
            raise KeyError(f"the fixed search was built without {len(missing)} of these questions, e.g. {missing[0]!r}")
        return np.stack([table[t][:k] for t in texts])  # (Q, k)
    return lookup


def tower_search_fn(retriever, tokenizer, query_len: int, search_fn: SearchFn) -> Callable[[Sequence[str], int], np.ndarray]:
    """(questions, n) -> (Q, n) block rows (-1 padded): the top n of the frozen index for the query
    tower *as it is when called* (ORQA's per-step search; the open-QA collator calls it once per
    batch, evaluation once per question chunk). The tower is read in eval mode without gradient,
    on its own device, and its train/eval mode is restored."""
    def search(texts: Sequence[str], n: int) -> np.ndarray:
        was_training = retriever.training
        device = next(retriever.parameters()).device
        t = tokenizer(list(texts), max_length=query_len, truncation=True, padding=True, return_tensors="pt",
                      return_token_type_ids=False)
        retriever.eval()
        try:
            with torch.no_grad():
                q = retriever.encode_query(t["input_ids"].to(device), t["attention_mask"].to(device)).float().cpu().numpy()
        finally:
            retriever.train(was_training)
        return np.asarray(search_fn(q, n)[1])
    return search
