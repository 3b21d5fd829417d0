"""Hard negatives for the bi-encoder: each training pair gets a ranked pool of `depth` passages.

    pairs = load_pairs(CORPUS, "train")                              # components.data.finetune_data
    pairs = mine_bm25_negatives(pairs, corpus, depth=30)             # + "negatives": ranked doc ids
    #  or   mine_dense_negatives(make_encode_fn(stage1, tok, 32, 80), pairs, corpus, depth=30)

A pool never holds one of the query's positives nor, when the query has QA answers, a passage
containing an answer (DPR's filter for likely false negatives). `BiEncoderCollator` samples from
the pool every batch and tops a short pool up with random passages.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from components.data.text import normalize_answer
from components.retrieval.search import SIDE_PASSAGE, SIDE_QUERY, EncodeFn, dense_search


def _unique_queries(pairs: Sequence[dict]) -> tuple[list[str], dict[str, dict]]:
    first: dict[str, dict] = {}
    for r in pairs:
        first.setdefault(r["qid"], r)
    return list(first), first


def _with_negatives(pairs: Sequence[dict], negatives: Mapping[str, list[str]]) -> list[dict]:
    return [{**r, "negatives": list(negatives[r["qid"]])} for r in pairs]


def mine_bm25_negatives(pairs: Sequence[dict], corpus: Mapping[str, str], depth: int = 30, retriever: Any = None) -> list[dict]:
    """Add `negatives`: the top `depth` BM25 passages of each query that are not its positives
    (nor answer-bearing, when the pair has `answers`). `retriever`: a fitted BM25Retriever
    (fitted on `corpus` here when None). BM25 may return fewer (docs sharing no term are no hard
    negatives); the collator tops short pools up with random passages."""
    if retriever is None:
        from components.retrieval.bm25 import BM25Retriever

        retriever = BM25Retriever().fit(list(corpus), list(corpus.values()))
    qids, first = _unique_queries(pairs)
    if not qids:
        return []
    negs = retriever.hard_negatives(
        [first[q]["query"] for q in qids], [first[q]["positives"] for q in qids], k=depth,
        answers=[first[q].get("answers", []) for q in qids],  # [] = no answer filter for that query
    )
    return _with_negatives(pairs, dict(zip(qids, negs)))


def mine_dense_negatives(
    encode_fn: EncodeFn, pairs: Sequence[dict], corpus: Mapping[str, str], depth: int = 30,
    passage_vecs: np.ndarray | None = None,
) -> list[dict]:
    """Add `negatives` from a dense search of the stage-1 encoder (ANCE/RocketQA-style): the top
    `depth` passages by inner product that are not positives and contain no gold answer.

    `encode_fn(texts, "query"|"passage") -> (N, D)` float32 (see `biencoder.make_encode_fn`);
    `passage_vecs` (len(corpus), D) in corpus order skips re-encoding the corpus.
    """
    doc_ids = list(corpus)
    qids, first = _unique_queries(pairs)
    if not qids:
        return []
    if passage_vecs is None:
        passage_vecs = encode_fn([corpus[d] for d in doc_ids], SIDE_PASSAGE)
    query_vecs = encode_fn([first[q]["query"] for q in qids], SIDE_QUERY)
    max_pos = max(len(first[q]["positives"]) for q in qids)
    # Search deep enough that filtering positives and answer-bearing passages still leaves `depth`
    # in most cases; the collator tops up the rest.
    _, rows = dense_search(query_vecs, passage_vecs, 2 * depth + max_pos)
    normed: dict[str, str] = {}
    out: dict[str, list[str]] = {}
    for qi, q in enumerate(qids):
        pos = set(first[q]["positives"])
        golds = [f" {a} " for a in (normalize_answer(x) for x in first[q].get("answers", [])) if a]
        negs: list[str] = []
        for r in rows[qi]:
            if r < 0 or len(negs) == depth:
                break
            d = doc_ids[r]
            if d in pos:
                continue
            if golds:
                t = normed.setdefault(d, f" {normalize_answer(corpus[d])} ")
                if any(g in t for g in golds):
                    continue  # likely a false negative: it answers the question
            negs.append(d)
        out[q] = negs
    return _with_negatives(pairs, out)
