"""BM25 with `bm25s`: the sparse baseline row of the results table, and hard-negative mining.

    from components.retrieval.bm25 import BM25Retriever
    bm25 = BM25Retriever().fit(doc_ids, texts)
    ids, scores = bm25.retrieve(["who wrote hamlet"], k=10)      # ids: [[doc_id] * 10], scores: (1, 10)
    run = bm25.run({"q1": "who wrote hamlet"}, k=100)           # -> metrics.retrieval_metrics(qrels, run)
    negs = bm25.hard_negatives(questions, positives=gold_doc_ids, k=1)

Tokenisation is bm25s' own: lowercase, the regex `\\b\\w\\w+\\b` (tokens of 2+ word characters),
its built-in English stopword list, no stemmer (PyStemmer is not a dependency). Scoring is
bm25s' "lucene" variant with its defaults k1=1.5, b=0.75.

Deterministic: scores come from bm25s' exact sparse index, and the top k is chosen by
(score descending, doc id ascending), the same tie rule as `metrics.canonical_run`, so the
ranking does not depend on the order of the corpus or on how a partial sort broke ties.
"""

from __future__ import annotations

from typing import Collection, Mapping, Sequence

import bm25s
import numpy as np
from bm25s.tokenization import Tokenizer

from components.data.text import normalize_answer


class BM25Retriever:
    def __init__(self, k1: float = 1.5, b: float = 0.75, method: str = "lucene"):
        self.k1, self.b, self.method = k1, b, method
        self.doc_ids: list[str] = []
        self._texts: list[str] = []
        self._normalized: list[str | None] = []  # " normalised text " per doc, filled on first use

    # ------------------------------------------------------------------------------------------
    def fit(self, doc_ids: Sequence[str], texts: Sequence[str]) -> "BM25Retriever":
        """Index the corpus. `doc_ids` must be unique (one row per retrievable unit)."""
        doc_ids, texts = [str(d) for d in doc_ids], list(texts)
        if len(doc_ids) != len(texts):
            raise ValueError(f"fit: {len(doc_ids)} doc_ids but {len(texts)} texts")
        if not doc_ids:
            raise ValueError("fit: empty corpus")
        if len(set(doc_ids)) != len(doc_ids):
            dup = next(d for i, d in enumerate(doc_ids) if d in doc_ids[:i])
            raise ValueError(f"fit: duplicate doc id {dup!r}; ids must be unique")
        self.tokenizer = Tokenizer(lower=True, stopwords="en", stemmer=None)
        corpus_tokens = self.tokenizer.tokenize(texts, update_vocab=True, return_as="tuple", show_progress=False)
        self.index = bm25s.BM25(k1=self.k1, b=self.b, method=self.method)
        self.index.index(corpus_tokens, show_progress=False)
        self.doc_ids, self._texts = doc_ids, texts
        self._normalized = [None] * len(texts)
        # id_rank[i] = position of doc i in sorted(doc_ids): the tie-breaker (doc id ascending).
        order = sorted(range(len(doc_ids)), key=doc_ids.__getitem__)
        self._id_rank = np.empty(len(doc_ids), dtype=np.int64)
        self._id_rank[order] = np.arange(len(doc_ids))
        return self

    def _normalized_text(self, j: int) -> str:
        """Doc j after SQuAD answer normalisation, padded with spaces for whole-word `in` tests.
        Cached: mining checks the same top passages for thousands of queries, and normalising a
        passage (four regex passes) costs far more than the BM25 scoring itself."""
        if self._normalized[j] is None:
            self._normalized[j] = f" {normalize_answer(self._texts[j])} "
        return self._normalized[j]

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every document for one query, in fit order. (N,) float32."""
        if not self.doc_ids:
            raise RuntimeError("BM25Retriever: call fit() first")
        # update_vocab=False: words the corpus never saw are dropped (they score 0 anyway);
        # allow_empty=False: a query of only stopwords scores 0 everywhere instead of matching
        # the empty-document placeholder token.
        (ids,) = self.tokenizer.tokenize([query], update_vocab=False, return_as="ids",
                                         show_progress=False, allow_empty=False)
        return self.index.get_scores_from_ids(ids)

    def _top(self, scores: np.ndarray, k: int) -> np.ndarray:
        """Indices of the k best docs by (score desc, doc id asc), without a full sort."""
        n = scores.shape[0]
        if k < n:
            # every doc scoring >= the k-th best score; ties at the boundary all come along
            kth = np.partition(scores, n - k)[n - k]
            cand = np.flatnonzero(scores >= kth)
        else:
            cand = np.arange(n)
        order = np.lexsort((self._id_rank[cand], -scores[cand]))  # last key is primary
        return cand[order[:k]]

    def retrieve(self, queries: Sequence[str], k: int) -> tuple[list[list[str]], np.ndarray]:
        """Top-k doc ids (Q lists of min(k, N) ids) and their scores (Q, min(k, N)) float32."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        k = min(k, len(self.doc_ids))
        ids: list[list[str]] = []
        out = np.zeros((len(queries), k), dtype=np.float32)  # (Q, k)
        for i, q in enumerate(queries):
            s = self.scores(q)  # (N,)
            top = self._top(s, k)
            ids.append([self.doc_ids[j] for j in top])
            out[i] = s[top]
        return ids, out

    def run(self, queries: Mapping[str, str], k: int) -> dict[str, dict[str, float]]:
        """{query_id: {doc_id: score}} for `metrics.retrieval_metrics`."""
        qids = list(queries)
        ids, scores = self.retrieve([queries[q] for q in qids], k)
        return {q: {d: float(s) for d, s in zip(row, srow)} for q, row, srow in zip(qids, ids, scores)}

    def hard_negatives(
        self,
        queries: Sequence[str],
        positives: Sequence[str | Collection[str]],
        k: int,
        answers: Sequence[Sequence[str]] | None = None,
        allow_zero_score: bool = False,
    ) -> list[list[str]]:
        """Up to k BM25-ranked negatives per query, never one of its positives.

        `positives[i]`: the gold doc id (or ids) of query i. `answers[i]` (optional): gold
        answer strings; a passage containing one (after SQuAD normalisation) is skipped, as
        DPR does, because it is likely a false negative. Docs that share no term with the query
        (score 0) are not "hard" and are skipped unless `allow_zero_score`, so a query may get
        fewer than k negatives: callers must handle short lists.
        """
        if len(positives) != len(queries) or (answers is not None and len(answers) != len(queries)):
            raise ValueError("hard_negatives: queries, positives (and answers) must have the same length")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        out: list[list[str]] = []
        for i, q in enumerate(queries):
            pos = {positives[i]} if isinstance(positives[i], str) else set(positives[i])
            golds = [f" {a} " for a in (normalize_answer(x) for x in (answers[i] if answers else [])) if a]
            s = self.scores(q)  # (N,)
            depth = k + len(pos)
            negs: list[str] = []
            # widen the window until k negatives are found or the corpus is exhausted
            while True:
                top = self._top(s, min(depth, len(self.doc_ids)))
                negs = []
                for j in top:
                    if len(negs) == k or (s[j] <= 0 and not allow_zero_score):
                        break
                    if self.doc_ids[j] in pos:
                        continue
                    if golds and any(g in self._normalized_text(j) for g in golds):
                        continue
                    negs.append(self.doc_ids[j])
                if len(negs) == k or depth >= len(self.doc_ids) or (len(top) and s[top[-1]] <= 0 and not allow_zero_score):
                    break
                depth *= 4
            out.append(negs)
        return out
