"""Evaluation metrics: retrieval (nDCG@10, MRR@10, Recall@k via ir-measures) and open-QA EM/F1.

    from components.eval.metrics import retrieval_metrics, qa_metrics
    m = retrieval_metrics(qrels, run, recall_at=[1, 5, 20, 100])
    m["ndcg_at_10"], m["mrr_at_10"], m["recall_at_5"], m["per_query"]["q1"]["mrr_at_10"]
    qa_metrics({"q1": "Paris"}, {"q1": ["paris", "Paris, France"]})   # {"em": 1.0, "f1": 1.0, ...}

Metric keys are MLflow-safe (`@` is not allowed in MLflow metric names): `ndcg_at_10`,
`mrr_at_10`, `recall_at_{k}`, `em`, `f1`. Values are fractions in [0, 1].

Definitions (trec_eval's, through ir-measures and its pytrec_eval backend):
- nDCG@10: graded gain = the qrels score, discount 1/log2(rank+1), normalised by the ideal
  ranking of the judged documents.
- MRR@10 (ir-measures `RR@10`): 1/rank of the first document with score >= 1 in the top 10, else 0.
- Recall@k (`R@k`): (relevant docs in top k) / (all relevant docs of the query). With one gold
  passage per question (our qa data) this equals DPR's "top-k retrieval accuracy".

Which queries count: every qrels query with at least one document of score >= 1. A query that
is judged but absent from the run scores 0 on every metric (ir-measures fills it in), and is
counted in `n_missing`, so a query-id mismatch shows up instead of silently shrinking the set.
Queries with no relevant document are dropped (every metric would be 0/0) and counted in
`n_no_relevant`. Run queries without qrels are ignored.

Ties. Metrics depend only on the order of documents, and providers break equal scores
differently: trec_eval (pytrec_eval) orders ties by doc id *descending*, ir-measures' msmarco
provider (used for RR@10, which pytrec_eval has no cutoff for) by doc id *ascending*, so the
same run could get an MRR and an nDCG computed on two different rankings. `canonical_run`
therefore fixes the order itself, (score descending, doc id ascending), and replaces each score
by a rank-derived one (n - rank): tie-free, exactly representable, so every provider sees one
ranking. `components.retrieval.bm25` breaks its ties the same way.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Iterable, Mapping, Sequence

import ir_measures
from ir_measures import R, RR, nDCG

from components.data.text import normalize_answer

NDCG_KEY, MRR_KEY = "ndcg_at_10", "mrr_at_10"


def recall_key(k: int) -> str:
    return f"recall_at_{k}"


# ----------------------------------------------------------------------------------------------
# retrieval
# ----------------------------------------------------------------------------------------------
def canonical_run(run: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """Same ranking, tie-free scores: sort by (score desc, doc_id asc), then score = n - rank."""
    out: dict[str, dict[str, float]] = {}
    for qid, docs in run.items():
        for doc_id, s in docs.items():
            if not isinstance(s, (int, float)) or math.isnan(s):
                raise ValueError(f"run[{qid!r}][{doc_id!r}] = {s!r}: scores must be numbers, not NaN")
        ranked = sorted(docs.items(), key=lambda kv: (-float(kv[1]), str(kv[0])))
        n = len(ranked)
        out[str(qid)] = {str(doc_id): float(n - rank) for rank, (doc_id, _) in enumerate(ranked)}
    return out


def _check_qrels(qrels: Mapping[str, Mapping[str, int]]) -> None:
    for qid, rels in qrels.items():
        for doc_id, rel in rels.items():
            if not isinstance(rel, int) or isinstance(rel, bool):
                raise ValueError(f"qrels[{qid!r}][{doc_id!r}] = {rel!r}: relevance must be an int")


def retrieval_metrics(
    qrels: Mapping[str, Mapping[str, int]],
    run: Mapping[str, Mapping[str, float]],
    recall_at: Sequence[int] = (1, 5, 20, 100),
) -> dict:
    """nDCG@10, MRR@10 and Recall@k (means over judged queries) plus `per_query` values.

    Returns {"ndcg_at_10", "mrr_at_10", "recall_at_{k}"..., "n_queries", "n_missing",
    "n_no_relevant", "per_query": {qid: {metric: value}}}. Include at least max(recall_at)
    documents per query in `run`, or the deeper recalls are lower bounds.
    """
    if not recall_at or any(int(k) < 1 for k in recall_at):
        raise ValueError(f"recall_at must be a non-empty list of ints >= 1, got {recall_at!r}")
    _check_qrels(qrels)
    judged = {str(q): {str(d): r for d, r in rels.items()} for q, rels in qrels.items()
              if any(r >= 1 for r in rels.values())}
    if not judged:
        raise ValueError("qrels has no query with a relevant document (score >= 1): nothing to evaluate")
    run = canonical_run(run)

    ks = sorted({int(k) for k in recall_at})
    names = {nDCG @ 10: NDCG_KEY, RR @ 10: MRR_KEY, **{R @ k: recall_key(k) for k in ks}}
    evaluator = ir_measures.evaluator(list(names), judged)
    values: dict[str, dict[str, float]] = {q: {} for q in judged}
    for m in evaluator.iter_calc(run):
        values[m.query_id][names[m.measure]] = float(m.value)
    # fixed key order (provider output order is not), so per_query JSON diffs stay readable
    per_query = {q: {key: v[key] for key in names.values()} for q, v in values.items()}

    n = len(per_query)
    out: dict = {key: sum(v[key] for v in per_query.values()) / n for key in names.values()}
    out.update(
        n_queries=n,
        n_missing=sum(1 for q in judged if not run.get(q)),
        n_no_relevant=len(qrels) - len(judged),
        per_query=per_query,
    )
    return out


# ----------------------------------------------------------------------------------------------
# open-domain QA: exact match and token F1, SQuAD v1.1 rules (as REALM/ORQA/DPR report EM)
# ----------------------------------------------------------------------------------------------
def _golds(golds: str | Iterable[str]) -> list[str]:
    golds = [golds] if isinstance(golds, str) else list(golds)
    if not golds:
        raise ValueError("no gold answers given: EM/F1 need at least one")
    return golds


def exact_match(pred: str, golds: str | Iterable[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold, else 0.0."""
    p = normalize_answer(pred)
    return float(any(p == normalize_answer(g) for g in _golds(golds)))


def _f1_one(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    # Bag-of-tokens overlap (a token counts min(#pred, #gold) times). As in SQuAD v1.1, an empty
    # side gives 0 (v2.0 would give 1 for empty-vs-empty; golds are never empty in our data).
    same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1(pred: str, golds: str | Iterable[str]) -> float:
    """Token-level F1 = 2PR/(P+R) on normalised tokens, max over the gold answers."""
    p = normalize_answer(pred).split()
    return max(_f1_one(p, normalize_answer(g).split()) for g in _golds(golds))


def qa_metrics(preds: Mapping[str, str], golds: Mapping[str, Sequence[str]]) -> dict:
    """Mean EM and F1 over every id in `golds`: {"em", "f1", "n", "n_missing"}.

    A gold id with no prediction scores 0 on both (counted in `n_missing`); a prediction for an
    id that has no gold is an error (it means the ids got mixed up).
    """
    if not golds:
        raise ValueError("qa_metrics: no gold answers")
    unknown = [i for i in preds if i not in golds]
    if unknown:
        raise ValueError(f"qa_metrics: {len(unknown)} prediction id(s) have no gold answers, e.g. {unknown[:3]}")
    em = f = 0.0
    for qa_id, answers in golds.items():
        if qa_id in preds:  # a missing prediction scores 0 even if a gold normalises to ""
            em += exact_match(preds[qa_id], answers)
            f += f1(preds[qa_id], answers)
    n = len(golds)
    return {"em": em / n, "f1": f / n, "n": n, "n_missing": sum(1 for i in golds if i not in preds)}
